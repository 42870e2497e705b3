//! `POST /v1/responses`: OpenAI's Responses API, stateless (nothing is stored, so
//! `previous_response_id` is a 400). Input items become chat messages rendered by the chat
//! template; the generated text goes through the same [`AssistantParser`] as chat, and its parts
//! become output items (`reasoning`, `message`, `function_call`). Streaming sends the API's
//! typed events; the non-streamed response is what the same event builder ends with.

use std::collections::VecDeque;
use std::convert::Infallible;

use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::Json as JsonResponse;
use futures::stream::{self, StreamExt};
use serde::Deserialize;
use serde_json::{json, Map, Value as Json};
use voltllm_chat::RenderOptions;
use voltllm_protocol::{StructuredOutput, StructuredOutputKind};

use super::{blocking, body_bytes, new_id, SharedState};
use crate::assistant::{new_call_id, AssistantDelta, AssistantParser};
use crate::error::ApiError;
use crate::generate::{self, unix_now, DeltaStream, Generation};
use crate::openai::{self, CommonParams};
use crate::tools::request::{json_constraint, ToolShape};
use crate::tools::ToolRequest;

/// The request body. Every field the API defines that voltllm reads is here; any other field is
/// a 400 naming it (`deny_unknown_fields`), never silently dropped.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ResponsesRequest {
    model: Option<String>,
    input: InputField,
    instructions: Option<String>,
    tools: Option<Vec<Json>>,
    tool_choice: Option<Json>,
    parallel_tool_calls: Option<bool>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    max_output_tokens: Option<i64>,
    #[serde(default)]
    stream: bool,
    text: Option<TextOptions>,
    /// Stateless: accepted, and the response says `"store": false`.
    #[allow(dead_code)]
    store: Option<bool>,
    previous_response_id: Option<String>,
    /// A stored conversation: stateless, so a 400 when set.
    conversation: Option<Json>,
    /// A stored prompt template: a 400 when set.
    prompt: Option<Json>,
    context_management: Option<Json>,
    /// Cache hints: voltllm's prefix cache needs none.
    #[allow(dead_code)]
    prompt_cache_retention: Option<String>,
    #[allow(dead_code)]
    prompt_cache_options: Option<Json>,
    /// Echoed back, as the API does.
    metadata: Option<Json>,
    /// Only `null` / `"disabled"` / `"auto"`: a prompt that does not fit is a 400 either way.
    truncation: Option<String>,
    /// Only output the server produces anyway may be asked for (none today).
    include: Option<Vec<String>>,
    reasoning: Option<Json>,
    background: Option<bool>,
    /// End-user identifiers for abuse tracking; voltllm has no use for them.
    #[allow(dead_code)]
    user: Option<String>,
    #[allow(dead_code)]
    safety_identifier: Option<String>,
    #[allow(dead_code)]
    prompt_cache_key: Option<String>,
    service_tier: Option<String>,
    top_logprobs: Option<i64>,
    max_tool_calls: Option<i64>,
    stream_options: Option<Json>,
    // vLLM's extras beyond OpenAI's fields.
    top_k: Option<i64>,
    min_p: Option<f64>,
    repetition_penalty: Option<f64>,
    seed: Option<i64>,
    chat_template_kwargs: Option<Map<String, Json>>,
}

/// `input`: a text, or a list of input items (messages, function calls and their outputs).
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(untagged)]
enum InputField {
    Text(String),
    Items(Vec<Json>),
}

/// `text`: the output's format and verbosity.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
struct TextOptions {
    format: Option<Json>,
    verbosity: Option<String>,
}

/// `text.format`: the constraint it asks for, if any.
fn text_constraint(format: Option<&Json>) -> Result<Option<StructuredOutput>, ApiError> {
    let Some(format) = format.filter(|f| !f.is_null()) else {
        return Ok(None);
    };
    let kind = format.get("type").and_then(Json::as_str).unwrap_or("");
    match kind {
        "text" => Ok(None),
        "json_object" => Ok(Some(StructuredOutput::new(
            StructuredOutputKind::JsonObject,
            "",
        ))),
        "json_schema" => {
            let schema = format
                .get("schema")
                .filter(|s| s.is_object())
                .ok_or_else(|| {
                    ApiError::bad(
                        "text.format.schema",
                        "text.format.schema must be a JSON schema object",
                    )
                })?;
            jsonschema::validator_for(schema).map_err(|e| {
                ApiError::bad(
                    "text.format.schema",
                    format!("text.format.schema is not a valid JSON schema: {e}"),
                )
            })?;
            Ok(Some(json_constraint(schema)))
        }
        other => Err(ApiError::bad(
            "text.format.type",
            format!("text.format.type must be text, json_object or json_schema, got {other:?}"),
        )),
    }
}

