//! The tool-call formats models write, by `--tool-call-parser` name, and the parsers of forced
//! calls (whose output the grammar shaped as JSON).

use std::sync::Arc;

use serde_json::{Map, Value as Json};

use super::request::{ToolChoice, ToolRequest, ToolSchemas};
use super::scanner::{Delimited, WholeOutput};
use super::{pythonic, ParseEvent, ToolCall, ToolCallParser};

/// The formats `--tool-call-parser` accepts, as vLLM names them.
pub const TOOL_PARSER_NAMES: [&str; 5] = [
    "hermes",
    "qwen3_coder",
    "llama3_json",
    "mistral",
    "pythonic",
];

/// A model family's tool-call format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolParserKind {
    /// `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes, Qwen2.5, Qwen3).
    Hermes,
    /// `<tool_call><function=NAME><parameter=P>value</parameter></function></tool_call>`.
    Qwen3Coder,
    /// `{"name": ..., "parameters": {...}}` as the whole output, `;`-separated, optionally after
    /// `<|python_tag|>` (Llama 3.1 / 3.2 JSON tool calling).
    Llama3Json,
    /// `[TOOL_CALLS][{"name": ..., "arguments": {...}}]` or, from tokenizer v11,
    /// `[TOOL_CALLS]NAME[ARGS]{...}`.
    Mistral,
    /// `[f(a=1), g(b="x")]` as the whole output (Llama 3.2 / 4 pythonic).
    Pythonic,
}

impl ToolParserKind {
    /// The parser named `name` (one of [`TOOL_PARSER_NAMES`]).
    pub fn from_name(name: &str) -> Option<Self> {
        Some(match name {
            "hermes" => Self::Hermes,
            "qwen3_coder" => Self::Qwen3Coder,
            "llama3_json" => Self::Llama3Json,
            "mistral" => Self::Mistral,
            "pythonic" => Self::Pythonic,
            _ => return None,
        })
    }

    /// Whether the format's markers are special tokens, so the output must be decoded with them
    /// (`skip_special_tokens=false`) for the parser to see them.
    pub fn needs_special_tokens(self) -> bool {
        matches!(self, Self::Llama3Json | Self::Mistral | Self::Pythonic)
    }

    /// A fresh parser for one output.
    pub fn parser(self, schemas: Arc<ToolSchemas>) -> Box<dyn ToolCallParser> {
        match self {
            Self::Hermes => Box::new(Delimited::new(
                "<tool_call>",
                Some("</tool_call>"),
                parse_hermes,
                schemas,
            )),
            Self::Qwen3Coder => Box::new(Delimited::new(
                "<tool_call>",
                Some("</tool_call>"),
                parse_qwen3_coder,
                schemas,
            )),
            Self::Mistral => Box::new(Delimited::new("[TOOL_CALLS]", None, parse_mistral, schemas)),
            Self::Llama3Json => Box::new(WholeOutput::new(
                &["<|python_tag|>", "{"],
                parse_llama3_json,
                schemas,
            )),
            Self::Pythonic => Box::new(WholeOutput::new(
                &["<|python_start|>", "["],
                parse_pythonic,
                schemas,
            )),
        }
    }
}

/// The parser for one output of a request with tools: the forced form for `required` and a named
/// function, the model's own format for `auto` (when the server has one), none otherwise.
pub fn parser_for(
    request: &ToolRequest,
    auto: Option<ToolParserKind>,
) -> Option<Box<dyn ToolCallParser>> {
    match &request.choice {
        ToolChoice::None => None,
        ToolChoice::Auto => auto.map(|kind| kind.parser(Arc::new(request.schemas()))),
        ToolChoice::Required => Some(Box::new(RequiredCalls::default())),
        ToolChoice::Named(name) => Some(Box::new(NamedCall {
            name: Some(name.clone()),
        })),
    }
}

/// `{"name": ..., "arguments" | "parameters": {...}}` as a call.
fn json_call(value: &Json) -> Option<ToolCall> {
    let obj = value.as_object()?;
    let name = obj.get("name")?.as_str()?.to_string();
    let arguments = match obj.get("arguments").or_else(|| obj.get("parameters")) {
        None | Some(Json::Null) => "{}".to_string(),
        // Some models write the arguments as a JSON string.
        Some(Json::String(text)) => match serde_json::from_str::<Json>(text) {
            Ok(args @ Json::Object(_)) => args.to_string(),
            _ => return None,
        },
        Some(args @ Json::Object(_)) => args.to_string(),
        Some(_) => return None,
    };
    Some(ToolCall { name, arguments })
}

