//! OpenAI's `response_format` as a constraint on the Generate: `json_object`
//! (any JSON object) and `json_schema` (its `schema`, enforced whether or
//! not `strict` is set); `text` constrains nothing. A schema that does not
//! compile is a 400 on `response_format` with the compiler's message.

use super::openai::{ApiError, ResponseFormat};
use super::Front;
use crate::constraint::ConstraintSpec;
use crate::runtime::RequestConstraint;

/// The constraint `format` asks for, compiled; `None` for text.
pub(super) fn constraint(
    format: Option<&ResponseFormat>,
    front: &Front,
) -> Result<Option<RequestConstraint>, ApiError> {
    let spec = match format {
        None | Some(ResponseFormat::Text) => return Ok(None),
        Some(ResponseFormat::JsonObject) => ConstraintSpec::JsonObject,
        Some(ResponseFormat::JsonSchema { json_schema }) => {
            let schema = json_schema.schema.as_ref().ok_or_else(|| {
                ApiError::invalid(
                    "response_format",
                    "response_format.json_schema.schema is required",
                )
            })?;
            ConstraintSpec::JsonSchema(schema.to_string())
        }
    };
    front
        .state
        .constraints
        .compile(&spec)
        .map(Some)
        .map_err(|e| ApiError {
            param: Some("response_format"),
            ..ApiError::from(e)
        })
}
