//! Rendering Hugging Face chat templates the way transformers' `apply_chat_template` does.
//!
//! transformers renders with a sandboxed Jinja2 environment configured with `trim_blocks`,
//! `lstrip_blocks`, loop controls, and the globals `raise_exception`, `strftime_now`,
//! `namespace`, `dict` plus a `tojson` filter that is plain `json.dumps` (no HTML escaping).
//! Templates also call Python methods on strings, dicts and lists (`.strip()`, `.items()`, ...).
//! This module builds the same environment on minijinja: the `pycompat` callback supplies the
//! Python methods, and [`crate::pyfmt`] makes printed values and JSON look as Python prints them.

use std::collections::BTreeMap;
use std::sync::Arc;

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{AutoEscape, Environment, Error, ErrorKind, State};
use serde_json::{Map, Value as Json};

use crate::error::{ChatError, Result};
use crate::pyfmt::{self, DumpOptions};

/// The name of the template used when none is requested.
pub const DEFAULT_TEMPLATE_NAME: &str = "default";
/// The named template transformers prefers when tools are passed.
pub const TOOL_USE_TEMPLATE_NAME: &str = "tool_use";

/// Marker appended to the final message for `continue_final_message` (transformers' trick: render,
/// then cut the text at the marker, so the template's end-of-turn tokens are dropped).
const CONTINUE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";

/// Message fields that carry reasoning text; transformers copies the first present one to
/// `thinking` and `reasoning_content` so templates of every family find it.
const REASONING_FIELDS: [&str; 3] = ["reasoning_content", "thinking", "reasoning"];

/// Keys that the renderer sets itself; `extra` may not override them (transformers raises a
/// `TypeError` for duplicate keyword arguments).
const RESERVED_KEYS: [&str; 4] = ["messages", "tools", "documents", "add_generation_prompt"];

/// The special-token strings a template sees as variables (`bos_token`, `eos_token`, ...), as
/// transformers passes its `special_tokens_map`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecialTokenStrings {
    /// `bos_token`.
    pub bos_token: Option<String>,
    /// `eos_token`.
    pub eos_token: Option<String>,
    /// `unk_token`.
    pub unk_token: Option<String>,
    /// `pad_token`.
    pub pad_token: Option<String>,
}

/// Options of one rendering, mirroring `apply_chat_template`'s keyword arguments.
#[derive(Debug, Clone, Default)]
pub struct RenderOptions {
    /// End with the header that starts an assistant turn.
    pub add_generation_prompt: bool,
    /// Leave the final message open so the model continues it (incompatible with
    /// `add_generation_prompt`).
    pub continue_final_message: bool,
    /// Tool JSON schemas (`None` renders as Python `None`, which templates test with `is none`).
    pub tools: Option<Vec<Json>>,
    /// RAG documents, for templates that read `documents`.
    pub documents: Option<Vec<Json>>,
    /// Extra template variables (`chat_template_kwargs`, e.g. `enable_thinking`). They override
    /// the special tokens but may not shadow `messages`, `tools`, `documents` or
    /// `add_generation_prompt`.
    pub extra: Map<String, Json>,
    /// Which named template to use; `None` picks `tool_use` when tools are given and the model
    /// has one, else `default`.
    pub template_name: Option<String>,
}

/// A compiled chat template (possibly several named ones) plus the special-token strings it
/// sees. `Send + Sync`; cloning is cheap.
#[derive(Clone)]
pub struct ChatTemplate {
    inner: Arc<Inner>,
}

struct Inner {
    env: Environment<'static>,
    /// Template names in the environment, sorted.
    names: Vec<String>,
    /// The source of every template, by name.
    sources: BTreeMap<String, String>,
    tokens: SpecialTokenStrings,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("names", &self.inner.names)
            .field("tokens", &self.inner.tokens)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles a single (default) template.
    pub fn new(source: impl Into<String>, tokens: SpecialTokenStrings) -> Result<Self> {
        Self::with_named([(DEFAULT_TEMPLATE_NAME.to_string(), source.into())], tokens)
    }

    /// Compiles several named templates (the list form of `chat_template` in
    /// `tokenizer_config.json`).
    pub fn with_named<I>(templates: I, tokens: SpecialTokenStrings) -> Result<Self>
    where
        I: IntoIterator<Item = (String, String)>,
    {
        let mut env = new_environment();
        let mut sources = BTreeMap::new();
        for (name, source) in templates {
            let prepared = replace_generation_tags(&source);
            env.add_template_owned(name.clone(), prepared)
                .map_err(|e| ChatError::Syntax {
                    name: name.clone(),
                    message: describe(&e),
                })?;
            sources.insert(name, source);
        }
        Ok(Self {
            inner: Arc::new(Inner {
                env,
                names: sources.keys().cloned().collect(),
                sources,
                tokens,
            }),
        })
    }

