//! OpenAI / vLLM request bodies and their validation into engine sampling parameters.
//!
//! Every field a body carries is read or refused: the fields the types below do not read land in
//! their `other` map, which [`request_fields::check`] turns into a 400 naming the first one that is
//! unknown or set to a value voltllm cannot honour. Known fields with wrong types or out-of-range
//! values are a 400 naming the parameter. The same types describe the bodies in `/openapi.json`
//! (`ToSchema`), so the description cannot drift from what is parsed.

use serde::Deserialize;
use serde_json::{Map, Value as Json};
use utoipa::ToSchema;
use voltllm_protocol::{LogitBias, SamplingParams};

use crate::error::ApiError;
use crate::request_fields::{self, Route};
use crate::structured::StructuredFields;

/// Largest `n` accepted: each choice is an engine request.
pub const MAX_N: u32 = 128;
/// Largest number of top alternatives per token the engine returns.
pub const MAX_LOGPROBS: u32 = 20;

/// `stop`: one string or a list.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum StopField {
    One(String),
    Many(Vec<String>),
}

/// `stream_options`.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    /// Send a last chunk with the request's `usage`.
    #[serde(default, deserialize_with = "null_as_default")]
    #[schema(value_type = Option<bool>)]
    pub include_usage: bool,
    /// vLLM's usage in every chunk: only `false` (not supported).
    pub continuous_usage_stats: Option<bool>,
    /// OpenAI's random padding of stream events: only `false` (none is sent).
    pub include_obfuscation: Option<bool>,
}

/// Sampling fields shared by chat and completions. (The `structured.rs` fields and the unread
/// `other` ones sit beside this struct, not inside it: serde hands a flattened struct only the
/// fields it names when it has no flattened field of its own, which leaves `other` the rest.)
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct CommonParams {
    /// A served model name (`/v1/models`); any when omitted.
    pub model: Option<String>,
    /// At most this many generated tokens (at least 1; 0 only with `echo` on completions, which
    /// scores the prompt); the default fills the context window (16 on completions).
    #[schema(minimum = 0)]
    pub max_tokens: Option<i64>,
    /// 0 is greedy.
    #[schema(minimum = 0)]
    pub temperature: Option<f64>,
    #[schema(exclusive_minimum = 0, maximum = 1)]
    pub top_p: Option<f64>,
    /// -1 or 0: off.
    #[schema(minimum = -1)]
    pub top_k: Option<i64>,
    #[schema(minimum = 0, maximum = 1)]
    pub min_p: Option<f64>,
    #[schema(minimum = -2, maximum = 2)]
    pub presence_penalty: Option<f64>,
    #[schema(minimum = -2, maximum = 2)]
    pub frequency_penalty: Option<f64>,
    #[schema(exclusive_minimum = 0)]
    pub repetition_penalty: Option<f64>,
    pub seed: Option<i64>,
    /// Strings that end the output (not included unless `include_stop_str_in_output`).
    pub stop: Option<StopField>,
    /// Token ids that end the output.
    #[serde(default, deserialize_with = "null_as_default")]
    #[schema(value_type = Option<Vec<i64>>)]
    pub stop_token_ids: Vec<i64>,
    #[serde(default, deserialize_with = "null_as_default")]
    #[schema(value_type = Option<bool>)]
    pub ignore_eos: bool,
    #[schema(minimum = 0)]
    pub min_tokens: Option<i64>,
    /// Choices to generate.
    #[schema(minimum = 1, maximum = 128)]
    pub n: Option<i64>,
    /// Token id (as a string) to a bias in [-100, 100] added to its logit.
    pub logit_bias: Option<Map<String, Json>>,
    /// Answer with server-sent events.
    #[serde(default, deserialize_with = "null_as_default")]
    #[schema(value_type = Option<bool>)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    #[serde(default, deserialize_with = "null_as_default")]
    #[schema(value_type = Option<bool>)]
    pub include_stop_str_in_output: bool,
    /// Leave special tokens out of the text (default true).
    pub skip_special_tokens: Option<bool>,
    /// Lower runs first under `--scheduling-policy priority`.
    pub priority: Option<i64>,
    /// The end user the request is made for: written to the server's log with the request id.
    pub user: Option<String>,
    /// OpenAI's successor of `user`: logged the same way.
    pub safety_identifier: Option<String>,
    /// A hint for prompt-cache hits: the prefix cache matches prompts by their tokens, so any key
    /// gets the hits it asks for without being read.
    pub prompt_cache_key: Option<String>,
}

