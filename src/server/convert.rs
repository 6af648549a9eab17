//! Conversions between the `kakeya.v1` wire messages and the runtime's
//! plain types, and from runtime errors to gRPC statuses. Every check of a
//! request's shape that needs no session state happens here, on the
//! completion-queue thread, before any work reaches a worker.

use grpcio::{RpcStatus, RpcStatusCode};

use crate::proto::inferd_session_v1::session_service as ext;
use crate::proto::kakeya_v1::runtime as pb;
use crate::runtime::{
    AppendTokens, CreateSession, ForkSession, GenerateDone, GenerateEvent, GenerateRequest,
    RuntimeError, SamplingOptions, SessionId, SessionInfo, StatusKind, StopReason,
};
use crate::sampler::TokenLogprobs;

/// The gRPC status a runtime error is reported as (CONTRACT §2.4).
pub fn status_of(err: &RuntimeError) -> RpcStatus {
    let code = match err.code() {
        StatusKind::NotFound => RpcStatusCode::NOT_FOUND,
        StatusKind::InvalidArgument => RpcStatusCode::INVALID_ARGUMENT,
        StatusKind::ResourceExhausted => RpcStatusCode::RESOURCE_EXHAUSTED,
        StatusKind::FailedPrecondition => RpcStatusCode::FAILED_PRECONDITION,
        StatusKind::DeadlineExceeded => RpcStatusCode::DEADLINE_EXCEEDED,
        StatusKind::Unavailable => RpcStatusCode::UNAVAILABLE,
        StatusKind::Internal => RpcStatusCode::INTERNAL,
        StatusKind::DataLoss => RpcStatusCode::DATA_LOSS,
        StatusKind::Aborted => RpcStatusCode::ABORTED,
    };
    RpcStatus::with_message(code, err.to_string())
}

/// A session id from the wire. Text that is not 32 lowercase hex digits
/// (the empty string included) is an id the server never issued:
/// NOT_FOUND, like an unknown, closed or evicted one (CONTRACT §2.4).
pub fn session_id(text: &str) -> Result<SessionId, RuntimeError> {
    Ok(SessionId::parse(text)?)
}

/// A CreateSession request (the runtime checks its bounds).
pub fn create_request(req: &mut pb::CreateSessionRequest) -> CreateSession {
    CreateSession {
        client_label: req.take_client_label(),
        eos_token_ids: req.take_eos_token_ids(),
    }
}

/// An AppendTokens request. An id of any form the server never issues
/// becomes [`SessionId::NEVER_ISSUED`], so the runtime checks the tokens
/// first (INVALID_ARGUMENT whatever the id) and only then finds no session
/// (NOT_FOUND).
pub fn append_request(req: &mut pb::AppendTokensRequest) -> AppendTokens {
    AppendTokens {
        id: SessionId::parse_or_never_issued(req.get_session_id()),
        tokens: req.take_token_ids(),
    }
}

/// A ForkSession request: an absent `at_length` forks the whole history, an
/// empty label keeps the source's. As for an append, an id of any form the
/// server never issues is NOT_FOUND only after the label was checked.
pub fn fork_request(req: &mut ext::ForkSessionRequest) -> ForkSession {
    let label = req.take_client_label();
    ForkSession {
        source: SessionId::parse_or_never_issued(req.get_session_id()),
        at_length: req.has_at_length().then(|| req.get_at_length()),
        client_label: (!label.is_empty()).then_some(label),
    }
}

