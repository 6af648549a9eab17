//! What a worker is sent: commands from the runtime's handle, the
//! operations that join a session's FIFO, and a checked Generate.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Instant;

use super::super::notify::NotifySender;
use super::super::{
    AppendReply, CloseReply, CreateSession, ForkReply, GenerateEvent, GenerateRequest,
    RuntimeError, SessionId, SessionInfo, Tenant,
};
use crate::durable::Recovered;
use crate::sampler::CheckedParams;

pub(super) type Reply<T> = NotifySender<Result<T, RuntimeError>>;

/// A message to a worker. Every command that names an existing session
/// carries the caller's tenant, and the worker finds the session only
/// through [`session_for`], which checks it.
pub(crate) enum Command {
    Create {
        id: SessionId,
        /// Who the new session belongs to.
        owner: Tenant,
        req: CreateSession,
        reply: Reply<SessionId>,
        deadline: Option<Instant>,
        /// Never journaled, whatever the state directory (the server's
        /// warm-up session).
        transient: bool,
    },
    /// An operation that joins the session's FIFO.
    Enqueue {
        id: SessionId,
        caller: Tenant,
        op: Op,
        deadline: Option<Instant>,
    },
    Info {
        id: SessionId,
        caller: Tenant,
        reply: Reply<SessionInfo>,
    },
    /// A session read back from the state directory: add it and feed its
    /// history again.
    Restore(Box<Recovered>),
    /// Another replica asks for session `id` (a call for it reached it):
    /// let it go if nothing runs or waits on it.
    HandOff(SessionId),
    Shutdown,
}

/// An operation that runs in the session's arrival order.
pub(crate) enum Op {
    Append {
        tokens: Vec<u32>,
        reply: Reply<AppendReply>,
    },
    Generate {
        gen: Box<AdmittedGenerate>,
        events: NotifySender<GenerateEvent>,
        cancel: Arc<AtomicBool>,
    },
    /// The committed history, in the session's order (after what is queued
    /// before it).
    History {
        reply: Reply<Vec<u32>>,
    },
    /// GetSessionInfo once the session's KV is in place: the answer for a
    /// session a replica takes over from the store by this call (its
    /// logits digest is then the one it had before it moved).
    Info {
        reply: Reply<SessionInfo>,
    },
    Close {
        reply: Reply<CloseReply>,
    },
    /// Make session `fork` (drawn for this worker) from this one's first
    /// `at_length` tokens.
    Fork {
        fork: SessionId,
        /// Who the fork belongs to: the caller.
        owner: Tenant,
        at_length: Option<u64>,
        client_label: Option<String>,
        reply: Reply<ForkReply>,
    },
}

impl Op {
    /// Whether the op writes a session's journal (or starts one): new
    /// durable work, which the state directory's limits may refuse.
    pub(super) fn grows_state(&self) -> bool {
        match self {
            Op::Append { tokens, .. } => !tokens.is_empty(),
            Op::Generate { .. } | Op::Fork { .. } => true,
            Op::History { .. } | Op::Info { .. } | Op::Close { .. } => false,
        }
    }

    pub(super) fn fail(self, err: RuntimeError) {
        // A caller that went away no longer needs the answer.
        match self {
            Op::Append { reply, .. } => drop(reply.send(Err(err))),
            Op::Close { reply } => drop(reply.send(Err(err))),
            Op::History { reply } => drop(reply.send(Err(err))),
            Op::Info { reply } => drop(reply.send(Err(err))),
            Op::Fork { reply, .. } => drop(reply.send(Err(err))),
            Op::Generate { events, .. } => drop(events.try_send(GenerateEvent::Error(err))),
        }
    }
}

/// A Generate the runtime's boundary accepted: the request, and the
/// sampler parameters checked there once for the whole call.
pub(crate) struct AdmittedGenerate {
    pub(crate) req: GenerateRequest,
    pub(crate) params: CheckedParams,
    pub(crate) seed_used: u64,
}
