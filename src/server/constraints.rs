//! Output constraints at the gRPC door: the request's `OutputConstraint`
//! compiled against the model's vocabulary (the compiler is built on the
//! first constrained request, so a server that never sees one never pays
//! for its vocabulary trie). A constraint that does not compile is
//! INVALID_ARGUMENT with the compiler's message.
//!
//! Compiling takes up to 2 s of CPU, so it runs on a few threads of its own
//! ([`Constraints::compile_later`]) rather than on a thread that serves
//! other calls (a gRPC completion queue, the HTTP front's event loop); at
//! most [`MAX_QUEUED_COMPILES`] wait, and one more is RESOURCE_EXHAUSTED.

use std::sync::{Arc, Mutex, OnceLock};

use futures_channel::oneshot;

use crate::constraint::{ConstraintCompiler, ConstraintSpec};
use crate::model::Model;
use crate::proto::kakeya_v1::runtime as pb;
use crate::runtime::{RequestConstraint, RuntimeError};
use crate::tokenizer::Tokenizer;

/// Threads that compile constraints.
const COMPILE_THREADS: usize = 2;

/// Compiles that may wait for a thread.
pub const MAX_QUEUED_COMPILES: usize = 64;

/// One compile handed to the threads, and where its result goes.
type CompileJob = (
    ConstraintSpec,
    oneshot::Sender<Result<RequestConstraint, RuntimeError>>,
);

/// A server's constraint compiler, built when first needed.
pub(crate) struct Constraints {
    model: Arc<Model>,
    compiler: OnceLock<Result<Arc<ConstraintCompiler>, String>>,
    /// The compile threads' queue, started with the first compile; the
    /// threads end when it is dropped.
    queue: Mutex<Option<crossbeam_channel::Sender<CompileJob>>>,
}

impl Constraints {
    pub fn new(model: Arc<Model>) -> Self {
        Self {
            model,
            compiler: OnceLock::new(),
            queue: Mutex::new(None),
        }
    }

    /// Compiles `spec` on the compile threads; the result arrives on the
    /// returned receiver. A full queue is RESOURCE_EXHAUSTED at once.
    pub fn compile_later(
        &self,
        spec: ConstraintSpec,
    ) -> Result<oneshot::Receiver<Result<RequestConstraint, RuntimeError>>, RuntimeError> {
        let compiler = self.compiler()?;
        let (tx, rx) = oneshot::channel();
        let mut queue = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        let sender = queue.get_or_insert_with(|| start_threads(&compiler));
        sender
            .try_send((spec, tx))
            .map_err(|_| RuntimeError::ResourceExhausted {
                what: "constraint compile queue".into(),
                asked: 1,
                free: 0,
            })?;
        Ok(rx)
    }

    /// The compiler for the model's vocabulary.
    pub fn compiler(&self) -> Result<Arc<ConstraintCompiler>, RuntimeError> {
        self.compiler
            .get_or_init(|| {
                let tokenizer = Tokenizer::from_gguf(self.model.gguf())
                    .map_err(|e| format!("the model's tokenizer: {e}"))?;
                ConstraintCompiler::new(&tokenizer, self.model.config.vocab)
                    .map_err(|e| e.to_string())
            })
            .clone()
            .map_err(|e| RuntimeError::Internal(format!("constraints are unavailable: {e}")))
    }

    /// Compiles `spec` for one Generate.
    pub fn compile(&self, spec: &ConstraintSpec) -> Result<RequestConstraint, RuntimeError> {
        let constraint = self
            .compiler()?
            .compile(spec)
            .map_err(|e| RuntimeError::invalid(e.to_string()))?;
        Ok(RequestConstraint::new(constraint))
    }
}

/// The compile threads, fed by the returned queue.
fn start_threads(compiler: &Arc<ConstraintCompiler>) -> crossbeam_channel::Sender<CompileJob> {
    let (tx, rx) = crossbeam_channel::bounded::<CompileJob>(MAX_QUEUED_COMPILES);
    for n in 0..COMPILE_THREADS {
        let (rx, compiler) = (rx.clone(), Arc::clone(compiler));
        let started = std::thread::Builder::new()
            .name(format!("inferd-compile-{n}"))
            .spawn(move || {
                for (spec, reply) in rx {
                    // A caller that went away needs no compile.
                    if reply.is_canceled() {
                        continue;
                    }
                    let compiled = compiler
                        .compile(&spec)
                        .map(RequestConstraint::new)
                        .map_err(|e| RuntimeError::invalid(e.to_string()));
                    let _ = reply.send(compiled);
                }
            });
        if let Err(e) = started {
            tracing::error!(error = %e, "could not start a constraint compile thread");
        }
    }
    tx
}

/// What a request's `OutputConstraint` asks for.
pub(crate) fn spec_of(constraint: &pb::OutputConstraint) -> Result<ConstraintSpec, RuntimeError> {
    if constraint.has_json_schema() {
        Ok(ConstraintSpec::JsonSchema(
            constraint.get_json_schema().to_owned(),
        ))
    } else if constraint.has_json_object() {
        Ok(ConstraintSpec::JsonObject)
    } else if constraint.has_regex() {
        Ok(ConstraintSpec::Regex(constraint.get_regex().to_owned()))
    } else if constraint.has_lark_grammar() {
        Ok(ConstraintSpec::Lark(
            constraint.get_lark_grammar().to_owned(),
        ))
    } else if constraint.has_gbnf_grammar() {
        Ok(ConstraintSpec::Gbnf(
            constraint.get_gbnf_grammar().to_owned(),
        ))
    } else {
        Err(RuntimeError::invalid(
            "constraint is set but names no kind (json_schema, json_object, regex, lark_grammar \
             or gbnf_grammar)",
        ))
    }
}
