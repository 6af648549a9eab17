//! The runtime with its layers on a real wgpu device (lavapipe in CI) and
//! its sessions sampling where their logits are: when more sessions
//! generate than the kept-logits rows hold, or a session's row went to
//! another, the tokens and log-probabilities are still those of sampling
//! the same logits on the CPU. The same for the CLI's engine (`generate`,
//! `chat`, `bench` with `--device gpu`).
//!
//! Without any wgpu adapter the test says so loudly and passes, unless
//! `INFERD_REQUIRE_WGPU=1` (set by `scripts/test`), when it fails.

mod support;

use std::sync::Arc;

use inferd::engine::{Engine, EngineConfig};
use inferd::gguf::GgufFile;
use inferd::gpu::{AdapterKind, GpuDevice, StepCapacity};
use inferd::model::Model;
use inferd::quant::GgmlType;
use inferd::runtime::{
    AppendTokens, CreateSession, GenerateEvent, GenerateRequest, GpuLayers, Runtime, RuntimeConfig,
    SamplingOptions, SessionId, Tenant,
};
use inferd::sampler::gpu::GpuContext;
use inferd::sampler::{SamplingParams, SelectedSampler};

fn device() -> Option<Arc<GpuDevice>> {
    match GpuDevice::open(AdapterKind::Any) {
        Ok(device) => Some(device),
        Err(e) => {
            let required = std::env::var("INFERD_REQUIRE_WGPU").is_ok_and(|v| v == "1");
            assert!(!required, "INFERD_REQUIRE_WGPU=1 but {e}");
            eprintln!("\n!!! SKIPPING the GPU runtime test: {e}\n");
            None
        }
    }
}

/// One worker whose layers are on `device`, keeping two rows of logits
/// there when `on_device` (and sampling them there), else sampling on the
/// CPU with the logits read back every step.
fn start(device: &Arc<GpuDevice>, model: &Arc<Model>, on_device: bool) -> Runtime {
    start_with(device, model, on_device, 1).0
}

/// A runtime of `workers` workers, and the sampler's context on the
/// device when sessions sample there.
fn start_with(
    device: &Arc<GpuDevice>,
    model: &Arc<Model>,
    on_device: bool,
    workers: usize,
) -> (Runtime, Option<Arc<GpuContext>>) {
    let capacity = StepCapacity {
        kept_rows: 2,
        ..StepCapacity::default()
    };
    let mut layers = GpuLayers::new(Arc::clone(device), Arc::clone(model))
        .expect("the model on the device")
        .with_capacity(capacity);
    let mut sampler = SelectedSampler::Cpu;
    let mut on = None;
    if on_device {
        let context = GpuContext::on_device(device).expect("a sampler on the device");
        sampler = SelectedSampler::Wgpu(Arc::clone(&context));
        layers = layers.sampling_on(Arc::clone(&context));
        on = Some(context);
    }
    let cfg = RuntimeConfig {
        workers,
        pin_cores: false,
        kv_bytes: 8 << 20,
        sampler,
        layers: Arc::new(layers),
        ..RuntimeConfig::default()
    };
    let runtime = Runtime::start(Arc::clone(model), cfg).expect("runtime starts");
    (runtime, on)
}

fn create(rt: &Runtime) -> SessionId {
    rt.create_session(
        &Tenant::NONE,
        CreateSession {
            client_label: "gpu".into(),
            eos_token_ids: Vec::new(),
        },
        None,
    )
    .expect("queued")
    .wait()
    .expect("created")
}

fn append(rt: &Runtime, id: SessionId, tokens: Vec<u32>) {
    rt.append_tokens(&Tenant::NONE, AppendTokens { id, tokens }, None)
        .expect("queued")
        .wait()
        .expect("appended");
}

fn request(id: SessionId, seed: u64) -> GenerateRequest {
    GenerateRequest {
        constraint: None,
        speculate: None,
        id,
        max_tokens: 6,
        sampling: SamplingOptions {
            temperature: Some(1.5),
            top_k: Some(50),
            seed: Some(seed),
            repetition_penalty: Some(1.2),
            top_logprobs: 3,
            ..SamplingOptions::default()
        },
        stop_sequences: Vec::new(),
    }
}

/// What every call answered, in order: five sessions generating at once
/// (more than the two kept rows), then one at a time so that rows go from
/// session to session and come back.
fn answers(rt: &Runtime) -> Vec<Vec<GenerateEvent>> {
    let ids: Vec<SessionId> = (0..5).map(|_| create(rt)).collect();
    for (k, &id) in ids.iter().enumerate() {
        append(
            rt,
            id,
            (0..40).map(|i| (i * 13 + k as u32 * 7) % 380).collect(),
        );
    }
    let mut out = Vec::new();
    let streams: Vec<_> = ids
        .iter()
        .enumerate()
        .map(|(k, &id)| {
            rt.generate(&Tenant::NONE, request(id, k as u64), None)
                .expect("queued")
        })
        .collect();
    out.extend(streams.into_iter().map(|s| s.collect()));
    for round in 0..2u64 {
        for (k, &id) in ids.iter().enumerate() {
            let events = rt
                .generate(
                    &Tenant::NONE,
                    request(id, 100 + round * 10 + k as u64),
                    None,
                )
                .expect("queued")
                .collect();
            out.push(events);
        }
    }
    out
}

