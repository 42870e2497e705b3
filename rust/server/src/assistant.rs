//! Turns a choice's generated text into the parts of an assistant message: `reasoning_content`
//! (the reasoning parser), `tool_calls` (the tool-call parser) and `content` (the rest), with
//! OpenAI's streamed tool-call deltas. Streaming and non-streaming responses feed the same text
//! through the same [`AssistantParser`], so they agree.
//!
//! Reasoning is split off first: a tool call written inside the reasoning is not a call.

use serde_json::{json, Value as Json};

use crate::error::{ApiError, ServerError};
use crate::reasoning::{ReasoningKind, ReasoningParser, REASONING_PARSER_NAMES};
use crate::server::ServerConfig;
use crate::tools::{
    parser_for, ParseEvent, ToolCallParser, ToolChoice, ToolParserKind, ToolRequest,
    TOOL_PARSER_NAMES,
};

/// The server's output-parsing settings (`--enable-auto-tool-choice`, `--tool-call-parser`,
/// `--reasoning-parser`).
#[derive(Debug, Clone, Default)]
pub struct OutputParsing {
    /// The format parsed for `tool_choice: auto`; `None` unless auto tool choice is enabled.
    pub auto_tool_parser: Option<ToolParserKind>,
    pub reasoning: Option<ReasoningKind>,
}

impl OutputParsing {
    /// Checks the flags: known names, and auto tool choice only with a parser (as vLLM requires).
    pub fn from_config(config: &ServerConfig) -> Result<Self, ServerError> {
        let tool_parser = match &config.tool_call_parser {
            None => None,
            Some(name) => Some(ToolParserKind::from_name(name).ok_or_else(|| {
                ServerError::Config(format!(
                    "unknown --tool-call-parser {name:?}; choose one of {}",
                    TOOL_PARSER_NAMES.join(", ")
                ))
            })?),
        };
        if config.enable_auto_tool_choice && tool_parser.is_none() {
            return Err(ServerError::Config(
                "--enable-auto-tool-choice requires --tool-call-parser".into(),
            ));
        }
        let reasoning = match &config.reasoning_parser {
            None => None,
            Some(name) => Some(ReasoningKind::from_name(name).ok_or_else(|| {
                ServerError::Config(format!(
                    "unknown --reasoning-parser {name:?}; choose one of {}",
                    REASONING_PARSER_NAMES.join(", ")
                ))
            })?),
        };
        Ok(Self {
            auto_tool_parser: tool_parser.filter(|_| config.enable_auto_tool_choice),
            reasoning,
        })
    }

    /// Refuses `tool_choice: auto` with tools when the server parses no tool-call format
    /// (vLLM's answer: a 400 naming the flags), rather than ignoring the tools.
    pub fn check(&self, tools: Option<&ToolRequest>) -> Result<(), ApiError> {
        match tools {
            Some(t) if t.choice == ToolChoice::Auto && self.auto_tool_parser.is_none() => {
                Err(ApiError::bad(
                    "tool_choice",
                    "\"auto\" tool choice requires --enable-auto-tool-choice and \
                     --tool-call-parser to be set on the server",
                ))
            }
            _ => Ok(()),
        }
    }

    /// Whether the output of this request must be decoded with special tokens for its parser.
    pub fn needs_special_tokens(&self, tools: Option<&ToolRequest>) -> bool {
        tools.is_some_and(|t| t.choice == ToolChoice::Auto)
            && self
                .auto_tool_parser
                .is_some_and(ToolParserKind::needs_special_tokens)
    }

    /// A parser for one choice of a request. A forced call's output is the grammar's JSON, with
    /// no reasoning block, so it skips the reasoning parser.
    pub fn parser(&self, tools: Option<&ToolRequest>) -> AssistantParser {
        let forced = tools.is_some_and(|t| t.forced_schema().is_some());
        let tool_parser = tools.and_then(|t| parser_for(t, self.auto_tool_parser));
        AssistantParser::new(self.reasoning.filter(|_| !forced), tool_parser)
    }
}

/// A piece of a streamed tool call: the first one of a call carries its id and name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCallDelta {
    /// The call's position among the choice's calls.
    pub index: usize,
    pub id: Option<String>,
    pub name: Option<String>,
    pub arguments: String,
}

impl ToolCallDelta {
    /// The chat API's `delta.tool_calls[]` entry.
    pub fn to_json(&self) -> Json {
        let mut function = serde_json::Map::new();
        if let Some(name) = &self.name {
            function.insert("name".into(), Json::String(name.clone()));
        }
        function.insert("arguments".into(), Json::String(self.arguments.clone()));
        let mut entry = json!({"index": self.index, "function": function});
        if let Some(id) = &self.id {
            entry["id"] = Json::String(id.clone());
            entry["type"] = Json::String("function".into());
        }
        entry
    }
}

/// What a piece of output adds to the message.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AssistantDelta {
    pub content: String,
    pub reasoning: String,
    pub tool_calls: Vec<ToolCallDelta>,
}

