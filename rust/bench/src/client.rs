//! One streaming request against an OpenAI-compatible endpoint, timed on the client.
//!
//! Timing rules (those of `vllm bench serve`, except that an empty chunk does not count as a token):
//! TTFT is send → first chunk carrying generated text; ITL is the gap between consecutive chunks
//! carrying text (one entry per chunk, so a chunk holding several tokens is one gap); latency is
//! send → end of stream.

use std::time::{Duration, Instant};

use eventsource_stream::Eventsource;
use futures_util::StreamExt;
use serde_json::{json, Map, Value};

use crate::dataset::SampleRequest;

/// Static part of every request: where it goes and what it carries besides the prompt.
#[derive(Debug, Clone)]
pub struct RequestTemplate {
    pub api_url: String,
    pub model: String,
    pub chat: bool,
    pub api_key: Option<String>,
    pub ignore_eos: bool,
    pub temperature: Option<f64>,
    /// Merged into the body last, so it can override anything.
    pub extra_body: Map<String, Value>,
}

/// What one request measured. Times are seconds.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RequestOutput {
    pub success: bool,
    pub prompt_len: usize,
    /// Offset of the send from the start of the benchmark.
    pub start_time: f64,
    pub ttft: f64,
    pub itl: Vec<f64>,
    pub latency: f64,
    pub generated_text: String,
    /// `usage.completion_tokens` from the final chunk, when the server reports it.
    pub output_tokens: Option<usize>,
    pub error: String,
}

impl RequestTemplate {
    /// JSON body for one request.
    pub fn body(&self, req: &SampleRequest) -> Value {
        let mut body = if self.chat {
            json!({
                "model": self.model,
                "messages": [{"role": "user", "content": req.prompt}],
                // Both spellings: newer servers read the first, older ones (and some non-vLLM ones)
                // only the second.
                "max_completion_tokens": req.expected_output_len,
                "max_tokens": req.expected_output_len,
            })
        } else {
            json!({"model": self.model, "prompt": req.prompt, "max_tokens": req.expected_output_len})
        };
        let obj = body.as_object_mut().expect("literal object");
        obj.insert("stream".into(), json!(true));
        obj.insert("stream_options".into(), json!({"include_usage": true}));
        if self.ignore_eos {
            obj.insert("ignore_eos".into(), json!(true));
        }
        if let Some(t) = self.temperature {
            obj.insert("temperature".into(), json!(t));
        }
        for (k, v) in &self.extra_body {
            obj.insert(k.clone(), v.clone());
        }
        body
    }
}

/// Text carried by one streamed chunk, for either route.
fn chunk_text(chunk: &Value, chat: bool) -> Option<&str> {
    let choice = chunk.get("choices")?.get(0)?;
    let text = if chat {
        let delta = choice.get("delta")?;
        delta
            .get("content")
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
            .or_else(|| delta.get("reasoning_content").and_then(Value::as_str))
    } else {
        choice.get("text").and_then(Value::as_str)
    };
    text.filter(|s| !s.is_empty())
}

/// Shortens a server error body to something that fits on one line of a report.
fn one_line(s: &str) -> String {
    let flat: String = s.split_whitespace().collect::<Vec<_>>().join(" ");
    if flat.chars().count() > 300 {
        format!("{}…", flat.chars().take(300).collect::<String>())
    } else {
        flat
    }
}

/// A request ready to go: its body is serialized ahead of time so that no client-side work
/// happens between the send timestamp and the bytes leaving.
#[derive(Debug, Clone)]
pub struct PreparedRequest {
    pub prompt_len: usize,
    pub body: bytes::Bytes,
}

impl RequestTemplate {
    /// Serializes the body of `req`.
    pub fn prepare(&self, req: &SampleRequest) -> PreparedRequest {
        PreparedRequest {
            prompt_len: req.prompt_len,
            body: bytes::Bytes::from(self.body(req).to_string()),
        }
    }
}

/// Sends `req` and streams the response. Never panics and never returns an `Err`: every failure is
/// recorded in the output so that the run keeps going and the report can count reasons.
pub async fn send(
    client: &reqwest::Client,
    tpl: &RequestTemplate,
    req: &PreparedRequest,
    bench_start: Instant,
) -> RequestOutput {
    let mut out = RequestOutput {
        prompt_len: req.prompt_len,
        ..Default::default()
    };
    let mut builder = client
        .post(&tpl.api_url)
        .header(reqwest::header::CONTENT_TYPE, "application/json")
        .body(req.body.clone());
    if let Some(key) = &tpl.api_key {
        builder = builder.bearer_auth(key);
    }
    let sent = Instant::now();
    out.start_time = sent.duration_since(bench_start).as_secs_f64();
    let result = match builder.build() {
        Ok(request) => stream_into(client, request, tpl.chat, sent, &mut out).await,
        Err(e) => Err(format!("cannot build request: {}", error_chain(&e))),
    };
    out.latency = sent.elapsed().as_secs_f64();
    match result {
        Ok(()) => out.success = true,
        Err(e) => out.error = e,
    }
    out
}

