//! Wire types between the voltllm front end and EngineCore processes.
//!
//! `docs/protocol.md` is the specification; `python/voltllm/protocol.py` is the Python half.
//! Every message is two ZeroMQ frames, `[type: 1 byte][payload: msgpack]`.
//!
//! Encoding invariants (checked byte for byte against the golden vectors in
//! `tests/protocol/golden/`):
//! - hot messages ([`EngineCoreRequest`], [`EngineCoreOutputs`], [`EngineCoreOutput`], [`Logprob`])
//!   are msgpack arrays, which is rmp-serde's default for derived structs;
//! - every other message is a msgpack map written with all fields in declaration order (their
//!   `Serialize` impls go through [`map_struct!`] because rmp-serde can only switch struct-as-map
//!   for a whole serializer, not per type); decoders ignore unknown keys and default missing ones;
//! - integers take their smallest encoding and floats are always float64 (rmp-serde does both).

use serde::de::DeserializeOwned;
use serde::ser::SerializeMap;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

pub use rmpv::Value;

/// Failure to encode or decode one message.
#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    /// The multipart message did not have exactly `[type, payload]` frames.
    #[error("expected [type, payload] frames, got {0} frame(s)")]
    FrameCount(usize),
    /// The type frame was not exactly one byte long.
    #[error("type frame must be 1 byte, got {0} bytes")]
    TypeFrameLength(usize),
    /// The type byte names no known message.
    #[error("unknown message type 0x{0:02x}")]
    UnknownType(u8),
    /// The payload did not decode as the type the type byte announced.
    #[error("malformed {kind:?} payload: {source}")]
    Decode {
        kind: MessageType,
        #[source]
        source: rmp_serde::decode::Error,
    },
    /// The payload could not be encoded (only non-encodable values such as NaN keys trigger this).
    #[error("cannot encode {kind:?} payload: {source}")]
    Encode {
        kind: MessageType,
        #[source]
        source: rmp_serde::encode::Error,
    },
}

/// First frame of every message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum MessageType {
    Add = 0x01,
    Abort = 0x02,
    Utility = 0x03,
    Ready = 0x10,
    Outputs = 0x11,
    UtilityResult = 0x12,
    Error = 0x13,
    Dead = 0x14,
}

impl MessageType {
    /// The byte that goes in the type frame.
    pub fn byte(self) -> u8 {
        self as u8
    }
}

impl TryFrom<u8> for MessageType {
    type Error = ProtocolError;

    fn try_from(b: u8) -> Result<Self, ProtocolError> {
        Ok(match b {
            0x01 => Self::Add,
            0x02 => Self::Abort,
            0x03 => Self::Utility,
            0x10 => Self::Ready,
            0x11 => Self::Outputs,
            0x12 => Self::UtilityResult,
            0x13 => Self::Error,
            0x14 => Self::Dead,
            other => return Err(ProtocolError::UnknownType(other)),
        })
    }
}

/// Why a request finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// EOS or a stop token (or, decided by the front end, a stop string).
    Stop,
    /// `max_tokens` or `max_model_len` reached.
    Length,
    /// Aborted by the front end.
    Abort,
    /// The engine rejected or failed the request; `EngineCoreOutput::error` says why.
    Error,
}

impl FinishReason {
    /// The wire spelling, also used as the OpenAI `finish_reason` and the metrics label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
            Self::Abort => "abort",
            Self::Error => "error",
        }
    }
}

/// Writes a struct as a msgpack map of all its fields in declaration order.
macro_rules! map_struct {
    ($ty:ty { $($field:ident),+ $(,)? }) => {
        impl Serialize for $ty {
            fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                let n = [$(stringify!($field)),+].len();
                let mut map = serializer.serialize_map(Some(n))?;
                $(map.serialize_entry(stringify!($field), &self.$field)?;)+
                map.end()
            }
        }
    };
}

/// Token-id → bias map that keeps the order it was written in, so re-encoding is byte-identical
/// (msgspec writes dicts in insertion order; a `HashMap` would shuffle them).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LogitBias(pub Vec<(u32, f64)>);

impl Serialize for LogitBias {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(self.0.len()))?;
        for (token_id, bias) in &self.0 {
            map.serialize_entry(token_id, bias)?;
        }
        map.end()
    }
}

impl<'de> Deserialize<'de> for LogitBias {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = LogitBias;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a map of token id to bias")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut a: A,
            ) -> Result<LogitBias, A::Error> {
                let mut entries = Vec::with_capacity(a.size_hint().unwrap_or(0));
                while let Some(entry) = a.next_entry::<u32, f64>()? {
                    entries.push(entry);
                }
                Ok(LogitBias(entries))
            }
        }
        deserializer.deserialize_map(Visitor)
    }
}