/// Consecutive JSON values in `text`, separated by whitespace or `sep`.
fn json_values(text: &str, sep: Option<char>) -> Option<Vec<Json>> {
    let mut values = Vec::new();
    let mut rest = text.trim_start();
    while !rest.is_empty() {
        let mut stream = serde_json::Deserializer::from_str(rest).into_iter::<Json>();
        values.push(stream.next()?.ok()?);
        rest = rest[stream.byte_offset()..].trim_start();
        if let Some(sep) = sep {
            rest = rest.strip_prefix(sep).unwrap_or(rest).trim_start();
        }
    }
    Some(values)
}

fn parse_hermes(body: &str, _: &ToolSchemas) -> Option<Vec<ToolCall>> {
    json_values(body, None)?.iter().map(json_call).collect()
}

fn parse_llama3_json(body: &str, _: &ToolSchemas) -> Option<Vec<ToolCall>> {
    let body = body.trim_start();
    let body = body.strip_prefix("<|python_tag|>").unwrap_or(body);
    let calls: Vec<ToolCall> = json_values(body, Some(';'))?
        .iter()
        .map(json_call)
        .collect::<Option<_>>()?;
    (!calls.is_empty()).then_some(calls)
}

fn parse_mistral(body: &str, _: &ToolSchemas) -> Option<Vec<ToolCall>> {
    let mut calls = Vec::new();
    for piece in body.split("[TOOL_CALLS]") {
        let piece = piece.trim();
        if piece.starts_with('[') || piece.starts_with('{') {
            for value in json_values(piece, None)? {
                match value {
                    Json::Array(items) => {
                        calls.extend(items.iter().map(json_call).collect::<Option<Vec<_>>>()?)
                    }
                    other => calls.push(json_call(&other)?),
                }
            }
        } else {
            // v11: NAME[ARGS]{...} (v13 may put [CALL_ID]id between the name and [ARGS]).
            let (head, args) = piece.split_once("[ARGS]")?;
            let name = head.split("[CALL_ID]").next()?.trim();
            let args: Json = serde_json::from_str(args.trim()).ok()?;
            if name.is_empty() || !args.is_object() {
                return None;
            }
            calls.push(ToolCall {
                name: name.to_string(),
                arguments: args.to_string(),
            });
        }
    }
    (!calls.is_empty()).then_some(calls)
}

fn parse_pythonic(body: &str, _: &ToolSchemas) -> Option<Vec<ToolCall>> {
    let body = body.trim();
    let body = body.strip_prefix("<|python_start|>").unwrap_or(body);
    let body = body.strip_suffix("<|python_end|>").unwrap_or(body);
    pythonic::parse_calls(body)
}

/// The text between `open` and the next `close` in `text`, and what follows.
fn between<'a>(text: &'a str, open: &str, close: &str) -> Option<(&'a str, &'a str)> {
    let start = text.find(open)? + open.len();
    let len = text[start..].find(close)?;
    Some((
        &text[start..start + len],
        &text[start + len + close.len()..],
    ))
}

/// A qwen3_coder parameter value as JSON: text for string (or unknown) parameters, else the
/// value parsed as JSON when it is (`42`, `true`, `{...}`), else the text.
fn coder_value(raw: &str, declared: Option<&str>) -> Json {
    // The format puts each value on its own lines: one newline on each side is markup.
    let raw = raw.strip_prefix('\n').unwrap_or(raw);
    let raw = raw.strip_suffix('\n').unwrap_or(raw);
    match declared {
        None | Some("string") => Json::String(raw.to_string()),
        Some(_) => {
            serde_json::from_str(raw.trim()).unwrap_or_else(|_| Json::String(raw.to_string()))
        }
    }
}

fn parse_qwen3_coder(body: &str, schemas: &ToolSchemas) -> Option<Vec<ToolCall>> {
    let mut calls = Vec::new();
    let mut rest = body;
    while let Some((function, after)) = between(rest, "<function=", "</function>") {
        let (name, mut params) = function.split_once('>')?;
        let name = name.trim();
        let mut arguments = Map::new();
        while let Some((param, after_param)) = between(params, "<parameter=", "</parameter>") {
            let (key, raw) = param.split_once('>')?;
            let key = key.trim();
            arguments.insert(
                key.to_string(),
                coder_value(raw, schemas.param_type(name, key)),
            );
            params = after_param;
        }
        if name.is_empty() || !params.trim().is_empty() {
            return None;
        }
        calls.push(ToolCall {
            name: name.to_string(),
            arguments: Json::Object(arguments).to_string(),
        });
        rest = after;
    }
    (!calls.is_empty() && rest.trim().is_empty()).then_some(calls)
}

/// A named function was forced: the whole output is its arguments, streamed as they come.
struct NamedCall {
    /// Taken when the call starts (on the first push).
    name: Option<String>,
}

impl ToolCallParser for NamedCall {
    fn push(&mut self, text: &str) -> Vec<ParseEvent> {
        let mut events = Vec::new();
        if let Some(name) = self.name.take() {
            events.push(ParseEvent::CallStart { name });
        }
        if !text.is_empty() {
            events.push(ParseEvent::CallArguments(text.to_string()));
        }
        events
    }