async fn stream_into(
    client: &reqwest::Client,
    request: reqwest::Request,
    chat: bool,
    sent: Instant,
    out: &mut RequestOutput,
) -> Result<(), String> {
    let resp = client
        .execute(request)
        .await
        .map_err(|e| format!("request failed: {}", error_chain(&e)))?;
    let status = resp.status();
    if !status.is_success() {
        let body = resp.text().await.unwrap_or_default();
        return Err(format!("HTTP {}: {}", status.as_u16(), one_line(&body)));
    }
    let mut events = resp.bytes_stream().eventsource();
    let mut last = sent;
    let mut done = false;
    while let Some(event) = events.next().await {
        let event = event.map_err(|e| format!("stream broke: {e}"))?;
        let now = Instant::now();
        let data = event.data.trim();
        if data == "[DONE]" {
            done = true;
            break;
        }
        let chunk: Value = serde_json::from_str(data)
            .map_err(|e| format!("bad SSE payload ({e}): {}", one_line(data)))?;
        if let Some(err) = chunk.get("error") {
            return Err(format!(
                "server error in stream: {}",
                one_line(&err.to_string())
            ));
        }
        if let Some(n) = chunk
            .pointer("/usage/completion_tokens")
            .and_then(Value::as_u64)
        {
            out.output_tokens = Some(n as usize);
        }
        if let Some(text) = chunk_text(&chunk, chat) {
            if out.ttft == 0.0 {
                out.ttft = now.duration_since(sent).as_secs_f64();
            } else {
                out.itl.push(now.duration_since(last).as_secs_f64());
            }
            last = now;
            out.generated_text.push_str(text);
        }
    }
    if !done {
        return Err("stream ended without [DONE]".into());
    }
    if out.ttft == 0.0 {
        return Err("stream carried no generated text".into());
    }
    Ok(())
}

/// `reqwest` hides the useful part ("Connection refused", "timed out") in the source chain.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut msg = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        let text = s.to_string();
        if !msg.contains(&text) {
            msg.push_str(": ");
            msg.push_str(&text);
        }
        src = s.source();
    }
    msg
}

/// The shared HTTP client: connections are pooled per host and kept alive across requests.
pub fn build_client(read_timeout: Duration) -> Result<reqwest::Client, String> {
    reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(10))
        .read_timeout(read_timeout)
        .pool_idle_timeout(Duration::from_secs(90))
        .tcp_nodelay(true)
        .build()
        .map_err(|e| format!("cannot build HTTP client: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tpl(chat: bool) -> RequestTemplate {
        RequestTemplate {
            api_url: "http://x/v1/completions".into(),
            model: "m".into(),
            chat,
            api_key: None,
            ignore_eos: true,
            temperature: Some(0.0),
            extra_body: serde_json::from_str(r#"{"top_k": 5}"#).unwrap(),
        }
    }

    #[test]
    fn bodies_follow_openai_schema() {
        let req = SampleRequest {
            prompt: "hi".into(),
            prompt_len: 1,
            expected_output_len: 7,
        };
        let b = tpl(false).body(&req);
        assert_eq!(b["prompt"], "hi");
        assert_eq!(b["max_tokens"], 7);
        assert_eq!(b["stream"], true);
        assert_eq!(b["stream_options"]["include_usage"], true);
        assert_eq!(b["ignore_eos"], true);
        assert_eq!(b["top_k"], 5);
        let c = tpl(true).body(&req);
        assert_eq!(c["messages"][0]["content"], "hi");
        assert_eq!(c["max_completion_tokens"], 7);
        assert!(c.get("prompt").is_none());
    }

    #[test]
    fn chunk_text_ignores_role_only_and_usage_chunks() {
        let role: Value =
            serde_json::from_str(r#"{"choices":[{"delta":{"role":"assistant","content":""}}]}"#)
                .unwrap();
        let tok: Value =
            serde_json::from_str(r#"{"choices":[{"delta":{"content":"Hi"}}]}"#).unwrap();
        let usage: Value =
            serde_json::from_str(r#"{"choices":[],"usage":{"completion_tokens":3}}"#).unwrap();
        let cmpl: Value =
            serde_json::from_str(r#"{"choices":[{"text":" yo","index":0}]}"#).unwrap();
        assert_eq!(chunk_text(&role, true), None);
        assert_eq!(chunk_text(&tok, true), Some("Hi"));
        assert_eq!(chunk_text(&usage, true), None);
        assert_eq!(chunk_text(&cmpl, false), Some(" yo"));
    }

    #[test]
    fn long_error_bodies_are_cut_to_one_line() {
        let s = one_line(&format!("a\nb {}", "x".repeat(1000)));
        assert!(!s.contains('\n'));
        assert!(s.chars().count() <= 301);
    }
}
