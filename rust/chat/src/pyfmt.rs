//! Python-compatible text forms of template values.
//!
//! transformers renders chat templates with Jinja2, so a value printed by a template looks the way
//! Python prints it: `None`, `True`, `{'a': 1}`, and `tojson` is `json.dumps`. minijinja's own
//! forms differ (`none`, `true`, `{"a": 1}`, HTML-escaped JSON), which would change the prompt.
//! This module reproduces the Python forms on `serde_json::Value`s.

use std::fmt::Write;

use serde_json::Value as Json;

/// Options of Python's `json.dumps` that templates use.
#[derive(Debug, Clone, Default)]
pub struct DumpOptions {
    /// Escape non-ASCII characters as `\uXXXX`.
    pub ensure_ascii: bool,
    /// Pretty-print with this indent string per level (`indent=2` is two spaces).
    pub indent: Option<String>,
    /// `(item_separator, key_separator)`; defaults as in Python depend on `indent`.
    pub separators: Option<(String, String)>,
    /// Sort object keys.
    pub sort_keys: bool,
}

/// `json.dumps(value, ...)`.
pub fn json_dumps(value: &Json, opts: &DumpOptions) -> String {
    let (item_sep, key_sep) = match &opts.separators {
        Some((item, key)) => (item.clone(), key.clone()),
        None if opts.indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let mut out = String::new();
    let mut writer = JsonWriter {
        opts,
        item_sep: &item_sep,
        key_sep: &key_sep,
        out: &mut out,
    };
    writer.value(value, 0);
    out
}

struct JsonWriter<'a> {
    opts: &'a DumpOptions,
    item_sep: &'a str,
    key_sep: &'a str,
    out: &'a mut String,
}

impl JsonWriter<'_> {
    fn value(&mut self, value: &Json, level: usize) {
        match value {
            Json::Null => self.out.push_str("null"),
            Json::Bool(b) => self.out.push_str(if *b { "true" } else { "false" }),
            Json::Number(n) => self.out.push_str(&number_repr(n, true)),
            Json::String(s) => json_string(s, self.opts.ensure_ascii, self.out),
            Json::Array(items) => {
                if items.is_empty() {
                    self.out.push_str("[]");
                    return;
                }
                self.out.push('[');
                for (i, item) in items.iter().enumerate() {
                    self.separator(i, level + 1);
                    self.value(item, level + 1);
                }
                self.newline(level);
                self.out.push(']');
            }
            Json::Object(map) => {
                if map.is_empty() {
                    self.out.push_str("{}");
                    return;
                }
                let mut entries: Vec<(&String, &Json)> = map.iter().collect();
                if self.opts.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(b.0));
                }
                self.out.push('{');
                for (i, (key, item)) in entries.into_iter().enumerate() {
                    self.separator(i, level + 1);
                    json_string(key, self.opts.ensure_ascii, self.out);
                    self.out.push_str(self.key_sep);
                    self.value(item, level + 1);
                }
                self.newline(level);
                self.out.push('}');
            }
        }
    }

    /// What goes before the `i`-th item of a container: the item separator (not before the
    /// first), then a newline and indent when pretty-printing.
    fn separator(&mut self, i: usize, level: usize) {
        if i > 0 {
            self.out.push_str(self.item_sep);
        }
        self.newline(level);
    }

    fn newline(&mut self, level: usize) {
        if let Some(indent) = &self.opts.indent {
            self.out.push('\n');
            for _ in 0..level {
                self.out.push_str(indent);
            }
        }
    }
}

/// A JSON string literal as `json.dumps` writes it.
fn json_string(s: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && !c.is_ascii() => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// `str(value)` in Python: strings as they are, everything else as `repr`.
pub fn py_str(value: &Json) -> String {
    match value {
        Json::String(s) => s.clone(),
        other => py_repr(other),
    }
}

/// `repr(value)` in Python for the JSON-shaped values templates see.
pub fn py_repr(value: &Json) -> String {
    let mut out = String::new();
    write_repr(value, &mut out);
    out
}

fn write_repr(value: &Json, out: &mut String) {
    match value {
        Json::Null => out.push_str("None"),
        Json::Bool(b) => out.push_str(if *b { "True" } else { "False" }),
        Json::Number(n) => out.push_str(&number_repr(n, false)),
        Json::String(s) => string_repr(s, out),
        Json::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_repr(item, out);
            }
            out.push(']');
        }
        Json::Object(map) => {
            out.push('{');
            for (i, (key, item)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                string_repr(key, out);
                out.push_str(": ");
                write_repr(item, out);
            }
            out.push('}');
        }
    }
}