/// The schema of `messages` as [`normalize_messages`] accepts it (the field is parsed as JSON and
/// checked by hand, so `/openapi.json` puts this in place of the derived schema).
pub fn messages_schema() -> Json {
    serde_json::json!({
        "type": "array",
        "minItems": 1,
        "items": {
            "type": "object",
            "required": ["role"],
            "properties": {
                "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
                "content": {
                    "description": "Text, a list of text parts, or null on an assistant turn that made tool calls",
                    "oneOf": [
                        {"type": "string"},
                        {"type": "null"},
                        {"type": "array", "items": {
                            "type": "object", "required": ["type", "text"],
                            "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}
                    ]
                },
                "name": {"type": "string"},
                "tool_calls": {"type": "array", "items": {"type": "object"}},
                "tool_call_id": {"type": "string"}
            }
        }
    })
}

/// The schema of `prompt` as [`PromptField`] parses it (by hand, so `/openapi.json` puts this in
/// place of the derived schema).
pub fn prompt_schema() -> Json {
    let ids = serde_json::json!({"type": "array", "minItems": 1,
                                 "items": {"type": "integer", "minimum": 0}});
    serde_json::json!({
        "description": "Text, texts, token ids, or lists of token ids (one choice set each); \
                        none may be empty",
        "oneOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
            ids,
            {"type": "array", "minItems": 1, "items": ids}
        ]
    })
}

/// The schema of `logit_bias` as [`sampling_params`] checks it.
pub fn logit_bias_schema() -> Json {
    serde_json::json!({
        "type": ["object", "null"],
        "description": "Token id (as a string) to a bias in [-100, 100] added to its logit",
        "propertyNames": {"pattern": "^[0-9]+$"},
        "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}
    })
}

/// `POST /v1/chat/completions` body.
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct ChatRequest {
    /// The conversation, rendered with the model's chat template.
    #[schema(value_type = Vec<Object>)]
    pub messages: Vec<Json>,
    /// OpenAI's newer name of `max_tokens` (wins when both are set).
    #[schema(minimum = 1)]
    pub max_completion_tokens: Option<i64>,
    /// Return the sampled tokens' logprobs.
    #[serde(default, deserialize_with = "null_as_default")]
    #[schema(value_type = Option<bool>)]
    pub logprobs: bool,
    /// Alternatives per token (needs `logprobs`).
    #[schema(minimum = 0, maximum = 20)]
    pub top_logprobs: Option<i64>,
    /// Default: true unless `continue_final_message`.
    pub add_generation_prompt: Option<bool>,
    /// Continue the last (assistant) message instead of starting a new one.
    #[serde(default, deserialize_with = "null_as_default")]
    #[schema(value_type = Option<bool>)]
    pub continue_final_message: bool,
    /// Extra variables for the chat template (e.g. `enable_thinking`).
    pub chat_template_kwargs: Option<Map<String, Json>>,
    /// Tokenize the rendered prompt with the tokenizer's special tokens (default false: the
    /// template writes them).
    pub add_special_tokens: Option<bool>,
    /// Function tools (`{"type": "function", "function": {"name", "parameters", ...}}`).
    pub tools: Option<Vec<Json>>,
    /// `none`, `auto`, `required` or `{"type": "function", "function": {"name"}}`.
    pub tool_choice: Option<Json>,
    pub parallel_tool_calls: Option<bool>,
    #[serde(flatten)]
    pub common: CommonParams,
    #[serde(flatten)]
    pub structured: StructuredFields,
    /// The fields none of the above read (checked by [`request_fields::check`]); must come last.
    #[serde(flatten)]
    pub other: Map<String, Json>,
}

impl ChatRequest {
    /// Parses a body; an unknown field or one voltllm cannot honour is a 400 naming it.
    pub fn parse(body: &[u8]) -> Result<Self, ApiError> {
        let req: Self = parse_body(body).map_err(|e| name_flattened_field(e, body))?;
        request_fields::check(Route::Chat, &req.other)?;
        Ok(req)
    }
}

/// `prompt` of a completion: text, texts, token ids, or lists of token ids.
///
/// Deserialized by hand: `#[serde(untagged)]` would first copy the whole value into serde's
/// buffer, at ~32 bytes per token id, 16 times the size of a `1,` in the body. Here the first
/// element picks the shape and the rest is read straight into it.
#[derive(Debug, Clone)]
pub enum PromptField {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<i64>),
    TokenLists(Vec<Vec<i64>>),
}

