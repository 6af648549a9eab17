//! The wgpu sampler in use: the runtime's workers sampling whole batches on
//! it (many sessions at once, the same tokens as the CPU), `inferd
//! generate --sampler wgpu` against `--sampler cpu` on the reference model,
//! and the start-up choice when no adapter exists.
//!
//! Skipped loudly without a wgpu adapter unless `INFERD_REQUIRE_WGPU=1`.

use std::path::Path;
use std::process::{Command, Output};

use inferd::runtime::{
    AppendTokens, CreateSession, GenerateEvent, GenerateRequest, Runtime, RuntimeConfig,
    SamplingOptions, Tenant,
};
use inferd::sampler::gpu::GpuError;
use inferd::sampler::{SamplerChoice, SelectedSampler, TokenLogprobs};

mod support;
use support::tiny_model;

const REFERENCE: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

fn wgpu() -> Option<SelectedSampler> {
    match SelectedSampler::resolve(SamplerChoice::Wgpu) {
        Ok(selected) => Some(selected),
        Err(GpuError::NoAdapter { seen }) => {
            let required = std::env::var("INFERD_REQUIRE_WGPU").is_ok_and(|v| v == "1");
            assert!(!required, "INFERD_REQUIRE_WGPU=1 but no wgpu adapter{seen}");
            eprintln!("\n!!! SKIPPING: no wgpu adapter{seen}\n");
            None
        }
        Err(other) => panic!("wgpu adapter present but unusable: {other}"),
    }
}

/// Starts `sessions` Generates at once on a runtime with `sampler` and
/// returns each one's tokens and log-probability reports.
fn generate_all(sampler: SelectedSampler, sessions: u32) -> Vec<(Vec<u32>, Vec<TokenLogprobs>)> {
    let rt = Runtime::start(
        tiny_model(),
        RuntimeConfig {
            workers: 2,
            pin_cores: false,
            kv_bytes: 16 << 20,
            sampler,
            ..RuntimeConfig::default()
        },
    )
    .expect("runtime starts");
    let mut streams = Vec::new();
    for s in 0..sessions {
        let id = rt
            .create_session(
                &Tenant::NONE,
                CreateSession {
                    client_label: "wgpu".into(),
                    eos_token_ids: Vec::new(),
                },
                None,
            )
            .expect("queued")
            .wait()
            .expect("created");
        let prompt: Vec<u32> = (0..20).map(|i| (i * 37 + s * 11) % 300).collect();
        rt.append_tokens(&Tenant::NONE, AppendTokens { id, tokens: prompt }, None)
            .expect("queued")
            .wait()
            .expect("appended");
        // Half greedy, half seeded with the whole chain.
        let sampling = if s % 2 == 0 {
            SamplingOptions::default()
        } else {
            SamplingOptions {
                temperature: Some(1.5),
                top_k: Some(50),
                top_p: Some(0.9),
                min_p: Some(0.01),
                repetition_penalty: Some(1.1),
                presence_penalty: Some(0.3),
                seed: Some(u64::from(s) * 1000),
                top_logprobs: s % 4,
                ..SamplingOptions::default()
            }
        };
        let request = GenerateRequest {
            constraint: None,
            speculate: None,
            id,
            max_tokens: 24,
            sampling,
            stop_sequences: Vec::new(),
        };
        streams.push(rt.generate(&Tenant::NONE, request, None).expect("queued"));
    }
    streams
        .into_iter()
        .map(|stream| {
            let mut tokens = Vec::new();
            let mut reports = Vec::new();
            for event in stream.collect() {
                match event {
                    GenerateEvent::Token(t) => tokens.push(t),
                    GenerateEvent::Logprobs(report) => {
                        assert_eq!(
                            Some(&report.token),
                            tokens.last(),
                            "a report follows its token"
                        );
                        reports.push(report);
                    }
                    GenerateEvent::Done(_) => {}
                    GenerateEvent::Truncated { .. } => {}
                    GenerateEvent::Error(e) => panic!("generate failed: {e}"),
                }
            }
            (tokens, reports)
        })
        .collect()
}

