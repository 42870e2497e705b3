//! `POST /v1/chat/completions`.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::response::{IntoResponse, Response};
use axum::Json as JsonResponse;
use serde::Serialize;
use serde_json::{json, Value as Json};
use voltllm_chat::RenderOptions;

use super::{blocking, body_bytes, new_id, sse_frame, sse_response, usage, SharedState};
use crate::assistant::AssistantMessage;
use crate::error::ApiError;
use crate::generate::{self, unix_now, Generation, TokenLogprob};
use crate::openai::{self, ChatRequest, MAX_LOGPROBS};
use crate::tools::request::ToolShape;
use crate::tools::ToolRequest;

/// A streamed chat chunk, serialized without building a JSON tree.
#[derive(Serialize)]
struct ChatChunk<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: [ChatChoice<'a>; 1],
}

#[derive(Serialize)]
struct ChatChoice<'a> {
    index: u32,
    delta: ChatDelta<'a>,
    logprobs: Option<Json>,
    finish_reason: Option<&'static str>,
    stop_reason: Option<&'a Json>,
}

#[derive(Serialize)]
struct ChatDelta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    content: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning_content: Option<&'a str>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tool_calls: Vec<Json>,
}

/// OpenAI chat `logprobs.content` entries.
fn logprobs_json(logprobs: &[TokenLogprob]) -> Json {
    let content: Vec<Json> = logprobs
        .iter()
        .map(|lp| {
            json!({
                "token": lp.token,
                "logprob": lp.logprob,
                "bytes": lp.token.as_bytes(),
                "top_logprobs": lp.top.iter().map(|(t, l)| json!({
                    "token": t, "logprob": l, "bytes": t.as_bytes(),
                })).collect::<Vec<_>>(),
            })
        })
        .collect();
    json!({ "content": content })
}

/// Bytes of every string inside a JSON value (the text a message contributes to the prompt).
fn json_text_bytes(value: &Json) -> usize {
    match value {
        Json::String(s) => s.len(),
        Json::Array(items) => items.iter().map(json_text_bytes).sum(),
        Json::Object(map) => map.values().map(json_text_bytes).sum(),
        _ => 0,
    }
}

