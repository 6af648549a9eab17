//! OpenAI's `response_format` as a constraint on the Generate: `json_object`
//! (any JSON object) and `json_schema` (its `schema`, enforced whether or
//! not `strict` is set); `text` constrains nothing. llama.cpp's server
//! extensions `grammar` (GBNF) and `json_schema` (a bare schema) are taken
//! too, one constraint per request. A constraint that does not compile is
//! a 400 on its field with the compiler's message.

use super::openai::{ApiError, ResponseFormat, Sampling};
use super::Front;
use crate::constraint::ConstraintSpec;
use crate::runtime::RequestConstraint;

/// The request's constraint fields, taken out of `sampling`.
pub(super) struct Asked {
    format: Option<ResponseFormat>,
    grammar: Option<String>,
    json_schema: Option<serde_json::Value>,
}

impl Asked {
    /// Whether each of `response_format` (other than text), `grammar` and
    /// `json_schema` is given.
    fn given(&self) -> [bool; 3] {
        [
            !matches!(self.format, None | Some(ResponseFormat::Text)),
            self.grammar.is_some(),
            self.json_schema.is_some(),
        ]
    }

    /// Whether the request asks for a constraint.
    pub(super) fn any(&self) -> bool {
        self.given().contains(&true)
    }

    pub(super) fn take(sampling: &mut Sampling) -> Asked {
        Asked {
            format: sampling.response_format.take(),
            grammar: sampling.grammar.take(),
            json_schema: sampling.json_schema.take(),
        }
    }
}

/// The constraint the request asks for, compiled; `None` for none.
pub(super) fn constraint(
    asked: Asked,
    front: &Front,
) -> Result<Option<RequestConstraint>, ApiError> {
    if asked.given().iter().filter(|&&g| g).count() > 1 {
        return Err(ApiError::invalid(
            "response_format",
            "one constraint per request: response_format, grammar or json_schema",
        ));
    }
    let (param, spec) = if let Some(gbnf) = asked.grammar {
        ("grammar", ConstraintSpec::Gbnf(gbnf))
    } else if let Some(schema) = asked.json_schema {
        (
            "json_schema",
            ConstraintSpec::JsonSchema(schema.to_string()),
        )
    } else {
        match format_spec(asked.format.as_ref())? {
            Some(spec) => ("response_format", spec),
            None => return Ok(None),
        }
    };
    front
        .state
        .constraints
        .compile(&spec)
        .map(Some)
        .map_err(|e| ApiError {
            param: Some(param),
            ..ApiError::from(e)
        })
}

/// What `response_format` asks for; `None` for text.
fn format_spec(format: Option<&ResponseFormat>) -> Result<Option<ConstraintSpec>, ApiError> {
    Ok(match format {
        None | Some(ResponseFormat::Text) => None,
        Some(ResponseFormat::JsonObject) => Some(ConstraintSpec::JsonObject),
        Some(ResponseFormat::JsonSchema { json_schema }) => {
            let schema = json_schema.schema.as_ref().ok_or_else(|| {
                ApiError::invalid(
                    "response_format",
                    "response_format.json_schema.schema is required",
                )
            })?;
            Some(ConstraintSpec::JsonSchema(schema.to_string()))
        }
    })
}
