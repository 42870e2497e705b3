//! Closed-loop streaming load generator for `benches/frontend_overhead`.
//!
//! `loadgen --url http://127.0.0.1:8000 --concurrency 64 --duration 10 --max-tokens 128 --prompt TEXT`
//! keeps `concurrency` streaming `/v1/completions` requests in flight for `duration` seconds and
//! prints one JSON line: completed requests, streamed content chunks (one per token with the
//! mock engine), requests/s, chunks/s, and errors. Chunks count when they arrive inside the
//! window; requests count when their `[DONE]` does.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;

fn arg(args: &[String], name: &str, default: &str) -> String {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
        .unwrap_or_else(|| default.to_string())
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let url = format!(
        "{}/v1/completions",
        arg(&args, "--url", "http://127.0.0.1:8000")
    );
    let concurrency: usize = arg(&args, "--concurrency", "1").parse()?;
    let duration = Duration::from_secs_f64(arg(&args, "--duration", "10").parse()?);
    let max_tokens: u32 = arg(&args, "--max-tokens", "128").parse()?;
    let prompt = arg(&args, "--prompt", "Hello, my name is");
    let body = serde_json::json!({
        "model": arg(&args, "--model", "mock"),
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": true,
        "ignore_eos": true,
    })
    .to_string();

    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(concurrency)
        .build()?;
    let requests = Arc::new(AtomicU64::new(0));
    let chunks = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let deadline = start + duration;
    let mut workers = Vec::with_capacity(concurrency);
    for _ in 0..concurrency {
        let (http, url, body) = (http.clone(), url.clone(), body.clone());
        let (requests, chunks, errors) = (requests.clone(), chunks.clone(), errors.clone());
        workers.push(tokio::spawn(async move {
            while Instant::now() < deadline {
                let send = http
                    .post(&url)
                    .header("content-type", "application/json")
                    .body(body.clone())
                    .send();
                let resp = match tokio::time::timeout_at(deadline.into(), send).await {
                    Ok(Ok(resp)) => resp,
                    Ok(Err(_)) => {
                        errors.fetch_add(1, Ordering::Relaxed);
                        continue;
                    }
                    Err(_) => break,
                };
                if !resp.status().is_success() {
                    errors.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                let mut done = false;
                let mut tail = Vec::new();
                let mut stream = resp.bytes_stream();
                // Stop reading at the deadline: chunks after it do not count.
                while let Ok(Some(Ok(bytes))) =
                    tokio::time::timeout_at(deadline.into(), stream.next()).await
                {
                    tail.extend_from_slice(&bytes);
                    // Count complete SSE events; keep a partial one for the next read.
                    while let Some(pos) = tail.windows(2).position(|w| w == b"\n\n") {
                        let event: Vec<u8> = tail.drain(..pos + 2).collect();
                        if event.starts_with(b"data: [DONE]") {
                            done = true;
                        } else if event.starts_with(b"data: {\"error") {
                            errors.fetch_add(1, Ordering::Relaxed);
                        } else if event.starts_with(b"data: ") {
                            chunks.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
                if done {
                    requests.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    for w in workers {
        w.await?;
    }
    let secs = duration.as_secs_f64();
    let (r, c) = (
        requests.load(Ordering::Relaxed),
        chunks.load(Ordering::Relaxed),
    );
    println!(
        "{}",
        serde_json::json!({
            "concurrency": concurrency,
            "requests": r,
            "chunks": c,
            "errors": errors.load(Ordering::Relaxed),
            "requests_per_s": r as f64 / secs,
            "chunks_per_s": c as f64 / secs,
        })
    );
    Ok(())
}