    /// The names of the templates, sorted.
    pub fn names(&self) -> &[String] {
        &self.inner.names
    }

    /// The source of the template `name`, as given (before any preprocessing).
    pub fn source(&self, name: &str) -> Option<&str> {
        self.inner.sources.get(name).map(String::as_str)
    }

    /// The special-token strings the template sees.
    pub fn special_tokens(&self) -> &SpecialTokenStrings {
        &self.inner.tokens
    }

    /// Renders `messages` (a list of JSON objects with `role`, `content`, ...) into a prompt.
    ///
    /// Like transformers: keys whose value is `null` are dropped from each message; reasoning
    /// fields are aliased; `raise_exception(msg)` in the template becomes
    /// [`ChatError::TemplateRaised`].
    pub fn render(&self, messages: &[Json], opts: &RenderOptions) -> Result<String> {
        let name = self.pick_template(opts)?;
        if messages.is_empty() {
            return Err(ChatError::InvalidMessages(
                "cannot apply a chat template to an empty conversation".into(),
            ));
        }
        let mut messages = normalize_messages(messages)?;
        let continued = if opts.continue_final_message {
            if opts.add_generation_prompt {
                return Err(ChatError::InvalidOptions(
                    "continue_final_message and add_generation_prompt are not compatible".into(),
                ));
            }
            // transformers refuses when the template never reads `content`.
            if !self.inner.sources[name].contains("content") {
                return Err(ChatError::InvalidOptions(
                    "continue_final_message is set but the chat template does not use the \
                     message content"
                        .into(),
                ));
            }
            Some(tag_final_message(&mut messages)?)
        } else {
            None
        };

        check_objects("tools", opts.tools.as_deref())?;
        check_objects("documents", opts.documents.as_deref())?;
        let ctx = self.context(messages, opts)?;
        let template = self
            .inner
            .env
            .get_template(name)
            .map_err(|e| ChatError::Render(describe(&e)))?;
        let rendered = template.render(ctx).map_err(render_error)?;

        match continued {
            Some(final_text) => cut_at_continue_tag(rendered, &final_text),
            None => Ok(rendered),
        }
    }

    fn pick_template(&self, opts: &RenderOptions) -> Result<&str> {
        let has = |name: &str| self.inner.sources.contains_key(name);
        let requested = match &opts.template_name {
            Some(name) => name.as_str(),
            None if opts.tools.is_some() && has(TOOL_USE_TEMPLATE_NAME) => TOOL_USE_TEMPLATE_NAME,
            None => DEFAULT_TEMPLATE_NAME,
        };
        self.inner
            .sources
            .get_key_value(requested)
            .map(|(k, _)| k.as_str())
            .ok_or_else(|| ChatError::TemplateNotFound {
                requested: requested.to_string(),
                available: self.inner.names.clone(),
            })
    }

    fn context(&self, messages: Vec<Json>, opts: &RenderOptions) -> Result<Value> {
        let mut ctx = Map::new();
        let tokens = &self.inner.tokens;
        for (key, token) in [
            ("bos_token", &tokens.bos_token),
            ("eos_token", &tokens.eos_token),
            ("unk_token", &tokens.unk_token),
            ("pad_token", &tokens.pad_token),
        ] {
            if let Some(token) = token {
                ctx.insert(key.to_string(), Json::String(token.clone()));
            }
        }
        for (key, value) in &opts.extra {
            if RESERVED_KEYS.contains(&key.as_str()) {
                return Err(ChatError::InvalidOptions(format!(
                    "extra template variable {key:?} would shadow a reserved variable"
                )));
            }
            ctx.insert(key.clone(), value.clone());
        }
        ctx.insert("messages".into(), Json::Array(messages));
        let list_or_null = |items: &Option<Vec<Json>>| match items {
            Some(items) => Json::Array(items.clone()),
            None => Json::Null,
        };
        ctx.insert("tools".into(), list_or_null(&opts.tools));
        ctx.insert("documents".into(), list_or_null(&opts.documents));
        ctx.insert(
            "add_generation_prompt".into(),
            Json::Bool(opts.add_generation_prompt),
        );
        Ok(Value::from_serialize(&ctx))
    }
}

