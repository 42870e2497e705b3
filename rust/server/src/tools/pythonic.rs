//! The pythonic tool-call format (Llama 3.2 / Llama 4, ToolACE): a Python list of calls with
//! keyword arguments whose values are Python literals, e.g. `[f(a=1), g(b="x", c=[True, None])]`.

use serde_json::{Map, Number, Value as Json};

use super::ToolCall;

/// Parses `[f(a=1), ...]` (the whole text, whitespace around it allowed).
pub(crate) fn parse_calls(text: &str) -> Option<Vec<ToolCall>> {
    let mut p = Parser {
        s: text.as_bytes(),
        text,
        i: 0,
    };
    p.ws();
    p.eat(b'[')?;
    let mut calls = Vec::new();
    loop {
        p.ws();
        if p.eat(b']').is_some() {
            break;
        }
        if !calls.is_empty() {
            p.eat(b',')?;
            p.ws();
        }
        calls.push(p.call()?);
        p.ws();
        if p.eat(b']').is_some() {
            break;
        }
    }
    p.ws();
    (p.i == p.s.len() && !calls.is_empty()).then_some(calls)
}

struct Parser<'a> {
    s: &'a [u8],
    text: &'a str,
    i: usize,
}

impl Parser<'_> {
    fn peek(&self) -> Option<u8> {
        self.s.get(self.i).copied()
    }

    fn ws(&mut self) {
        while self.peek().is_some_and(|c| c.is_ascii_whitespace()) {
            self.i += 1;
        }
    }

    fn eat(&mut self, c: u8) -> Option<()> {
        (self.peek() == Some(c)).then(|| self.i += 1)
    }

    /// A (dotted) identifier.
    fn ident(&mut self) -> Option<String> {
        let start = self.i;
        while self
            .peek()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b'.' || c == b'-')
        {
            self.i += 1;
        }
        let name = &self.text[start..self.i];
        (!name.is_empty() && !name.as_bytes()[0].is_ascii_digit()).then(|| name.to_string())
    }

    fn call(&mut self) -> Option<ToolCall> {
        let name = self.ident()?;
        self.ws();
        self.eat(b'(')?;
        let mut args = Map::new();
        loop {
            self.ws();
            if self.eat(b')').is_some() {
                break;
            }
            if !args.is_empty() {
                self.eat(b',')?;
                self.ws();
                if self.eat(b')').is_some() {
                    break;
                }
            }
            let key = self.ident()?;
            self.ws();
            self.eat(b'=')?;
            self.ws();
            let value = self.value()?;
            args.insert(key, value);
        }
        Some(ToolCall {
            name,
            arguments: Json::Object(args).to_string(),
        })
    }

    fn value(&mut self) -> Option<Json> {
        match self.peek()? {
            b'"' | b'\'' => self.string().map(Json::String),
            b'[' | b'(' => self.list(),
            b'{' => self.dict(),
            b'-' | b'+' | b'0'..=b'9' | b'.' => self.number(),
            _ => match self.ident()?.as_str() {
                "True" => Some(Json::Bool(true)),
                "False" => Some(Json::Bool(false)),
                "None" => Some(Json::Null),
                _ => None,
            },
        }
    }

    fn list(&mut self) -> Option<Json> {
        let close = if self.peek()? == b'[' { b']' } else { b')' };
        self.i += 1;
        let mut items = Vec::new();
        loop {
            self.ws();
            if self.eat(close).is_some() {
                return Some(Json::Array(items));
            }
            if !items.is_empty() {
                self.eat(b',')?;
                self.ws();
                if self.eat(close).is_some() {
                    return Some(Json::Array(items));
                }
            }
            items.push(self.value()?);
        }
    }

    fn dict(&mut self) -> Option<Json> {
        self.i += 1;
        let mut map = Map::new();
        loop {
            self.ws();
            if self.eat(b'}').is_some() {
                return Some(Json::Object(map));
            }
            if !map.is_empty() {
                self.eat(b',')?;
                self.ws();
                if self.eat(b'}').is_some() {
                    return Some(Json::Object(map));
                }
            }
            let key = match self.value()? {
                Json::String(s) => s,
                Json::Number(n) => n.to_string(),
                Json::Bool(b) => if b { "True" } else { "False" }.to_string(),
                _ => return None,
            };
            self.ws();
            self.eat(b':')?;
            self.ws();
            map.insert(key, self.value()?);
        }
    }

    fn number(&mut self) -> Option<Json> {
        let start = self.i;
        while self.peek().is_some_and(|c| {
            c.is_ascii_digit() || matches!(c, b'-' | b'+' | b'.' | b'e' | b'E' | b'_')
        }) {
            self.i += 1;
        }
        let literal: String = self.text[start..self.i]
            .chars()
            .filter(|&c| c != '_')
            .collect();
        if let Ok(n) = literal.parse::<i64>() {
            return Some(Json::from(n));
        }
        literal
            .parse::<f64>()
            .ok()
            .and_then(Number::from_f64)
            .map(Json::Number)
    }

    /// A single- or double-quoted Python string with the common escapes.
    fn string(&mut self) -> Option<String> {
        let quote = self.peek()?;
        self.i += 1;
        let mut out = String::new();
        let mut chars = self.text[self.i..].char_indices();
        while let Some((k, c)) = chars.next() {
            match c {
                c if c as u32 == quote as u32 => {
                    self.i += k + 1;
                    return Some(out);
                }
                '\\' => {
                    let (_, e) = chars.next()?;
                    match e {
                        'n' => out.push('\n'),
                        't' => out.push('\t'),
                        'r' => out.push('\r'),
                        '0' => out.push('\0'),
                        'u' => {
                            let hex: String = (0..4)
                                .filter_map(|_| chars.next())
                                .map(|(_, h)| h)
                                .collect();
                            out.push(char::from_u32(u32::from_str_radix(&hex, 16).ok()?)?);
                        }
                        '\n' => {}
                        other => out.push(other),
                    }
                }
                c => out.push(c),
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn literals_become_json() {
        let calls = parse_calls(
            r#"[get_weather(city="San Francisco", metric='celsius'), f(a=-1.5, b=[1, 2,], c={"k": None}, d=True, e=(1,), g="it\'s \"q\"\n")]"#,
        )
        .unwrap();
        assert_eq!(calls[0].name, "get_weather");
        assert_eq!(
            calls[0].arguments,
            r#"{"city":"San Francisco","metric":"celsius"}"#
        );
        assert_eq!(
            calls[1].arguments,
            r#"{"a":-1.5,"b":[1,2],"c":{"k":null},"d":true,"e":[1],"g":"it's \"q\"\n"}"#
        );
        assert_eq!(parse_calls("[f()]").unwrap()[0].arguments, "{}");
    }

    #[test]
    fn not_calls() {
        for text in [
            "[1, 2]",
            "[f(1)]",
            "[f(a=1)",
            "f(a=1)",
            "[f(a=1)] trailing",
            "[]",
            "[f(a=x)]",
        ] {
            assert!(parse_calls(text).is_none(), "{text}");
        }
    }
}
