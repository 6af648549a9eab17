//! `inferd serve --device gpu` through a stock grpcio client, on a real
//! wgpu device (Mesa's lavapipe in CI): sessions answer, greedy tokens do
//! not depend on how the history was fed (appends, forks, a restart that
//! computes the history again), generating sessions sample where their
//! logits are (to the same tokens and log-probabilities as sampling them
//! on the CPU), and without an adapter `--device gpu` refuses to start
//! while `auto` takes the CPU.
//!
//! Without any wgpu adapter the GPU tests say so loudly and pass, unless
//! `INFERD_REQUIRE_WGPU=1` (set by `scripts/test`), when they fail.

mod support;

use std::process::Command;

use inferd::gpu::{AdapterKind, GpuDevice};
use support::durable::{serve_with, write_model};
use support::{greedy, scrape, seeded, Client};

fn have_adapter() -> bool {
    match GpuDevice::open(AdapterKind::Any) {
        Ok(_) => true,
        Err(e) => {
            let required = std::env::var("INFERD_REQUIRE_WGPU").is_ok_and(|v| v == "1");
            assert!(!required, "INFERD_REQUIRE_WGPU=1 but {e}");
            eprintln!("\n!!! SKIPPING the GPU server tests: {e}\n");
            false
        }
    }
}

const PROMPT: [u32; 23] = [
    257, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 10, 84, 104, 101, 32, 71, 80,
    85, 46,
];

#[test]
fn a_stock_client_runs_sessions_on_the_gpu() {
    if !have_adapter() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let model = write_model(dir.path());
    let state = dir.path().join("state");
    let mut server = serve_with(
        &model,
        &state,
        "sync",
        &["--device", "gpu", "--metrics-listen", "127.0.0.1:0"],
    );
    let client = Client::connect(&server.addr);
    let metrics = scrape(server.metrics.as_deref().expect("metrics address"));
    assert!(
        metrics.contains("inferd_layers_backend_info{backend=\"gpu\""),
        "{metrics}"
    );

    let a = client.create();
    client.append(&a, &PROMPT).expect("append");
    let whole = client.generate(&greedy(&a, 12, 3));
    assert!(whole.error.is_none(), "{:?}", whole.error);
    assert_eq!(whole.tokens.len(), 12);

    // The same history in three appends, beside another session's traffic.
    let b = client.create();
    let other = client.create();
    client.append(&b, &PROMPT[..4]).expect("append");
    client.append(&other, &PROMPT[5..]).expect("append");
    client.append(&b, &PROMPT[4..19]).expect("append");
    client.append(&b, &PROMPT[19..]).expect("append");
    let pieces = client.generate(&greedy(&b, 12, 3));
    assert_eq!(pieces, whole, "appended in pieces");

    // A fork inside a page copies that page on the device.
    let f = client.fork(&a, 21);
    client.append(&f, &PROMPT[21..]).expect("append");
    let forked = client.generate(&greedy(&f, 12, 3));
    assert_eq!(forked, whole, "forked mid-page");

    let info = client.info(&a).expect("info");
    assert_eq!(info.get_history_length() as usize, PROMPT.len() + 12);
    assert_eq!(info.get_backend(), "gpu");

    // Killed and started again: the history is computed again on the GPU.
    server.kill();
    let server = serve_with(&model, &state, "sync", &["--device", "gpu"]);
    let client = Client::connect(&server.addr);
    let c = client.create();
    client.append(&c, &PROMPT).expect("append");
    let fresh = client.generate(&greedy(&c, 12, 3));
    assert_eq!(fresh, whole, "after a restart");
    let after = client.generate(&greedy(&a, 4, 3));
    assert!(after.error.is_none(), "restored session: {:?}", after.error);
    for id in [&a, &b, &c, &f, &other] {
        client.close(id).expect("close");
    }
}

#[test]
fn without_an_adapter_gpu_refuses_to_start_and_auto_takes_the_cpu() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = write_model(dir.path());
    let check = |device: &str| {
        Command::new(env!("CARGO_BIN_EXE_inferd"))
            .args([
                "serve",
                "--check",
                "--listen",
                "127.0.0.1:0",
                "--device",
                device,
            ])
            .arg("--model")
            .arg(&model)
            // The Vulkan loader then finds no driver at all.
            .env("VK_ICD_FILENAMES", dir.path().join("no-such-driver.json"))
            .env("VK_DRIVER_FILES", dir.path().join("no-such-driver.json"))
            .env_remove("INFERD_DEVICE")
            .output()
            .expect("run inferd")
    };
    let gpu = check("gpu");
    let stderr = String::from_utf8_lossy(&gpu.stderr);
    assert!(
        !gpu.status.success(),
        "--device gpu started without an adapter"
    );
    assert!(
        stderr.contains("--device gpu") && stderr.contains("no GPU adapter"),
        "{stderr}"
    );
    let auto = check("auto");
    let stdout = String::from_utf8_lossy(&auto.stdout);
    assert!(
        auto.status.success(),
        "{}",
        String::from_utf8_lossy(&auto.stderr)
    );
    assert!(stdout.contains("layers in this process"), "{stdout}");
}