/// A Generate request, converted only: the runtime checks every argument
/// before it looks the session up (an id of any other form becomes
/// [`SessionId::NEVER_ISSUED`], as for an append).
pub fn generate_request(req: &pb::GenerateRequest) -> GenerateRequest {
    let opt_f32 = |has: bool, v: f32| has.then_some(v);
    let sampling = SamplingOptions {
        temperature: opt_f32(req.has_temperature(), req.get_temperature()),
        top_p: opt_f32(req.has_top_p(), req.get_top_p()),
        // 0 is "no limit" in the schema; the sampler knows it the same way.
        top_k: req.has_top_k().then_some(req.get_top_k()),
        min_p: opt_f32(req.has_min_p(), req.get_min_p()),
        repetition_penalty: opt_f32(req.has_repetition_penalty(), req.get_repetition_penalty()),
        presence_penalty: opt_f32(req.has_presence_penalty(), req.get_presence_penalty()),
        frequency_penalty: opt_f32(req.has_frequency_penalty(), req.get_frequency_penalty()),
        penalty_last_n: req.has_penalty_last_n().then_some(req.get_penalty_last_n()),
        logit_bias: req
            .get_logit_bias()
            .iter()
            .map(|b| (b.get_token_id(), b.get_bias()))
            .collect(),
        seed: req.has_seed().then_some(req.get_seed()),
        top_logprobs: req.get_top_logprobs(),
    };
    let stop_sequences: Vec<Vec<u32>> = req
        .get_stop_sequences()
        .iter()
        .map(|s| s.get_token_ids().to_vec())
        .collect();
    GenerateRequest {
        constraint: None,
        speculate: req.has_speculate().then(|| req.get_speculate()),
        id: SessionId::parse_or_never_issued(req.get_session_id()),
        max_tokens: req.get_max_tokens(),
        sampling,
        stop_sequences,
    }
}

fn stop_reason(reason: StopReason) -> pb::GenerateDone_StopReason {
    use pb::GenerateDone_StopReason as R;
    match reason {
        StopReason::MaxTokens => R::STOP_REASON_MAX_TOKENS,
        StopReason::Eos | StopReason::StopSequence { .. } => R::STOP_REASON_EOS,
        StopReason::Cancelled => R::STOP_REASON_CANCELLED,
        StopReason::Truncated => R::STOP_REASON_TRUNCATED,
        StopReason::ConstraintDone => R::STOP_REASON_CONSTRAINT_DONE,
        StopReason::ConstraintUnfinished => R::STOP_REASON_CONSTRAINT_UNFINISHED,
    }
}

/// The terminal message of a Generate stream.
pub fn done_message(done: &GenerateDone) -> pb::GenerateResponse {
    let mut msg = pb::GenerateDone::new();
    msg.set_stop_reason(stop_reason(done.stop_reason));
    msg.set_generated_token_count(done.generated_token_count);
    msg.set_prefill_duration_seconds(done.prefill_duration.as_secs_f64());
    msg.set_total_duration_seconds(done.total_duration.as_secs_f64());
    msg.set_seed_used(done.seed_used);
    msg.set_prefill_token_count(done.prefill_token_count);
    if let StopReason::StopSequence { index } = done.stop_reason {
        msg.set_stop_sequence_index(index);
    }
    msg.set_history_length(done.history_length);
    msg.set_speculation_proposed_token_count(done.speculation.proposed);
    msg.set_speculation_accepted_token_count(done.speculation.accepted);
    let mut response = pb::GenerateResponse::new();
    response.set_done(msg);
    response
}

fn token_logprob(token_id: u32, logprob: f32) -> pb::TokenLogprob {
    let mut entry = pb::TokenLogprob::new();
    entry.set_token_id(token_id);
    entry.set_logprob(logprob);
    entry
}

/// The report that follows a token: the token itself, then the top list.
fn logprobs_message(logprobs: &TokenLogprobs) -> pb::TokenLogprobs {
    let mut message = pb::TokenLogprobs::new();
    message.set_chosen(token_logprob(logprobs.token, logprobs.chosen));
    message.set_top(
        logprobs
            .top
            .iter()
            .map(|&(id, logprob)| token_logprob(id, logprob))
            .collect(),
    );
    message
}

/// One stream event as a wire message; `Err` for the error that ends it.
pub fn event_message(event: &GenerateEvent) -> Result<pb::GenerateResponse, RpcStatus> {
    let mut response = pb::GenerateResponse::new();
    match event {
        GenerateEvent::Token(token) => response.set_token_id(*token),
        GenerateEvent::Truncated {
            dropped_token_count,
        } => {
            let mut truncated = pb::HistoryTruncated::new();
            truncated.set_dropped_token_count(*dropped_token_count);
            response.set_truncated(truncated);
        }
        GenerateEvent::Logprobs(logprobs) => response.set_logprobs(logprobs_message(logprobs)),
        GenerateEvent::Done(done) => return Ok(done_message(done)),
        GenerateEvent::Error(err) => return Err(status_of(err)),
    }
    Ok(response)
}

