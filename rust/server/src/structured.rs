//! The structured-output and prompt-logprob fields of chat and completion requests.
//!
//! A request carries at most one constraint, from any of the spellings clients use: OpenAI's
//! `response_format` (`json_object`, `json_schema`), vLLM's `structured_outputs` object (`json`,
//! `regex`, `choice`, `grammar`, `json_object`) and vLLM's older `guided_json` / `guided_regex` /
//! `guided_choice` / `guided_grammar`. Each becomes the wire [`StructuredOutput`]; the engine
//! compiles it (a spec that does not compile comes back as a rejected request, which the route
//! answers with a 400 before sending anything). Two constraints in one request are a 400. Other
//! front-end features (forced tool calls) attach theirs with [`attach`].
//!
//! vLLM's `guided_decoding_backend` picks the grammar engine: the names that mean llguidance
//! (`guidance`, `llguidance`, `auto`) are accepted, any other is a 400. `guided_whitespace_pattern`
//! (or `structured_outputs.whitespace_pattern`) travels with a JSON constraint to the engine, which
//! lets llguidance allow that whitespace between JSON tokens.

use serde::Deserialize;
use serde_json::Value as Json;
use utoipa::ToSchema;
use voltllm_protocol::{SamplingParams, StructuredOutput, StructuredOutputKind};

use crate::error::ApiError;
use crate::generate::PromptLogprobs;
use crate::openai::MAX_LOGPROBS;

/// Grammar engines `guided_decoding_backend` may name: all mean this server's llguidance.
pub const GRAMMAR_BACKENDS: [&str; 3] = ["auto", "guidance", "llguidance"];

/// The request fields this module reads (flattened into both routes' bodies).
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct StructuredFields {
    /// OpenAI's `{"type": "text"}`, `{"type": "json_object"}` or
    /// `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`.
    pub response_format: Option<Json>,
    /// vLLM's: exactly one of `json`, `regex`, `choice`, `grammar`, `json_object`, and with a JSON
    /// one optionally `whitespace_pattern`.
    pub structured_outputs: Option<Json>,
    /// vLLM's older spelling: a JSON Schema (an object or its text).
    pub guided_json: Option<Json>,
    /// A regular expression the whole output matches.
    pub guided_regex: Option<Json>,
    /// A non-empty list of strings; the output is one of them.
    pub guided_choice: Option<Json>,
    /// A Lark (or GBNF) grammar.
    pub guided_grammar: Option<Json>,
    /// The grammar engine: `auto`, `guidance` or `llguidance` (all llguidance); any other is a 400.
    pub guided_decoding_backend: Option<String>,
    /// With a JSON constraint: a regular expression for the whitespace allowed between JSON tokens
    /// (without it the output is compact JSON).
    pub guided_whitespace_pattern: Option<String>,
    /// vLLM's extra: top-N alternatives per prompt position.
    #[schema(minimum = 0, maximum = 20)]
    pub prompt_logprobs: Option<i64>,
}

/// Sets the request's constraint; a 400 naming both fields when it already has one.
///
/// `param` names where `constraint` came from (for the error message), e.g. `"tool_choice"`.
pub fn attach(
    params: &mut SamplingParams,
    constraint: StructuredOutput,
    param: &str,
) -> Result<(), ApiError> {
    if params.structured_output.is_some() {
        return Err(ApiError::bad(
            param,
            format!(
                "only one structured-output constraint per request: {param} conflicts with \
                 another constraint in the request"
            ),
        ));
    }
    params.structured_output = Some(constraint);
    Ok(())
}