/// The environment transformers' `_compile_jinja_template` builds, on minijinja.
fn new_environment() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    // Prompts are not HTML: never escape, whatever a template's name looks like.
    env.set_auto_escape_callback(|_| AutoEscape::None);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.set_formatter(|out, _state, value| out.write_str(&py_str(value)?).map_err(Error::from));
    env.add_filter("tojson", tojson);
    env.add_filter(
        "string",
        |value: &Value| -> std::result::Result<String, Error> {
            match value.as_str() {
                Some(s) => Ok(s.to_string()),
                None => Ok(pyfmt::py_str(&to_json(value)?)),
            }
        },
    );
    env.add_filter("trim", trim);
    // Jinja2's `sequence` test is "has len() and []": true for strings and dicts too.
    env.add_test("sequence", |value: &Value| {
        matches!(
            value.kind(),
            ValueKind::String | ValueKind::Seq | ValueKind::Map
        )
    });
    env.add_filter("join", join);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    env
}

/// `str(value)` as Python would print it.
fn py_str(value: &Value) -> std::result::Result<String, Error> {
    match value.as_str() {
        Some(s) => Ok(s.to_string()),
        None if value.is_undefined() => Ok(String::new()),
        None => Ok(pyfmt::py_str(&to_json(value)?)),
    }
}

/// Jinja2's `trim(value, chars=None)`: `str(value).strip(chars)`, so a non-string (e.g. a list
/// of content parts) is trimmed in its Python form.
fn trim(value: &Value, chars: Option<String>) -> std::result::Result<String, Error> {
    let text = py_str(value)?;
    Ok(match chars {
        Some(chars) => text.trim_matches(|c| chars.contains(c)).to_string(),
        // Python's `str.isspace` also counts the separators U+001C..U+001F.
        None => text
            .trim_matches(|c: char| c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c))
            .to_string(),
    })
}

/// Jinja2's `join(value, d='', attribute=None)`, joining the Python `str` of each item.
fn join(
    value: &Value,
    separator: Option<String>,
    kwargs: Kwargs,
) -> std::result::Result<String, Error> {
    let attribute: Option<String> = kwargs.get("attribute")?;
    kwargs.assert_all_used()?;
    if let Some(s) = value.as_str() {
        // A string joins its characters.
        let separator = separator.unwrap_or_default();
        return Ok(s
            .chars()
            .map(String::from)
            .collect::<Vec<_>>()
            .join(&separator));
    }
    let mut parts = Vec::new();
    for item in value.try_iter()? {
        let item = match &attribute {
            Some(path) => attribute_path(&item, path)?,
            None => item,
        };
        parts.push(py_str(&item)?);
    }
    Ok(parts.join(&separator.unwrap_or_default()))
}

/// Follows a Jinja2 attribute path such as `function.name` or `parts.0`.
fn attribute_path(value: &Value, path: &str) -> std::result::Result<Value, Error> {
    let mut current = value.clone();
    for segment in path.split('.') {
        current = match segment.parse::<usize>() {
            Ok(index)
                if current.as_object().is_some() && current.get_attr(segment)?.is_undefined() =>
            {
                current.get_item_by_index(index)?
            }
            _ => current.get_attr(segment)?,
        };
    }
    Ok(current)
}

/// Converts a template value to JSON for the Python-style printers.
fn to_json(value: &Value) -> std::result::Result<Json, Error> {
    serde_json::to_value(value).map_err(|e| {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("value cannot be converted to JSON: {e}"),
        )
    })
}

/// transformers' `tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`.
/// Its first positional argument is `ensure_ascii` (not `indent`, as in Jinja2's own filter).
fn tojson(
    _state: &State,
    value: &Value,
    ensure_ascii: Option<bool>,
    kwargs: Kwargs,
) -> std::result::Result<Value, Error> {
    let ensure_ascii = match kwargs.get::<Option<bool>>("ensure_ascii")? {
        Some(flag) => flag,
        None => ensure_ascii.unwrap_or(false),
    };
    let indent = match kwargs.get::<Option<Value>>("indent")? {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match (v.as_str(), i64::try_from(v.clone())) {
            (Some(s), _) => Some(s.to_string()),
            (None, Ok(n)) => Some(" ".repeat(usize::try_from(n).unwrap_or(0))),
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: indent must be an integer or a string",
                ))
            }
        },
    };
    let separators = match kwargs.get::<Option<Vec<String>>>("separators")? {
        None => None,
        Some(pair) if pair.len() == 2 => Some((pair[0].clone(), pair[1].clone())),
        Some(_) => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be a pair of strings",
            ))
        }
    };
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    kwargs.assert_all_used()?;
    let opts = DumpOptions {
        ensure_ascii,
        indent,
        separators,
        sort_keys,
    };
    // Marked safe so that an auto-escaping caller would not escape it again (never the case here).
    Ok(Value::from_safe_string(pyfmt::json_dumps(
        &to_json(value)?,
        &opts,
    )))
}