pub fn info_message(info: &SessionInfo, page_bytes: u64) -> pb::GetSessionInfoResponse {
    let mut msg = pb::GetSessionInfoResponse::new();
    msg.set_history_length(info.history_length);
    msg.set_kv_live_bytes(info.kv_live_bytes);
    msg.set_cache_invariant_inv1_violations(info.inv1_violations);
    msg.set_cache_invariant_inv2_violations(info.inv2_violations);
    msg.set_idle_seconds(info.idle_seconds);
    msg.set_kv_pages_held(info.pages_held);
    msg.set_kv_page_bytes(page_bytes);
    msg.set_client_label(info.client_label.clone());
    // The schema promises 0 for an empty history (there are no logits yet);
    // the runtime's FNV-1a of no bytes is the offset basis instead.
    let digest = if info.history_length == 0 {
        0
    } else {
        info.logits_digest
    };
    msg.set_logits_digest(digest);
    msg.set_eos_token_ids(info.eos_token_ids.clone());
    msg.set_truncated_token_count(info.truncated_token_count);
    msg.set_busy(info.busy);
    msg.set_durable(info.durable);
    msg.set_backend(info.backend.to_string());
    msg.set_speculation_proposed_token_count(info.speculation.proposed);
    msg.set_speculation_accepted_token_count(info.speculation.accepted);
    msg
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::SpeculationCounts;

    fn generate(f: impl FnOnce(&mut pb::GenerateRequest)) -> GenerateRequest {
        let mut req = pb::GenerateRequest::new();
        req.set_session_id("0123456789abcdef0123456789abcdef".into());
        req.set_max_tokens(4);
        f(&mut req);
        generate_request(&req)
    }

    #[test]
    fn an_id_of_any_other_form_converts_to_the_never_issued_one() {
        for id in [
            "sess-does-not-exist",
            "",
            "0123456789ABCDEF0123456789abcdef",
        ] {
            let got = generate(|r| r.set_session_id(id.into()));
            assert_eq!(got.id, SessionId::NEVER_ISSUED, "{id:?}");
            let mut req = pb::AppendTokensRequest::new();
            req.set_session_id(id.into());
            assert_eq!(append_request(&mut req).id, SessionId::NEVER_ISSUED);
        }
        let got = generate(|_| {});
        assert_eq!(got.id.to_string(), "0123456789abcdef0123456789abcdef");
    }

    #[test]
    fn conversion_checks_nothing_and_keeps_every_value() {
        let got = generate(|r| {
            r.set_max_tokens(0);
            r.set_temperature(f32::NAN);
            r.mut_stop_sequences().push(pb::StopSequence::new());
        });
        assert_eq!(got.max_tokens, 0);
        assert!(got.sampling.temperature.is_some_and(f32::is_nan));
        assert_eq!(got.stop_sequences, vec![Vec::<u32>::new()]);
        assert_eq!(
            got.admit(320).map(|_| ()).map_err(|e| e.code()),
            Err(StatusKind::InvalidArgument)
        );
    }

    /// What a client sees of a bad argument: converted as it is, then
    /// refused by the runtime's admission whatever form its id has.
    #[test]
    fn every_bad_generate_argument_is_invalid_argument_whatever_the_id() {
        let bad: [fn(&mut pb::GenerateRequest); 8] = [
            |r| r.set_max_tokens(0),
            |r| r.set_temperature(-0.5),
            |r| r.set_temperature(f32::NAN),
            |r| r.set_top_p(0.0),
            |r| r.set_top_p(1.5),
            |r| r.set_top_logprobs(21),
            |r| r.mut_stop_sequences().push(pb::StopSequence::new()),
            |r| {
                let mut bias = pb::LogitBias::new();
                bias.set_token_id(320);
                r.mut_logit_bias().push(bias);
            },
        ];
        for (i, f) in bad.iter().enumerate() {
            for id in [
                "0123456789abcdef0123456789abcdef",
                "sess-does-not-exist",
                "",
            ] {
                let got = generate(|r| {
                    f(r);
                    r.set_session_id(id.into());
                })
                .admit(320)
                .map(|_| ())
                .map_err(|e| e.code());
                assert_eq!(got, Err(StatusKind::InvalidArgument), "case {i}, id {id:?}");
            }
        }
    }

    #[test]
    fn append_tokens_are_checked_whatever_the_id() {
        let mut req = pb::AppendTokensRequest::new();
        req.set_session_id("sess-does-not-exist".into());
        req.set_token_ids(vec![1, 320]);
        let got = append_request(&mut req);
        let checked = AppendTokens::check_tokens(&got.tokens, 320).map_err(|e| e.code());
        assert_eq!(checked, Err(StatusKind::InvalidArgument));
        req.set_token_ids(vec![1, 319]);
        req.set_session_id("0123456789abcdef0123456789abcdef".into());
        let got = append_request(&mut req);
        assert_eq!(AppendTokens::check_tokens(&got.tokens, 320), Ok(()));
        assert_eq!(got.tokens, vec![1, 319]);
    }

    #[test]
    fn unset_knobs_stay_unset_and_set_zeroes_stay_set() {
        let plain = generate(|_| {});
        assert_eq!(plain.sampling, SamplingOptions::default());
        let seeded = generate(|r| {
            r.set_seed(0);
            r.set_temperature(0.0);
            r.set_top_k(0);
        });
        assert_eq!(seeded.sampling.seed, Some(0));
        assert_eq!(seeded.sampling.temperature, Some(0.0));
        assert_eq!(seeded.sampling.top_k, Some(0));
    }

    #[test]
    fn info_reports_busy_and_a_zero_digest_for_an_empty_history() {
        let mut info = SessionInfo {
            history_length: 0,
            kv_live_bytes: 0,
            inv1_violations: 0,
            inv2_violations: 0,
            idle_seconds: 0.0,
            pages_held: 0,
            client_label: "c".into(),
            eos_token_ids: vec![2],
            truncated_token_count: 0,
            busy: true,
            logits_digest: 0xcbf2_9ce4_8422_2325,
            durable: true,
            backend: "gpu",
            speculation: SpeculationCounts {
                proposed: 12,
                accepted: 9,
            },
        };
        let msg = info_message(&info, 4096);
        assert!(msg.get_busy());
        assert!(msg.get_durable());
        assert_eq!(msg.get_backend(), "gpu");
        assert_eq!(msg.get_speculation_proposed_token_count(), 12);
        assert_eq!(msg.get_speculation_accepted_token_count(), 9);
        assert_eq!(msg.get_logits_digest(), 0);
        assert_eq!(msg.get_eos_token_ids(), &[2]);
        info.history_length = 3;
        info.busy = false;
        let msg = info_message(&info, 4096);
        assert!(!msg.get_busy());
        assert_eq!(msg.get_logits_digest(), 0xcbf2_9ce4_8422_2325);
    }

    #[test]
    fn statuses_follow_the_contract_table() {
        let cases = [
            (RuntimeError::NotFound, RpcStatusCode::NOT_FOUND),
            (
                RuntimeError::DeadlineExceeded,
                RpcStatusCode::DEADLINE_EXCEEDED,
            ),
            (RuntimeError::Unavailable, RpcStatusCode::UNAVAILABLE),
            (
                RuntimeError::Shard {
                    status: StatusKind::DataLoss,
                    message: "checksum failure at shard 10.0.0.2:7000".into(),
                },
                RpcStatusCode::DATA_LOSS,
            ),
            (
                RuntimeError::Shard {
                    status: StatusKind::Aborted,
                    message: "sequence failure at shard 10.0.0.2:7000".into(),
                },
                RpcStatusCode::ABORTED,
            ),
            (
                RuntimeError::ResourceExhausted {
                    what: "KV pages".into(),
                    asked: 3,
                    free: 1,
                },
                RpcStatusCode::RESOURCE_EXHAUSTED,
            ),
        ];
        for (err, code) in cases {
            let status = status_of(&err);
            assert_eq!(status.code(), code);
            assert_eq!(status.message(), err.to_string());
        }
    }
}
