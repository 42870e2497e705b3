//! Turns a choice's generated text into the parts of an assistant message: `reasoning_content`
//! (the reasoning parser), `tool_calls` (the tool-call parser) and `content` (the rest), with
//! OpenAI's streamed tool-call deltas. Streaming and non-streaming responses feed the same text
//! through the same [`AssistantParser`], so they agree.
//!
//! Reasoning is split off first: a tool call written inside the reasoning is not a call.

use serde_json::{json, Value as Json};

use crate::reasoning::{ReasoningKind, ReasoningParser};
use crate::tools::{ParseEvent, ToolCallParser};

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
            delta.content.push_str(&std::mem::take(&mut self.held_whitespace));
        }
        delta
    }

    fn apply(&mut self, events: Vec<ParseEvent>, delta: &mut AssistantDelta) {
        for event in events {
            match event {
                ParseEvent::Content(text) => {
                    let body = text.trim_end();
                    if !body.is_empty() {
                        delta.content.push_str(&std::mem::take(&mut self.held_whitespace));
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
        assert!(whole.reasoning.contains("<tool_call>{\"name\": \"no\"}</tool_call>"));
        assert_eq!(whole.tool_calls.len(), 1);
        assert_eq!((whole.tool_calls[0].name.as_str(), whole.tool_calls[0].arguments.as_str()), ("f", "{\"a\":1}"));
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
        let m = message(&mut AssistantParser::new(None, hermes()), &["Hi ", "there\n\n"]);
        assert_eq!(m.content, "Hi there\n\n");
        let m = message(&mut AssistantParser::new(None, None), &["a\n"]);
        assert_eq!(m.content, "a\n");
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