/// The first element of a list `prompt`, which decides the list's shape.
enum PromptItem {
    Text(String),
    Token(i64),
    Tokens(Vec<i64>),
}

impl<'de> Deserialize<'de> for PromptItem {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = PromptItem;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a string, a token id or a list of token ids")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<PromptItem, E> {
                Ok(PromptItem::Text(v.to_string()))
            }
            fn visit_string<E: serde::de::Error>(self, v: String) -> Result<PromptItem, E> {
                Ok(PromptItem::Text(v))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<PromptItem, E> {
                Ok(PromptItem::Token(v))
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<PromptItem, E> {
                i64::try_from(v)
                    .map(PromptItem::Token)
                    .map_err(|_| E::custom("token id out of range"))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                seq: A,
            ) -> Result<PromptItem, A::Error> {
                Vec::<i64>::deserialize(serde::de::value::SeqAccessDeserializer::new(seq))
                    .map(PromptItem::Tokens)
            }
        }
        d.deserialize_any(V)
    }
}

impl<'de> Deserialize<'de> for PromptField {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = PromptField;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a string, a list of strings, a list of token ids or a list of lists")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<PromptField, E> {
                Ok(PromptField::Text(v.to_string()))
            }
            fn visit_string<E: serde::de::Error>(self, v: String) -> Result<PromptField, E> {
                Ok(PromptField::Text(v))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<PromptField, A::Error> {
                let rest = |n: usize| n.min(1 << 16);
                let hint = seq.size_hint().unwrap_or(0);
                Ok(match seq.next_element::<PromptItem>()? {
                    None => PromptField::Texts(Vec::new()),
                    Some(PromptItem::Text(first)) => {
                        let mut all = Vec::with_capacity(rest(hint));
                        all.push(first);
                        while let Some(t) = seq.next_element::<String>()? {
                            all.push(t);
                        }
                        PromptField::Texts(all)
                    }
                    Some(PromptItem::Token(first)) => {
                        let mut all = Vec::with_capacity(rest(hint));
                        all.push(first);
                        while let Some(t) = seq.next_element::<i64>()? {
                            all.push(t);
                        }
                        PromptField::Tokens(all)
                    }
                    Some(PromptItem::Tokens(first)) => {
                        let mut all = Vec::with_capacity(rest(hint));
                        all.push(first);
                        while let Some(t) = seq.next_element::<Vec<i64>>()? {
                            all.push(t);
                        }
                        PromptField::TokenLists(all)
                    }
                })
            }
        }
        d.deserialize_any(V)
    }
}

/// `POST /v1/completions` body.
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct CompletionRequest {
    #[schema(value_type = Value)]
    pub prompt: PromptField,
    /// Alternatives per token to return (the sampled token's logprob comes with them).
    #[schema(minimum = 0, maximum = 20)]
    pub logprobs: Option<i64>,
    /// Put the prompt before the completion (with `logprobs`: the prompt's logprobs too).
    #[serde(default, deserialize_with = "null_as_default")]
    #[schema(value_type = Option<bool>)]
    pub echo: bool,
    /// Tokenize a text prompt with the tokenizer's special tokens (BOS; default true).
    pub add_special_tokens: Option<bool>,
    #[serde(flatten)]
    pub common: CommonParams,
    #[serde(flatten)]
    pub structured: StructuredFields,
    /// The fields none of the above read (checked by [`request_fields::check`]); must come last.
    #[serde(flatten)]
    pub other: Map<String, Json>,
}

impl CompletionRequest {
    /// Parses a body; an unknown field or one voltllm cannot honour is a 400 naming it.
    pub fn parse(body: &[u8]) -> Result<Self, ApiError> {
        let req: Self = parse_body(body).map_err(|e| name_flattened_field(e, body))?;
        request_fields::check(Route::Completions, &req.other)?;
        Ok(req)
    }
}

/// Bodies up to this size are parsed a second time to name a flattened field at fault.
const NAME_FIELD_MAX_BODY: usize = 1 << 20;

