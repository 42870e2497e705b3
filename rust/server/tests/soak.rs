//! A bounded soak (issue 22): 1,000 concurrent streams against the mock engine for about 20 s,
//! every stream checked to its `[DONE]`, and the process's resident memory flat between the end of
//! the warm-up and the end of the run. `VOLTLLM_SOAK_SECONDS` lengthens it; the minutes-long run
//! with the server in its own process is `benches/soak.py`.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::harness;
use futures::StreamExt;
use serde_json::json;

const STREAMS: usize = 1000;
const MAX_TOKENS: u32 = 32;
/// Warm-up before the first memory reading: every worker has opened its connection and the
/// server's per-connection buffers and the allocator's arenas have reached their working size.
const WARM_UP: Duration = Duration::from_secs(5);
/// The most resident memory may grow between the end of the warm-up and the end of the run. A leak
/// of 4 KiB per request over the ~10,000 requests of a 20 s run would exceed it.
const MAX_GROWTH_BYTES: u64 = 40 << 20;

/// This process's resident set size (Linux `/proc/self/status`).
fn resident_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc/self/status");
    kb * 1024
}

#[derive(Default)]
struct Tally {
    completed: AtomicU64,
    tokens: AtomicU64,
    errors: AtomicU64,
    first_error: Mutex<Option<String>>,
}

impl Tally {
    fn fail(&self, what: String) {
        self.errors.fetch_add(1, Ordering::Relaxed);
        self.first_error.lock().unwrap().get_or_insert(what);
    }
}

/// One streamed completion read to its end: counts a completion when the stream carried
/// `MAX_TOKENS` tokens and ended with `[DONE]`, an error otherwise.
async fn one_stream(http: &reqwest::Client, url: &str, tally: &Tally) {
    let body = json!({"prompt": "The quick brown fox jumps over the lazy dog", "max_tokens": MAX_TOKENS,
                      "stream": true, "ignore_eos": true});
    let response = match http.post(url).json(&body).send().await {
        Ok(r) if r.status() == 200 => r,
        Ok(r) => return tally.fail(format!("status {}", r.status())),
        Err(e) => return tally.fail(format!("send: {e}")),
    };
    let mut text = Vec::new();
    let mut chunks = response.bytes_stream();
    while let Some(chunk) = chunks.next().await {
        match chunk {
            Ok(bytes) => text.extend_from_slice(&bytes),
            Err(e) => return tally.fail(format!("body: {e}")),
        }
    }
    let text = String::from_utf8_lossy(&text);
    let events: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    let tokens = events.iter().filter(|e| e.contains("\"text\"")).count() as u64;
    if events.last() != Some(&"[DONE]") || text.contains("\"error\"") || tokens == 0 {
        return tally.fail(format!("stream did not complete: {}", events.join(" | ")));
    }
    tally.completed.fetch_add(1, Ordering::Relaxed);
    tally.tokens.fetch_add(tokens, Ordering::Relaxed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_concurrent_streams_end_cleanly_in_flat_memory() {
    let seconds: f64 = std::env::var("VOLTLLM_SOAK_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20.0);
    let h = harness("soak", |config, mock| {
        config.max_waiting_requests = STREAMS;
        mock.max_num_seqs = STREAMS as u32;
        mock.max_model_len = 4096;
        // 50 tokens/s per stream: 50,000 streamed tokens/s over the 1,000 streams.
        mock.step_interval = Duration::from_millis(20);
    })
    .await;
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(STREAMS)
        .build()
        .unwrap();
    let url = format!("{}/v1/completions", h.base);
    let tally = Arc::new(Tally::default());
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(seconds);
    let workers: Vec<_> = (0..STREAMS)
        .map(|_| {
            let (http, url, tally) = (http.clone(), url.clone(), tally.clone());
            tokio::spawn(async move {
                while Instant::now() < deadline {
                    one_stream(&http, &url, &tally).await;
                }
            })
        })
        .collect();
    tokio::time::sleep(WARM_UP).await;
    let rss_start = resident_bytes();
    let completed_at_start = tally.completed.load(Ordering::Relaxed);
    for worker in workers {
        worker.await.unwrap();
    }
    let rss_end = resident_bytes();
    let elapsed = start.elapsed().as_secs_f64();
    let completed = tally.completed.load(Ordering::Relaxed);
    let errors = tally.errors.load(Ordering::Relaxed);
    eprintln!(
        "soak: {STREAMS} streams, {elapsed:.1} s, {completed} completed ({} after warm-up), \
         {} tokens, {errors} errors, resident {} -> {} MiB",
        completed - completed_at_start,
        tally.tokens.load(Ordering::Relaxed),
        rss_start >> 20,
        rss_end >> 20,
    );
    assert_eq!(
        errors,
        0,
        "first error: {:?}",
        tally.first_error.lock().unwrap()
    );
    // Every worker finished several requests: the streams ran concurrently, not one at a time.
    assert!(
        completed >= 2 * STREAMS as u64,
        "only {completed} completed"
    );
    assert!(
        rss_end <= rss_start + MAX_GROWTH_BYTES,
        "resident memory grew from {} to {} MiB",
        rss_start >> 20,
        rss_end >> 20
    );
    // Every admission permit came back: nothing is left running in the server.
    let (_, metrics) = h.get("/metrics").await;
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("voltllm:requests_admitted{") && l.ends_with(" 0")),
        "requests still admitted:\n{metrics}"
    );
    h.shutdown().await.unwrap();
}