/// Refuses the fields whose meaning voltllm cannot honour.
fn check_unsupported(req: &ResponsesRequest) -> Result<(), ApiError> {
    if req.previous_response_id.is_some() {
        return Err(ApiError::bad(
            "previous_response_id",
            "this server is stateless and stores no responses: send the whole conversation in \
             input instead of previous_response_id",
        ));
    }
    for (param, value) in [
        ("conversation", &req.conversation),
        ("prompt", &req.prompt),
        ("context_management", &req.context_management),
    ] {
        if value.as_ref().is_some_and(|v| !v.is_null()) {
            return Err(ApiError::bad(
                param,
                format!(
                    "{param} needs server-side state, which this stateless server does not keep"
                ),
            ));
        }
    }
    if req.background == Some(true) {
        return Err(ApiError::bad(
            "background",
            "background responses are not supported",
        ));
    }
    if let Some(t) = req.truncation.as_deref() {
        if !matches!(t, "disabled" | "auto") {
            return Err(ApiError::bad(
                "truncation",
                format!("truncation must be \"disabled\" or \"auto\", got {t:?}"),
            ));
        }
    }
    if let Some(first) = req.include.as_ref().and_then(|i| i.first()) {
        return Err(ApiError::bad(
            "include",
            format!("include {first:?} is not supported"),
        ));
    }
    let reasoning_set = req
        .reasoning
        .as_ref()
        .and_then(Json::as_object)
        .is_some_and(|r| r.values().any(|v| !v.is_null()));
    if reasoning_set {
        return Err(ApiError::bad(
            "reasoning",
            "reasoning options (effort, summary) are not supported; use chat_template_kwargs \
             (e.g. enable_thinking) and the server's --reasoning-parser",
        ));
    }
    if req.top_logprobs.is_some_and(|n| n != 0) {
        return Err(ApiError::bad(
            "top_logprobs",
            "top_logprobs is not supported on /v1/responses",
        ));
    }
    if req.max_tool_calls.is_some() {
        return Err(ApiError::bad(
            "max_tool_calls",
            "max_tool_calls is not supported",
        ));
    }
    if req.stream_options.as_ref().is_some_and(|o| !o.is_null()) {
        return Err(ApiError::bad(
            "stream_options",
            "stream_options is not supported on /v1/responses",
        ));
    }
    if let Some(v) = req.text.as_ref().and_then(|t| t.verbosity.as_deref()) {
        if v != "medium" {
            return Err(ApiError::bad(
                "text.verbosity",
                "only the default verbosity (medium) is supported",
            ));
        }
    }
    Ok(())
}

/// The text of a message item's content: a string, or a list of `input_text` / `output_text`
/// parts.
fn item_text(param: &str, content: Option<&Json>) -> Result<String, ApiError> {
    match content {
        None | Some(Json::Null) => Ok(String::new()),
        Some(Json::String(s)) => Ok(s.clone()),
        Some(Json::Array(parts)) => {
            let mut text = String::new();
            for (k, part) in parts.iter().enumerate() {
                let kind = part.get("type").and_then(Json::as_str);
                match (kind, part.get("text").and_then(Json::as_str)) {
                    (Some("input_text" | "output_text" | "text"), Some(t)) => text.push_str(t),
                    (Some("refusal"), _) => {
                        text.push_str(part.get("refusal").and_then(Json::as_str).unwrap_or(""))
                    }
                    _ => {
                        return Err(ApiError::bad(
                            param,
                            format!(
                            "{param}.content[{k}]: part type {kind:?} is not supported (text only)"
                        ),
                        ))
                    }
                }
            }
            Ok(text)
        }
        Some(_) => Err(ApiError::bad(
            param,
            format!("{param}.content must be a string or a list of parts"),
        )),
    }
}

fn str_field<'a>(item: &'a Json, param: &str, key: &str) -> Result<&'a str, ApiError> {
    item.get(key)
        .and_then(Json::as_str)
        .ok_or_else(|| ApiError::bad(param, format!("{param}.{key} must be a string")))
}