/// What [`StructuredOutput::spec`] holds; the wire spelling is the lowercase name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StructuredOutputKind {
    /// A JSON Schema (its text).
    Json,
    /// Any JSON object; the spec is empty.
    JsonObject,
    /// A regular expression the whole output matches.
    Regex,
    /// A JSON array of strings; the output is exactly one of them.
    Choice,
    /// A Lark grammar as llguidance reads it (the engine converts GBNF).
    Grammar,
}

impl StructuredOutputKind {
    /// The wire spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Json => "json",
            Self::JsonObject => "json_object",
            Self::Regex => "regex",
            Self::Choice => "choice",
            Self::Grammar => "grammar",
        }
    }
}

/// A constraint on the generated tokens, enforced by the engine's grammar matcher (a map).
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct StructuredOutput {
    pub kind: StructuredOutputKind,
    #[serde(default)]
    pub spec: String,
    /// JSON kinds only: a regular expression for the whitespace allowed between JSON tokens
    /// (`None`: none, the output is compact JSON).
    #[serde(default)]
    pub whitespace_pattern: Option<String>,
}

impl StructuredOutput {
    /// A constraint of `kind` with `spec` and no whitespace pattern.
    pub fn new(kind: StructuredOutputKind, spec: impl Into<String>) -> Self {
        Self {
            kind,
            spec: spec.into(),
            whitespace_pattern: None,
        }
    }
}

map_struct!(StructuredOutput {
    kind,
    spec,
    whitespace_pattern
});

/// Sampling settings of one request, as they travel (a map: new fields can be added).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    pub temperature: f64,
    pub top_p: f64,
    pub top_k: i64,
    pub min_p: f64,
    pub presence_penalty: f64,
    pub frequency_penalty: f64,
    pub repetition_penalty: f64,
    pub seed: Option<i64>,
    pub max_tokens: u32,
    pub min_tokens: u32,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    pub logprobs: Option<u32>,
    pub logit_bias: Option<LogitBias>,
    /// The constraint the output must satisfy, if any.
    pub structured_output: Option<StructuredOutput>,
    /// Top-N alternatives per prompt position (0: only the prompt token's own); `None`: none.
    pub prompt_logprobs: Option<u32>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            seed: None,
            max_tokens: 16,
            min_tokens: 0,
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            logprobs: None,
            logit_bias: None,
            structured_output: None,
            prompt_logprobs: None,
        }
    }
}

map_struct!(SamplingParams {
    temperature,
    top_p,
    top_k,
    min_p,
    presence_penalty,
    frequency_penalty,
    repetition_penalty,
    seed,
    max_tokens,
    min_tokens,
    stop_token_ids,
    ignore_eos,
    logprobs,
    logit_bias,
    structured_output,
    prompt_logprobs,
});

/// ADD payload (array).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EngineCoreRequest {
    pub request_id: String,
    pub prompt_token_ids: Vec<u32>,
    pub sampling_params: SamplingParams,
    /// Seconds since the Unix epoch when the front end received the request.
    pub arrival_time: f64,
    #[serde(default)]
    pub priority: i64,
}

/// Sampled (or prompt) token first, then the top-N alternatives; `rank` is that token's rank (1 = best).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Logprob {
    pub token_ids: Vec<u32>,
    pub logprobs: Vec<f64>,
    pub rank: u32,
}

/// What one request gained in one engine step (array).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EngineCoreOutput {
    pub request_id: String,
    pub new_token_ids: Vec<u32>,
    #[serde(default)]
    pub new_logprobs: Option<Vec<Logprob>>,
    #[serde(default)]
    pub finish_reason: Option<FinishReason>,
    #[serde(default)]
    pub stop_reason: Option<u32>,
    #[serde(default)]
    pub error: Option<String>,
    #[serde(default)]
    pub num_cached_tokens: u32,
    #[serde(default)]
    pub queued_ts: Option<f64>,
    #[serde(default)]
    pub scheduled_ts: Option<f64>,
    #[serde(default)]
    pub first_token_ts: Option<f64>,
    /// Prompt positions 1..len-1 (position 0 has no context: no entry), sent once, on the
    /// request's first output that carries tokens; `None` unless the request asked for them.
    #[serde(default)]
    pub prompt_logprobs: Option<Vec<Logprob>>,
}

impl EngineCoreOutput {
    /// True for the last output of a request.
    pub fn finished(&self) -> bool {
        self.finish_reason.is_some()
    }
}

