//! CONTRACT §2.9 and the drain through the wire: health, a graceful
//! shutdown, and SIGTERM on the real `inferd serve` process.

use super::*;

// ---------------------------------------------------------------- §2.9 --

#[test]
fn health_is_serving_for_both_names_and_not_found_otherwise() {
    let served = Served::tiny(1);
    assert_eq!(served.health_check("").expect("health"), Serving::SERVING);
    assert_eq!(
        served
            .health_check("kakeya.v1.RuntimeService")
            .expect("health"),
        Serving::SERVING
    );
    assert_code(
        served.health_check("kakeya.v1.NoSuchService"),
        RpcStatusCode::NOT_FOUND,
        "unknown service",
    );
    served.stop();
}

#[test]
fn shutdown_lets_a_running_stream_finish_and_refuses_new_calls() {
    let mut served = Served::slow(1);
    let id = served.create("drain", &[]);
    served.append(&id, &[1, 2, 3]).expect("append");
    let started = Instant::now();
    let mut running = served.generate(gen_req(&id, 250));
    running.first_token(STREAM_TIMEOUT);
    let shutdown_after = started.elapsed().as_secs_f64();
    let server = served.server.take().expect("server");
    let (report_tx, report_rx) = mpsc::channel();
    thread::spawn(move || {
        let _ = report_tx.send(server.shutdown(Duration::from_secs(20)));
    });
    // Shutdown has begun once health leaves SERVING (or stops answering).
    let t0 = Instant::now();
    while matches!(served.health_check(""), Ok(Serving::SERVING)) {
        assert!(t0.elapsed() < Duration::from_secs(5), "never left SERVING");
        thread::sleep(Duration::from_millis(5));
    }
    thread::sleep(Duration::from_millis(50));
    let late = served.try_create("late", &[]);
    match late {
        Err(s) => {
            eprintln!("a call after shutdown began: {s:?}");
            assert!(
                matches!(
                    s.code,
                    RpcStatusCode::UNAVAILABLE | RpcStatusCode::DEADLINE_EXCEEDED
                ),
                "refused or unreachable: {s:?}"
            )
        }
        Ok(r) => panic!("a call after shutdown began was served: {r:?}"),
    }
    let outcome = running.finish(STREAM_TIMEOUT);
    let done = outcome.done();
    assert_eq!(done.get_stop_reason(), Stop::STOP_REASON_MAX_TOKENS);
    assert_eq!(outcome.tokens().len(), 250);
    assert!(
        done.get_total_duration_seconds() > shutdown_after,
        "the generate was still running when shutdown began ({} s vs {shutdown_after} s)",
        done.get_total_duration_seconds()
    );
    let report = report_rx
        .recv_timeout(Duration::from_secs(30))
        .expect("shutdown returns");
    assert!(report.drained, "{report:?}");
}

/// Reads lines of a child's stream on a thread.
fn line_reader(stream: impl Read + Send + 'static) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        for line in BufReader::new(stream).lines() {
            let Ok(line) = line else { return };
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    rx
}

#[test]
fn sigterm_drains_the_real_process_and_it_exits_zero() {
    let Some(model) = reference_model_path() else {
        return;
    };
    let mut child = Command::new(env!("CARGO_BIN_EXE_inferd"))
        .args(["serve", "--listen", "127.0.0.1:0", "--workers", "1"])
        .args(["--drain-timeout", "30", "--kv-mib", "64", "--model"])
        .arg(&model)
        .env_remove("INFERD_CONFIG")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("inferd serve starts");
    /// Kills the child if the test fails before it exits.
    struct Reaper(Option<std::process::Child>);
    impl Drop for Reaper {
        fn drop(&mut self) {
            if let Some(child) = self.0.as_mut() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
    let stdout = line_reader(child.stdout.take().expect("stdout"));
    let stderr = line_reader(child.stderr.take().expect("stderr"));
    let pid = child.id().to_string();
    let mut reaper = Reaper(Some(child));
    let logs = |stderr: &mpsc::Receiver<String>| stderr.try_iter().collect::<Vec<_>>().join("\n");

    let line = stdout
        .recv_timeout(Duration::from_secs(60))
        .unwrap_or_else(|_| panic!("no `listening on` line; stderr:\n{}", logs(&stderr)));
    let addr = line
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_owned();
    let env = client_env();
    let client = RuntimeServiceClient::new(ChannelBuilder::new(env).connect(&addr));
    let opt = CallOption::default().timeout(CALL_TIMEOUT);
    let id = client
        .create_session_opt(&pb::CreateSessionRequest::new(), opt.clone())
        .expect("created")
        .take_session_id();
    let mut append = pb::AppendTokensRequest::new();
    append.set_session_id(id.clone());
    append.set_token_ids(vec![1, 504, 2365, 6354]);
    client
        .append_tokens_opt(&append, opt.clone())
        .expect("append");
    let started = Instant::now();
    let mut running = Gen::spawn(client.clone(), gen_req(&id, 120), opt);
    running.first_token(STREAM_TIMEOUT);
    let killed = Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill runs");
    assert!(killed.success());
    let t0 = Instant::now();
    let signalled_after = t0.duration_since(started).as_secs_f64();
    let outcome = running.finish(STREAM_TIMEOUT);
    let done = outcome.done();
    assert_eq!(done.get_stop_reason(), Stop::STOP_REASON_MAX_TOKENS);
    assert_eq!(outcome.tokens().len(), 120);
    assert!(
        done.get_total_duration_seconds() > signalled_after,
        "the generate was still running when the signal came ({} s vs {signalled_after} s)",
        done.get_total_duration_seconds()
    );
    let child = reaper.0.as_mut().expect("child");
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(35),
            "no exit within the drain timeout; stderr:\n{}",
            logs(&stderr)
        );
        thread::sleep(Duration::from_millis(20));
    };
    reaper.0 = None;
    assert_eq!(status.code(), Some(0), "stderr:\n{}", logs(&stderr));
}
