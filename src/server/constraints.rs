//! Output constraints at the gRPC door: the request's `OutputConstraint`
//! compiled against the model's vocabulary (the compiler is built on the
//! first constrained request, so a server that never sees one never pays
//! for its vocabulary trie). A constraint that does not compile is
//! INVALID_ARGUMENT with the compiler's message.

use std::sync::{Arc, OnceLock};

use crate::constraint::{ConstraintCompiler, ConstraintSpec};
use crate::model::Model;
use crate::proto::kakeya_v1::runtime as pb;
use crate::runtime::{RequestConstraint, RuntimeError};
use crate::tokenizer::Tokenizer;

/// A server's constraint compiler, built when first needed.
pub(crate) struct Constraints {
    model: Arc<Model>,
    compiler: OnceLock<Result<Arc<ConstraintCompiler>, String>>,
}

impl Constraints {
    pub fn new(model: Arc<Model>) -> Self {
        Self {
            model,
            compiler: OnceLock::new(),
        }
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