/// Sessions spilled from device pages to disk and read back into device
/// pages hold the bits of a session that was never spilled.
#[test]
fn a_spilled_gpu_session_reads_its_pages_back_to_the_same_bits() {
    if !have_adapter() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let model = write_model(dir.path());
    let state = dir.path().join("state");
    let history = |k: u32| -> Vec<u32> { (0..200).map(|i| (i * 17 + k) % 320).collect() };
    // Room for two sessions of 200 positions: a third spills the oldest.
    let server = serve_with(
        &model,
        &state,
        "sync",
        &[
            "--device",
            "gpu",
            "--kv-pages",
            "30",
            "--metrics-listen",
            "127.0.0.1:0",
        ],
    );
    let client = Client::connect(&server.addr);
    let model_arg = model.to_str().expect("UTF-8 path");
    let reference = support::Inferd::start(&[
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--model",
        model_arg,
        "--device",
        "gpu",
    ]);
    let reference = Client::connect(&reference.addr);
    let ids: Vec<String> = (0..3).map(|_| client.create()).collect();
    for (k, id) in ids.iter().enumerate() {
        client.append(id, &history(k as u32)).expect("append");
    }
    assert_eq!(client.info(&ids[0]).expect("info").get_kv_pages_held(), 0);
    let metrics = scrape(server.metrics.as_deref().expect("metrics"));
    let read = |text: &str| {
        support::sample(text, "inferd_session_spill_read_tokens_total").expect("read tokens")
    };
    assert_eq!(read(&metrics), 0.0);
    client
        .append(&ids[0], &[7])
        .expect("append to a spilled session");
    let metrics = scrape(server.metrics.as_deref().expect("metrics"));
    assert_eq!(read(&metrics), 192.0, "pages read back from the spill file");
    let mut truth = history(0);
    truth.push(7);
    let cold = reference.create();
    reference.append(&cold, &truth).expect("append");
    assert_eq!(
        client.info(&ids[0]).expect("info").get_logits_digest(),
        reference.info(&cold).expect("info").get_logits_digest(),
        "a session read back from its spill file against one never spilled"
    );
    let a = client.generate(&greedy(&ids[0], 8, 2));
    let b = reference.generate(&greedy(&cold, 8, 2));
    assert_eq!(a, b);
}

#[test]
fn generating_sessions_sample_on_the_device_and_only_tokens_come_back() {
    if !have_adapter() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let model = write_model(dir.path());
    let serve = |sampler: &str| {
        let state = dir.path().join(format!("state-{sampler}"));
        serve_with(
            &model,
            &state,
            "sync",
            &[
                "--device",
                "gpu",
                "--sampler",
                sampler,
                "--metrics-listen",
                "127.0.0.1:0",
            ],
        )
    };
    let rows_read = |server: &support::Inferd| {
        let text = scrape(server.metrics.as_deref().expect("metrics"));
        support::sample(&text, "inferd_gpu_logit_rows_read_total").expect("rows read")
    };
    // The same calls on a server sampling on the device and on one
    // sampling on the CPU: their answers, the last logits' digest, and
    // the rows of logits that came back from the GPU.
    let submissions = |server: &support::Inferd| {
        let text = scrape(server.metrics.as_deref().expect("metrics"));
        support::sample(&text, "inferd_gpu_submissions_total").expect("submissions")
    };
    let run = |server: &support::Inferd| {
        let client = Client::connect(&server.addr);
        let before = rows_read(server);
        let submitted = submissions(server);
        let a = client.create();
        client.append(&a, &PROMPT).expect("append");
        let mut runs = vec![
            client.generate(&greedy(&a, 16, 5)),
            client.generate(&seeded(&a, 16, 7)),
        ];
        // More tokens after generated ones, then a fork of the result.
        client.append(&a, &PROMPT[..5]).expect("append");
        let mut reported = seeded(&a, 8, 11);
        reported.set_top_logprobs(3);
        runs.push(client.generate(&reported));
        let f = client.fork(&a, client.info(&a).expect("info").get_history_length());
        runs.push(client.generate(&greedy(&f, 6, 2)));
        for r in &runs {
            assert!(r.error.is_none(), "{:?}", r.error);
        }
        let digest = client.info(&a).expect("info").get_logits_digest();
        let rows = rows_read(server) - before;
        (runs, digest, rows, submissions(server) - submitted)
    };
    let (device_runs, device_digest, device_rows, _) = run(&serve("wgpu"));
    let (cpu_runs, cpu_digest, cpu_rows, _) = run(&serve("cpu"));
    let model_arg = model.to_str().expect("UTF-8 path");
    let no_journal = support::Inferd::start(&[
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--model",
        model_arg,
        "--device",
        "gpu",
        "--sampler",
        "wgpu",
        "--metrics-listen",
        "127.0.0.1:0",
    ]);
    let (plain_runs, plain_digest, plain_rows, plain_submissions) = run(&no_journal);
    // Without a journal, a call's end reads nothing back: only the appends
    // (a row each, and the undo of the one after generated tokens), the
    // fork and GetSessionInfo's digest do.
    assert!(plain_rows <= 5.0, "{plain_rows} rows came back");
    // 46 tokens, a submission each (a decode step's layers and its
    // sampling go out together), and a few for the appends, the fork and
    // the rows read back.
    eprintln!("submissions: {plain_submissions} for 46 tokens");
    assert!(
        plain_submissions <= 46.0 + 12.0,
        "{plain_submissions} submissions"
    );
    assert_eq!((&plain_runs, plain_digest), (&device_runs, device_digest));
    eprintln!("logit rows read back: {device_rows} sampling on the device, {cpu_rows} on the CPU");
    // Sampled on the device: a row per append and per call's end (for the
    // journal's digest). On the CPU: a row per token as well.
    assert!(device_rows <= 7.0, "{device_rows} rows came back");
    assert!(
        cpu_rows >= (16 + 16 + 8 + 6) as f64,
        "{cpu_rows} rows came back"
    );
    assert_eq!(
        device_runs, cpu_runs,
        "sampling where the logits are gives the CPU sampler's tokens and log-probabilities"
    );
    assert_eq!(device_digest, cpu_digest);
}