/// Names the field of a parse error that serde could not place: a field of a flattened struct
/// (`CommonParams`, `StructuredFields`) is read from a buffer that keeps no path. Each top-level
/// field of the body is parsed alone into those (all-optional) structs; the first that fails is
/// the one at fault. Only on the error path, and only for bodies up to 1 MiB.
fn name_flattened_field(error: ApiError, body: &[u8]) -> ApiError {
    let unplaced = matches!(&error, ApiError::BadRequest { param: None, .. });
    if !unplaced || body.len() > NAME_FIELD_MAX_BODY {
        return error;
    }
    let Ok(Json::Object(fields)) = serde_json::from_slice::<Json>(body) else {
        return error;
    };
    for (name, value) in fields {
        let alone = Json::Object(Map::from_iter([(name, value)]));
        let failure = serde_path_to_error::deserialize::<_, CommonParams>(alone.clone())
            .err()
            .or_else(|| serde_path_to_error::deserialize::<_, StructuredFields>(alone).err());
        if let Some(e) = failure {
            let path = e.path().to_string();
            return ApiError::bad(
                &path,
                format!("invalid request body: {path}: {}", e.inner()),
            );
        }
    }
    error
}

/// Writes the end user a request is made for (`user`, `safety_identifier`) to the log, with the
/// request id, as those fields ask.
pub fn log_end_user(request_id: &str, common: &CommonParams) {
    if common.user.is_some() || common.safety_identifier.is_some() {
        tracing::info!(
            request_id,
            user = common.user.as_deref(),
            safety_identifier = common.safety_identifier.as_deref(),
            "request for an end user"
        );
    }
}

/// What the generation pipeline needs beyond the engine's sampling parameters.
#[derive(Debug, Clone)]
pub struct OutputOptions {
    pub n: u32,
    pub stop: Vec<String>,
    pub include_stop_str_in_output: bool,
    pub skip_special_tokens: bool,
    /// Top alternatives per token to report; `None` when logprobs were not asked for.
    pub logprobs: Option<u32>,
    pub stream: bool,
    pub include_usage: bool,
    /// Scheduling priority sent to the engine (lower runs first under the priority policy).
    pub priority: i64,
}

/// `null` read as the type's default, as OpenAI's and vLLM's optional fields read it.
fn null_as_default<'de, D, T>(deserializer: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(deserializer)?.unwrap_or_default())
}

/// Parses a JSON body, turning every serde failure into a 400 that names the field at fault
/// (`param`, e.g. `stream_options.include_usage` or `messages[2]`) when there is one.
pub fn parse_body<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let bad = |path: Option<String>, e: serde_json::Error| {
        let at = path.as_deref().map_or(String::new(), |p| format!("{p}: "));
        ApiError::BadRequest {
            message: format!("invalid request body: {at}{e}"),
            param: path,
        }
    };
    let mut deserializer = serde_json::Deserializer::from_slice(body);
    let value = serde_path_to_error::deserialize(&mut deserializer).map_err(|e| {
        let path = e.path().to_string();
        bad((path != ".").then_some(path), e.into_inner())
    })?;
    deserializer.end().map_err(|e| bad(None, e))?;
    Ok(value)
}

fn check_range(param: &str, value: f64, lo: f64, hi: f64) -> Result<(), ApiError> {
    if !(lo..=hi).contains(&value) {
        return Err(ApiError::bad(
            param,
            format!("{param} must be in [{lo}, {hi}], got {value}"),
        ));
    }
    Ok(())
}

fn token_id(param: &str, id: i64, vocab_size: u32) -> Result<u32, ApiError> {
    if id < 0 || id >= vocab_size as i64 {
        return Err(ApiError::bad(
            param,
            format!("token id {id} is out of range [0, {vocab_size})"),
        ));
    }
    Ok(id as u32)
}

/// Token ids of a prompt given as ids, checked against the vocabulary.
pub fn prompt_ids(ids: &[i64], vocab_size: u32) -> Result<Vec<u32>, ApiError> {
    if ids.is_empty() {
        return Err(ApiError::bad("prompt", "prompt must not be empty"));
    }
    ids.iter()
        .map(|&id| token_id("prompt", id, vocab_size))
        .collect()
}