/// Input items as chat messages: `function_call` items join the assistant turn before them,
/// `function_call_output` items become `tool` messages, `reasoning` items the next assistant
/// turn's `reasoning_content`.
fn input_messages(instructions: Option<&str>, input: &InputField) -> Result<Vec<Json>, ApiError> {
    let mut messages = Vec::new();
    if let Some(text) = instructions {
        messages.push(json!({"role": "system", "content": text}));
    }
    let items = match input {
        InputField::Text(text) => {
            messages.push(json!({"role": "user", "content": text}));
            return Ok(messages);
        }
        InputField::Items(items) => items,
    };
    let mut reasoning: Option<String> = None;
    for (i, item) in items.iter().enumerate() {
        let param = format!("input[{i}]");
        let kind = item.get("type").and_then(Json::as_str).unwrap_or("message");
        match kind {
            "message" => {
                let role = str_field(item, &param, "role")?;
                if !matches!(role, "user" | "system" | "developer" | "assistant") {
                    return Err(ApiError::bad(&param, format!("{param}.role {role:?} is not supported")));
                }
                let mut message = json!({"role": role, "content": item_text(&param, item.get("content"))?});
                if role == "assistant" {
                    if let Some(r) = reasoning.take() {
                        message["reasoning_content"] = Json::String(r);
                    }
                }
                messages.push(message);
            }
            "function_call" => {
                let call = json!({
                    "id": str_field(item, &param, "call_id")?,
                    "type": "function",
                    "function": {"name": str_field(item, &param, "name")?,
                                 "arguments": str_field(item, &param, "arguments")?},
                });
                let joins_last = messages.last().is_some_and(|m: &Json| {
                    m["role"] == "assistant" && reasoning.is_none()
                });
                if !joins_last {
                    let mut message = json!({"role": "assistant", "content": null});
                    if let Some(r) = reasoning.take() {
                        message["reasoning_content"] = Json::String(r);
                    }
                    messages.push(message);
                }
                if let Some(last) = messages.last_mut() {
                    match last.get_mut("tool_calls").and_then(Json::as_array_mut) {
                        Some(calls) => calls.push(call),
                        None => last["tool_calls"] = json!([call]),
                    }
                }
            }
            "function_call_output" => {
                let output = match item.get("output") {
                    Some(Json::String(s)) => s.clone(),
                    other => item_text(&format!("{param}.output"), other)?,
                };
                messages.push(json!({
                    "role": "tool",
                    "tool_call_id": str_field(item, &param, "call_id")?,
                    "content": output,
                }));
            }
            "reasoning" => {
                let texts: Vec<&str> = ["content", "summary"]
                    .iter()
                    .filter_map(|key| item.get(*key).and_then(Json::as_array))
                    .flatten()
                    .filter_map(|part| part.get("text").and_then(Json::as_str))
                    .collect();
                reasoning = Some(texts.join("\n"));
            }
            other => {
                return Err(ApiError::bad(
                    &param,
                    format!("{param}.type {other:?} is not supported (message, function_call, function_call_output, reasoning)"),
                ))
            }
        }
    }
    Ok(messages)
}

/// Everything fixed about the response before generation starts.
struct ResponseHead {
    id: String,
    created_at: u64,
    model: String,
    /// The request's settings the response object repeats.
    echo: Map<String, Json>,
}

/// One output item being built.
enum OpenItem {
    Reasoning {
        id: String,
        text: String,
    },
    Message {
        id: String,
        text: String,
    },
    Call {
        id: String,
        call_id: String,
        name: String,
        arguments: String,
    },
}

/// Builds the stream of Responses events from assistant deltas, and the final response.
struct EventBuilder {
    head: ResponseHead,
    sequence_number: u64,
    output: Vec<Json>,
    open: Option<OpenItem>,
    /// Framed events not sent yet.
    frames: VecDeque<Bytes>,
    /// The final response once finished, or the failure.
    outcome: Option<Result<Json, String>>,
}

impl EventBuilder {
    fn new(head: ResponseHead) -> Self {
        Self {
            head,
            sequence_number: 0,
            output: Vec::new(),
            open: None,
            frames: VecDeque::new(),
            outcome: None,
        }
    }

