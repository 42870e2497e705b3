//! `GET /openapi.json`: every route described in OpenAPI 3.1, generated with utoipa.
//!
//! Request bodies are the very types the routes deserialize (`openai.rs`, `structured.rs`,
//! `routes/misc.rs`, `routes/responses.rs`), so the description cannot drift from what is parsed.
//! Chat and completion bodies flatten several structs (utoipa writes an `allOf`); [`close_schema`]
//! merges them into one object, adds the fields `request_fields.rs` accepts only at their no-op
//! value, and sets `additionalProperties: false`, as the parser refuses anything else. The routes
//! build their answers as JSON, so the answers are described by the schema-only types below; the
//! schemathesis test (`tests/entrypoints/test_openapi.py`) checks every answer against them, and a
//! unit test checks that every route the router mounts is described.

use axum::http::header::CONTENT_TYPE;
use axum::routing::get;
use axum::Router;
use serde_json::{Map, Value as Json};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi, ToSchema};

use crate::openai::{self, ChatRequest, CompletionRequest};
use crate::request_fields::{known_fields, Route};
use crate::routes::misc::{DetokenizeRequest, TokenizeRequest};
use crate::routes::responses::ResponsesRequest;

/// `{"error": {...}}`, the body of every 4xx and 5xx answer.
#[derive(ToSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

/// What failed, OpenAI-style.
#[derive(ToSchema)]
pub struct ErrorDetail {
    pub message: String,
    /// `BadRequestError`, `AuthenticationError`, `NotFoundError`, `RequestTooLargeError`,
    /// `ServiceUnavailableError`, `InternalServerError`.
    #[schema(rename = "type")]
    pub kind: String,
    /// The request field at fault, when one is.
    pub param: Option<String>,
    /// The HTTP status.
    pub code: u16,
}

/// Token counts of a request.
#[derive(ToSchema)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub total_tokens: u64,
}

/// The assistant's message of a chat choice.
#[derive(ToSchema)]
pub struct ChatMessage {
    pub role: String,
    pub content: Option<String>,
    /// With `--reasoning-parser`: the text inside the model's thinking markup.
    pub reasoning_content: Option<String>,
    /// The calls the model made (`{"id", "type": "function", "function": {"name", "arguments"}}`).
    pub tool_calls: Option<Vec<Json>>,
}

/// One choice of a chat completion.
#[derive(ToSchema)]
pub struct ChatChoice {
    pub index: u32,
    pub message: ChatMessage,
    /// `{"content": [...]}` when `logprobs` was asked for.
    pub logprobs: Option<Json>,
    /// `stop`, `length`, `tool_calls`, `abort`, `error`.
    pub finish_reason: Option<String>,
    /// The stop string or the stop token id that ended the choice.
    pub stop_reason: Option<Json>,
}

/// `POST /v1/chat/completions` without `stream` (with `stream`: `text/event-stream` of
/// `chat.completion.chunk` objects, then `data: [DONE]`).
#[derive(ToSchema)]
pub struct ChatCompletion {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChoice>,
    pub usage: Usage,
    /// With `prompt_logprobs`: per prompt position (the first `null`), token id to logprob.
    pub prompt_logprobs: Option<Vec<Json>>,
}

/// One choice of a completion.
#[derive(ToSchema)]
pub struct CompletionChoice {
    pub index: u32,
    pub text: String,
    /// `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}` when `logprobs` was asked for.
    pub logprobs: Option<Json>,
    pub finish_reason: Option<String>,
    pub stop_reason: Option<Json>,
}

/// `POST /v1/completions` without `stream`.
#[derive(ToSchema)]
pub struct Completion {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    pub usage: Usage,
}

/// One served model.
#[derive(ToSchema)]
pub struct Model {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub owned_by: String,
    pub root: String,
    pub parent: Option<String>,
    pub max_model_len: u32,
}

/// `POST /v1/responses` without `stream` (with `stream`: the API's typed server-sent events).
#[derive(ToSchema)]
pub struct ResponseObject {
    pub id: String,
    /// `response`.
    pub object: String,
    pub created_at: u64,
    /// `completed`, `incomplete` or `failed`.
    pub status: String,
    pub model: String,
    /// `message`, `reasoning` and `function_call` items.
    pub output: Vec<Json>,
    pub error: Option<Json>,
    pub incomplete_details: Option<Json>,
    pub usage: Option<ResponseUsage>,
}