#[test]
fn shards_on_the_gpu_serve_a_coordinator_and_say_so_at_the_handshake() {
    if !have_adapter() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let model = write_model(dir.path());
    let model_arg = model.to_str().expect("UTF-8 path");
    let shard = |layers: &str, device: &str| {
        support::Inferd::start(&[
            "shard",
            "--model",
            model_arg,
            "--layers",
            layers,
            "--listen",
            "127.0.0.1:0",
            "--kv-mib",
            "16",
            "--device",
            device,
        ])
    };
    // Greedy tokens (and log-probabilities) of the prompt, fed whole and
    // in pieces, through a coordinator over `shards`.
    let run = |shards: &[(&support::Inferd, &str)]| {
        let list: Vec<String> = shards
            .iter()
            .map(|(s, layers)| format!("{}={layers}", s.addr))
            .collect();
        let coordinator = support::Inferd::start(&[
            "serve",
            "--model",
            model_arg,
            "--listen",
            "127.0.0.1:0",
            "--shards",
            &list.join(","),
            "--metrics-listen",
            "127.0.0.1:0",
        ]);
        let client = Client::connect(&coordinator.addr);
        let a = client.create();
        client.append(&a, &PROMPT).expect("append");
        let whole = client.generate(&greedy(&a, 8, 3));
        assert!(whole.error.is_none(), "{:?}", whole.error);
        assert_eq!(whole.tokens.len(), 8);
        let b = client.create();
        client.append(&b, &PROMPT[..9]).expect("append");
        client.append(&b, &PROMPT[9..]).expect("append");
        assert_eq!(client.generate(&greedy(&b, 8, 3)), whole, "fed in pieces");
        let metrics = scrape(coordinator.metrics.as_deref().expect("metrics"));
        (whole, metrics)
    };

    let gpu_first = shard("0..1", "gpu");
    let cpu_second = shard("1..2", "cpu");
    let (_, metrics) = run(&[(&gpu_first, "0..1"), (&cpu_second, "1..2")]);
    for (s, backend) in [(&gpu_first, "gpu"), (&cpu_second, "cpu")] {
        let line = format!(
            "inferd_shard_backend_info{{shard=\"{}\",backend=\"{backend}\"}} 1",
            s.addr
        );
        assert!(metrics.contains(&line), "no {line} in\n{metrics}");
    }

    // Two GPU shards give the bits of one holding every layer.
    let gpu_second = shard("1..2", "gpu");
    let gpu_whole = shard("0..2", "gpu");
    let (split, _) = run(&[(&gpu_first, "0..1"), (&gpu_second, "1..2")]);
    let (whole, _) = run(&[(&gpu_whole, "0..2")]);
    assert_eq!(split, whole, "layers split over GPU shards");

    // Its pages are on the device: a state directory cannot keep them.
    let refused = Command::new(env!("CARGO_BIN_EXE_inferd"))
        .args([
            "shard",
            "--model",
            model_arg,
            "--layers",
            "0..1",
            "--listen",
            "127.0.0.1:0",
        ])
        .args(["--device", "gpu", "--state-dir"])
        .arg(dir.path().join("shard-state"))
        .output()
        .expect("run inferd shard");
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("--state-dir"), "{stderr}");
}