    /// `event: TYPE` + `data: JSON` with the event's type and sequence number added.
    fn emit(&mut self, kind: &str, mut body: Json) {
        body["type"] = Json::String(kind.to_string());
        body["sequence_number"] = json!(self.sequence_number);
        self.sequence_number += 1;
        let mut frame = format!("event: {kind}\ndata: ").into_bytes();
        frame.extend_from_slice(body.to_string().as_bytes());
        frame.extend_from_slice(b"\n\n");
        self.frames.push_back(Bytes::from(frame));
    }

    fn response(&self, status: &str, usage: Option<(usize, usize)>) -> Json {
        let mut r = json!({
            "id": self.head.id,
            "object": "response",
            "created_at": self.head.created_at,
            "status": status,
            "model": self.head.model,
            "output": self.output,
            "error": null,
            "incomplete_details": null,
            "previous_response_id": null,
            "store": false,
            "usage": null,
        });
        for (k, v) in &self.head.echo {
            r[k] = v.clone();
        }
        if let Some((input, output)) = usage {
            r["usage"] = json!({
                "input_tokens": input,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": output,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": input + output,
            });
        }
        r
    }

    fn start(&mut self) {
        let response = self.response("in_progress", None);
        self.emit("response.created", json!({"response": response}));
        self.emit("response.in_progress", json!({"response": response}));
    }

    fn item_json(item: &OpenItem, status: &str) -> Json {
        match item {
            OpenItem::Reasoning { id, text } => json!({
                "type": "reasoning", "id": id, "summary": [], "status": status,
                "content": [{"type": "reasoning_text", "text": text}],
            }),
            OpenItem::Message { id, text } => json!({
                "type": "message", "id": id, "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
            }),
            OpenItem::Call {
                id,
                call_id,
                name,
                arguments,
            } => json!({
                "type": "function_call", "id": id, "call_id": call_id, "name": name,
                "arguments": arguments, "status": status,
            }),
        }
    }

    fn open(&mut self, item: OpenItem) {
        self.close();
        let output_index = self.output.len();
        let mut added = Self::item_json(&item, "in_progress");
        match &item {
            OpenItem::Message { id, .. } => {
                added["content"] = json!([]);
                self.emit(
                    "response.output_item.added",
                    json!({"output_index": output_index, "item": added}),
                );
                self.emit("response.content_part.added", json!({
                    "item_id": id, "output_index": output_index, "content_index": 0,
                    "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []},
                }));
            }
            OpenItem::Reasoning { .. } => {
                added["content"] = json!([]);
                self.emit(
                    "response.output_item.added",
                    json!({"output_index": output_index, "item": added}),
                );
            }
            OpenItem::Call { .. } => {
                self.emit(
                    "response.output_item.added",
                    json!({"output_index": output_index, "item": added}),
                );
            }
        }
        self.open = Some(item);
    }

    fn close(&mut self) {
        let Some(item) = self.open.take() else { return };
        let output_index = self.output.len();
        let done = Self::item_json(&item, "completed");
        match &item {
            OpenItem::Message { id, text } => {
                self.emit(
                    "response.output_text.done",
                    json!({
                        "item_id": id, "output_index": output_index, "content_index": 0,
                        "text": text, "logprobs": [],
                    }),
                );
                self.emit(
                    "response.content_part.done",
                    json!({
                        "item_id": id, "output_index": output_index, "content_index": 0,
                        "part": done["content"][0],
                    }),
                );
            }
            OpenItem::Reasoning { id, text } => {
                self.emit("response.reasoning_text.done", json!({
                    "item_id": id, "output_index": output_index, "content_index": 0, "text": text,
                }));
            }
            OpenItem::Call {
                id,
                name,
                arguments,
                ..
            } => {
                self.emit("response.function_call_arguments.done", json!({
                    "item_id": id, "output_index": output_index, "name": name, "arguments": arguments,
                }));
            }
        }
        self.emit(
            "response.output_item.done",
            json!({"output_index": output_index, "item": done}),
        );
        self.output.push(done);
    }

