//! The fields of a chat or completion request beyond those the routes read.
//!
//! Nothing a client sends is dropped silently. The fields OpenAI's and vLLM's APIs define that
//! voltllm does not implement are listed in [`KNOWN_FIELDS`], each with the values (besides `null`)
//! that ask for what voltllm does anyway (`"store": false`, `"use_beam_search": false`, ...):
//! those are accepted, any other value is a 400 saying why. A field in neither the request types nor
//! this table is a 400 naming it. `/openapi.json` describes both (see `openapi.rs`), and closes the
//! request schemas (`additionalProperties: false`).

use serde_json::{json, Map, Value as Json};

use crate::error::ApiError;

/// The route a request body was sent to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    Chat,
    Completions,
}

/// Which routes a [`KnownField`] belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Routes {
    Both,
    ChatOnly,
    CompletionsOnly,
}

impl Routes {
    fn include(self, route: Route) -> bool {
        match self {
            Self::Both => true,
            Self::ChatOnly => route == Route::Chat,
            Self::CompletionsOnly => route == Route::Completions,
        }
    }
}

/// A request field of OpenAI's or vLLM's API that voltllm does not implement.
#[derive(Debug)]
pub struct KnownField {
    pub name: &'static str,
    pub routes: Routes,
    /// The values accepted besides `null`, as a JSON array: those that ask for what voltllm does
    /// anyway. `[]`: only `null`.
    pub accepted: &'static str,
    /// Why other values are refused (the 400's message and the schema's description).
    pub reason: &'static str,
}

const fn field(
    name: &'static str,
    routes: Routes,
    accepted: &'static str,
    reason: &'static str,
) -> KnownField {
    KnownField {
        name,
        routes,
        accepted,
        reason,
    }
}

use Routes::{Both, ChatOnly, CompletionsOnly};