/// Checks the shared fields and builds the engine's sampling parameters (without `max_tokens`,
/// which depends on the prompt length and is settled by [`resolve_max_tokens`]).
pub fn sampling_params(
    common: &CommonParams,
    structured: &StructuredFields,
    logprobs: Option<u32>,
    vocab_size: u32,
) -> Result<(SamplingParams, OutputOptions), ApiError> {
    let mut p = SamplingParams::default();
    if let Some(t) = common.temperature {
        if !(t >= 0.0 && t.is_finite()) {
            return Err(ApiError::bad(
                "temperature",
                format!("temperature must be >= 0, got {t}"),
            ));
        }
        p.temperature = t;
    }
    if let Some(v) = common.top_p {
        if !(v > 0.0 && v <= 1.0) {
            return Err(ApiError::bad(
                "top_p",
                format!("top_p must be in (0, 1], got {v}"),
            ));
        }
        p.top_p = v;
    }
    if let Some(k) = common.top_k {
        if k < -1 {
            return Err(ApiError::bad(
                "top_k",
                format!("top_k must be -1, 0 (off) or >= 1, got {k}"),
            ));
        }
        p.top_k = k.max(0);
    }
    if let Some(v) = common.min_p {
        check_range("min_p", v, 0.0, 1.0)?;
        p.min_p = v;
    }
    if let Some(v) = common.presence_penalty {
        check_range("presence_penalty", v, -2.0, 2.0)?;
        p.presence_penalty = v;
    }
    if let Some(v) = common.frequency_penalty {
        check_range("frequency_penalty", v, -2.0, 2.0)?;
        p.frequency_penalty = v;
    }
    if let Some(v) = common.repetition_penalty {
        if !(v > 0.0 && v.is_finite()) {
            return Err(ApiError::bad(
                "repetition_penalty",
                format!("repetition_penalty must be > 0, got {v}"),
            ));
        }
        p.repetition_penalty = v;
    }
    p.seed = common.seed;
    p.ignore_eos = common.ignore_eos;
    p.stop_token_ids = common
        .stop_token_ids
        .iter()
        .map(|&id| token_id("stop_token_ids", id, vocab_size))
        .collect::<Result<_, _>>()?;
    if let Some(m) = common.min_tokens {
        if m < 0 {
            return Err(ApiError::bad(
                "min_tokens",
                format!("min_tokens must be >= 0, got {m}"),
            ));
        }
        p.min_tokens = m.min(u32::MAX as i64) as u32;
    }
    if let Some(bias) = &common.logit_bias {
        let mut entries = Vec::with_capacity(bias.len());
        for (key, value) in bias {
            let id: i64 = key.parse().map_err(|_| {
                ApiError::bad(
                    "logit_bias",
                    format!("logit_bias key {key:?} is not a token id"),
                )
            })?;
            let id = token_id("logit_bias", id, vocab_size)?;
            let b = value.as_f64().ok_or_else(|| {
                ApiError::bad("logit_bias", format!("logit_bias[{key}] is not a number"))
            })?;
            check_range("logit_bias", b, -100.0, 100.0)?;
            entries.push((id, b));
        }
        p.logit_bias = Some(LogitBias(entries));
    }
    if let Some(n) = logprobs {
        if n > MAX_LOGPROBS {
            return Err(ApiError::bad(
                "logprobs",
                format!("at most {MAX_LOGPROBS} logprobs per token, got {n}"),
            ));
        }
    }
    p.logprobs = logprobs;
    crate::structured::apply(structured, &mut p)?;
    let n = common.n.unwrap_or(1);
    if !(1..=MAX_N as i64).contains(&n) {
        return Err(ApiError::bad(
            "n",
            format!("n must be in [1, {MAX_N}], got {n}"),
        ));
    }
    let stop = match &common.stop {
        None => Vec::new(),
        Some(StopField::One(s)) => vec![s.clone()],
        Some(StopField::Many(v)) => v.clone(),
    };
    if stop.iter().any(String::is_empty) {
        return Err(ApiError::bad("stop", "stop strings must not be empty"));
    }
    if let Some(o) = &common.stream_options {
        if o.continuous_usage_stats == Some(true) {
            return Err(ApiError::bad(
                "stream_options.continuous_usage_stats",
                "stream_options.continuous_usage_stats is not supported: use include_usage",
            ));
        }
        if o.include_obfuscation == Some(true) {
            return Err(ApiError::bad(
                "stream_options.include_obfuscation",
                "stream_options.include_obfuscation is not supported: events are sent unpadded",
            ));
        }
    }
    let options = OutputOptions {
        n: n as u32,
        stop,
        include_stop_str_in_output: common.include_stop_str_in_output,
        skip_special_tokens: common.skip_special_tokens.unwrap_or(true),
        logprobs,
        stream: common.stream,
        include_usage: common
            .stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage),
        priority: common.priority.unwrap_or(0),
    };
    Ok((p, options))
}