/// Token counts of a response.
#[derive(ToSchema)]
pub struct ResponseUsage {
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub total_tokens: u64,
}

/// `GET /v1/models`.
#[derive(ToSchema)]
pub struct ModelList {
    pub object: String,
    pub data: Vec<Model>,
}

/// `GET /version`.
#[derive(ToSchema)]
pub struct Version {
    pub version: String,
}

/// `POST /tokenize`.
#[derive(ToSchema)]
pub struct TokenizeResponse {
    pub count: u64,
    pub max_model_len: u32,
    pub tokens: Vec<u32>,
}

/// `POST /detokenize`.
#[derive(ToSchema)]
pub struct DetokenizeResponse {
    pub prompt: String,
}

/// The `bearer` scheme `--api-key` turns on.
struct BearerAuth;

impl Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some("The --api-key, when the server was started with one"))
                    .build(),
            ),
        );
    }
}

// The answers every guarded route shares besides its own: 401 (`--api-key`), 413 for a route that
// reads a body (over `--max-request-body-bytes`) and 503, which for a route that queues engine work
// also means a full queue or a restarting engine (with `Retry-After`), else only draining.

/// 401, 413 and 503 of a route that queues work for the engine.
#[derive(utoipa::IntoResponses)]
#[allow(dead_code)]
enum QueuedWorkErrors {
    #[response(status = 401, description = "Missing or wrong API key")]
    Unauthorized(ErrorBody),
    #[response(
        status = 413,
        description = "The body is over --max-request-body-bytes"
    )]
    TooLarge(ErrorBody),
    #[response(status = 503, description = "Not now: retry after Retry-After")]
    Unavailable(ErrorBody),
}

/// 401, 413 and 503 of a route that reads a body but queues nothing.
#[derive(utoipa::IntoResponses)]
#[allow(dead_code)]
enum BodyRouteErrors {
    #[response(status = 401, description = "Missing or wrong API key")]
    Unauthorized(ErrorBody),
    #[response(
        status = 413,
        description = "The body is over --max-request-body-bytes"
    )]
    TooLarge(ErrorBody),
    #[response(status = 503, description = "The server is draining")]
    Draining(ErrorBody),
}

/// 401 and 503 of a guarded route without a body.
#[derive(utoipa::IntoResponses)]
#[allow(dead_code)]
enum GuardedRouteErrors {
    #[response(status = 401, description = "Missing or wrong API key")]
    Unauthorized(ErrorBody),
    #[response(status = 503, description = "The server is draining")]
    Draining(ErrorBody),
}

// The operations. utoipa reads the attributes; the bodies never run (the handlers are in
// `routes/`).

#[utoipa::path(post, path = "/v1/chat/completions", tag = "openai", security(("bearer" = [])),
    request_body = ChatRequest,
    responses(
        (status = 200, description = "The completion, or with `stream` its server-sent events",
         content((ChatCompletion = "application/json"), (String = "text/event-stream"))),
        (status = 400, description = "A field is malformed, out of range, unknown or not supported", body = ErrorBody),
        (status = 404, description = "`model` is not served here", body = ErrorBody),
        QueuedWorkErrors,
    ))]
#[allow(dead_code)]
fn chat_completions() {}

#[utoipa::path(post, path = "/v1/completions", tag = "openai", security(("bearer" = [])),
    request_body = CompletionRequest,
    responses(
        (status = 200, description = "The completion, or with `stream` its server-sent events",
         content((Completion = "application/json"), (String = "text/event-stream"))),
        (status = 400, description = "A field is malformed, out of range, unknown or not supported", body = ErrorBody),
        (status = 404, description = "`model` is not served here", body = ErrorBody),
        QueuedWorkErrors,
    ))]
#[allow(dead_code)]
fn completions() {}

#[utoipa::path(get, path = "/v1/models", tag = "openai", security(("bearer" = [])),
    responses(
        (status = 200, description = "The served model names", body = ModelList),
        GuardedRouteErrors,
    ))]
#[allow(dead_code)]
fn models() {}

#[utoipa::path(get, path = "/v1/models/{id}", tag = "openai", security(("bearer" = [])),
    params(("id" = String, Path, description = "A served model name")),
    responses(
        (status = 200, description = "The model", body = Model),
        (status = 404, description = "No model of that name is served here", body = ErrorBody),
        GuardedRouteErrors,
    ))]
#[allow(dead_code)]
fn model() {}