/// The events without their timings.
fn strip(events: &[Vec<GenerateEvent>]) -> Vec<String> {
    events
        .iter()
        .flatten()
        .map(|e| match e {
            GenerateEvent::Done(done) => {
                format!("done {:?} {}", done.stop_reason, done.history_length)
            }
            other => format!("{other:?}"),
        })
        .collect()
}

#[test]
fn sampling_kept_logits_matches_sampling_them_on_the_cpu() {
    let Some(device) = device() else {
        return;
    };
    let file = GgufFile::from_bytes(support::small_llama(GgmlType::Q4_1, true).build())
        .expect("synthetic model parses");
    let model = Arc::new(Model::from_gguf(Arc::new(file)).expect("loads"));

    // Two workers: each holds one sampler on the device, which samples its
    // kept rows and its host ones alike.
    let (kept, context) = start_with(&device, &model, true, 2);
    let context = context.expect("sampling on the device");
    assert_eq!(context.samplers(), 2, "one GPU sampler per worker");
    let on_device = answers(&kept);
    let kept_rows = kept.stats().logit_rows_read.expect("a GPU counts its rows");
    kept.shutdown();

    let read_back = start(&device, &model, false);
    let on_cpu = answers(&read_back);
    let read_rows = read_back
        .stats()
        .logit_rows_read
        .expect("a GPU counts its rows");
    read_back.shutdown();

    for events in &on_device {
        assert!(
            matches!(events.last(), Some(GenerateEvent::Done(_))),
            "{events:?}"
        );
    }
    assert_eq!(strip(&on_device), strip(&on_cpu));
    eprintln!("logit rows read back: {kept_rows} kept, {read_rows} read every step");
    assert!(
        kept_rows < read_rows / 2,
        "kept: {kept_rows} rows came back, read back: {read_rows}"
    );
}

#[test]
fn the_engine_samples_kept_logits_as_the_cpu_samples_them() {
    let Some(device) = device() else {
        return;
    };
    let file = GgufFile::from_bytes(support::small_llama(GgmlType::Q8_0, false).build())
        .expect("synthetic model parses");
    let model = Arc::new(Model::from_gguf(Arc::new(file)).expect("loads"));
    let engine = |sampler: SelectedSampler| {
        Engine::new(
            Arc::clone(&model),
            &EngineConfig {
                gpu: Some(Arc::clone(&device)),
                sampler,
                kv_bytes: 8 << 20,
                ..EngineConfig::default()
            },
        )
        .expect("engine")
    };
    let context = GpuContext::on_device(&device).expect("a sampler on the device");
    let mut seeded = SamplingParams::greedy();
    seeded.temperature = 1.3;
    seeded.top_k = 40;
    seeded.seed = 5;
    let mut runs = Vec::new();
    let mut rows = Vec::new();
    let mut submissions = Vec::new();
    for sampler in [SelectedSampler::Wgpu(context), SelectedSampler::Cpu] {
        let mut e = engine(sampler);
        let mut s = e.new_session();
        e.append(
            &mut s,
            &(0..30).map(|i| (i * 11 + 3) % 380).collect::<Vec<u32>>(),
        )
        .expect("append");
        let before = e.gpu_submissions().expect("on the GPU");
        let greedy = e
            .generate(&mut s, &SamplingParams::greedy(), 10, &[], |_| true)
            .expect("greedy");
        submissions.push(e.gpu_submissions().expect("on the GPU") - before);
        let drawn = e
            .generate(&mut s, &seeded, 10, &[], |_| true)
            .expect("seeded");
        let logits: Vec<u32> = s.next_logits().iter().map(|v| v.to_bits()).collect();
        assert_eq!(s.history().len(), 50);
        e.bench(0, 8, 8).expect("bench");
        rows.push(e.logit_rows_read().expect("on the GPU"));
        runs.push((greedy, drawn, logits));
    }
    assert!(
        !runs[0].2.is_empty(),
        "the logits came home after the generation"
    );
    assert_eq!(runs[0], runs[1]);
    eprintln!(
        "engine logit rows read back: {} kept, {} read every step",
        rows[0], rows[1]
    );
    // Kept: the append's row, one per generation's end and the bench's
    // prefill; read back: a row per token as well.
    assert!(rows[0] <= 4, "{} rows came back", rows[0]);
    // Ten tokens: a decode step's layers and its sampling are one
    // submission (the first token samples the append's kept row).
    eprintln!("submissions for ten tokens: {submissions:?} (device sampler, CPU sampler)");
    assert!(submissions[0] <= 10, "{} submissions", submissions[0]);
    assert!(rows[1] >= 1 + 20 + 8, "{} rows came back", rows[1]);
}
