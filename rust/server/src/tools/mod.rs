//! Tool calling: the request side (`tools`, `tool_choice`, `parallel_tool_calls`, checked and
//! turned into a constraint when a call is forced) and the response side (parsers that find the
//! calls in a model's own output format, streamed).
//!
//! A parser sees the generated text in chunks of any size and emits [`ParseEvent`]s. Its one
//! invariant: the events it emits for a text do not depend on how the text was split, so a
//! streamed response reassembles to the non-streamed one (the tests split every sample at every
//! position).

mod formats;
mod pythonic;
pub mod request;
mod scanner;

pub use formats::{parser_for, ToolParserKind, TOOL_PARSER_NAMES};
pub use request::{ToolChoice, ToolRequest};

/// One complete tool call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    pub name: String,
    /// The arguments as JSON text (an object).
    pub arguments: String,
}

/// What a parser found in the text pushed so far.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ParseEvent {
    /// Text for `content` (outside any tool-call markup).
    Content(String),
    /// A new call starts; argument chunks follow.
    CallStart { name: String },
    /// More of the current call's arguments.
    CallArguments(String),
}

/// Finds tool calls in generated text, incrementally.
pub trait ToolCallParser: Send {
    /// Feeds the next piece of generated text; returns what is settled.
    fn push(&mut self, text: &str) -> Vec<ParseEvent>;
    /// The generation ended: settles whatever was held back.
    fn finish(&mut self) -> Vec<ParseEvent>;
}

/// The events of a complete call.
fn call_events(call: ToolCall) -> [ParseEvent; 2] {
    [
        ParseEvent::CallStart { name: call.name },
        ParseEvent::CallArguments(call.arguments),
    ]
}

/// Content and calls of a whole output, as the events say (for tests and non-streamed use).
pub fn reassemble(events: impl IntoIterator<Item = ParseEvent>) -> (String, Vec<ToolCall>) {
    let mut content = String::new();
    let mut calls: Vec<ToolCall> = Vec::new();
    for event in events {
        match event {
            ParseEvent::Content(text) => content.push_str(&text),
            ParseEvent::CallStart { name } => calls.push(ToolCall {
                name,
                arguments: String::new(),
            }),
            ParseEvent::CallArguments(chunk) => {
                if let Some(call) = calls.last_mut() {
                    call.arguments.push_str(&chunk);
                }
            }
        }
    }
    (content, calls)
}