#[utoipa::path(post, path = "/v1/responses", tag = "openai", security(("bearer" = [])),
    request_body = ResponsesRequest,
    responses(
        (status = 200, description = "The response, or with `stream` its server-sent events",
         content((ResponseObject = "application/json"), (String = "text/event-stream"))),
        (status = 400, description = "A field is malformed, out of range or not supported", body = ErrorBody),
        (status = 404, description = "`model` is not served here", body = ErrorBody),
        QueuedWorkErrors,
    ))]
#[allow(dead_code)]
fn responses() {}

#[utoipa::path(post, path = "/tokenize", tag = "vllm", security(("bearer" = [])),
    request_body = TokenizeRequest,
    responses(
        (status = 200, description = "The prompt's token ids", body = TokenizeResponse),
        (status = 400, description = "A field is malformed", body = ErrorBody),
        (status = 404, description = "`model` is not served here", body = ErrorBody),
        BodyRouteErrors,
    ))]
#[allow(dead_code)]
fn tokenize() {}

#[utoipa::path(post, path = "/detokenize", tag = "vllm", security(("bearer" = [])),
    request_body = DetokenizeRequest,
    responses(
        (status = 200, description = "The ids' text", body = DetokenizeResponse),
        (status = 400, description = "A field is malformed or an id out of range", body = ErrorBody),
        (status = 404, description = "`model` is not served here", body = ErrorBody),
        BodyRouteErrors,
    ))]
#[allow(dead_code)]
fn detokenize() {}

#[utoipa::path(get, path = "/version", tag = "vllm", security(("bearer" = [])),
    responses(
        (status = 200, description = "The server's version", body = Version),
        GuardedRouteErrors,
    ))]
#[allow(dead_code)]
fn version() {}

#[utoipa::path(get, path = "/metrics", tag = "operations", security(("bearer" = [])),
    responses(
        (status = 200, description = "Prometheus metrics (vLLM's names, plus voltllm's bounds)",
         content_type = "application/openmetrics-text; version=1.0.0; charset=utf-8", body = String),
        GuardedRouteErrors,
    ))]
#[allow(dead_code)]
fn metrics() {}

#[utoipa::path(get, path = "/health", tag = "operations",
    responses(
        // No content is declared: a healthy answer has no body, and OpenAPI cannot say "no body
        // or JSON" for one status.
        (status = 200, description = "Every engine serves: an empty body. With data parallelism, \
                                      while some engines serve and others restart or are lost: \
                                      `{\"status\": \"degraded\", \"engines\": [{\"engine\", \
                                      \"state\", \"reason\"}]}` as application/json"),
        (status = 503, description = "No engine serves (restarting, or all died), or the server drains",
         body = ErrorBody),
    ))]
#[allow(dead_code)]
fn health() {}

#[utoipa::path(get, path = "/ping", tag = "operations",
    responses(
        (status = 200, description = "As /health"),
        (status = 503, description = "As /health", body = ErrorBody),
    ))]
#[allow(dead_code)]
fn ping_get() {}

#[utoipa::path(post, path = "/ping", tag = "operations",
    responses(
        (status = 200, description = "As /health"),
        (status = 503, description = "As /health", body = ErrorBody),
    ))]
#[allow(dead_code)]
fn ping_post() {}

#[utoipa::path(get, path = "/", tag = "page",
    responses((status = 200, description = "The chat page", content_type = "text/html; charset=utf-8", body = String)))]
#[allow(dead_code)]
fn page() {}

#[utoipa::path(get, path = "/assets/chat.css", tag = "page",
    responses((status = 200, description = "The chat page's style", content_type = "text/css; charset=utf-8", body = String)))]
#[allow(dead_code)]
fn page_css() {}

#[utoipa::path(get, path = "/assets/chat.js", tag = "page",
    responses((status = 200, description = "The chat page's script", content_type = "text/javascript; charset=utf-8", body = String)))]
#[allow(dead_code)]
fn page_js() {}

#[utoipa::path(get, path = "/openapi.json", tag = "operations",
    responses((status = 200, description = "This description", content_type = "application/json", body = Object)))]
#[allow(dead_code)]
fn openapi_json() {}

#[derive(OpenApi)]
#[openapi(
    info(title = "voltllm", description = "OpenAI-compatible LLM inference server (docs/server.md)"),
    paths(chat_completions, completions, responses, models, model, tokenize, detokenize, version,
          metrics, health, ping_get, ping_post, page, page_css, page_js, openapi_json),
    modifiers(&BearerAuth)
)]
struct ApiDoc;