impl AssistantDelta {
    pub fn is_empty(&self) -> bool {
        self.content.is_empty() && self.reasoning.is_empty() && self.tool_calls.is_empty()
    }
}

/// A complete tool call of a message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MessageToolCall {
    pub id: String,
    pub name: String,
    pub arguments: String,
}

/// A whole assistant message, gathered from deltas.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AssistantMessage {
    pub content: String,
    pub reasoning: String,
    pub tool_calls: Vec<MessageToolCall>,
}

impl AssistantMessage {
    /// Adds a delta.
    pub fn extend(&mut self, delta: AssistantDelta) {
        self.content.push_str(&delta.content);
        self.reasoning.push_str(&delta.reasoning);
        for call in delta.tool_calls {
            match self.tool_calls.get_mut(call.index) {
                Some(existing) => existing.arguments.push_str(&call.arguments),
                None => self.tool_calls.push(MessageToolCall {
                    id: call.id.unwrap_or_default(),
                    name: call.name.unwrap_or_default(),
                    arguments: call.arguments,
                }),
            }
        }
    }

    /// The chat API's `message`: `content` is `null` when the turn only made calls;
    /// `reasoning_content` is there when the server parses reasoning.
    pub fn chat_json(&self, with_reasoning: bool) -> Json {
        let mut message = json!({"role": "assistant"});
        message["content"] = if self.content.is_empty() && !self.tool_calls.is_empty() {
            Json::Null
        } else {
            Json::String(self.content.clone())
        };
        if with_reasoning {
            message["reasoning_content"] = if self.reasoning.is_empty() {
                Json::Null
            } else {
                Json::String(self.reasoning.clone())
            };
        }
        if !self.tool_calls.is_empty() {
            message["tool_calls"] = Json::Array(self.tool_calls_json());
        }
        message
    }

    /// The chat API's `tool_calls` array.
    pub fn tool_calls_json(&self) -> Vec<Json> {
        self.tool_calls
            .iter()
            .map(|c| {
                json!({"id": c.id, "type": "function",
                       "function": {"name": c.name, "arguments": c.arguments}})
            })
            .collect()
    }
}

/// A fresh tool-call id, `call_` and 24 hex digits.
pub fn new_call_id() -> String {
    let hex = uuid::Uuid::new_v4().simple().to_string();
    format!("call_{}", &hex[..24])
}

/// Splits one choice's output into reasoning, tool calls and content.
pub struct AssistantParser {
    reasoning: Option<ReasoningParser>,
    tools: Option<Box<dyn ToolCallParser>>,
    num_calls: usize,
    /// Trailing whitespace of the content, held while tools are parsed: it is emitted when more
    /// content follows and dropped when the message ends in calls.
    held_whitespace: String,
}

impl AssistantParser {
    /// `reasoning`: the server's reasoning format; `tools`: this request's tool-call parser.
    pub fn new(reasoning: Option<ReasoningKind>, tools: Option<Box<dyn ToolCallParser>>) -> Self {
        Self {
            reasoning: reasoning.map(ReasoningParser::new),
            tools,
            num_calls: 0,
            held_whitespace: String::new(),
        }
    }

    /// Whether any tool call was found so far.
    pub fn made_calls(&self) -> bool {
        self.num_calls > 0
    }

    /// Feeds the next piece of generated text.
    pub fn push(&mut self, text: &str) -> AssistantDelta {
        let (reasoning, content) = match &mut self.reasoning {
            Some(r) => {
                let split = r.push(text);
                (split.reasoning, split.content)
            }
            None => (String::new(), text.to_string()),
        };
        let mut delta = AssistantDelta {
            reasoning,
            ..Default::default()
        };
        let events = match &mut self.tools {
            Some(tools) if !content.is_empty() => tools.push(&content),
            Some(_) => Vec::new(),
            None => {
                delta.content = content;
                return delta;
            }
        };
        self.apply(events, &mut delta);
        delta
    }

    /// The output ended: settles everything held back.
    pub fn finish(&mut self) -> AssistantDelta {
        let (reasoning, content) = match &mut self.reasoning {
            Some(r) => {
                let split = r.finish();
                (split.reasoning, split.content)
            }
            None => (String::new(), String::new()),
        };
        let mut delta = AssistantDelta {
            reasoning,
            ..Default::default()
        };
        let Some(tools) = &mut self.tools else {
            delta.content = content;
            return delta;
        };
        let mut events = tools.push(&content);
        events.extend(tools.finish());
        self.apply(events, &mut delta);
        if !self.made_calls() {
            delta
                .content
                .push_str(&std::mem::take(&mut self.held_whitespace));
        }
        delta
    }