/// Every field OpenAI's chat/completions APIs and vLLM's extensions define that the request types
/// do not read (the official client, LangChain, the Agents SDK and lm-eval send only fields that are
/// either read or here).
pub const KNOWN_FIELDS: &[KnownField] = &[
    // OpenAI's.
    field("store", Both, "[false]", "this server stores no completions"),
    field("metadata", Both, "[]", "metadata is kept with stored completions, and this server stores none"),
    field("service_tier", Both, r#"["auto", "default"]"#, "this server has one service tier (auto/default)"),
    field("prompt_cache_retention", Both, r#"["in_memory"]"#, "cached prompt prefixes live in memory only"),
    field("modalities", ChatOnly, r#"[["text"]]"#, "only text output is supported"),
    field("audio", ChatOnly, "[]", "audio output is not supported"),
    field("prediction", ChatOnly, "[]", "predicted outputs are not supported"),
    field("web_search_options", ChatOnly, "[]", "web search is not supported"),
    field("reasoning_effort", ChatOnly, "[]", "reasoning_effort is not supported: use chat_template_kwargs (e.g. enable_thinking) with --reasoning-parser"),
    field("verbosity", ChatOnly, r#"["medium"]"#, "only the default verbosity (medium) is supported"),
    field("functions", ChatOnly, "[]", "the deprecated functions field is not supported: use tools"),
    field("function_call", ChatOnly, "[]", "the deprecated function_call field is not supported: use tool_choice"),
    field("suffix", CompletionsOnly, r#"[""]"#, "suffix (text after the completion) is not supported"),
    field("best_of", Both, "[1]", "best_of is not supported: ask for n choices instead"),
    // vLLM's.
    field("echo", ChatOnly, "[false]", "echo is supported on /v1/completions only"),
    field("use_beam_search", Both, "[false]", "beam search is not supported"),
    field("length_penalty", Both, "[1.0]", "length_penalty applies to beam search, which is not supported"),
    field("spaces_between_special_tokens", Both, "[]", "spaces_between_special_tokens is not supported: special tokens are detokenized as the tokenizer writes them"),
    field("truncate_prompt_tokens", Both, "[]", "prompt truncation is not supported: a prompt that does not fit is a 400"),
    field("allowed_token_ids", Both, "[]", "allowed_token_ids is not supported: use logit_bias or a structured-output constraint"),
    field("bad_words", Both, "[]", "bad_words is not supported: use logit_bias"),
    field("documents", ChatOnly, "[]", "documents are not supported"),
    field("chat_template", ChatOnly, "[]", "a chat template per request is not supported: the model's own is used"),
    field("mm_processor_kwargs", ChatOnly, "[]", "multimodal input is not supported"),
    field("prompt_embeds", CompletionsOnly, "[]", "prompt embeddings are not supported"),
    field("request_id", Both, "[]", "request_id is not supported: the server names each request"),
    field("logits_processors", Both, "[]", "custom logits processors are not supported"),
    field("return_tokens_as_token_ids", Both, "[false]", "return_tokens_as_token_ids is not supported"),
    field("return_token_ids", Both, "[false]", "return_token_ids is not supported"),
    field("cache_salt", Both, "[]", "cache_salt is not supported: the prefix cache is shared"),
    field("kv_transfer_params", Both, "[]", "KV-cache transfer is not supported"),
    field("vllm_xargs", Both, "[]", "vllm_xargs is not supported"),
];

/// The known fields of `route`.
pub fn known_fields(route: Route) -> impl Iterator<Item = &'static KnownField> {
    KNOWN_FIELDS.iter().filter(move |f| f.routes.include(route))
}

impl KnownField {
    /// The accepted values besides `null`.
    pub fn accepted_values(&self) -> Vec<Json> {
        serde_json::from_str(self.accepted).unwrap_or_default()
    }

    /// Whether `value` is `null` or one of the accepted values (numbers compare by value).
    fn accepts(&self, value: &Json) -> bool {
        value.is_null() || self.accepted_values().iter().any(|a| same(a, value))
    }

    /// The field's JSON Schema: `null` or one of the accepted values.
    pub fn schema(&self) -> Json {
        let mut values = vec![Json::Null];
        values.extend(self.accepted_values());
        json!({"enum": values, "description": format!("Not supported: {}.", self.reason)})
    }
}

/// JSON equality, but `1` equals `1.0`.
fn same(a: &Json, b: &Json) -> bool {
    match (a.as_f64(), b.as_f64()) {
        (Some(x), Some(y)) => x == y,
        _ => a == b,
    }
}

/// A 400 for the first field of `other` (the fields no request type read) that is unknown or set
/// to a value voltllm cannot honour.
pub fn check(route: Route, other: &Map<String, Json>) -> Result<(), ApiError> {
    for (name, value) in other {
        let Some(known) = known_fields(route).find(|f| f.name == name) else {
            return Err(ApiError::bad(
                name,
                format!("unknown field `{name}`: this server does not implement it"),
            ));
        };
        if !known.accepts(value) {
            let accepted = known.accepted_values();
            let allowed = if accepted.is_empty() {
                String::new()
            } else {
                let list: Vec<String> = accepted.iter().map(Json::to_string).collect();
                format!(" (accepted: null, {})", list.join(", "))
            };
            return Err(ApiError::bad(
                name,
                format!("{name}: {}{allowed}", known.reason),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(v: Json) -> Map<String, Json> {
        v.as_object().unwrap().clone()
    }

    fn param(route: Route, v: Json) -> Option<String> {
        check(route, &map(v))
            .err()
            .map(|e| e.body()["error"]["param"].as_str().unwrap().to_string())
    }

    #[test]
    fn the_table_is_well_formed() {
        for f in KNOWN_FIELDS {
            let parsed: Result<Vec<Json>, _> = serde_json::from_str(f.accepted);
            assert!(parsed.is_ok(), "{}: accepted is not a JSON array", f.name);
            assert_eq!(
                KNOWN_FIELDS.iter().filter(|g| g.name == f.name).count(),
                1,
                "{} twice",
                f.name
            );
        }
    }

    #[test]
    fn no_op_values_and_null_pass_others_are_named() {
        let ok = json!({"store": false, "use_beam_search": false, "length_penalty": 1,
                        "best_of": 1, "service_tier": "auto", "modalities": ["text"],
                        "metadata": null, "echo": false, "functions": null});
        assert_eq!(param(Route::Chat, ok), None);
        for (body, name) in [
            (json!({"store": true}), "store"),
            (json!({"length_penalty": 0.5}), "length_penalty"),
            (json!({"best_of": 3}), "best_of"),
            (json!({"modalities": ["text", "audio"]}), "modalities"),
            (json!({"functions": []}), "functions"),
            (json!({"echo": true}), "echo"),
            (json!({"reasoning_effort": "low"}), "reasoning_effort"),
            (json!({"metadata": {"a": "b"}}), "metadata"),
        ] {
            assert_eq!(
                param(Route::Chat, body.clone()).as_deref(),
                Some(name),
                "{body}"
            );
        }
        let err = check(Route::Chat, &map(json!({"store": true}))).unwrap_err();
        assert!(
            err.to_string().contains("stores no completions") && err.to_string().contains("false"),
            "{err}"
        );
    }

    #[test]
    fn unknown_fields_are_named_and_route_specific_ones_are_unknown_elsewhere() {
        assert_eq!(
            param(Route::Chat, json!({"temprature": 0.5})).as_deref(),
            Some("temprature")
        );
        let err = check(Route::Chat, &map(json!({"temprature": 0.5}))).unwrap_err();
        assert!(
            err.to_string().contains("unknown field `temprature`"),
            "{err}"
        );
        // `suffix` is a completions field; `audio` a chat one.
        assert_eq!(
            param(Route::Chat, json!({"suffix": ""})).as_deref(),
            Some("suffix")
        );
        assert_eq!(param(Route::Completions, json!({"suffix": ""})), None);
        assert_eq!(
            param(Route::Completions, json!({"audio": null})).as_deref(),
            Some("audio")
        );
    }

    #[test]
    fn a_field_schema_lists_null_and_the_accepted_values() {
        let store = KNOWN_FIELDS.iter().find(|f| f.name == "store").unwrap();
        assert_eq!(store.schema()["enum"], json!([null, false]));
        assert!(store.schema()["description"]
            .as_str()
            .unwrap()
            .contains("stores no"));
    }
}