/// Scheduler state after a step (map). Counters are cumulative since the engine started.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct SchedulerStats {
    pub num_running: u64,
    pub num_waiting: u64,
    pub kv_cache_usage: f64,
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    pub num_preemptions: u64,
    pub num_prompt_tokens: u64,
    pub num_generation_tokens: u64,
}

map_struct!(SchedulerStats {
    num_running,
    num_waiting,
    kv_cache_usage,
    prefix_cache_queries,
    prefix_cache_hits,
    num_preemptions,
    num_prompt_tokens,
    num_generation_tokens,
});

/// OUTPUTS payload: one per engine step (array).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EngineCoreOutputs {
    pub engine_index: u32,
    pub outputs: Vec<EngineCoreOutput>,
    #[serde(default)]
    pub scheduler_stats: Option<SchedulerStats>,
    #[serde(default)]
    pub timestamp: f64,
}

/// READY payload (map): what the engine loaded and the limits the front end must enforce.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct EngineReady {
    pub engine_index: u32,
    pub pid: u32,
    pub model_name: String,
    pub max_model_len: u32,
    pub vocab_size: u32,
    pub eos_token_ids: Vec<u32>,
    pub num_kv_blocks: u64,
    pub block_size: u32,
    pub dtype: String,
    pub max_num_seqs: u32,
}

map_struct!(EngineReady {
    engine_index,
    pid,
    model_name,
    max_model_len,
    vocab_size,
    eos_token_ids,
    num_kv_blocks,
    block_size,
    dtype,
    max_num_seqs,
});

/// UTILITY payload (map).
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct UtilityCall {
    pub call_id: u64,
    pub method: String,
    #[serde(default)]
    pub args: Vec<Value>,
}

map_struct!(UtilityCall {
    call_id,
    method,
    args
});

/// UTILITY_RESULT payload (map).
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct UtilityResult {
    pub call_id: u64,
    pub ok: bool,
    #[serde(default = "nil")]
    pub result: Value,
    #[serde(default)]
    pub error: Option<String>,
}

map_struct!(UtilityResult {
    call_id,
    ok,
    result,
    error
});

fn nil() -> Value {
    Value::Nil
}

/// ERROR and DEAD payload (map).
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct EngineError {
    pub engine_index: u32,
    #[serde(default)]
    pub request_id: Option<String>,
    #[serde(default)]
    pub message: String,
}

map_struct!(EngineError {
    engine_index,
    request_id,
    message
});

/// One decoded message of either direction.
#[derive(Debug, Clone, PartialEq)]
pub enum Message {
    Add(EngineCoreRequest),
    Abort(Vec<String>),
    Utility(UtilityCall),
    Ready(EngineReady),
    Outputs(EngineCoreOutputs),
    UtilityResult(UtilityResult),
    Error(EngineError),
    Dead(EngineError),
}

impl Message {
    /// The type byte this message travels under.
    pub fn kind(&self) -> MessageType {
        match self {
            Self::Add(_) => MessageType::Add,
            Self::Abort(_) => MessageType::Abort,
            Self::Utility(_) => MessageType::Utility,
            Self::Ready(_) => MessageType::Ready,
            Self::Outputs(_) => MessageType::Outputs,
            Self::UtilityResult(_) => MessageType::UtilityResult,
            Self::Error(_) => MessageType::Error,
            Self::Dead(_) => MessageType::Dead,
        }
    }

    /// The msgpack payload (second frame).
    pub fn encode_payload(&self) -> Result<Vec<u8>, ProtocolError> {
        let kind = self.kind();
        let encoded = match self {
            Self::Add(m) => rmp_serde::to_vec(m),
            Self::Abort(m) => rmp_serde::to_vec(m),
            Self::Utility(m) => rmp_serde::to_vec(m),
            Self::Ready(m) => rmp_serde::to_vec(m),
            Self::Outputs(m) => rmp_serde::to_vec(m),
            Self::UtilityResult(m) => rmp_serde::to_vec(m),
            Self::Error(m) | Self::Dead(m) => rmp_serde::to_vec(m),
        };
        encoded.map_err(|source| ProtocolError::Encode { kind, source })
    }

    /// Both frames: `[type byte, msgpack payload]`.
    pub fn encode(&self) -> Result<[Vec<u8>; 2], ProtocolError> {
        Ok([vec![self.kind().byte()], self.encode_payload()?])
    }

