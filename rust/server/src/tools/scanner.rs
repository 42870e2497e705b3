//! The two shapes tool-call markup takes in model output, as incremental scanners that hold back
//! only what could still turn out to be markup.
//!
//! - [`Delimited`]: calls sit between a start and an end marker (`<tool_call>…</tool_call>`), or
//!   run from a start marker to the end of the output (`[TOOL_CALLS]…`); text around them is
//!   content.
//! - [`WholeOutput`]: the whole output is the calls when it begins with a marker (`{`, `[`,
//!   `<|python_tag|>`), else it is all content.
//!
//! A body that does not parse as calls is given back as content, markers included (the model
//! wrote text that merely looked like markup).

use std::sync::Arc;

use super::{call_events, ParseEvent, ToolCall, ToolCallParser};
use crate::tools::request::ToolSchemas;

/// Parses the text inside the markup into calls; `None` when it is not well-formed.
pub(crate) type BodyParser = fn(&str, &ToolSchemas) -> Option<Vec<ToolCall>>;

/// The length of the longest suffix of `text` that is a proper prefix of `marker`.
fn partial_marker_len(text: &str, marker: &str) -> usize {
    (1..marker.len().min(text.len() + 1))
        .rev()
        .find(|&k| text.ends_with(&marker[..k]))
        .unwrap_or(0)
}

fn body_events(
    parse: BodyParser,
    schemas: &ToolSchemas,
    body: &str,
    as_text: impl FnOnce() -> String,
) -> Vec<ParseEvent> {
    match parse(body, schemas) {
        Some(calls) => calls.into_iter().flat_map(call_events).collect(),
        None => vec![ParseEvent::Content(as_text())],
    }
}

/// Calls between `start` and `end` (or from `start` to the end of the output).
pub(crate) struct Delimited {
    start: &'static str,
    end: Option<&'static str>,
    parse: BodyParser,
    schemas: Arc<ToolSchemas>,
    /// Text not settled yet: after `start` while `inside`, else a possible partial `start`.
    buf: String,
    inside: bool,
}

impl Delimited {
    pub(crate) fn new(
        start: &'static str,
        end: Option<&'static str>,
        parse: BodyParser,
        schemas: Arc<ToolSchemas>,
    ) -> Self {
        Self {
            start,
            end,
            parse,
            schemas,
            buf: String::new(),
            inside: false,
        }
    }

    fn content(events: &mut Vec<ParseEvent>, text: &str) {
        if !text.is_empty() {
            events.push(ParseEvent::Content(text.to_string()));
        }
    }
}

impl ToolCallParser for Delimited {
    fn push(&mut self, text: &str) -> Vec<ParseEvent> {
        self.buf.push_str(text);
        let mut events = Vec::new();
        loop {
            if self.inside {
                let Some(end) = self.end else { break };
                let Some(pos) = self.buf.find(end) else { break };
                let body = &self.buf[..pos];
                let (start, parse) = (self.start, self.parse);
                events.extend(body_events(parse, &self.schemas, body, || {
                    format!("{start}{body}{end}")
                }));
                self.buf.drain(..pos + end.len());
                self.inside = false;
            } else if let Some(pos) = self.buf.find(self.start) {
                Self::content(&mut events, &self.buf[..pos]);
                self.buf.drain(..pos + self.start.len());
                self.inside = true;
            } else {
                let keep = partial_marker_len(&self.buf, self.start);
                let settled = self.buf.len() - keep;
                Self::content(&mut events, &self.buf[..settled]);
                self.buf.drain(..settled);
                break;
            }
        }
        events
    }

    fn finish(&mut self) -> Vec<ParseEvent> {
        let buf = std::mem::take(&mut self.buf);
        if !self.inside {
            let mut events = Vec::new();
            Self::content(&mut events, &buf);
            return events;
        }
        self.inside = false;
        // An unterminated call (the output ended first) still counts when its body parses.
        let start = self.start;
        body_events(self.parse, &self.schemas, &buf, || format!("{start}{buf}"))
    }
}

enum WholeState {
    /// Only whitespace or a partial marker so far.
    Undecided,
    Content,
    Calls,
}

/// The whole output is calls when it starts with one of `markers`.
pub(crate) struct WholeOutput {
    markers: &'static [&'static str],
    parse: BodyParser,
    schemas: Arc<ToolSchemas>,
    buf: String,
    state: WholeState,
}

impl WholeOutput {
    pub(crate) fn new(
        markers: &'static [&'static str],
        parse: BodyParser,
        schemas: Arc<ToolSchemas>,
    ) -> Self {
        Self {
            markers,
            parse,
            schemas,
            buf: String::new(),
            state: WholeState::Undecided,
        }
    }
}

impl ToolCallParser for WholeOutput {
    fn push(&mut self, text: &str) -> Vec<ParseEvent> {
        match self.state {
            WholeState::Content => {
                return if text.is_empty() {
                    Vec::new()
                } else {
                    vec![ParseEvent::Content(text.to_string())]
                }
            }
            WholeState::Calls => {
                self.buf.push_str(text);
                return Vec::new();
            }
            WholeState::Undecided => self.buf.push_str(text),
        }
        let head = self.buf.trim_start();
        if head.is_empty() || self.markers.iter().any(|m| m.starts_with(head)) {
            if self.markers.iter().any(|m| head.starts_with(m)) {
                self.state = WholeState::Calls;
            }
            return Vec::new();
        }
        if self.markers.iter().any(|m| head.starts_with(m)) {
            self.state = WholeState::Calls;
            return Vec::new();
        }
        self.state = WholeState::Content;
        vec![ParseEvent::Content(std::mem::take(&mut self.buf))]
    }

    fn finish(&mut self) -> Vec<ParseEvent> {
        let buf = std::mem::take(&mut self.buf);
        let state = std::mem::replace(&mut self.state, WholeState::Content);
        match state {
            WholeState::Calls => body_events(self.parse, &self.schemas, &buf, || buf.clone()),
            _ if buf.is_empty() => Vec::new(),
            _ => vec![ParseEvent::Content(buf)],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::partial_marker_len;

    #[test]
    fn partial_markers_are_held_back() {
        assert_eq!(partial_marker_len("abc <tool", "<tool_call>"), 5);
        assert_eq!(partial_marker_len("abc <", "<tool_call>"), 1);
        assert_eq!(partial_marker_len("abc", "<tool_call>"), 0);
        assert_eq!(partial_marker_len("<tool_call", "<tool_call>"), 10);
        assert_eq!(partial_marker_len("é<", "<a>"), 1);
    }
}