/// Python's `repr(str)`: single quotes unless the text has `'` and no `"`.
fn string_repr(s: &str, out: &mut String) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

/// A number as Python prints it. Floats use Python's `repr` (shortest round-trip digits,
/// exponent form outside 1e-4..1e16); in JSON, non-finite floats are `NaN` / `Infinity`.
fn number_repr(n: &serde_json::Number, json: bool) -> String {
    if let Some(i) = n.as_i64() {
        return i.to_string();
    }
    if let Some(u) = n.as_u64() {
        return u.to_string();
    }
    let f = n.as_f64().unwrap_or(f64::NAN);
    float_repr(f, json)
}

fn float_repr(f: f64, json: bool) -> String {
    if f.is_nan() {
        return if json { "NaN" } else { "nan" }.to_string();
    }
    if f.is_infinite() {
        let text = if json { "Infinity" } else { "inf" };
        return if f < 0.0 {
            format!("-{text}")
        } else {
            text.to_string()
        };
    }
    // Rust's `{:?}` already picks the shortest round-trip digits and switches to exponent form at
    // the same thresholds as Python; only the exponent spelling differs (`1e16` vs `1e+16`).
    let debug = format!("{f:?}");
    match debug.split_once('e') {
        Some((mantissa, exp)) => {
            let (sign, digits) = match exp.strip_prefix('-') {
                Some(d) => ('-', d),
                None => ('+', exp),
            };
            let mantissa = mantissa.strip_suffix(".0").unwrap_or(mantissa);
            format!("{mantissa}e{sign}{digits:0>2}")
        }
        None => debug,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn dumps_matches_python_defaults() {
        let v = json!({"b": [1, 2.5, null, true], "a": "é\"\n"});
        assert_eq!(
            json_dumps(&v, &DumpOptions::default()),
            r#"{"b": [1, 2.5, null, true], "a": "é\"\n"}"#
        );
        let sorted = DumpOptions {
            sort_keys: true,
            ensure_ascii: true,
            ..Default::default()
        };
        assert_eq!(
            json_dumps(&v, &sorted),
            r#"{"a": "\u00e9\"\n", "b": [1, 2.5, null, true]}"#
        );
    }

    #[test]
    fn dumps_indent_uses_compact_item_separator() {
        let v = json!({"a": [1, {}], "b": []});
        let opts = DumpOptions {
            indent: Some("  ".into()),
            ..Default::default()
        };
        assert_eq!(
            json_dumps(&v, &opts),
            "{\n  \"a\": [\n    1,\n    {}\n  ],\n  \"b\": []\n}"
        );
    }

    #[test]
    fn ensure_ascii_writes_surrogate_pairs() {
        let opts = DumpOptions {
            ensure_ascii: true,
            ..Default::default()
        };
        assert_eq!(json_dumps(&json!("😀"), &opts), r#""\ud83d\ude00""#);
    }

    #[test]
    fn repr_matches_python() {
        assert_eq!(py_repr(&json!(null)), "None");
        assert_eq!(py_repr(&json!([true, false])), "[True, False]");
        assert_eq!(py_repr(&json!({"k": "it's"})), r#"{'k': "it's"}"#);
        assert_eq!(py_repr(&json!("a'b\"c")), r#"'a\'b"c'"#);
        assert_eq!(py_str(&json!("plain")), "plain");
    }

    #[test]
    fn floats_match_python_repr() {
        assert_eq!(float_repr(1.0, false), "1.0");
        assert_eq!(float_repr(0.1, false), "0.1");
        assert_eq!(float_repr(1e16, false), "1e+16");
        assert_eq!(float_repr(1.5e-7, false), "1.5e-07");
        assert_eq!(float_repr(123456.789, false), "123456.789");
        assert_eq!(float_repr(f64::NAN, true), "NaN");
    }
}