    fn finish(&mut self) -> Vec<ParseEvent> {
        self.push("")
    }
}

/// `required` was forced: the output is a JSON array of `{"name", "arguments"}`, parsed whole.
#[derive(Default)]
struct RequiredCalls {
    buf: String,
}

impl ToolCallParser for RequiredCalls {
    fn push(&mut self, text: &str) -> Vec<ParseEvent> {
        self.buf.push_str(text);
        Vec::new()
    }

    fn finish(&mut self) -> Vec<ParseEvent> {
        let buf = std::mem::take(&mut self.buf);
        let calls = match serde_json::from_str::<Json>(&buf) {
            Ok(Json::Array(items)) => items.iter().map(json_call).collect::<Option<Vec<_>>>(),
            _ => None,
        };
        match calls {
            Some(calls) => calls.into_iter().flat_map(super::call_events).collect(),
            // Cut short (max_tokens): what was generated is content, so nothing is lost.
            None if buf.is_empty() => Vec::new(),
            None => vec![ParseEvent::Content(buf)],
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::tools::reassemble;
    use crate::tools::request::ToolShape;

    fn schemas() -> Arc<ToolSchemas> {
        let tools = vec![
            json!({"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
            "metric": {"type": "boolean"}, "zip": {"type": "string"}}}}}),
        ];
        Arc::new(
            ToolRequest::parse(Some(&tools), None, None, ToolShape::Chat)
                .unwrap()
                .unwrap()
                .schemas(),
        )
    }

    fn run(kind: ToolParserKind, chunks: &[&str]) -> (String, Vec<ToolCall>) {
        let mut parser = kind.parser(schemas());
        let mut events = Vec::new();
        for chunk in chunks {
            events.extend(parser.push(chunk));
        }
        events.extend(parser.finish());
        reassemble(events)
    }

    /// Every split of `text` into two chunks, and one chunk per character, give the same content
    /// and calls as the whole text, which are `content` and `calls`.
    fn check(kind: ToolParserKind, text: &str, content: &str, calls: &[(&str, Json)]) {
        let whole = run(kind, &[text]);
        assert_eq!(whole.0, content, "{kind:?} content of {text:?}");
        let got: Vec<(String, Json)> = whole
            .1
            .iter()
            .map(|c| (c.name.clone(), serde_json::from_str(&c.arguments).unwrap()))
            .collect();
        let want: Vec<(String, Json)> = calls
            .iter()
            .map(|(n, a)| (n.to_string(), a.clone()))
            .collect();
        assert_eq!(got, want, "{kind:?} calls of {text:?}");
        for (k, _) in text.char_indices().skip(1) {
            assert_eq!(
                run(kind, &[&text[..k], &text[k..]]),
                whole,
                "{kind:?} split at {k}"
            );
        }
        let chars: Vec<String> = text.chars().map(String::from).collect();
        let chars: Vec<&str> = chars.iter().map(String::as_str).collect();
        assert_eq!(run(kind, &chars), whole, "{kind:?} char by char");
        // Token-like chunks of three characters with empty pushes between them.
        let pieces: Vec<String> = chars.chunks(3).map(|c| c.concat()).collect();
        let interleaved: Vec<&str> = pieces.iter().flat_map(|p| ["", p.as_str()]).collect();
        assert_eq!(run(kind, &interleaved), whole, "{kind:?} with empty pushes");
    }

    #[test]
    fn hermes_qwen_outputs() {
        // Qwen2.5-7B-Instruct's format: a JSON object per <tool_call> block, one per line.
        check(
            ToolParserKind::Hermes,
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Zürich\", \"days\": 3}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Bern\"}}\n</tool_call>",
            "\n",
            &[("get_weather", json!({"city": "Zürich", "days": 3})), ("get_weather", json!({"city": "Bern"}))],
        );
        // Qwen3 writes text first; an unterminated block at the end still parses.
        check(
            ToolParserKind::Hermes,
            "Let me check the weather.\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}",
            "Let me check the weather.\n\n",
            &[("get_weather", json!({"city": "Paris"}))],
        );
        // Text that only looks like markup stays content; so does a malformed block.
        check(
            ToolParserKind::Hermes,
            "a < b and <tool_ stays",
            "a < b and <tool_ stays",
            &[],
        );
        check(
            ToolParserKind::Hermes,
            "x<tool_call>not json</tool_call>y",
            "x<tool_call>not json</tool_call>y",
            &[],
        );
    }

    #[test]
    fn qwen3_coder_outputs() {
        // Qwen3-Coder's XML, values typed by the parameter schema.
        check(
            ToolParserKind::Qwen3Coder,
            "I'll look it up.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n5\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n<parameter=zip>\n10001\n</parameter>\n</function>\n</tool_call>",
            "I'll look it up.\n",
            &[("get_weather", json!({"city": "New York", "days": 5, "metric": true, "zip": "10001"}))],
        );
        check(
            ToolParserKind::Qwen3Coder,
            "<tool_call>\n<function=list_files>\n</function>\n</tool_call>",
            "",
            &[("list_files", json!({}))],
        );
    }

    #[test]
    fn llama3_json_outputs() {
        // Llama 3.1/3.2 JSON tool calling, with and without the python tag, two calls `;`-separated.
        check(
            ToolParserKind::Llama3Json,
            "<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Rome\"}}; {\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}",
            "",
            &[("get_weather", json!({"city": "Rome"})), ("get_weather", json!({"city": "Oslo"}))],
        );
        check(
            ToolParserKind::Llama3Json,
            "\n{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Rome\", \"days\": 2}}",
            "",
            &[("get_weather", json!({"city": "Rome", "days": 2}))],
        );
        check(
            ToolParserKind::Llama3Json,
            "The answer is {42}.",
            "The answer is {42}.",
            &[],
        );
        check(
            ToolParserKind::Llama3Json,
            "{\"answer\": 42}",
            "{\"answer\": 42}",
            &[],
        );
    }

    #[test]
    fn mistral_outputs() {
        // Mistral-7B-Instruct-v0.3 (tokenizer v3): a JSON list after [TOOL_CALLS].
        check(
            ToolParserKind::Mistral,
            "[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Lyon\"}}, {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Nice\"}}]",
            "",
            &[("get_weather", json!({"city": "Lyon"})), ("get_weather", json!({"city": "Nice"}))],
        );
        // Mistral Small 3.2 / Magistral (tokenizer v11+): NAME[ARGS]{...}, repeated.
        check(
            ToolParserKind::Mistral,
            "Sure.[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Lyon\"}[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Nice\", \"days\": 1}",
            "Sure.",
            &[("get_weather", json!({"city": "Lyon"})), ("get_weather", json!({"city": "Nice", "days": 1}))],
        );
    }

    #[test]
    fn pythonic_outputs() {
        // Llama 3.2 pythonic, and Llama 4 between its python tokens.
        check(
            ToolParserKind::Pythonic,
            "[get_weather(city='San Francisco', days=3), get_weather(city=\"Tokyo\", metric=False)]",
            "",
            &[
                ("get_weather", json!({"city": "San Francisco", "days": 3})),
                ("get_weather", json!({"city": "Tokyo", "metric": false})),
            ],
        );
        check(
            ToolParserKind::Pythonic,
            "<|python_start|>[get_weather(city=\"Lima\")]<|python_end|>",
            "",
            &[("get_weather", json!({"city": "Lima"}))],
        );
        check(
            ToolParserKind::Pythonic,
            "[1] is a citation.",
            "[1] is a citation.",
            &[],
        );
    }

    #[test]
    fn forced_outputs() {
        let tools = vec![json!({"type": "function", "function": {"name": "f"}})];
        let named = ToolRequest::parse(
            Some(&tools),
            Some(&json!({"type": "function", "function": {"name": "f"}})),
            None,
            ToolShape::Chat,
        )
        .unwrap()
        .unwrap();
        let mut p = parser_for(&named, None).unwrap();
        let mut events = p.push("{\"a\"");
        events.extend(p.push(": 1}"));
        events.extend(p.finish());
        assert_eq!(events[0], ParseEvent::CallStart { name: "f".into() });
        let (content, calls) = reassemble(events);
        assert_eq!(
            (content.as_str(), calls[0].arguments.as_str()),
            ("", "{\"a\": 1}")
        );

        let required = ToolRequest::parse(
            Some(&tools),
            Some(&json!("required")),
            None,
            ToolShape::Chat,
        )
        .unwrap()
        .unwrap();
        let mut p = parser_for(&required, None).unwrap();
        assert!(p
            .push("[{\"name\": \"f\", \"arguments\": {\"x\": [1]}}]")
            .is_empty());
        let (_, calls) = reassemble(p.finish());
        assert_eq!(
            calls,
            vec![ToolCall {
                name: "f".into(),
                arguments: "{\"x\":[1]}".into()
            }]
        );
        // Cut short: the text is content, not lost.
        let mut p = parser_for(&required, None).unwrap();
        p.push("[{\"name\": ");
        assert_eq!(reassemble(p.finish()).0, "[{\"name\": ");
        // auto without a server parser, and none: no parsing.
        let auto = ToolRequest::parse(Some(&tools), None, None, ToolShape::Chat)
            .unwrap()
            .unwrap();
        assert!(parser_for(&auto, None).is_none());
        assert!(parser_for(&auto, Some(ToolParserKind::Hermes)).is_some());
    }
}