    /// Decodes a payload whose type byte has already been read.
    pub fn decode_payload(kind: MessageType, payload: &[u8]) -> Result<Self, ProtocolError> {
        fn de<T: DeserializeOwned>(kind: MessageType, p: &[u8]) -> Result<T, ProtocolError> {
            rmp_serde::from_slice(p).map_err(|source| ProtocolError::Decode { kind, source })
        }
        Ok(match kind {
            MessageType::Add => Self::Add(de(kind, payload)?),
            MessageType::Abort => Self::Abort(de(kind, payload)?),
            MessageType::Utility => Self::Utility(de(kind, payload)?),
            MessageType::Ready => Self::Ready(de(kind, payload)?),
            MessageType::Outputs => Self::Outputs(de(kind, payload)?),
            MessageType::UtilityResult => Self::UtilityResult(de(kind, payload)?),
            MessageType::Error => Self::Error(de(kind, payload)?),
            MessageType::Dead => Self::Dead(de(kind, payload)?),
        })
    }

    /// Decodes `[type, payload]` frames (the ROUTER identity frame, if any, already stripped).
    pub fn decode<F: AsRef<[u8]>>(frames: &[F]) -> Result<Self, ProtocolError> {
        let [kind, payload] = frames else {
            return Err(ProtocolError::FrameCount(frames.len()));
        };
        let kind = kind.as_ref();
        if kind.len() != 1 {
            return Err(ProtocolError::TypeFrameLength(kind.len()));
        }
        Self::decode_payload(MessageType::try_from(kind[0])?, payload.as_ref())
    }
}

/// The ROUTER identity of engine `index`: 2 bytes, little-endian.
pub fn engine_identity(index: u32) -> [u8; 2] {
    // Engine indices beyond u16 are not addressable on the wire; callers validate the count.
    (index as u16).to_le_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request() -> EngineCoreRequest {
        EngineCoreRequest {
            request_id: "r-1".into(),
            prompt_token_ids: vec![1, 2, 300, 70_000],
            sampling_params: SamplingParams {
                seed: Some(-5),
                logit_bias: Some(LogitBias(vec![(9, -100.0), (3, 2.5)])),
                ..Default::default()
            },
            arrival_time: 1.5,
            priority: 0,
        }
    }

    #[test]
    fn request_roundtrips_as_array_with_map_params() {
        let msg = Message::Add(request());
        let [kind, payload] = msg.encode().unwrap();
        assert_eq!(kind, vec![0x01]);
        // fixarray of 5 fields, then a fixstr id.
        assert_eq!(payload[0], 0x95);
        let back = Message::decode(&[kind, payload]).unwrap();
        assert_eq!(back, msg);
    }

    #[test]
    fn map_messages_ignore_unknown_keys_and_default_missing() {
        // {"engine_index": 2, "future_field": 1}
        let mut buf = Vec::new();
        rmp::encode::write_map_len(&mut buf, 2).unwrap();
        rmp::encode::write_str(&mut buf, "engine_index").unwrap();
        rmp::encode::write_uint(&mut buf, 2).unwrap();
        rmp::encode::write_str(&mut buf, "future_field").unwrap();
        rmp::encode::write_uint(&mut buf, 1).unwrap();
        let msg = Message::decode(&[&[0x13u8][..], &buf[..]]).unwrap();
        assert_eq!(
            msg,
            Message::Error(EngineError {
                engine_index: 2,
                request_id: None,
                message: String::new()
            })
        );
    }

    #[test]
    fn bad_frames_are_typed_errors() {
        assert!(matches!(
            Message::decode(&[&[0x01u8][..]]),
            Err(ProtocolError::FrameCount(1))
        ));
        assert!(matches!(
            Message::decode(&[&[0x01u8, 0x02][..], &[0x90][..]]),
            Err(ProtocolError::TypeFrameLength(2))
        ));
        assert!(matches!(
            Message::decode(&[&[0x7fu8][..], &[0x90][..]]),
            Err(ProtocolError::UnknownType(0x7f))
        ));
        let err = Message::decode(&[&[0x11u8][..], &[0xc1][..]]).unwrap_err();
        assert!(matches!(
            err,
            ProtocolError::Decode {
                kind: MessageType::Outputs,
                ..
            }
        ));
        assert!(err.to_string().contains("Outputs"));
    }

    #[test]
    fn finish_reason_spelling() {
        let out: EngineCoreOutput = rmp_serde::from_slice(
            &rmp_serde::to_vec(&("x", [5u32], (), "length", (), (), 0u32, (), (), ())).unwrap(),
        )
        .unwrap();
        assert_eq!(out.finish_reason, Some(FinishReason::Length));
        assert!(out.finished());
    }

    #[test]
    fn identity_is_two_bytes_little_endian() {
        assert_eq!(engine_identity(0), [0, 0]);
        assert_eq!(engine_identity(258), [2, 1]);
    }
}