    fn push(&mut self, delta: AssistantDelta) {
        if !delta.reasoning.is_empty() {
            if !matches!(self.open, Some(OpenItem::Reasoning { .. })) {
                self.open(OpenItem::Reasoning {
                    id: new_id("rs"),
                    text: String::new(),
                });
            }
            let output_index = self.output.len();
            if let Some(OpenItem::Reasoning { id, text }) = &mut self.open {
                text.push_str(&delta.reasoning);
                let id = id.clone();
                self.emit(
                    "response.reasoning_text.delta",
                    json!({
                        "item_id": id, "output_index": output_index, "content_index": 0,
                        "delta": delta.reasoning,
                    }),
                );
            }
        }
        if !delta.content.is_empty() {
            if !matches!(self.open, Some(OpenItem::Message { .. })) {
                self.open(OpenItem::Message {
                    id: new_id("msg"),
                    text: String::new(),
                });
            }
            let output_index = self.output.len();
            if let Some(OpenItem::Message { id, text }) = &mut self.open {
                text.push_str(&delta.content);
                let id = id.clone();
                self.emit(
                    "response.output_text.delta",
                    json!({
                        "item_id": id, "output_index": output_index, "content_index": 0,
                        "delta": delta.content, "logprobs": [],
                    }),
                );
            }
        }
        for call in delta.tool_calls {
            if let Some(name) = call.name {
                let call_id = call.id.unwrap_or_else(new_call_id);
                self.open(OpenItem::Call {
                    id: new_id("fc"),
                    call_id,
                    name,
                    arguments: String::new(),
                });
            }
            let output_index = self.output.len();
            if let Some(OpenItem::Call { id, arguments, .. }) = &mut self.open {
                if !call.arguments.is_empty() {
                    arguments.push_str(&call.arguments);
                    let id = id.clone();
                    self.emit(
                        "response.function_call_arguments.delta",
                        json!({
                            "item_id": id, "output_index": output_index, "delta": call.arguments,
                        }),
                    );
                }
            }
        }
    }

    /// Closes the open item and emits the final event; returns the final response.
    fn finish(&mut self, finish_reason: Option<&str>, usage: (usize, usize)) -> Json {
        let response = self.final_response(finish_reason, usage);
        self.outcome = Some(Ok(response.clone()));
        response
    }

    fn final_response(&mut self, finish_reason: Option<&str>, usage: (usize, usize)) -> Json {
        self.close();
        let incomplete = finish_reason == Some("length");
        let mut response = self.response(
            if incomplete {
                "incomplete"
            } else {
                "completed"
            },
            Some(usage),
        );
        if incomplete {
            response["incomplete_details"] = json!({"reason": "max_output_tokens"});
        }
        let kind = if incomplete {
            "response.incomplete"
        } else {
            "response.completed"
        };
        self.emit(kind, json!({"response": response}));
        response
    }

    fn fail(&mut self, error: &ApiError) {
        let body = error.body();
        self.emit(
            "error",
            json!({
                "code": body["error"]["type"], "message": body["error"]["message"],
                "param": body["error"]["param"],
            }),
        );
        let mut response = self.response("failed", None);
        response["error"] = json!({"code": "server_error", "message": error.to_string()});
        self.emit("response.failed", json!({"response": response}));
        self.outcome = Some(Err(error.to_string()));
    }
}

/// Drives the deltas through the parser and the event builder.
struct Run {
    deltas: Option<DeltaStream>,
    parser: AssistantParser,
    events: EventBuilder,
    prompt_len: usize,
    output_tokens: usize,
}

impl Run {
    /// Consumes one more delta; `false` once the response is complete (or failed).
    async fn step(&mut self) -> bool {
        let Some(deltas) = self.deltas.as_mut() else {
            return false;
        };
        match deltas.next().await {
            Some(Ok(d)) => {
                self.output_tokens += d.num_tokens;
                let part = self.parser.push(&d.text);
                self.events.push(part);
                if d.finish_reason.is_some() {
                    let rest = self.parser.finish();
                    self.events.push(rest);
                    self.events
                        .finish(d.finish_reason, (self.prompt_len, self.output_tokens));
                    self.deltas = None;
                }
                true
            }
            Some(Err(e)) => {
                self.events.fail(&e);
                self.deltas = None;
                true
            }
            None => {
                self.deltas = None;
                false
            }
        }
    }
}