/// Applies every structured-output field of a request to its sampling parameters.
pub fn apply(fields: &StructuredFields, params: &mut SamplingParams) -> Result<(), ApiError> {
    if let Some(backend) = &fields.guided_decoding_backend {
        check_backend(backend)?;
    }
    let mut found: Vec<(&'static str, StructuredOutput)> = Vec::new();
    let mut whitespace = fields
        .guided_whitespace_pattern
        .clone()
        .map(|p| ("guided_whitespace_pattern", p));
    if let Some(v) = &fields.response_format {
        if let Some(c) = response_format(v)? {
            found.push(("response_format", c));
        }
    }
    if let Some(v) = &fields.structured_outputs {
        let (constraints, pattern) = structured_outputs(v)?;
        found.extend(constraints);
        if let Some(p) = pattern {
            if whitespace.is_some() {
                return Err(ApiError::bad(
                    "structured_outputs.whitespace_pattern",
                    "give the whitespace pattern once: structured_outputs.whitespace_pattern \
                     conflicts with guided_whitespace_pattern",
                ));
            }
            whitespace = Some(("structured_outputs.whitespace_pattern", p));
        }
    }
    let guided = [
        ("guided_json", &fields.guided_json),
        ("guided_regex", &fields.guided_regex),
        ("guided_choice", &fields.guided_choice),
        ("guided_grammar", &fields.guided_grammar),
    ];
    for (param, value) in guided {
        if let Some(v) = value.as_ref().filter(|v| !v.is_null()) {
            found.push((param, constraint_of(param, guided_kind(param), v)?));
        }
    }
    if found.len() > 1 {
        let names: Vec<&str> = found.iter().map(|(p, _)| *p).collect();
        return Err(ApiError::bad(
            names[1],
            format!(
                "only one structured-output constraint per request, got {}",
                names.join(" and ")
            ),
        ));
    }
    let mut constraint = found.pop();
    if let Some((param, pattern)) = whitespace {
        with_whitespace(constraint.as_mut().map(|(_, c)| c), param, pattern)?;
    }
    if let Some((param, c)) = constraint {
        attach(params, c, param)?;
    }
    if let Some(n) = fields.prompt_logprobs {
        params.prompt_logprobs = Some(prompt_logprobs(n)?);
    }
    Ok(())
}

/// A 400 unless `backend` names llguidance, the one grammar engine here.
fn check_backend(backend: &str) -> Result<(), ApiError> {
    if GRAMMAR_BACKENDS.contains(&backend) {
        return Ok(());
    }
    Err(ApiError::bad(
        "guided_decoding_backend",
        format!(
            "guided_decoding_backend {backend:?} is not available: this server's grammar engine is \
             llguidance (accepted names: {})",
            GRAMMAR_BACKENDS.join(", ")
        ),
    ))
}

/// Puts the whitespace pattern on the request's JSON constraint; a 400 naming `param` when there
/// is none (the pattern would change nothing, or means nothing for a regex, choice or grammar).
fn with_whitespace(
    constraint: Option<&mut StructuredOutput>,
    param: &str,
    pattern: String,
) -> Result<(), ApiError> {
    match constraint {
        Some(c)
            if matches!(
                c.kind,
                StructuredOutputKind::Json | StructuredOutputKind::JsonObject
            ) =>
        {
            c.whitespace_pattern = Some(pattern);
            Ok(())
        }
        _ => Err(ApiError::bad(
            param,
            format!(
                "{param} applies to a JSON constraint (response_format json_schema or \
                 json_object, guided_json, structured_outputs.json or json_object), and this \
                 request has none"
            ),
        )),
    }
}

/// Checks a requested number of prompt alternatives (`prompt_logprobs`, or completions' `logprobs`
/// with `echo`).
pub fn prompt_logprobs(n: i64) -> Result<u32, ApiError> {
    if !(0..=MAX_LOGPROBS as i64).contains(&n) {
        return Err(ApiError::bad(
            "prompt_logprobs",
            format!("prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {n}"),
        ));
    }
    Ok(n as u32)
}

/// vLLM's `prompt_logprobs` value: `null` for the first prompt token, then per position a map from
/// token id to `{logprob, rank, decoded_token}` (the prompt's token and up to `top` alternatives).
pub fn prompt_logprobs_json(prompt: &PromptLogprobs, top: u32) -> Json {
    let mut out = Vec::with_capacity(prompt.positions.len() + 1);
    out.push(Json::Null);
    for candidates in &prompt.positions {
        let mut entry = serde_json::Map::new();
        for c in candidates.iter().take(top as usize + 1) {
            entry.entry(c.token_id.to_string()).or_insert_with(|| {
                serde_json::json!({"logprob": c.logprob, "rank": c.rank, "decoded_token": c.token})
            });
        }
        out.push(Json::Object(entry));
    }
    Json::Array(out)
}

fn guided_kind(param: &str) -> StructuredOutputKind {
    match param {
        "guided_json" => StructuredOutputKind::Json,
        "guided_regex" => StructuredOutputKind::Regex,
        "guided_choice" => StructuredOutputKind::Choice,
        _ => StructuredOutputKind::Grammar,
    }
}

/// OpenAI's `response_format`: `text` (no constraint), `json_object`, or `json_schema`.
fn response_format(v: &Json) -> Result<Option<StructuredOutput>, ApiError> {
    let kind = v.get("type").and_then(Json::as_str).ok_or_else(|| {
        ApiError::bad(
            "response_format",
            "response_format must be an object with a string `type`",
        )
    })?;
    match kind {
        "text" => Ok(None),
        "json_object" => Ok(Some(StructuredOutput::new(
            StructuredOutputKind::JsonObject,
            "",
        ))),
        "json_schema" => {
            let schema = v
                .get("json_schema")
                .and_then(|s| s.get("schema"))
                .ok_or_else(|| {
                    ApiError::bad(
                        "response_format.json_schema.schema",
                        "response_format of type json_schema needs json_schema.schema",
                    )
                })?;
            if let Some(strict) = v["json_schema"].get("strict") {
                if !strict.is_boolean() && !strict.is_null() {
                    return Err(ApiError::bad(
                        "response_format.json_schema.strict",
                        "response_format.json_schema.strict must be a boolean",
                    ));
                }
            }
            // The output always follows the schema exactly: `strict: false` only allows less.
            constraint_of(
                "response_format.json_schema.schema",
                StructuredOutputKind::Json,
                schema,
            )
            .map(Some)
        }
        other => Err(ApiError::bad(
            "response_format.type",
            format!("response_format.type must be text, json_object or json_schema, got {other:?}"),
        )),
    }
}

/// The constraints found in a `structured_outputs` object, and its whitespace pattern.
type StructuredOutputsObject = (Vec<(&'static str, StructuredOutput)>, Option<String>);

/// vLLM's `structured_outputs` object: its constraint keys (the caller refuses more than one) and
/// `whitespace_pattern`; other keys are a 400.
fn structured_outputs(v: &Json) -> Result<StructuredOutputsObject, ApiError> {
    let object = v.as_object().ok_or_else(|| {
        ApiError::bad("structured_outputs", "structured_outputs must be an object")
    })?;
    let mut found = Vec::new();
    let mut whitespace = None;
    for (key, value) in object {
        if value.is_null() {
            continue;
        }
        let (param, kind) = match key.as_str() {
            "whitespace_pattern" => {
                let pattern = value.as_str().ok_or_else(|| {
                    ApiError::bad(
                        "structured_outputs.whitespace_pattern",
                        "structured_outputs.whitespace_pattern must be a string",
                    )
                })?;
                whitespace = Some(pattern.to_string());
                continue;
            }
            "json" => ("structured_outputs.json", StructuredOutputKind::Json),
            "regex" => ("structured_outputs.regex", StructuredOutputKind::Regex),
            "choice" => ("structured_outputs.choice", StructuredOutputKind::Choice),
            "grammar" => ("structured_outputs.grammar", StructuredOutputKind::Grammar),
            "json_object" => {
                if value.as_bool() == Some(true) {
                    let c = StructuredOutput::new(StructuredOutputKind::JsonObject, "");
                    found.push(("structured_outputs.json_object", c));
                } else if !value.is_boolean() {
                    return Err(ApiError::bad(
                        "structured_outputs.json_object",
                        "structured_outputs.json_object must be a boolean",
                    ));
                }
                continue;
            }
            other => {
                return Err(ApiError::bad(
                    "structured_outputs",
                    format!(
                        "structured_outputs.{other} is not supported (supported: json, regex, \
                         choice, grammar, json_object, whitespace_pattern)"
                    ),
                ))
            }
        };
        found.push((param, constraint_of(param, kind, value)?));
    }
    Ok((found, whitespace))
}

/// The wire constraint of one field's value: a schema as an object (or its JSON text), a regex or
/// grammar as a string, a choice as a non-empty array of strings.
fn constraint_of(
    param: &str,
    kind: StructuredOutputKind,
    value: &Json,
) -> Result<StructuredOutput, ApiError> {
    let spec = match kind {
        StructuredOutputKind::Json => match value {
            Json::String(text) => text.clone(),
            Json::Object(_) | Json::Bool(_) => value.to_string(),
            _ => {
                return Err(ApiError::bad(
                    param,
                    format!("{param} must be a JSON Schema (an object)"),
                ))
            }
        },
        StructuredOutputKind::Choice => {
            let choices = value.as_array().filter(|a| !a.is_empty()).ok_or_else(|| {
                ApiError::bad(
                    param,
                    format!("{param} must be a non-empty array of strings"),
                )
            })?;
            if !choices
                .iter()
                .all(|c| c.as_str().is_some_and(|s| !s.is_empty()))
            {
                return Err(ApiError::bad(
                    param,
                    format!("{param} must be a non-empty array of non-empty strings"),
                ));
            }
            value.to_string()
        }
        StructuredOutputKind::Regex | StructuredOutputKind::Grammar => {
            match value.as_str().filter(|s| !s.is_empty()) {
                Some(s) => s.to_string(),
                None => {
                    return Err(ApiError::bad(
                        param,
                        format!("{param} must be a non-empty string"),
                    ))
                }
            }
        }
        StructuredOutputKind::JsonObject => String::new(),
    };
    Ok(StructuredOutput::new(kind, spec))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(body: Json) -> Result<SamplingParams, ApiError> {
        let fields: StructuredFields = serde_json::from_value(body).unwrap();
        let mut p = SamplingParams::default();
        apply(&fields, &mut p)?;
        Ok(p)
    }

    fn constraint(body: Json) -> Option<(StructuredOutputKind, String)> {
        parse(body)
            .unwrap()
            .structured_output
            .map(|c| (c.kind, c.spec))
    }

    fn param_of(body: Json) -> Option<String> {
        match parse(body) {
            Err(ApiError::BadRequest { param, .. }) => param,
            other => panic!("expected a 400, got {other:?}"),
        }
    }

    #[test]
    fn every_spelling_becomes_one_wire_constraint() {
        use StructuredOutputKind::*;
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let cases = [
            (json!({"response_format": {"type": "text"}}), None),
            (
                json!({"response_format": {"type": "json_object"}}),
                Some((JsonObject, String::new())),
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": true}}}),
                Some((Json, schema.to_string())),
            ),
            (
                json!({"structured_outputs": {"regex": "a+"}}),
                Some((Regex, "a+".into())),
            ),
            (
                json!({"structured_outputs": {"choice": ["x", "y"], "json": null}}),
                Some((Choice, r#"["x","y"]"#.into())),
            ),
            (
                json!({"structured_outputs": {"json_object": true}}),
                Some((JsonObject, String::new())),
            ),
            (
                json!({"guided_json": schema.to_string()}),
                Some((Json, schema.to_string())),
            ),
            (
                json!({"guided_grammar": "root ::= \"a\""}),
                Some((Grammar, "root ::= \"a\"".into())),
            ),
            (
                json!({"guided_choice": ["a"]}),
                Some((Choice, r#"["a"]"#.into())),
            ),
            (json!({}), None),
        ];
        for (body, expected) in cases {
            assert_eq!(constraint(body.clone()), expected, "{body}");
        }
    }

    #[test]
    fn two_constraints_or_a_bad_shape_are_a_400_naming_the_field() {
        assert_eq!(
            param_of(json!({"response_format": {"type": "json_object"}, "guided_regex": "a"})),
            Some("guided_regex".into())
        );
        assert_eq!(
            param_of(json!({"structured_outputs": {"regex": "a", "choice": ["b"]}})),
            Some("structured_outputs.choice".into())
        );
        assert_eq!(
            param_of(json!({"response_format": {"type": "yaml"}})),
            Some("response_format.type".into())
        );
        assert_eq!(
            param_of(json!({"response_format": {"type": "json_schema"}})),
            Some("response_format.json_schema.schema".into())
        );
        assert_eq!(
            param_of(json!({"structured_outputs": {"structural_tag": "x"}})),
            Some("structured_outputs".into())
        );
        assert_eq!(
            param_of(json!({"guided_choice": []})),
            Some("guided_choice".into())
        );
        assert_eq!(
            param_of(json!({"guided_regex": 5})),
            Some("guided_regex".into())
        );
        assert_eq!(
            param_of(json!({"prompt_logprobs": 21})),
            Some("prompt_logprobs".into())
        );
    }

    #[test]
    fn attach_refuses_a_second_constraint() {
        let mut p = parse(json!({"guided_regex": "a"})).unwrap();
        let c = StructuredOutput::new(StructuredOutputKind::Json, "{}");
        assert!(attach(&mut p, c.clone(), "tool_choice").is_err());
        let mut q = SamplingParams::default();
        attach(&mut q, c.clone(), "tool_choice").unwrap();
        assert_eq!(q.structured_output, Some(c));
    }

    #[test]
    fn the_backend_must_name_llguidance() {
        for name in GRAMMAR_BACKENDS {
            assert!(parse(json!({"guided_decoding_backend": name, "guided_regex": "a"})).is_ok());
        }
        for name in [
            "xgrammar",
            "outlines",
            "lm-format-enforcer",
            "guidance:no-fallback",
        ] {
            let err = parse(json!({"guided_decoding_backend": name})).unwrap_err();
            assert_eq!(err.body()["error"]["param"], "guided_decoding_backend");
            assert!(err.to_string().contains(name), "{err}");
        }
    }

    #[test]
    fn a_whitespace_pattern_rides_on_a_json_constraint_only() {
        let schema = json!({"type": "object"});
        let p = parse(json!({"guided_json": schema, "guided_whitespace_pattern": "[ ]?"})).unwrap();
        let c = p.structured_output.unwrap();
        assert_eq!(c.kind, StructuredOutputKind::Json);
        assert_eq!(c.whitespace_pattern.as_deref(), Some("[ ]?"));
        let p = parse(
            json!({"structured_outputs": {"json_object": true, "whitespace_pattern": "\n?"}}),
        )
        .unwrap();
        assert_eq!(
            p.structured_output.unwrap().whitespace_pattern.as_deref(),
            Some("\n?")
        );
        let p = parse(json!({"response_format": {"type": "json_object"}})).unwrap();
        assert_eq!(p.structured_output.unwrap().whitespace_pattern, None);
        for body in [
            json!({"guided_whitespace_pattern": " "}),
            json!({"guided_regex": "a+", "guided_whitespace_pattern": " "}),
            json!({"response_format": {"type": "text"}, "guided_whitespace_pattern": " "}),
        ] {
            assert_eq!(
                param_of(body.clone()),
                Some("guided_whitespace_pattern".into()),
                "{body}"
            );
        }
        assert_eq!(
            param_of(json!({"structured_outputs": {"choice": ["a"], "whitespace_pattern": " "}})),
            Some("structured_outputs.whitespace_pattern".into())
        );
        assert_eq!(
            param_of(
                json!({"guided_json": schema, "guided_whitespace_pattern": " ",
                            "structured_outputs": {"whitespace_pattern": " "}})
            ),
            Some("structured_outputs.whitespace_pattern".into())
        );
    }

    #[test]
    fn prompt_logprobs_pass_through() {
        assert_eq!(
            parse(json!({"prompt_logprobs": 0}))
                .unwrap()
                .prompt_logprobs,
            Some(0)
        );
    }
}
