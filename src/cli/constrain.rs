//! `--json-schema FILE`, `--regex RX` and `--grammar FILE` of `generate`:
//! what the continuation must match (see `crate::constraint`), compiled
//! here for the engine or sent as GenerateRequest.constraint to a server.

use clap::Args;

use super::CliError;
use crate::constraint::ConstraintSpec;
use crate::proto::kakeya_v1::runtime as pb;

#[derive(Debug, Args, Clone, Default)]
pub struct ConstraintArgs {
    /// The output must be JSON matching this JSON Schema (a file).
    #[arg(long, value_name = "FILE", group = "constraint")]
    pub json_schema: Option<std::path::PathBuf>,
    /// The whole output must match this regular expression.
    #[arg(long, value_name = "RX", group = "constraint")]
    pub regex: Option<String>,
    /// The output must match this grammar (a file: llama.cpp's GBNF when
    /// its name ends in `.gbnf`, else llguidance's Lark syntax).
    #[arg(long, value_name = "FILE", group = "constraint")]
    pub grammar: Option<std::path::PathBuf>,
}

impl ConstraintArgs {
    /// The constraint asked for, its files read.
    pub fn spec(&self) -> Result<Option<ConstraintSpec>, CliError> {
        let read = |path: &std::path::Path| {
            std::fs::read_to_string(path)
                .map_err(|e| CliError::Usage(format!("reading {}: {e}", path.display())))
        };
        Ok(if let Some(path) = &self.json_schema {
            Some(ConstraintSpec::JsonSchema(read(path)?))
        } else if let Some(rx) = &self.regex {
            Some(ConstraintSpec::Regex(rx.clone()))
        } else if let Some(path) = &self.grammar {
            let text = read(path)?;
            Some(if path.extension().is_some_and(|e| e == "gbnf") {
                ConstraintSpec::Gbnf(text)
            } else {
                ConstraintSpec::Lark(text)
            })
        } else {
            None
        })
    }
}

/// `spec` as the gRPC extension message.
pub fn to_proto(spec: &ConstraintSpec) -> pb::OutputConstraint {
    let mut c = pb::OutputConstraint::new();
    match spec {
        ConstraintSpec::JsonSchema(s) => c.set_json_schema(s.clone()),
        ConstraintSpec::JsonObject => c.set_json_object(true),
        ConstraintSpec::Regex(s) => c.set_regex(s.clone()),
        ConstraintSpec::Lark(s) => c.set_lark_grammar(s.clone()),
        ConstraintSpec::Gbnf(s) => c.set_gbnf_grammar(s.clone()),
    }
    c
}
