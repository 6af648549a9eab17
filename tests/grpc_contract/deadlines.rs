//! CONTRACT §2.7 through the wire: deadlines and cancellation stop a call
//! within one step and keep exactly what was committed.

use super::*;

// ---------------------------------------------------------------- §2.7 --

#[test]
fn a_generate_past_its_deadline_ends_deadline_exceeded_and_keeps_its_tokens() {
    let served = Served::slow(1);
    let id = served.create("deadline", &[]);
    served.append(&id, &[1, 2, 3]).expect("append");
    let t0 = Instant::now();
    let outcome = served
        .generate_with(
            gen_req(&id, 4000),
            CallOption::default().timeout(Duration::from_millis(400)),
        )
        .finish(STREAM_TIMEOUT);
    assert_eq!(outcome.failure().code, RpcStatusCode::DEADLINE_EXCEEDED);
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    let received = outcome.tokens().len() as u64;
    assert!(received >= 1, "some tokens came before the deadline");
    let info = served.wait_idle(&id, Duration::from_secs(2));
    let committed = info.get_history_length();
    assert!(
        committed >= 3 + received && committed < 3 + 4000,
        "{committed} committed, {received} received"
    );
    thread::sleep(Duration::from_millis(100));
    assert_eq!(served.history(&id), committed, "the work stopped");
    assert_eq!(
        served.append(&id, &[4]).expect("append"),
        committed + 1,
        "still usable"
    );
    served.stop();
}

#[test]
fn an_append_whose_deadline_passed_in_the_queue_is_never_applied() {
    let served = Served::slow(1);
    let id = served.create("late append", &[]);
    served.append(&id, &[1, 2, 3]).expect("append");
    // Long enough to outlive the append's deadline on a quiet fast machine
    // too (300 tokens of this model once took under 150 ms).
    let mut long = served.generate(gen_req(&id, 3000));
    long.first_token(STREAM_TIMEOUT);
    let late = served.append_with(
        &id,
        &[9, 9],
        CallOption::default().timeout(Duration::from_millis(150)),
    );
    assert_code(late, RpcStatusCode::DEADLINE_EXCEEDED, "queued append");
    assert!(
        served.info(&id).expect("info").get_busy(),
        "the generate outlived the append's deadline"
    );
    let done = long.finish(STREAM_TIMEOUT).done();
    assert_eq!(done.get_history_length(), 3 + 3000);
    thread::sleep(Duration::from_millis(100));
    assert_eq!(served.history(&id), 3 + 3000, "the late append never ran");
    served.stop();
}

#[test]
fn a_cancelled_stream_frees_the_session_and_keeps_what_was_committed() {
    let served = Served::slow(1);
    let id = served.create("cancel", &[]);
    let base = prompt(6, 2);
    served.append(&id, &base).expect("append");
    let mut stream = served.generate(gen_req(&id, 4000));
    stream.first_token(STREAM_TIMEOUT);
    let t0 = Instant::now();
    drop(stream);
    let info = served.wait_idle(&id, Duration::from_secs(2));
    let stopped_after = t0.elapsed();
    let committed = info.get_history_length();
    assert!(
        committed > base.len() as u64 && committed < base.len() as u64 + 4000,
        "{committed}"
    );
    thread::sleep(Duration::from_millis(150));
    assert_eq!(served.history(&id), committed, "nothing runs any more");
    // What is committed is exactly the greedy continuation the worker had
    // emitted: a fresh session generating that many tokens ends up with the
    // same logits.
    let check = served.create("check", &[]);
    served.append(&check, &base).expect("append");
    served.run(gen_req(&check, (committed - base.len() as u64) as u32));
    assert_eq!(served.digest(&check), served.digest(&id));
    // And the session takes new work.
    let (tokens, done) = served.run(gen_req(&id, 3));
    assert_eq!(tokens.len(), 3);
    assert_eq!(done.get_history_length(), committed + 3);
    eprintln!("cancelled generate stopped within {stopped_after:?}");
    served.stop();
}