#[test]
fn workers_sampling_batches_on_the_gpu_match_the_cpu_token_for_token() {
    let Some(selected) = wgpu() else { return };
    assert_eq!(selected.backend_name(), "wgpu");
    let on_gpu = generate_all(selected, 12);
    let on_cpu = generate_all(SelectedSampler::Cpu, 12);
    for (s, (tokens, reports)) in on_gpu.iter().enumerate() {
        assert_eq!(tokens.len(), 24);
        let asked = if s % 2 == 1 { s % 4 } else { 0 };
        assert_eq!(reports.len(), if asked > 0 { 24 } else { 0 }, "session {s}");
    }
    assert_eq!(on_gpu, on_cpu);
}

fn inferd(args: &[&str], envs: &[(&str, &str)]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_inferd"))
        .args(args)
        .envs(envs.iter().copied())
        .output()
        .expect("run inferd")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn generate_with(sampler: &str, extra: &[&str]) -> String {
    let mut args = vec![
        "generate",
        "--sampler",
        sampler,
        "--tokens",
        "504,3575,282,4649,314",
        "--format",
        "ids",
        "-n",
        "48",
        "--ignore-eos",
        "--threads",
        "2",
    ];
    args.extend_from_slice(extra);
    let out = inferd(&args, &[]);
    assert!(
        out.status.success(),
        "--sampler {sampler}: {}",
        stderr(&out)
    );
    stdout(&out)
}

#[test]
fn inferd_generate_gives_the_same_continuation_on_wgpu_and_cpu() {
    if !Path::new(REFERENCE).exists() {
        eprintln!("SKIPPED: {REFERENCE} is absent; run scripts/fetch-model");
        return;
    }
    if wgpu().is_none() {
        return;
    }
    let greedy_cpu = generate_with("cpu", &[]);
    assert_eq!(greedy_cpu.split_whitespace().count(), 48);
    assert_eq!(generate_with("wgpu", &[]), greedy_cpu);
    let chain = [
        "--temperature",
        "0.9",
        "--top-k",
        "40",
        "--top-p",
        "0.95",
        "--min-p",
        "0.02",
        "--repeat-penalty",
        "1.1",
        "--seed",
        "42",
    ];
    assert_eq!(generate_with("wgpu", &chain), generate_with("cpu", &chain));
}

/// The Vulkan loader honours VK_ICD_FILENAMES: pointing it at nothing is a
/// host with no Vulkan driver.
const NO_VULKAN: [(&str, &str); 2] = [
    ("VK_ICD_FILENAMES", "/nonexistent/icd.json"),
    ("VK_DRIVER_FILES", "/nonexistent/icd.json"),
];

#[test]
fn without_an_adapter_wgpu_fails_at_start_up_and_auto_uses_the_cpu() {
    if !Path::new(REFERENCE).exists() {
        eprintln!("SKIPPED: {REFERENCE} is absent; run scripts/fetch-model");
        return;
    }
    let common = [
        "generate",
        "--tokens",
        "504,3575,282",
        "--format",
        "ids",
        "-n",
        "4",
        "--threads",
        "1",
    ];
    let mut forced = common.to_vec();
    forced.extend(["--sampler", "wgpu"]);
    let out = inferd(&forced, &NO_VULKAN);
    assert!(!out.status.success(), "wgpu without an adapter must fail");
    let message = stderr(&out);
    assert!(
        message.contains("no wgpu adapter found") && message.contains("--sampler cpu"),
        "{message}"
    );
    let mut auto = common.to_vec();
    auto.extend(["--sampler", "auto"]);
    let out = inferd(&auto, &NO_VULKAN);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out).split_whitespace().count(), 4);

    let out = inferd(&["serve", "--sampler", "wgpu", "--check"], &NO_VULKAN);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("no wgpu adapter found"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn serve_check_names_the_adapter_it_would_sample_on() {
    if !Path::new(REFERENCE).exists() || wgpu().is_none() {
        return;
    }
    let out = inferd(&["serve", "--sampler", "wgpu", "--check"], &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("sampler wgpu on "),
        "{}",
        stdout(&out)
    );
    let out = inferd(&["serve", "--sampler", "cpu", "--check"], &[]);
    assert!(stdout(&out).contains("sampler cpu"), "{}", stdout(&out));
}
