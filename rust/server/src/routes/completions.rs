//! `POST /v1/completions`.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::response::{IntoResponse, Response};
use axum::Json as JsonResponse;
use futures::StreamExt;
use serde::Serialize;
use serde_json::{json, Map, Value as Json};

use super::{blocking, body_bytes, new_id, sse_frame, sse_response, usage, SharedState};
use crate::error::ApiError;
use crate::generate::{self, unix_now, Generation, PromptLogprobs, TokenLogprob};
use crate::openai::{self, CompletionRequest, PromptField};
use crate::structured;

/// A streamed completions chunk, serialized without building a JSON tree.
#[derive(Serialize)]
struct TextChunk<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: [TextChoice<'a>; 1],
}

#[derive(Serialize)]
struct TextChoice<'a> {
    index: u32,
    text: &'a str,
    logprobs: Option<Json>,
    finish_reason: Option<&'static str>,
    stop_reason: Option<&'a Json>,
    #[serde(skip_serializing_if = "Option::is_none")]
    prompt_logprobs: Option<Json>,
}

/// Legacy completions `logprobs` object; `offset` is where this piece of text starts. With `echo`,
/// the prompt's entries come first (`prompt`: the first token's logprob and alternatives are
/// `null`, as OpenAI's legacy API has them; `top` alternatives per position), offsets from 0.
fn logprobs_json(
    prompt: Option<(&PromptLogprobs, u32)>,
    logprobs: &[TokenLogprob],
    mut offset: usize,
) -> Json {
    let mut tokens = Vec::with_capacity(logprobs.len());
    let mut token_logprobs = Vec::with_capacity(logprobs.len());
    let mut top = Vec::with_capacity(logprobs.len());
    let mut offsets = Vec::with_capacity(logprobs.len());
    if let Some((prompt, n)) = prompt {
        let mut prompt_offset = 0;
        tokens.push(json!(prompt.first_token));
        token_logprobs.push(Json::Null);
        top.push(Json::Null);
        offsets.push(json!(0));
        prompt_offset += prompt.first_token.len();
        for candidates in &prompt.positions {
            let Some(own) = candidates.first() else {
                continue;
            };
            tokens.push(json!(own.token));
            token_logprobs.push(json!(own.logprob));
            let mut alternatives = Map::new();
            for c in candidates.iter().skip(1).take(n as usize) {
                alternatives.insert(c.token.clone(), json!(c.logprob));
            }
            top.push(Json::Object(alternatives));
            offsets.push(json!(prompt_offset));
            prompt_offset += own.token.len();
        }
    }
    for lp in logprobs {
        tokens.push(json!(lp.token));
        token_logprobs.push(json!(lp.logprob));
        let mut alternatives = Map::new();
        for (t, l) in &lp.top {
            alternatives.insert(t.clone(), json!(l));
        }
        top.push(Json::Object(alternatives));
        offsets.push(json!(offset));
        offset += lp.token.len();
    }
    json!({"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets})
}

/// Handler.
pub async fn completions(
    state: SharedState,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let state = state.0;
    let body = body_bytes(&state, body)?;
    let req = CompletionRequest::parse(&body)?;
    state.check_model(req.common.model.as_deref())?;
    let logprobs = match req.logprobs {
        Some(n) if n < 0 => {
            return Err(ApiError::bad(
                "logprobs",
                format!("logprobs must be >= 0, got {n}"),
            ))
        }
        Some(n) => Some(n.min(u32::MAX as i64) as u32),
        None => None,
    };
    let (mut base_params, options) =
        openai::sampling_params(&req.common, &req.structured, logprobs, state.vocab_size)?;
    let echo_logprobs = if req.echo { logprobs } else { None };
    let vllm_prompt_logprobs = base_params.prompt_logprobs;
    // `echo` with `logprobs`: the prompt's logprobs lead the legacy logprobs object.
    if let Some(n) = echo_logprobs {
        base_params.prompt_logprobs = Some(n.max(vllm_prompt_logprobs.unwrap_or(0)));
    }
    let requested_max_tokens = req.common.max_tokens.unwrap_or(16);
    // `max_tokens: 0` with `echo` scores the prompt alone: the engine samples one token (it always
    // does), which the response leaves out.
    let score_only = req.echo && requested_max_tokens == 0;

    let vocab = state.vocab_size;
    let tokenizer = state.tokenizer.clone();
    let echo = req.echo;
    let add_special_tokens = req.add_special_tokens.unwrap_or(true);
    let limits = state.clone();
    // (token ids, echo text) per prompt; tokenization and decoding run off the async workers.
    let prompts: Vec<(Vec<u32>, String)> = blocking(move || {
        let prompts: Vec<(Vec<u32>, Option<String>)> = match req.prompt {
            PromptField::Text(t) => {
                limits.check_prompt_bytes("prompt", t.len())?;
                vec![(tokenizer.encode(&t, add_special_tokens)?, Some(t))]
            }
            PromptField::Texts(ts) => ts
                .into_iter()
                .map(|t| {
                    limits.check_prompt_bytes("prompt", t.len())?;
                    Ok((tokenizer.encode(&t, add_special_tokens)?, Some(t)))
                })
                .collect::<Result<_, ApiError>>()?,
            PromptField::Tokens(ids) => {
                limits.check_prompt_tokens("prompt", ids.len())?;
                vec![(openai::prompt_ids(&ids, vocab)?, None)]
            }
            PromptField::TokenLists(lists) => lists
                .iter()
                .map(|ids| {
                    limits.check_prompt_tokens("prompt", ids.len())?;
                    Ok((openai::prompt_ids(ids, vocab)?, None))
                })
                .collect::<Result<_, ApiError>>()?,
        };
        prompts
            .into_iter()
            .map(|(ids, text)| {
                if ids.is_empty() {
                    return Err(ApiError::bad("prompt", "prompt must not be empty"));
                }
                let echo_text = match (echo, text) {
                    (false, _) => String::new(),
                    (true, Some(t)) => t,
                    (true, None) => tokenizer.decode(&ids, false)?,
                };
                Ok((ids, echo_text))
            })
            .collect()
    })
    .await?;
    if prompts.is_empty() {
        return Err(ApiError::bad("prompt", "prompt must not be empty"));
    }
    let mut params = Vec::with_capacity(prompts.len());
    for (ids, _) in &prompts {
        let mut p = base_params.clone();
        p.max_tokens = openai::resolve_max_tokens(
            Some(if score_only { 1 } else { requested_max_tokens }),
            p.min_tokens,
            ids.len(),
            state.max_model_len,
        )?;
        params.push(p);
    }

    let id = new_id("cmpl");
    openai::log_end_user(&id, &req.common);
    let created = unix_now() as u64;
    let model = state.model_name().to_string();
    let n = options.n as usize;
    let prompt_tokens: usize = prompts.iter().map(|(ids, _)| ids.len()).sum();
    let stream = options.stream;
    let include_usage = options.include_usage;
    // Echo text of every choice (choice i*n+j belongs to prompt i).
    let echoes: Vec<String> = prompts
        .iter()
        .flat_map(|(_, e)| (0..n).map(move |_| e.clone()))
        .collect();
    let (prompt_ids, _): (Vec<Vec<u32>>, Vec<String>) = prompts.into_iter().unzip();
    let num_choices = prompt_ids.len() * n;
    let deltas = generate::start_checked(
        &state,
        Generation {
            prompts: prompt_ids,
            params,
            options,
            request_id: id.clone(),
        },
    )
    .await?;
    let deltas = if score_only {
        deltas.map(|d| d.map(drop_generated)).boxed()
    } else {
        deltas
    };

    let (chunk_id, chunk_model) = (id.clone(), model.clone());
    let head = move |choices: Json| json!({"id": id, "object": "text_completion", "created": created, "model": model, "choices": choices});
    if stream {
        let prefix = echoes
            .iter()
            .enumerate()
            .filter(|(_, e)| !e.is_empty())
            .map(|(i, e)| {
                head(json!([{"index": i, "text": e, "logprobs": null, "finish_reason": null}]))
            })
            .collect();
        let mut offsets: Vec<usize> = echoes.iter().map(String::len).collect();
        let chunk = move |d: generate::ChoiceDelta| {
            let i = d.index as usize;
            let prompt = d.prompt_logprobs.as_ref();
            let lp = logprobs.map(|_| {
                let echoed = echo_logprobs.and_then(|n| prompt.map(|p| (p, n)));
                logprobs_json(echoed, &d.logprobs, offsets[i])
            });
            offsets[i] += d.text.len();
            sse_frame(&TextChunk {
                id: &chunk_id,
                object: "text_completion",
                created,
                model: &chunk_model,
                choices: [TextChoice {
                    index: d.index,
                    text: &d.text,
                    logprobs: lp,
                    finish_reason: d.finish_reason,
                    stop_reason: d.stop_reason.as_ref(),
                    prompt_logprobs: vllm_prompt_logprobs
                        .and_then(|n| prompt.map(|p| structured::prompt_logprobs_json(p, n))),
                }],
            })
        };
        let usage_chunk = include_usage.then_some(move |completion: usize| {
            let mut v = head(json!([]));
            v["usage"] = usage(prompt_tokens, completion);
            v
        });
        return Ok(sse_response(prefix, deltas, chunk, usage_chunk));
    }

    let choices = generate::collect(deltas, num_choices).await?;
    let completion: usize = choices.iter().map(|c| c.num_tokens).sum();
    let choices: Vec<Json> = choices
        .into_iter()
        .zip(echoes)
        .enumerate()
        .map(|(i, (c, echo))| {
            let prompt = c.prompt_logprobs.as_ref();
            let echoed = echo_logprobs.and_then(|n| prompt.map(|p| (p, n)));
            let mut choice = json!({
                "index": i,
                "text": format!("{echo}{}", c.text),
                "logprobs": logprobs.map(|_| logprobs_json(echoed, &c.logprobs, echo.len())),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            });
            if let Some(n) = vllm_prompt_logprobs {
                choice["prompt_logprobs"] =
                    prompt.map_or(Json::Null, |p| structured::prompt_logprobs_json(p, n));
            }
            choice
        })
        .collect();
    let mut body = head(Json::Array(choices));
    body["usage"] = usage(prompt_tokens, completion);
    Ok(JsonResponse(body).into_response())
}

/// A delta of a score-only request (`echo`, `max_tokens: 0`) without the one token the engine
/// sampled: no text, no logprobs, no completion tokens, and `length` as the reason it ended.
fn drop_generated(mut d: generate::ChoiceDelta) -> generate::ChoiceDelta {
    d.text.clear();
    d.logprobs.clear();
    d.num_tokens = 0;
    if d.finish_reason.is_some() {
        d.finish_reason = Some("length");
        d.stop_reason = None;
    }
    d
}