/// The error `raise_exception` attaches, so that rendering can report the template's message.
#[derive(Debug)]
struct RaisedByTemplate(String);

impl std::fmt::Display for RaisedByTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RaisedByTemplate {}

fn raise_exception(message: String) -> std::result::Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message.clone())
        .with_source(RaisedByTemplate(message)))
}

/// `datetime.now().strftime(format)`, in local time like transformers.
fn strftime_now(format: &str) -> std::result::Result<String, Error> {
    use std::fmt::Write;
    let mut out = String::new();
    // Formatting through `write!` reports an invalid format as an error instead of panicking.
    write!(out, "{}", chrono::Local::now().format(format)).map_err(|_| {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: invalid format {format:?}"),
        )
    })?;
    Ok(out)
}

/// Maps a render failure to a [`ChatError`], recognising `raise_exception`.
fn render_error(err: Error) -> ChatError {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&err);
    while let Some(e) = source {
        if let Some(raised) = e.downcast_ref::<RaisedByTemplate>() {
            return ChatError::TemplateRaised(raised.0.clone());
        }
        source = e.source();
    }
    ChatError::Render(describe(&err))
}

/// An error's message with its template location, on one line.
fn describe(err: &Error) -> String {
    match (err.name(), err.line()) {
        (Some(name), Some(line)) => format!("{err} ({name} line {line})"),
        _ => err.to_string(),
    }
}

/// transformers' `_normalize_chat_messages` + `_alias_reasoning_fields`: every message must be
/// an object; `null` values are dropped; reasoning text is copied to `thinking` and
/// `reasoning_content`.
fn normalize_messages(messages: &[Json]) -> Result<Vec<Json>> {
    messages
        .iter()
        .enumerate()
        .map(|(i, message)| {
            let Json::Object(fields) = message else {
                return Err(ChatError::InvalidMessages(format!(
                    "message {i} is not a JSON object"
                )));
            };
            let mut fields: Map<String, Json> = fields
                .iter()
                .filter(|(_, v)| !v.is_null())
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            let reasoning = REASONING_FIELDS
                .iter()
                .find_map(|key| fields.get(*key).cloned());
            if let Some(reasoning) = reasoning {
                // Python's `{"thinking": r, **message, "reasoning_content": r}`: `thinking` comes
                // first (keeping the message's own value if it has one) and `reasoning_content`
                // is overwritten in place or appended.
                let thinking = fields.shift_remove("thinking").unwrap_or(reasoning.clone());
                let mut reordered = Map::new();
                reordered.insert("thinking".into(), thinking);
                reordered.extend(fields);
                reordered.insert("reasoning_content".into(), reasoning);
                fields = reordered;
            }
            Ok(Json::Object(fields))
        })
        .collect()
}

/// transformers accepts tools and documents only as JSON objects (dicts).
fn check_objects(what: &str, items: Option<&[Json]>) -> Result<()> {
    match items
        .unwrap_or_default()
        .iter()
        .position(|item| !item.is_object())
    {
        Some(i) => Err(ChatError::InvalidOptions(format!(
            "{what}[{i}] is not a JSON object"
        ))),
        None => Ok(()),
    }
}

/// Appends [`CONTINUE_TAG`] to the final message's text; returns that text (before the tag).
fn tag_final_message(messages: &mut [Json]) -> Result<String> {
    let last = messages.last_mut().ok_or_else(|| {
        ChatError::InvalidMessages("continue_final_message is set but there are no messages".into())
    })?;
    let content = last.get_mut("content").ok_or_else(|| {
        ChatError::InvalidMessages(
            "continue_final_message is set but the final message has no content".into(),
        )
    })?;
    match content {
        Json::String(text) => {
            let original = text.clone();
            text.push_str(CONTINUE_TAG);
            Ok(original)
        }
        Json::Array(parts) => {
            // The last text part is the one to continue.
            for part in parts.iter_mut().rev() {
                if let Some(Json::String(text)) = part.get_mut("text") {
                    let original = text.clone();
                    text.push_str(CONTINUE_TAG);
                    return Ok(original);
                }
            }
            Err(ChatError::InvalidMessages(
                "continue_final_message is set but the final message has no text part".into(),
            ))
        }
        _ => Err(ChatError::InvalidMessages(
            "continue_final_message is set but the final message content is not text".into(),
        )),
    }
}