/// Handler.
pub async fn chat_completions(
    state: SharedState,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let state = state.0;
    let body = body_bytes(&state, body)?;
    let req = ChatRequest::parse(&body)?;
    state.check_model(req.common.model.as_deref())?;
    let template = state.template.clone().ok_or_else(|| {
        ApiError::bad(
            "messages",
            "this model has no chat template; use /v1/completions instead",
        )
    })?;
    let logprobs = match (req.logprobs, req.top_logprobs) {
        (_, Some(n)) if !(0..=MAX_LOGPROBS as i64).contains(&n) => {
            return Err(ApiError::bad(
                "top_logprobs",
                format!("top_logprobs must be in [0, {MAX_LOGPROBS}], got {n}"),
            ))
        }
        (false, Some(n)) if n > 0 => {
            return Err(ApiError::bad(
                "top_logprobs",
                "top_logprobs requires logprobs to be true",
            ))
        }
        (true, n) => Some(n.unwrap_or(0) as u32),
        (false, _) => None,
    };
    let (mut params, mut options) =
        openai::sampling_params(&req.common, &req.structured, logprobs, state.vocab_size)?;
    let tools = ToolRequest::parse(
        req.tools.as_deref(),
        req.tool_choice.as_ref(),
        req.parallel_tool_calls,
        ToolShape::Chat,
    )?;
    let parsing = state.output_parsing.clone();
    parsing.check(tools.as_ref())?;
    if let Some(schema) = tools.as_ref().and_then(ToolRequest::forced_schema) {
        let constraint = crate::tools::request::json_constraint(&schema);
        crate::structured::attach(&mut params, constraint, "tool_choice")?;
    }
    if req.common.skip_special_tokens.is_none() && parsing.needs_special_tokens(tools.as_ref()) {
        options.skip_special_tokens = false;
    }
    let prompt_logprobs = params.prompt_logprobs;
    if prompt_logprobs.is_some() && options.stream {
        return Err(ApiError::bad(
            "prompt_logprobs",
            "prompt_logprobs is not supported with stream on /v1/chat/completions; use stream: false",
        ));
    }
    // A conversation whose text alone cannot fit is refused before it is copied and rendered.
    let text_bytes: usize = req.messages.iter().map(json_text_bytes).sum();
    state.check_prompt_bytes("messages", text_bytes)?;
    let messages = openai::normalize_messages(&req.messages)?;
    let render = RenderOptions {
        add_generation_prompt: req
            .add_generation_prompt
            .unwrap_or(!req.continue_final_message),
        continue_final_message: req.continue_final_message,
        tools: req.tools.clone(),
        extra: req.chat_template_kwargs.clone().unwrap_or_default(),
        ..Default::default()
    };
    let tokenizer = state.tokenizer.clone();
    let limits = state.clone();
    // The template already wrote BOS and friends, unless the client says otherwise.
    let add_special_tokens = req.add_special_tokens.unwrap_or(false);
    let prompt_ids = blocking(move || {
        let text = template.render(&messages, &render)?;
        limits.check_prompt_bytes("messages", text.len())?;
        Ok(tokenizer.encode(&text, add_special_tokens)?)
    })
    .await?;
    if prompt_ids.is_empty() {
        return Err(ApiError::bad("messages", "the rendered prompt is empty"));
    }
    let requested = req.max_completion_tokens.or(req.common.max_tokens);
    params.max_tokens = openai::resolve_max_tokens(
        requested,
        params.min_tokens,
        prompt_ids.len(),
        state.max_model_len,
    )?;

    let id = new_id("chatcmpl");
    openai::log_end_user(&id, &req.common);
    let created = unix_now() as u64;
    let model = state.model_name().to_string();
    let n = options.n as usize;
    let prompt_len = prompt_ids.len();
    let stream = options.stream;
    let include_usage = options.include_usage;
    let deltas = generate::start_checked(
        &state,
        Generation {
            prompts: vec![prompt_ids],
            params: vec![params],
            options,
            request_id: id.clone(),
        },
    )
    .await?;

    if stream {
        let (id2, model2) = (id.clone(), model.clone());
        let prefix = (0..n)
            .map(|i| json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": model,
                            "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                         "logprobs": null, "finish_reason": null}]}))
            .collect();
        let mut parsers: Vec<_> = (0..n).map(|_| parsing.parser(tools.as_ref())).collect();
        let with_reasoning = parsing.reasoning.is_some();
        let chunk = move |d: generate::ChoiceDelta| {
            let parser = &mut parsers[d.index as usize];
            let mut part = parser.push(&d.text);
            let mut finish_reason = d.finish_reason;
            if finish_reason.is_some() {
                let rest = parser.finish();
                part.content.push_str(&rest.content);
                part.reasoning.push_str(&rest.reasoning);
                part.tool_calls.extend(rest.tool_calls);
                if parser.made_calls() && finish_reason == Some("stop") {
                    finish_reason = Some("tool_calls");
                }
            }
            sse_frame(&ChatChunk {
                id: &id,
                object: "chat.completion.chunk",
                created,
                model: &model,
                choices: [ChatChoice {
                    index: d.index,
                    delta: ChatDelta {
                        content: (!part.content.is_empty()).then_some(part.content.as_str()),
                        reasoning_content: (with_reasoning && !part.reasoning.is_empty())
                            .then_some(part.reasoning.as_str()),
                        tool_calls: part.tool_calls.iter().map(|c| c.to_json()).collect(),
                    },
                    logprobs: logprobs.map(|_| logprobs_json(&d.logprobs)),
                    finish_reason,
                    stop_reason: d.stop_reason.as_ref(),
                }],
            })
        };
        let usage_chunk = include_usage.then_some(move |completion: usize| {
            json!({"id": id2, "object": "chat.completion.chunk", "created": created, "model": model2,
                   "choices": [], "usage": usage(prompt_len, completion)})
        });
        return Ok(sse_response(prefix, deltas, chunk, usage_chunk));
    }

    let choices = generate::collect(deltas, n).await?;
    let completion: usize = choices.iter().map(|c| c.num_tokens).sum();
    // vLLM's extra, at the top level: every choice shares the one prompt.
    let prompt_logprobs_json = prompt_logprobs.map(|top| {
        choices
            .iter()
            .find_map(|c| c.prompt_logprobs.as_ref())
            .map_or(Json::Null, |p| {
                crate::structured::prompt_logprobs_json(p, top)
            })
    });
    let choices: Vec<Json> = choices
        .into_iter()
        .enumerate()
        .map(|(i, c)| {
            let mut parser = parsing.parser(tools.as_ref());
            let mut message = AssistantMessage::default();
            message.extend(parser.push(&c.text));
            message.extend(parser.finish());
            let finish_reason = match c.finish_reason {
                Some("stop") if parser.made_calls() => Some("tool_calls"),
                other => other,
            };
            json!({
                "index": i,
                "message": message.chat_json(parsing.reasoning.is_some()),
                "logprobs": if logprobs.is_some() { logprobs_json(&c.logprobs) } else { Json::Null },
                "finish_reason": finish_reason,
                "stop_reason": c.stop_reason,
            })
        })
        .collect();
    let mut body = json!({
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage(prompt_len, completion),
    });
    if let Some(value) = prompt_logprobs_json {
        body["prompt_logprobs"] = value;
    }
    Ok(JsonResponse(body).into_response())
}