    fn apply(&mut self, events: Vec<ParseEvent>, delta: &mut AssistantDelta) {
        for event in events {
            match event {
                ParseEvent::Content(text) => {
                    let body = text.trim_end();
                    if !body.is_empty() {
                        delta
                            .content
                            .push_str(&std::mem::take(&mut self.held_whitespace));
                        delta.content.push_str(body);
                    }
                    self.held_whitespace.push_str(&text[body.len()..]);
                }
                ParseEvent::CallStart { name } => {
                    delta.tool_calls.push(ToolCallDelta {
                        index: self.num_calls,
                        id: Some(new_call_id()),
                        name: Some(name),
                        arguments: String::new(),
                    });
                    self.num_calls += 1;
                }
                ParseEvent::CallArguments(chunk) => {
                    let index = self.num_calls.saturating_sub(1);
                    match delta.tool_calls.last_mut() {
                        Some(last) if last.index == index => last.arguments.push_str(&chunk),
                        _ => delta.tool_calls.push(ToolCallDelta {
                            index,
                            id: None,
                            name: None,
                            arguments: chunk,
                        }),
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::tools::request::ToolSchemas;
    use crate::tools::ToolParserKind;

    fn message(parser: &mut AssistantParser, chunks: &[&str]) -> AssistantMessage {
        let mut m = AssistantMessage::default();
        for chunk in chunks {
            m.extend(parser.push(chunk));
        }
        m.extend(parser.finish());
        m
    }

    fn hermes() -> Option<Box<dyn ToolCallParser>> {
        Some(ToolParserKind::Hermes.parser(Arc::new(ToolSchemas::default())))
    }

    #[test]
    fn reasoning_then_calls_then_nothing_leaks() {
        let text = "<think>\nI could call <tool_call>{\"name\": \"no\"}</tool_call> here.\n</think>\n\nChecking.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n</tool_call>\n";
        let whole = message(
            &mut AssistantParser::new(Some(ReasoningKind::Qwen3), hermes()),
            &[text],
        );
        assert_eq!(whole.content, "Checking.");
        assert!(whole
            .reasoning
            .contains("<tool_call>{\"name\": \"no\"}</tool_call>"));
        assert_eq!(whole.tool_calls.len(), 1);
        assert_eq!(
            (
                whole.tool_calls[0].name.as_str(),
                whole.tool_calls[0].arguments.as_str()
            ),
            ("f", "{\"a\":1}")
        );
        assert!(whole.tool_calls[0].id.starts_with("call_"));
        for (k, _) in text.char_indices().skip(1) {
            let mut split = message(
                &mut AssistantParser::new(Some(ReasoningKind::Qwen3), hermes()),
                &[&text[..k], &text[k..]],
            );
            split.tool_calls[0].id.clone_from(&whole.tool_calls[0].id);
            assert_eq!(split, whole, "split at {k}");
        }
    }

    #[test]
    fn trailing_whitespace_is_content_without_calls() {
        let m = message(
            &mut AssistantParser::new(None, hermes()),
            &["Hi ", "there\n\n"],
        );
        assert_eq!(m.content, "Hi there\n\n");
        let m = message(&mut AssistantParser::new(None, None), &["a\n"]);
        assert_eq!(m.content, "a\n");
    }

    #[test]
    fn auto_tool_choice_needs_the_flags() {
        let mut config = ServerConfig::new("m", "ipc://a", "ipc://b");
        let tools = vec![json!({"type": "function", "function": {"name": "f"}})];
        let auto = ToolRequest::parse(
            Some(&tools),
            None,
            None,
            crate::tools::request::ToolShape::Chat,
        )
        .unwrap();
        let off = OutputParsing::from_config(&config).unwrap();
        let err = off.check(auto.as_ref()).unwrap_err();
        assert_eq!(err.body()["error"]["param"], "tool_choice");
        assert!(err.to_string().contains("--enable-auto-tool-choice"));
        config.enable_auto_tool_choice = true;
        assert!(
            OutputParsing::from_config(&config).is_err(),
            "a parser is required"
        );
        config.tool_call_parser = Some("mistral".into());
        let on = OutputParsing::from_config(&config).unwrap();
        assert!(on.check(auto.as_ref()).is_ok());
        assert!(on.needs_special_tokens(auto.as_ref()));
        config.tool_call_parser = Some("nope".into());
        assert!(OutputParsing::from_config(&config).is_err());
        config.tool_call_parser = None;
        config.enable_auto_tool_choice = false;
        config.reasoning_parser = Some("qwen3".into());
        assert_eq!(
            OutputParsing::from_config(&config).unwrap().reasoning,
            Some(ReasoningKind::Qwen3)
        );
    }

    #[test]
    fn deltas_carry_id_and_name_once() {
        let mut p = AssistantParser::new(None, hermes());
        let d = p.push("<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>");
        assert_eq!(d.tool_calls.len(), 1);
        let entry = d.tool_calls[0].to_json();
        assert_eq!(entry["function"]["name"], "f");
        assert_eq!(entry["type"], "function");
        assert_eq!(entry["index"], 0);
        assert!(p.made_calls());
    }
}
