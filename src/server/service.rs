//! `kakeya.v1.RuntimeService` and its extension
//! `inferd.session.v1.SessionService` on grpcio: each handler decodes and
//! validates
//! on the completion-queue thread (a body that does not parse is
//! INVALID_ARGUMENT, see `wire`), hands the work to the owning worker
//! through the runtime's bounded channels, and spawns a small future that
//! forwards the reply. No handler ever blocks a completion-queue thread: the
//! futures are woken by the worker's send (see `runtime::notify`).
//!
//! Every handler reads the caller's tenant from its bearer token first
//! ([`RuntimeServiceImpl::caller`]): the runtime's calls that name or make
//! a session cannot be made without it.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use futures_util::future::{select, Either};
use futures_util::{Sink, SinkExt, StreamExt};
use grpcio::{RpcContext, ServerStreamingSink, UnarySink, WriteFlags};

use super::auth::grpc_caller;
use super::convert::{self, status_of};
use super::deadline::call_deadline;
use super::stats::{Method, ServerStats};
use super::tokens::AccessTokens;
use super::wire::{self, Incoming};
use crate::proto::inferd_session_v1::session_service as ext;
use crate::proto::kakeya_v1::runtime as pb;
use crate::runtime::{GenerateEvent, Pending, Runtime, RuntimeError, Tenant};

/// What every handler shares: the runtime and the numbers it reports.
pub(crate) struct ServiceState {
    pub runtime: Runtime,
    /// The accepted tokens and their tenants (`None`: no token required).
    pub tokens: Option<AccessTokens>,
    pub stats: Arc<ServerStats>,
    pub vocab: u32,
    pub context: u64,
    pub page_bytes: u64,
    /// Compiles GenerateRequest.constraint.
    pub constraints: super::constraints::Constraints,
}

/// The service object grpcio clones into each completion queue.
#[derive(Clone)]
pub(crate) struct RuntimeServiceImpl {
    pub shared: Arc<ServiceState>,
}

impl RuntimeServiceImpl {
    /// The tenant the call comes from (CONTRACT §2.10).
    fn caller(&self, ctx: &RpcContext) -> Result<Tenant, RuntimeError> {
        grpc_caller(self.shared.tokens.as_ref(), ctx)
    }

    /// Forwards a unary reply once the worker answers.
    fn reply<T, R>(
        &self,
        ctx: &RpcContext,
        sink: UnarySink<R>,
        method: Method,
        started: Result<Pending<T>, RuntimeError>,
        to_message: impl FnOnce(T) -> R + Send + 'static,
    ) where
        T: Send + 'static,
        R: Send + 'static,
    {
        let stats = Arc::clone(&self.shared.stats);
        let task = async move {
            let result = match started {
                Ok(pending) => pending.await,
                Err(err) => Err(err),
            };
            let sent = match result {
                Ok(value) => {
                    stats.count(method, grpcio::RpcStatusCode::OK);
                    sink.success(to_message(value)).await
                }
                Err(err) => {
                    let status = status_of(&err);
                    log_failure(method, &err);
                    stats.count(method, status.code());
                    sink.fail(status).await
                }
            };
            if let Err(e) = sent {
                tracing::debug!(method = method.name(), error = %e, "reply not delivered");
            }
        };
        ctx.spawn(task);
    }
}

fn log_failure(method: Method, err: &RuntimeError) {
    match err {
        RuntimeError::Internal(_) => {
            tracing::error!(method = method.name(), error = %err, "call failed")
        }
        RuntimeError::FailedPrecondition(_) => {
            tracing::warn!(method = method.name(), error = %err, "session removed")
        }
        _ => tracing::debug!(method = method.name(), error = %err, "call refused"),
    }
}

/// The grpcio service: every RuntimeService method with its handler, each
/// decoding leniently (`wire`), so a body that does not parse reaches the
/// handler and is answered INVALID_ARGUMENT.
pub(crate) fn runtime_service(service: RuntimeServiceImpl) -> grpcio::Service {
    let (mut create, mut append, mut generate, mut close, mut info) = (
        service.clone(),
        service.clone(),
        service.clone(),
        service.clone(),
        service,
    );
    grpcio::ServiceBuilder::new()
        .add_unary_handler(&wire::CREATE_SESSION, move |ctx, req, sink| {
            create.create_session(ctx, req, sink)
        })
        .add_unary_handler(&wire::APPEND_TOKENS, move |ctx, req, sink| {
            append.append_tokens(ctx, req, sink)
        })
        .add_server_streaming_handler(&wire::GENERATE, move |ctx, req, sink| {
            generate.generate(ctx, req, sink)
        })
        .add_unary_handler(&wire::CLOSE_SESSION, move |ctx, req, sink| {
            close.close_session(ctx, req, sink)
        })
        .add_unary_handler(&wire::GET_SESSION_INFO, move |ctx, req, sink| {
            info.get_session_info(ctx, req, sink)
        })
        .build()
}