/// Settles `max_tokens` against the context window: the default fills it; a prompt that leaves
/// no room, or a request that would overflow it, is a 400 with the counts in the message.
pub fn resolve_max_tokens(
    requested: Option<i64>,
    min_tokens: u32,
    prompt_len: usize,
    max_model_len: u32,
) -> Result<u32, ApiError> {
    let max_model_len = max_model_len as usize;
    if prompt_len >= max_model_len {
        return Err(ApiError::bad(
            "messages",
            format!(
                "This model's maximum context length is {max_model_len} tokens. However, your \
                 prompt has {prompt_len} tokens, which leaves no room for a completion."
            ),
        ));
    }
    let room = max_model_len - prompt_len;
    let max_tokens = match requested {
        None => room,
        Some(m) if m < 1 => {
            return Err(ApiError::bad(
                "max_tokens",
                format!("max_tokens must be >= 1, got {m}"),
            ))
        }
        Some(m) if m as u128 > room as u128 => {
            return Err(ApiError::bad(
                "max_tokens",
                format!(
                    "This model's maximum context length is {max_model_len} tokens. However, you \
                     requested {} tokens ({prompt_len} in the prompt, {m} in the completion).",
                    prompt_len as i64 + m
                ),
            ))
        }
        Some(m) => m as usize,
    };
    let max_tokens = max_tokens as u32;
    if min_tokens > max_tokens {
        return Err(ApiError::bad(
            "min_tokens",
            format!("min_tokens ({min_tokens}) must not exceed max_tokens ({max_tokens})"),
        ));
    }
    Ok(max_tokens)
}

/// Chat messages as the template expects them: roles checked, text-part lists joined into one
/// string (what vLLM does for "string" content templates), other part types rejected.
pub fn normalize_messages(messages: &[Json]) -> Result<Vec<Json>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::bad("messages", "messages must not be empty"));
    }
    let mut out = Vec::with_capacity(messages.len());
    for (i, message) in messages.iter().enumerate() {
        let Some(obj) = message.as_object() else {
            return Err(ApiError::bad(
                "messages",
                format!("messages[{i}] is not an object"),
            ));
        };
        let role = obj.get("role").and_then(Json::as_str).unwrap_or("");
        if !matches!(role, "system" | "developer" | "user" | "assistant" | "tool") {
            return Err(ApiError::bad(
                "messages",
                format!("messages[{i}].role must be system, developer, user, assistant or tool, got {role:?}"),
            ));
        }
        let mut obj = obj.clone();
        normalize_tool_fields(i, &mut obj)?;
        match obj.get("content") {
            // A turn that only made tool calls has no content: templates that concatenate
            // `message.content` need a string (vLLM renders it as "").
            None | Some(Json::Null) => {
                obj.insert("content".into(), Json::String(String::new()));
            }
            Some(Json::String(_)) => {}
            Some(Json::Array(parts)) => {
                let mut texts = Vec::with_capacity(parts.len());
                for part in parts {
                    match (part.get("type").and_then(Json::as_str), part.get("text").and_then(Json::as_str)) {
                        (Some("text"), Some(text)) => texts.push(text.to_string()),
                        (kind, _) => {
                            return Err(ApiError::bad(
                                "messages",
                                format!("messages[{i}]: content part type {kind:?} is not supported (text only)"),
                            ))
                        }
                    }
                }
                obj.insert("content".into(), Json::String(texts.join("\n")));
            }
            Some(_) => {
                return Err(ApiError::bad(
                    "messages",
                    format!("messages[{i}].content must be a string or a list of text parts"),
                ))
            }
        }
        out.push(Json::Object(obj));
    }
    Ok(out)
}