/// Handler.
pub async fn responses(
    state: SharedState,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let state = state.0;
    let body = body_bytes(&state, body)?;
    let req: ResponsesRequest = openai::parse_body(&body)?;
    state.check_model(req.model.as_deref())?;
    check_unsupported(&req)?;
    let template = state.template.clone().ok_or_else(|| {
        ApiError::bad(
            "input",
            "this model has no chat template; use /v1/completions instead",
        )
    })?;
    let common = CommonParams {
        temperature: req.temperature,
        top_p: req.top_p,
        top_k: req.top_k,
        min_p: req.min_p,
        repetition_penalty: req.repetition_penalty,
        seed: req.seed,
        stream: req.stream,
        ..Default::default()
    };
    let (mut params, options) = openai::sampling_params(
        &common,
        &crate::structured::StructuredFields::default(),
        None,
        state.vocab_size,
    )?;
    let tools = ToolRequest::parse(
        req.tools.as_deref(),
        req.tool_choice.as_ref(),
        req.parallel_tool_calls,
        ToolShape::Responses,
    )?;
    let parsing = state.output_parsing.clone();
    parsing.check(tools.as_ref())?;
    let text_format = req.text.as_ref().and_then(|t| t.format.as_ref());
    params.structured_output = text_constraint(text_format)?;
    if let Some(schema) = tools.as_ref().and_then(ToolRequest::forced_schema) {
        if params.structured_output.is_some() {
            return Err(ApiError::bad(
                "text.format",
                "a forced tool call and text.format cannot both constrain the output",
            ));
        }
        params.structured_output = Some(json_constraint(&schema));
    }
    let messages =
        openai::normalize_messages(&input_messages(req.instructions.as_deref(), &req.input)?)
            .map_err(|e| match e {
                ApiError::BadRequest { message, .. } => ApiError::bad("input", message),
                other => other,
            })?;
    let render = RenderOptions {
        add_generation_prompt: true,
        tools: tools.as_ref().map(ToolRequest::template_tools),
        extra: req.chat_template_kwargs.clone().unwrap_or_default(),
        ..Default::default()
    };
    let tokenizer = state.tokenizer.clone();
    let limits = state.clone();
    let prompt_ids = blocking(move || {
        let text = template.render(&messages, &render)?;
        limits.check_prompt_bytes("input", text.len())?;
        Ok(tokenizer.encode(&text, false)?)
    })
    .await?;
    if prompt_ids.is_empty() {
        return Err(ApiError::bad("input", "the rendered prompt is empty"));
    }
    params.max_tokens = openai::resolve_max_tokens(
        req.max_output_tokens,
        params.min_tokens,
        prompt_ids.len(),
        state.max_model_len,
    )
    .map_err(|e| match e {
        ApiError::BadRequest {
            message,
            param: Some(p),
        } if p == "max_tokens" => ApiError::bad(
            "max_output_tokens",
            message.replace("max_tokens", "max_output_tokens"),
        ),
        other => other,
    })?;

    let id = new_id("resp");
    let mut echo = Map::new();
    echo.insert("instructions".into(), json!(req.instructions));
    echo.insert("metadata".into(), req.metadata.clone().unwrap_or(json!({})));
    echo.insert("temperature".into(), json!(params.temperature));
    echo.insert("top_p".into(), json!(params.top_p));
    echo.insert("max_output_tokens".into(), json!(req.max_output_tokens));
    echo.insert("tools".into(), json!(req.tools.clone().unwrap_or_default()));
    echo.insert(
        "tool_choice".into(),
        req.tool_choice.clone().unwrap_or(json!("auto")),
    );
    echo.insert(
        "parallel_tool_calls".into(),
        json!(req.parallel_tool_calls.unwrap_or(true)),
    );
    echo.insert(
        "text".into(),
        json!({"format": text_format.cloned().unwrap_or(json!({"type": "text"}))}),
    );
    echo.insert(
        "truncation".into(),
        json!(req.truncation.as_deref().unwrap_or("disabled")),
    );
    echo.insert("reasoning".into(), json!({"effort": null, "summary": null}));
    echo.insert(
        "service_tier".into(),
        json!(req.service_tier.as_deref().unwrap_or("default")),
    );
    let head = ResponseHead {
        id: id.clone(),
        created_at: unix_now() as u64,
        model: state.model_name().to_string(),
        echo,
    };
    let prompt_len = prompt_ids.len();
    // Waits for the engine to accept a constraint, so one it cannot compile is a 400.
    let deltas = generate::start_checked(
        &state,
        Generation {
            prompts: vec![prompt_ids],
            params: vec![params],
            options,
            request_id: id,
        },
    )
    .await?;
    let mut run = Run {
        deltas: Some(deltas),
        parser: parsing.parser(tools.as_ref()),
        events: EventBuilder::new(head),
        prompt_len,
        output_tokens: 0,
    };
    run.events.start();

    if !req.stream {
        while run.step().await {}
        return match run.events.outcome.take() {
            Some(Ok(response)) => Ok(JsonResponse(response).into_response()),
            Some(Err(message)) => Err(ApiError::Engine(message)),
            None => Err(ApiError::Engine(
                "the generation ended without finishing".into(),
            )),
        };
    }
    let events = stream::unfold(run, |mut run| async move {
        loop {
            if let Some(frame) = run.events.frames.pop_front() {
                return Some((Ok::<_, Infallible>(frame), run));
            }
            if !run.step().await {
                return None;
            }
        }
    });
    Ok((
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        Body::from_stream(events),
    )
        .into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn items(v: Json) -> InputField {
        InputField::Items(serde_json::from_value(v).unwrap())
    }

    #[test]
    fn input_items_become_messages() {
        let input = items(json!([
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"},
            {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "21 C"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "It is 21 C."}]},
        ]));
        let m = input_messages(Some("Be brief."), &input).unwrap();
        assert_eq!(m[0], json!({"role": "system", "content": "Be brief."}));
        assert_eq!(m[2]["role"], "assistant");
        assert_eq!(m[2]["tool_calls"].as_array().unwrap().len(), 2);
        assert_eq!(m[2]["tool_calls"][1]["id"], "call_2");
        assert_eq!(
            m[3],
            json!({"role": "tool", "tool_call_id": "call_1", "content": "21 C"})
        );
        assert_eq!(m[4]["content"], "It is 21 C.");
        let err = input_messages(None, &items(json!([{"type": "web_search_call"}]))).unwrap_err();
        assert_eq!(err.body()["error"]["param"], "input[0]");
        let err = input_messages(
            None,
            &items(json!([{"role": "user", "content": [{"type": "input_image"}]}])),
        )
        .unwrap_err();
        assert!(err.to_string().contains("input_image"));
    }

    #[test]
    fn unknown_and_unsupported_fields_are_named() {
        let err = openai::parse_body::<ResponsesRequest>(br#"{"input": "x", "frobnicate": 1}"#)
            .unwrap_err();
        assert!(err.to_string().contains("frobnicate"), "{err}");
        let req: ResponsesRequest =
            openai::parse_body(br#"{"input": "x", "previous_response_id": "resp_1"}"#).unwrap();
        assert_eq!(
            check_unsupported(&req).unwrap_err().body()["error"]["param"],
            "previous_response_id"
        );
        let req: ResponsesRequest =
            openai::parse_body(br#"{"input": "x", "store": false, "metadata": {"a": "b"}}"#)
                .unwrap();
        assert!(check_unsupported(&req).is_ok());
    }

    #[test]
    fn events_follow_the_item_lifecycle() {
        let head = ResponseHead {
            id: "resp_1".into(),
            created_at: 0,
            model: "m".into(),
            echo: Map::new(),
        };
        let mut b = EventBuilder::new(head);
        b.start();
        b.push(AssistantDelta {
            content: "Hi".into(),
            ..Default::default()
        });
        b.push(AssistantDelta {
            tool_calls: vec![crate::assistant::ToolCallDelta {
                index: 0,
                id: Some("call_x".into()),
                name: Some("f".into()),
                arguments: "{\"a\"".into(),
            }],
            ..Default::default()
        });
        b.push(AssistantDelta {
            tool_calls: vec![crate::assistant::ToolCallDelta {
                index: 0,
                id: None,
                name: None,
                arguments: ": 1}".into(),
            }],
            ..Default::default()
        });
        let response = b.finish(Some("stop"), (3, 4));
        let kinds: Vec<String> = b
            .frames
            .iter()
            .map(|f| {
                String::from_utf8_lossy(f)
                    .lines()
                    .next()
                    .unwrap()
                    .trim_start_matches("event: ")
                    .to_string()
            })
            .collect();
        assert_eq!(
            kinds,
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
        assert_eq!(response["output"][0]["content"][0]["text"], "Hi");
        assert_eq!(response["output"][1]["arguments"], "{\"a\": 1}");
        assert_eq!(response["output"][1]["call_id"], "call_x");
        assert_eq!(response["usage"]["total_tokens"], 7);
        assert_eq!(response["status"], "completed");
    }
}