impl RuntimeServiceImpl {
    fn create_session(
        &mut self,
        ctx: RpcContext,
        req: Incoming<pb::CreateSessionRequest>,
        sink: UnarySink<pb::CreateSessionResponse>,
    ) {
        let shared = &self.shared;
        let deadline = call_deadline(ctx.deadline());
        let started = req.message().and_then(|mut req| {
            let request = convert::create_request(&mut req);
            let caller = self.caller(&ctx)?;
            shared.runtime.create_session(&caller, request, deadline)
        });
        let (vocab, context, workers) = (shared.vocab, shared.context, shared.runtime.workers());
        self.reply(&ctx, sink, Method::CreateSession, started, move |id| {
            let worker = id.worker_index(workers) as u32;
            let mut msg = pb::CreateSessionResponse::new();
            msg.set_session_id(id.to_string());
            msg.set_vocab_size(vocab);
            msg.set_context_length(context);
            msg.set_worker(worker);
            msg
        });
    }

    fn append_tokens(
        &mut self,
        ctx: RpcContext,
        req: Incoming<pb::AppendTokensRequest>,
        sink: UnarySink<pb::AppendTokensResponse>,
    ) {
        let deadline = call_deadline(ctx.deadline());
        let started = req.message().and_then(|mut req| {
            let request = convert::append_request(&mut req);
            let caller = self.caller(&ctx)?;
            self.shared
                .runtime
                .append_tokens(&caller, request, deadline)
        });
        self.reply(&ctx, sink, Method::AppendTokens, started, |reply| {
            let mut msg = pb::AppendTokensResponse::new();
            msg.set_history_length(reply.history_length);
            msg.set_dropped_token_count(reply.dropped_token_count);
            msg
        });
    }

    fn generate(
        &mut self,
        ctx: RpcContext,
        req: Incoming<pb::GenerateRequest>,
        sink: ServerStreamingSink<pb::GenerateResponse>,
    ) {
        let deadline = call_deadline(ctx.deadline());
        let shared = Arc::clone(&self.shared);
        // A constraint compiles off this completion queue's thread.
        let asked = req.message().and_then(|req| {
            let caller = self.caller(&ctx)?;
            let compiling = if req.has_constraint() {
                let spec = super::constraints::spec_of(req.get_constraint())?;
                Some(shared.constraints.compile_later(spec)?)
            } else {
                None
            };
            Ok((convert::generate_request(&req), caller, compiling))
        });
        let stats = Arc::clone(&self.shared.stats);
        ctx.spawn(async move {
            let started = match asked {
                Ok((mut request, caller, compiling)) => {
                    let compiled = match compiling {
                        Some(rx) => match rx.await {
                            Ok(result) => result.map(Some),
                            Err(_) => Err(RuntimeError::Internal(
                                "a constraint compile thread stopped".into(),
                            )),
                        },
                        None => Ok(None),
                    };
                    compiled.and_then(|constraint| {
                        request.constraint = constraint;
                        shared.runtime.generate(&caller, request, deadline)
                    })
                }
                Err(e) => Err(e),
            };
            stream_generate(started, sink, stats).await
        });
    }

    fn close_session(
        &mut self,
        ctx: RpcContext,
        req: Incoming<pb::CloseSessionRequest>,
        sink: UnarySink<pb::CloseSessionResponse>,
    ) {
        let deadline = call_deadline(ctx.deadline());
        let started = req
            .message()
            .and_then(|req| convert::session_id(req.get_session_id()))
            .and_then(|id| {
                let caller = self.caller(&ctx)?;
                self.shared.runtime.close_session(&caller, id, deadline)
            });
        self.reply(&ctx, sink, Method::CloseSession, started, move |reply| {
            let mut msg = pb::CloseSessionResponse::new();
            msg.set_final_history_length(reply.final_history_length);
            msg
        });
    }

    fn get_session_info(
        &mut self,
        ctx: RpcContext,
        req: Incoming<pb::GetSessionInfoRequest>,
        sink: UnarySink<pb::GetSessionInfoResponse>,
    ) {
        let deadline = call_deadline(ctx.deadline());
        let workers = self.shared.runtime.workers();
        let page_bytes = self.shared.page_bytes;
        let started = req
            .message()
            .and_then(|req| convert::session_id(req.get_session_id()))
            .and_then(|id| {
                let caller = self.caller(&ctx)?;
                self.shared
                    .runtime
                    .session_info(&caller, id, deadline)
                    .map(|pending| (id, pending))
            });
        let (worker, started) = match started {
            Ok((id, pending)) => (id.worker_index(workers) as u32, Ok(pending)),
            Err(e) => (0, Err(e)),
        };
        self.reply(&ctx, sink, Method::GetSessionInfo, started, move |info| {
            let mut msg = convert::info_message(&info, page_bytes);
            msg.set_worker(worker);
            msg
        });
    }
}