/// Merges a flattened request schema (an `allOf` of objects and `$ref`s to them) into one object
/// with every property, adds the fields `request_fields.rs` knows for `route`, and refuses any other
/// property, as the parser does.
fn close_schema(schemas: &mut Map<String, Json>, name: &str, route: Route) {
    let Some(schema) = schemas.get(name).cloned() else {
        return;
    };
    let parts = match schema.get("allOf").and_then(Json::as_array) {
        Some(parts) => parts.clone(),
        None => vec![schema],
    };
    let mut properties = Map::new();
    let mut required: Vec<Json> = Vec::new();
    for part in parts {
        let part = match part.get("$ref").and_then(Json::as_str) {
            Some(reference) => {
                let target = reference.trim_start_matches("#/components/schemas/");
                schemas.get(target).cloned().unwrap_or_default()
            }
            None => part,
        };
        if let Some(p) = part.get("properties").and_then(Json::as_object) {
            properties.extend(p.clone());
        }
        if let Some(r) = part.get("required").and_then(Json::as_array) {
            required.extend(r.iter().cloned());
        }
    }
    for field in known_fields(route) {
        properties.insert(field.name.to_string(), field.schema());
    }
    let mut closed = Map::new();
    closed.insert("type".into(), Json::from("object"));
    closed.insert("required".into(), Json::Array(required));
    closed.insert("properties".into(), Json::Object(properties));
    closed.insert("additionalProperties".into(), Json::Bool(false));
    schemas.insert(name.to_string(), Json::Object(closed));
}

/// utoipa writes an optional `serde_json::Value` as `oneOf: [null, Value]`, which no value passes:
/// `Value` is any JSON, so `null` matches both branches. Such a union becomes the any-schema.
fn collapse_nullable_any(value: &mut Json) {
    const ANY: &str = "#/components/schemas/Value";
    match value {
        Json::Object(map) => {
            let union = map
                .get("oneOf")
                .and_then(Json::as_array)
                .filter(|branches| {
                    branches.iter().any(|b| b["$ref"] == ANY)
                        && branches
                            .iter()
                            .all(|b| b["$ref"] == ANY || b["type"] == "null")
                });
            if let Some(branches) = union {
                let description = branches.iter().find_map(|b| b.get("description").cloned());
                map.remove("oneOf");
                if let Some(d) = description {
                    map.entry("description").or_insert(d);
                }
            }
            map.values_mut().for_each(collapse_nullable_any);
        }
        Json::Array(items) => items.iter_mut().for_each(collapse_nullable_any),
        _ => {}
    }
}

/// The document as JSON: utoipa's, with the request schemas closed.
fn document() -> Json {
    let mut doc = ApiDoc::openapi();
    doc.info.version = env!("CARGO_PKG_VERSION").to_string();
    let mut doc = serde_json::to_value(doc).unwrap_or_default();
    if let Some(schemas) = doc
        .pointer_mut("/components/schemas")
        .and_then(Json::as_object_mut)
    {
        close_schema(schemas, "ChatRequest", Route::Chat);
        close_schema(schemas, "CompletionRequest", Route::Completions);
        // The fields parsed or checked by hand, described by hand.
        schemas["ChatRequest"]["properties"]["messages"] = openai::messages_schema();
        schemas["CompletionRequest"]["properties"]["prompt"] = openai::prompt_schema();
        for request in ["ChatRequest", "CompletionRequest"] {
            schemas[request]["properties"]["logit_bias"] = openai::logit_bias_schema();
        }
        let tokenize = &mut schemas["TokenizeRequest"];
        tokenize["properties"]["messages"] = openai::messages_schema();
        tokenize["oneOf"] =
            serde_json::json!([{"required": ["prompt"]}, {"required": ["messages"]}]);
        // Only chat and completions were merged: the parts they were made of are not used elsewhere.
        for part in ["CommonParams", "StructuredFields"] {
            schemas.remove(part);
        }
    }
    collapse_nullable_any(&mut doc);
    doc
}

/// The description as JSON text, built once.
pub fn openapi_json_text() -> &'static str {
    static TEXT: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    TEXT.get_or_init(|| document().to_string())
}