/// An assistant turn's `tool_calls` arguments arrive as JSON text (OpenAI's wire form) but
/// templates print them with `tojson`, so they are parsed into objects (as vLLM does); a tool
/// result's `tool_call_id` must be a string.
fn normalize_tool_fields(
    i: usize,
    obj: &mut serde_json::Map<String, Json>,
) -> Result<(), ApiError> {
    if let Some(id) = obj.get("tool_call_id") {
        if !id.is_string() {
            return Err(ApiError::bad(
                "messages",
                format!("messages[{i}].tool_call_id must be a string"),
            ));
        }
    }
    let Some(calls) = obj.get_mut("tool_calls") else {
        return Ok(());
    };
    let Some(calls) = calls.as_array_mut() else {
        return Err(ApiError::bad(
            "messages",
            format!("messages[{i}].tool_calls must be a list"),
        ));
    };
    for (k, call) in calls.iter_mut().enumerate() {
        let Some(function) = call.get_mut("function").and_then(Json::as_object_mut) else {
            return Err(ApiError::bad(
                "messages",
                format!("messages[{i}].tool_calls[{k}].function must be an object"),
            ));
        };
        if let Some(Json::String(text)) = function.get("arguments") {
            let parsed: Json = serde_json::from_str(text).map_err(|e| {
                ApiError::bad(
                    "messages",
                    format!("messages[{i}].tool_calls[{k}].function.arguments is not JSON: {e}"),
                )
            })?;
            function.insert("arguments".into(), parsed);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn common(v: Json) -> CommonParams {
        serde_json::from_value(v).unwrap()
    }

    fn params(v: Json) -> Result<(SamplingParams, OutputOptions), ApiError> {
        sampling_params(&common(v), &StructuredFields::default(), None, 100)
    }

    #[test]
    fn ranges_are_enforced_with_the_parameter_named() {
        for (body, param) in [
            (json!({"temperature": -0.5}), "temperature"),
            (json!({"top_p": 0.0}), "top_p"),
            (json!({"top_k": -2}), "top_k"),
            (json!({"min_p": 1.5}), "min_p"),
            (json!({"presence_penalty": 3.0}), "presence_penalty"),
            (json!({"repetition_penalty": 0.0}), "repetition_penalty"),
            (json!({"n": 0}), "n"),
            (json!({"stop_token_ids": [100]}), "stop_token_ids"),
            (json!({"logit_bias": {"5": 101}}), "logit_bias"),
            (json!({"logit_bias": {"x": 1}}), "logit_bias"),
            (json!({"stop": ["a", ""]}), "stop"),
        ] {
            let err = params(body.clone()).unwrap_err();
            assert_eq!(err.body()["error"]["param"], param, "{body}");
        }
        let err = sampling_params(
            &common(json!({})),
            &StructuredFields::default(),
            Some(21),
            100,
        )
        .unwrap_err();
        assert_eq!(err.body()["error"]["param"], "logprobs");
    }

    #[test]
    fn valid_values_reach_the_engine_params() {
        let c = common(
            json!({"temperature": 0, "top_k": -1, "seed": -7, "stop": "x",
                              "logit_bias": {"3": -100, "1": 2.5}, "n": 3}),
        );
        let (p, o) = sampling_params(&c, &StructuredFields::default(), Some(2), 100).unwrap();
        assert_eq!(p.temperature, 0.0);
        assert_eq!(p.top_k, 0);
        assert_eq!(p.seed, Some(-7));
        assert_eq!(p.logprobs, Some(2));
        assert_eq!(p.logit_bias, Some(LogitBias(vec![(3, -100.0), (1, 2.5)])));
        assert_eq!(o.n, 3);
        assert_eq!(o.stop, vec!["x".to_string()]);
    }

    #[test]
    fn every_field_is_read_or_refused() {
        let body = json!({"messages": [{"role": "user", "content": "hi"}], "temperature": 0.5,
                          "guided_regex": "a+", "logprobs": true, "user": "u-1", "store": false});
        let req = ChatRequest::parse(body.to_string().as_bytes()).unwrap();
        // Each flattened struct took its own fields; only the unread one reached `other`.
        assert_eq!(req.common.temperature, Some(0.5));
        assert_eq!(req.structured.guided_regex, Some(json!("a+")));
        assert_eq!(req.common.user.as_deref(), Some("u-1"));
        assert_eq!(req.other.keys().collect::<Vec<_>>(), ["store"]);
        let err = ChatRequest::parse(br#"{"messages": [], "temprature": 1}"#).unwrap_err();
        assert_eq!(err.body()["error"]["param"], "temprature");
        let err = CompletionRequest::parse(br#"{"prompt": "x", "max_completion_tokens": 3}"#)
            .unwrap_err();
        assert_eq!(err.body()["error"]["param"], "max_completion_tokens");
        let req = CompletionRequest::parse(br#"{"prompt": [1, 2], "echo": true, "suffix": null}"#)
            .unwrap();
        assert!(req.echo && req.other.len() == 1);
        let err = CompletionRequest::parse(br#"{"prompt": "x", "stream_options": {"a": 1}}"#)
            .unwrap_err();
        assert!(err.to_string().contains("unknown field `a`"), "{err}");
        let err = params(json!({"stream_options": {"continuous_usage_stats": true}})).unwrap_err();
        assert_eq!(
            err.body()["error"]["param"],
            "stream_options.continuous_usage_stats"
        );
    }

    #[test]
    fn a_body_that_does_not_parse_names_the_field_and_null_is_the_default() {
        let err = ChatRequest::parse(br#"{"messages": [], "temperature": "hot"}"#).unwrap_err();
        assert_eq!(err.body()["error"]["param"], "temperature", "{err}");
        let err =
            ChatRequest::parse(br#"{"messages": [], "stream_options": {"include_usage": 3}}"#)
                .unwrap_err();
        assert_eq!(
            err.body()["error"]["param"],
            "stream_options.include_usage",
            "{err}"
        );
        let err = CompletionRequest::parse(br#"{"prompt": [1, "a"]}"#).unwrap_err();
        assert!(err.to_string().contains("prompt"), "{err}");
        assert!(ChatRequest::parse(br#"{"messages": []} x"#).is_err());
        let req = ChatRequest::parse(
            br#"{"messages": [], "stream": null, "logprobs": null, "stop_token_ids": null}"#,
        )
        .unwrap();
        assert!(!req.common.stream && !req.logprobs && req.common.stop_token_ids.is_empty());
    }

    #[test]
    fn max_tokens_against_the_context_window() {
        assert_eq!(resolve_max_tokens(None, 0, 10, 100).unwrap(), 90);
        assert_eq!(resolve_max_tokens(Some(90), 0, 10, 100).unwrap(), 90);
        let err = resolve_max_tokens(Some(91), 0, 10, 100).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("100") && msg.contains("101") && msg.contains("10 in the prompt"),
            "{msg}"
        );
        let err = resolve_max_tokens(None, 0, 100, 100).unwrap_err();
        assert!(err.to_string().contains("prompt has 100 tokens"));
        assert!(resolve_max_tokens(Some(0), 0, 1, 100).is_err());
        assert!(resolve_max_tokens(Some(5), 6, 1, 100).is_err());
    }

    #[test]
    fn messages_are_normalized() {
        let m = normalize_messages(&[json!({"role": "user", "content": [
            {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]})])
        .unwrap();
        assert_eq!(m[0]["content"], "a\nb");
        assert!(normalize_messages(&[json!({"role": "wizard", "content": "x"})]).is_err());
        assert!(
            normalize_messages(&[json!({"role": "user", "content": [{"type": "image_url"}]})])
                .is_err()
        );
        assert!(normalize_messages(&[]).is_err());
    }

    #[test]
    fn tool_turns_are_normalized() {
        let m = normalize_messages(&[
            json!({"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
                   "function": {"name": "f", "arguments": "{\"a\": [1, 2]}"}}]}),
            json!({"role": "tool", "tool_call_id": "call_1", "content": "3"}),
        ])
        .unwrap();
        assert_eq!(m[0]["content"], "");
        assert_eq!(
            m[0]["tool_calls"][0]["function"]["arguments"],
            json!({"a": [1, 2]})
        );
        assert_eq!(m[1]["tool_call_id"], "call_1");
        let bad = json!({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]});
        assert!(normalize_messages(&[bad]).is_err());
        assert!(
            normalize_messages(&[json!({"role": "tool", "tool_call_id": 5, "content": "x"})])
                .is_err()
        );
    }

    #[test]
    fn prompt_shapes() {
        let p: PromptField = serde_json::from_value(json!("hi")).unwrap();
        assert!(matches!(p, PromptField::Text(_)));
        let p: PromptField = serde_json::from_value(json!(["a", "b"])).unwrap();
        assert!(matches!(p, PromptField::Texts(v) if v.len() == 2));
        let p: PromptField = serde_json::from_value(json!([1, 2])).unwrap();
        assert!(matches!(p, PromptField::Tokens(v) if v == vec![1, 2]));
        let p: PromptField = serde_json::from_value(json!([[1], [2, 3]])).unwrap();
        assert!(matches!(p, PromptField::TokenLists(v) if v.len() == 2));
        let p: PromptField = serde_json::from_str("[]").unwrap();
        assert!(matches!(p, PromptField::Texts(v) if v.is_empty()));
        for mixed in [
            json!([1, "a"]),
            json!(["a", 1]),
            json!([[1], 2]),
            json!({"a": 1}),
            json!(3),
        ] {
            assert!(serde_json::from_value::<PromptField>(mixed).is_err());
        }
        assert!(prompt_ids(&[5, 200], 100).is_err());
        assert!(prompt_ids(&[], 100).is_err());
    }
}