/// Cuts the rendered prompt at the continue tag, as transformers does.
fn cut_at_continue_tag(rendered: String, final_text: &str) -> Result<String> {
    let tag = CONTINUE_TAG.trim();
    let found = rendered.contains(final_text.trim()) && rendered.contains(tag);
    let Some(pos) = rendered.rfind(tag).filter(|_| found) else {
        return Err(ChatError::InvalidMessages(
            "continue_final_message is set but the final message does not appear in the rendered \
             chat (the template rewrites it)"
                .into(),
        ));
    };
    if rendered[pos..].starts_with(CONTINUE_TAG) {
        Ok(rendered[..pos].to_string())
    } else {
        // The template trimmed the space after the tag, so trailing space is not meaningful.
        Ok(rendered[..pos].trim_end().to_string())
    }
}

/// Rewrites transformers' `{% generation %}` … `{% endgeneration %}` block (an extension that only
/// marks assistant text for training masks) into `{% if true %}` … `{% endif %}`, which renders
/// the same text and keeps the tags' whitespace control.
fn replace_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let tag = &rest[start..];
        let Some(end) = tag.find("%}") else {
            break;
        };
        let inner = &tag[2..end];
        let (open, body) = split_ws_control_prefix(inner);
        let (body, close) = split_ws_control_suffix(body);
        let replacement = match body.trim() {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match replacement {
            Some(word) => {
                out.push_str("{%");
                out.push_str(open);
                out.push(' ');
                out.push_str(word);
                out.push(' ');
                out.push_str(close);
                out.push_str("%}");
            }
            None => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

fn split_ws_control_prefix(s: &str) -> (&str, &str) {
    match s.chars().next() {
        Some('-' | '+') => s.split_at(1),
        _ => ("", s),
    }
}

fn split_ws_control_suffix(s: &str) -> (&str, &str) {
    match s.chars().last() {
        Some('-' | '+') => s.split_at(s.len() - 1),
        _ => (s, ""),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn render(source: &str, messages: Json, opts: &RenderOptions) -> Result<String> {
        let template = ChatTemplate::new(source, SpecialTokenStrings::default())?;
        let messages = messages.as_array().cloned().unwrap_or_default();
        template.render(&messages, opts)
    }

    #[test]
    fn raise_exception_becomes_typed_error() {
        let err = render(
            "{% for m in messages %}{% if m.role == 'bad' %}{{ raise_exception('no bad roles') }}{% endif %}{% endfor %}",
            json!([{"role": "bad", "content": "x"}]),
            &RenderOptions::default(),
        )
        .unwrap_err();
        assert!(
            matches!(err, ChatError::TemplateRaised(ref m) if m == "no bad roles"),
            "{err:?}"
        );
    }

    #[test]
    fn raise_exception_inside_a_macro_and_a_filter_block_is_still_typed() {
        let err = render(
            "{% macro check(m) %}{% if m.role == 'x' %}{{ raise_exception('bad: ' ~ m.role) }}{% endif %}{% endmacro %}\
             {% filter upper %}{% for m in messages %}{{ check(m) }}{% endfor %}{% endfilter %}",
            json!([{"role": "user", "content": "a"}, {"role": "x", "content": "b"}]),
            &RenderOptions::default(),
        )
        .unwrap_err();
        assert!(
            matches!(err, ChatError::TemplateRaised(ref m) if m == "bad: x"),
            "{err:?}"
        );
    }

    #[test]
    fn generation_tags_render_their_body() {
        let out = render(
            "{% for m in messages %}{%- generation -%} [{{ m.content }}] {%- endgeneration %}{% endfor %}",
            json!([{"role": "assistant", "content": "hi"}]),
            &RenderOptions::default(),
        )
        .unwrap();
        assert_eq!(out, "[hi]");
    }

    #[test]
    fn null_fields_are_dropped_and_python_values_printed() {
        let out = render(
            "{% for m in messages %}{{ m.content is defined }} {{ m.flag }} {{ m.meta }}{% endfor %}",
            json!([{"role": "user", "content": null, "flag": false, "meta": {"k": [1, null]}}]),
            &RenderOptions::default(),
        )
        .unwrap();
        assert_eq!(out, "False False {'k': [1, None]}");
    }

    #[test]
    fn syntax_errors_are_reported_at_load() {
        let err = ChatTemplate::new("{% for %}", SpecialTokenStrings::default()).unwrap_err();
        assert!(matches!(err, ChatError::Syntax { .. }), "{err:?}");
    }

    #[test]
    fn extra_cannot_shadow_messages() {
        let mut opts = RenderOptions::default();
        opts.extra.insert("messages".into(), json!([]));
        let err = render("x", json!([{"role": "user", "content": "x"}]), &opts).unwrap_err();
        assert!(matches!(err, ChatError::InvalidOptions(_)), "{err:?}");
    }

    #[test]
    fn reasoning_fields_are_aliased_like_transformers() {
        let out = render(
            "{% for m in messages %}{{ m.keys() | list }}|{{ m.thinking }}|{{ m.reasoning_content }}\n{% endfor %}",
            json!([
                {"role": "assistant", "content": "a", "reasoning": "r1"},
                {"role": "assistant", "reasoning_content": "r2", "content": "b", "thinking": "own"},
            ]),
            &RenderOptions::default(),
        )
        .unwrap();
        assert_eq!(
            out,
            "['thinking', 'role', 'content', 'reasoning', 'reasoning_content']|r1|r1\n\
             ['thinking', 'role', 'reasoning_content', 'content']|own|r2\n"
        );
    }

    #[test]
    fn tools_must_be_objects() {
        let opts = RenderOptions {
            tools: Some(vec![json!("not a schema")]),
            ..Default::default()
        };
        let err = render("x", json!([{"role": "user", "content": "x"}]), &opts).unwrap_err();
        assert!(matches!(err, ChatError::InvalidOptions(_)), "{err:?}");
    }

    #[test]
    fn continue_final_message_needs_a_template_reading_content() {
        let opts = RenderOptions {
            continue_final_message: true,
            ..Default::default()
        };
        let messages = json!([{"role": "assistant", "content": "partial"}]);
        let err = render("{{ messages | length }}", messages.clone(), &opts).unwrap_err();
        assert!(matches!(err, ChatError::InvalidOptions(_)), "{err:?}");
        let out = render(
            "{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>{% endfor %}",
            messages,
            &opts,
        )
        .unwrap();
        assert_eq!(out, "<assistant>partial");
    }

    #[test]
    fn chat_template_is_send_and_sync() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<ChatTemplate>();
    }

    #[test]
    fn non_object_message_is_rejected() {
        let err = render("x", json!(["hello"]), &RenderOptions::default()).unwrap_err();
        assert!(matches!(err, ChatError::InvalidMessages(_)), "{err:?}");
    }

    #[test]
    fn strftime_now_formats_the_current_date() {
        let out = render(
            "{{ strftime_now('%Y-%m-%d') }}",
            json!([{"role": "user", "content": "x"}]),
            &RenderOptions::default(),
        )
        .unwrap();
        // Compare with the clock on both sides of the render, in case the date changed in between.
        let today = chrono::Local::now().format("%Y-%m-%d").to_string();
        assert_eq!(out.len(), 10);
        assert!(
            out <= today && out.as_bytes()[4] == b'-',
            "{out} vs {today}"
        );
    }

    #[test]
    fn named_template_selection_prefers_tool_use_with_tools() {
        let template = ChatTemplate::with_named(
            [
                ("default".to_string(), "plain".to_string()),
                (
                    "tool_use".to_string(),
                    "tools:{{ tools | length }}".to_string(),
                ),
            ],
            SpecialTokenStrings::default(),
        )
        .unwrap();
        let messages = [json!({"role": "user", "content": "hi"})];
        let plain = template
            .render(&messages, &RenderOptions::default())
            .unwrap();
        assert_eq!(plain, "plain");
        let opts = RenderOptions {
            tools: Some(vec![json!({"name": "f"})]),
            ..Default::default()
        };
        assert_eq!(template.render(&messages, &opts).unwrap(), "tools:1");
        let missing = RenderOptions {
            template_name: Some("nope".into()),
            ..Default::default()
        };
        assert!(matches!(
            template.render(&messages, &missing),
            Err(ChatError::TemplateNotFound { .. })
        ));
        assert!(matches!(
            template.render(&[], &RenderOptions::default()),
            Err(ChatError::InvalidMessages(_))
        ));
    }
}