/// `GET /openapi.json`; needs no state (and, like vLLM's, no API key).
pub fn router<S: Clone + Send + Sync + 'static>() -> Router<S> {
    Router::new().route(
        "/openapi.json",
        get(|| async { ([(CONTENT_TYPE, "application/json")], openapi_json_text()) }),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `(method, path)` of every `.route(...)` in the sources that build the router, with axum's
    /// `{*name}` written as OpenAPI's `{name}`.
    fn mounted_routes() -> Vec<(String, String)> {
        let sources = [
            include_str!("server.rs"),
            include_str!("routes/page.rs"),
            include_str!("openapi.rs"),
        ];
        let mut routes = Vec::new();
        for source in sources {
            for (i, _) in source.match_indices(".route(") {
                let rest = &source[i + ".route(".len()..];
                let path = rest
                    .trim_start()
                    .strip_prefix('"')
                    .and_then(|r| r.split('"').next());
                let Some(path) = path.filter(|p| p.starts_with('/')) else {
                    continue;
                };
                // The call's text: up to the next route.
                let end = rest[1..].find(".route(").map_or(rest.len(), |e| e + 1);
                let call = &rest[..end];
                for method in ["get", "post", "put", "delete", "patch"] {
                    if call.contains(&format!("{method}(")) {
                        routes.push((method.to_string(), path.replace("{*", "{")));
                    }
                }
            }
        }
        routes
    }

    #[test]
    fn every_mounted_route_is_described() {
        let doc: Json = serde_json::from_str(openapi_json_text()).unwrap();
        assert_eq!(doc["openapi"].as_str().map(|v| &v[..3]), Some("3.1"));
        let routes = mounted_routes();
        // The scan found the router (the test cannot pass on an empty list).
        for expected in [
            "/v1/chat/completions",
            "/v1/responses",
            "/v1/models/{id}",
            "/ping",
            "/",
        ] {
            assert!(
                routes.iter().any(|(_, p)| p == expected),
                "{expected}: {routes:?}"
            );
        }
        for (method, path) in routes {
            assert!(
                doc["paths"][&path][&method].is_object(),
                "{} {path} is mounted but not in /openapi.json",
                method.to_uppercase()
            );
        }
    }

    #[test]
    fn request_bodies_come_from_the_parsing_types_and_are_closed() {
        let doc: Json = serde_json::from_str(openapi_json_text()).unwrap();
        let schemas = &doc["components"]["schemas"];
        let chat = &schemas["ChatRequest"];
        assert_eq!(chat["additionalProperties"], false);
        assert_eq!(chat["required"], serde_json::json!(["messages"]));
        for field in [
            "messages",
            "temperature",
            "guided_json",
            "guided_whitespace_pattern",
            "tools",
            "store",
        ] {
            assert!(chat["properties"][field].is_object(), "chat lacks {field}");
        }
        assert_eq!(
            chat["properties"]["store"]["enum"],
            serde_json::json!([null, false])
        );
        let completion = &schemas["CompletionRequest"];
        assert_eq!(completion["additionalProperties"], false);
        assert!(completion["properties"]["prompt"]["oneOf"].is_array());
        assert!(completion["properties"]["suffix"].is_object());
        assert!(completion["properties"]["tools"].is_null());
        // A struct the parser closes with deny_unknown_fields is closed by utoipa itself.
        assert_eq!(schemas["ResponsesRequest"]["additionalProperties"], false);
        assert_eq!(schemas["TokenizeRequest"]["additionalProperties"], false);
        // Nothing points at the merged parts.
        assert!(!openapi_json_text().contains("#/components/schemas/CommonParams"));
        assert!(!openapi_json_text().contains("#/components/schemas/StructuredFields"));
    }

    #[test]
    fn an_optional_any_value_accepts_null() {
        let doc: Json = serde_json::from_str(openapi_json_text()).unwrap();
        let logprobs = &doc["components"]["schemas"]["ChatChoice"]["properties"]["logprobs"];
        assert!(logprobs.get("oneOf").is_none(), "{logprobs}");
        let tool_choice = &doc["components"]["schemas"]["ChatRequest"]["properties"]["tool_choice"];
        assert!(tool_choice.get("oneOf").is_none(), "{tool_choice}");
    }

    #[test]
    fn every_reference_resolves() {
        let text = openapi_json_text();
        let doc: Json = serde_json::from_str(text).unwrap();
        for (i, _) in text.match_indices("#/components/schemas/") {
            let name: String = text[i + 21..]
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            assert!(
                doc["components"]["schemas"][&name].is_object(),
                "dangling $ref {name}"
            );
        }
    }
}