/// The grpcio service of inferd's session extensions (ForkSession), on
/// the same state, token check and counters as the RuntimeService.
pub(crate) fn session_service(service: RuntimeServiceImpl) -> grpcio::Service {
    let mut fork = service;
    grpcio::ServiceBuilder::new()
        .add_unary_handler(&wire::FORK_SESSION, move |ctx, req, sink| {
            fork.fork_session(ctx, req, sink)
        })
        .build()
}

impl RuntimeServiceImpl {
    fn fork_session(
        &mut self,
        ctx: RpcContext,
        req: Incoming<ext::ForkSessionRequest>,
        sink: UnarySink<ext::ForkSessionResponse>,
    ) {
        let deadline = call_deadline(ctx.deadline());
        let started = req.message().and_then(|mut req| {
            let request = convert::fork_request(&mut req);
            let caller = self.caller(&ctx)?;
            self.shared.runtime.fork_session(&caller, request, deadline)
        });
        let workers = self.shared.runtime.workers();
        self.reply(&ctx, sink, Method::ForkSession, started, move |reply| {
            let mut msg = ext::ForkSessionResponse::new();
            msg.set_session_id(reply.id.to_string());
            msg.set_history_length(reply.history_length);
            msg.set_worker(reply.id.worker_index(workers) as u32);
            msg
        });
    }
}

/// Resolves when the call is over on the client's side (cancelled, deadline
/// passed, connection lost) before the server finished it.
struct CallGone<'a, T> {
    sink: &'a mut ServerStreamingSink<T>,
}

impl<T> Future for CallGone<'_, T> {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        // `poll_ready` looks at the call's completion first (registering this
        // task for it) and reports a finished call as an error.
        match Pin::new(&mut *self.sink).poll_ready(cx) {
            Poll::Ready(Err(_)) => Poll::Ready(()),
            _ => Poll::Pending,
        }
    }
}

/// Streams a Generate's events to the client. A client that goes away
/// cancels the generation at once (the worker stops within one step).
async fn stream_generate(
    started: Result<crate::runtime::GenerateStream, RuntimeError>,
    mut sink: ServerStreamingSink<pb::GenerateResponse>,
    stats: Arc<ServerStats>,
) {
    let mut stream = match started {
        Ok(stream) => stream,
        Err(err) => {
            log_failure(Method::Generate, &err);
            let status = status_of(&err);
            stats.count(Method::Generate, status.code());
            let _ = sink.fail(status).await;
            return;
        }
    };
    let _active = stats.stream_started();
    let began = Instant::now();
    let mut tokens = 0u32;
    loop {
        let next = {
            let gone = CallGone { sink: &mut sink };
            match select(stream.next(), gone).await {
                Either::Left((event, _)) => event,
                Either::Right(((), _)) => None,
            }
        };
        let Some(event) = next else {
            stream.cancel();
            stats.count(Method::Generate, grpcio::RpcStatusCode::CANCELLED);
            tracing::debug!(tokens, "generate abandoned by the client");
            return;
        };
        if matches!(event, GenerateEvent::Token(_)) {
            tokens += 1;
        }
        match convert::event_message(&event) {
            Ok(message) => {
                let terminal = matches!(event, GenerateEvent::Done(_));
                let flags = WriteFlags::default().buffer_hint(terminal);
                if sink.send((message, flags)).await.is_err() {
                    stream.cancel();
                    stats.count(Method::Generate, grpcio::RpcStatusCode::CANCELLED);
                    return;
                }
                if terminal {
                    stats.count(Method::Generate, grpcio::RpcStatusCode::OK);
                    if let GenerateEvent::Done(done) = &event {
                        tracing::info!(
                            tokens = done.generated_token_count,
                            reason = ?done.stop_reason,
                            seconds = began.elapsed().as_secs_f64(),
                            "generate done"
                        );
                    }
                    let _ = sink.close().await;
                    return;
                }
            }
            Err(status) => {
                if let GenerateEvent::Error(err) = &event {
                    log_failure(Method::Generate, err);
                }
                stats.count(Method::Generate, status.code());
                let _ = sink.fail(status).await;
                return;
            }
        }
    }
}
