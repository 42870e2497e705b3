//! The two faces of a result: the console table and the JSON document (`docs/bench.md` documents
//! its schema). Keys are those of `vllm bench serve` wherever the meaning is the same.

use std::path::{Path, PathBuf};

use serde_json::{json, Map, Value};

use crate::client::RequestOutput;
use crate::error::{BenchError, Result};
use crate::metrics::{Metrics, Slo, Stat};
use crate::prom::{self, Samples};

/// Version of the result layout; bumped when a key changes meaning or disappears.
pub const SCHEMA_VERSION: u32 = 1;

/// Everything about a run's configuration that goes into its result.
#[derive(Debug, Clone)]
pub struct RunInfo {
    pub date: String,
    pub backend: String,
    pub label: String,
    pub model_id: String,
    pub tokenizer_id: String,
    pub base_url: String,
    pub endpoint: String,
    pub dataset_name: String,
    pub num_prompts: usize,
    pub request_rate: f64,
    pub burstiness: f64,
    pub max_concurrency: Option<usize>,
    pub ramp_up: Option<(String, f64, f64)>,
    pub num_warmups: usize,
    pub seed: u64,
    pub duration_limit_s: Option<f64>,
    pub metadata: Vec<(String, String)>,
}

/// Which metrics get percentile keys, and which percentiles.
#[derive(Debug, Clone)]
pub struct PercentileSpec {
    pub metrics: Vec<String>,
    pub percentiles: Vec<f64>,
}

impl PercentileSpec {
    /// Parses `--percentile-metrics` and `--metric-percentiles`.
    pub fn parse(metrics: &str, percentiles: &str) -> Result<Self> {
        let metrics: Vec<String> = metrics
            .split(',')
            .map(|m| m.trim().to_string())
            .filter(|m| !m.is_empty())
            .collect();
        if let Some(bad) = metrics
            .iter()
            .find(|m| !["ttft", "tpot", "itl", "e2el"].contains(&m.as_str()))
        {
            return Err(BenchError::InvalidArgument(format!(
                "--percentile-metrics: unknown metric '{bad}' (use ttft,tpot,itl,e2el)"
            )));
        }
        let percentiles = percentiles
            .split(',')
            .map(|p| match p.trim().parse::<f64>() {
                Ok(v) if (0.0..=100.0).contains(&v) => Ok(v),
                _ => Err(BenchError::InvalidArgument(format!(
                    "--metric-percentiles: '{p}' is not in [0, 100]"
                ))),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            metrics,
            percentiles,
        })
    }
}

/// `99` → "99", `99.9` → "99.9" (vLLM's `p_word`).
pub fn percentile_word(p: f64) -> String {
    if p.fract() == 0.0 {
        format!("{}", p as i64)
    } else {
        format!("{p}")
    }
}

/// JSON has no infinity: infinite rates are written as the string "inf", as vLLM writes them.
fn rate_value(r: f64) -> Value {
    if r.is_finite() {
        json!(r)
    } else {
        json!("inf")
    }
}

fn stat_of<'a>(m: &'a Metrics, name: &str) -> &'a Stat {
    match name {
        "ttft" => &m.ttft,
        "tpot" => &m.tpot,
        "itl" => &m.itl,
        _ => &m.e2el,
    }
}

/// Server metrics as stored in the result: both scrapes and their difference.
pub fn server_metrics_value(before: Option<Samples>, after: Option<Samples>) -> Value {
    match (before, after) {
        (Some(b), Some(a)) => json!({"delta": prom::delta(&b, &a), "before": b, "after": a}),
        _ => Value::Null,
    }
}

/// Builds the result document of one run.
#[allow(clippy::too_many_arguments)]
pub fn result_json(
    info: &RunInfo,
    duration_s: f64,
    m: &Metrics,
    spec: &PercentileSpec,
    slo: Option<&Slo>,
    outputs: &[RequestOutput],
    output_lens: &[usize],
    server_metrics: Value,
) -> Value {
    let mut r = Map::new();
    let mut put = |k: &str, v: Value| {
        r.insert(k.to_string(), v);
    };
    put("schema_version", json!(SCHEMA_VERSION));
    put("date", json!(info.date));
    put("endpoint_type", json!(info.backend));
    put("backend", json!(info.backend));
    put("label", json!(info.label));
    put("model_id", json!(info.model_id));
    put("tokenizer_id", json!(info.tokenizer_id));
    put("base_url", json!(info.base_url));
    put("endpoint", json!(info.endpoint));
    put("dataset_name", json!(info.dataset_name));
    put("num_prompts", json!(info.num_prompts));
    put("request_rate", rate_value(info.request_rate));
    put("burstiness", rate_value(info.burstiness));
    put("max_concurrency", json!(info.max_concurrency));
    if let Some((strategy, start, end)) = &info.ramp_up {
        put("ramp_up_strategy", json!(strategy));
        put("ramp_up_start_rps", json!(start));
        put("ramp_up_end_rps", json!(end));
    }
    put("num_warmups", json!(info.num_warmups));
    put("seed", json!(info.seed));
    put("duration_limit_s", json!(info.duration_limit_s));
    for (k, v) in &info.metadata {
        put(k, json!(v));
    }
    put("duration", json!(duration_s));
    put("completed", json!(m.completed));
    put("failed", json!(m.failed));
    put("total_input_tokens", json!(m.total_input));
    put("total_output_tokens", json!(m.total_output));
    put("request_throughput", json!(m.request_throughput));
    put("request_goodput", json!(m.request_goodput));
    put("output_throughput", json!(m.output_throughput));
    put("total_token_throughput", json!(m.total_token_throughput));
    put("max_output_tokens_per_s", json!(m.max_output_tokens_per_s));
    put("max_concurrent_requests", json!(m.max_concurrent_requests));
    put(
        "goodput_slo_ms",
        match slo {
            Some(s) => json!({"ttft": s.ttft_ms, "tpot": s.tpot_ms, "e2el": s.e2el_ms}),
            None => Value::Null,
        },
    );
    for name in &spec.metrics {
        let s = stat_of(m, name);
        put(&format!("mean_{name}_ms"), json!(s.mean));
        put(&format!("median_{name}_ms"), json!(s.median));
        put(&format!("std_{name}_ms"), json!(s.std));
        for (p, v) in &s.percentiles {
            put(&format!("p{}_{name}_ms", percentile_word(*p)), json!(v));
        }
    }
    put("failure_reasons", json!(m.failure_reasons));
    put("server_metrics", server_metrics);
    // Per-request records: parallel lists, index i is request i in send order.
    put(
        "input_lens",
        json!(outputs.iter().map(|o| o.prompt_len).collect::<Vec<_>>()),
    );
    put("output_lens", json!(output_lens));
    put(
        "ttfts",
        json!(outputs.iter().map(|o| o.ttft).collect::<Vec<_>>()),
    );
    put("tpots", json!(m.tpots));
    put(
        "itls",
        json!(outputs.iter().map(|o| &o.itl).collect::<Vec<_>>()),
    );
    put(
        "latencies",
        json!(outputs.iter().map(|o| o.latency).collect::<Vec<_>>()),
    );
    put(
        "start_times",
        json!(outputs.iter().map(|o| o.start_time).collect::<Vec<_>>()),
    );
    put(
        "successes",
        json!(outputs.iter().map(|o| o.success).collect::<Vec<_>>()),
    );
    put(
        "generated_texts",
        json!(outputs
            .iter()
            .map(|o| &o.generated_text)
            .collect::<Vec<_>>()),
    );
    put(
        "errors",
        json!(outputs.iter().map(|o| &o.error).collect::<Vec<_>>()),
    );
    Value::Object(r)
}

/// The same result without per-request lists (used inside sweep documents).
pub fn summary_only(result: &Value) -> Value {
    const PER_REQUEST: [&str; 10] = [
        "input_lens",
        "output_lens",
        "ttfts",
        "tpots",
        "itls",
        "latencies",
        "start_times",
        "successes",
        "generated_texts",
        "errors",
    ];
    let mut v = result.clone();
    if let Some(obj) = v.as_object_mut() {
        for k in PER_REQUEST {
            obj.remove(k);
        }
        obj.remove("server_metrics");
    }
    v
}

/// Renders the console table in the layout of `vllm bench serve`.
pub fn table(info: &RunInfo, duration_s: f64, m: &Metrics, spec: &PercentileSpec) -> String {
    let mut s = String::new();
    let mut line = |label: &str, value: String| {
        s.push_str(format!("{label:<40} {value}").trim_end());
        s.push('\n');
    };
    let f2 = |v: f64| format!("{v:.2}");
    line_header(&mut line, " Serving Benchmark Result ", '=');
    line("Successful requests:", m.completed.to_string());
    line("Failed requests:", m.failed.to_string());
    if let Some(c) = info.max_concurrency {
        line("Maximum request concurrency:", c.to_string());
    }
    if info.request_rate.is_finite() {
        line("Request rate configured (RPS):", f2(info.request_rate));
    }
    line("Benchmark duration (s):", f2(duration_s));
    line("Total input tokens:", m.total_input.to_string());
    line("Total generated tokens:", m.total_output.to_string());
    line("Request throughput (req/s):", f2(m.request_throughput));
    if let Some(g) = m.request_goodput {
        line("Request goodput (req/s):", f2(g));
    }
    line("Output token throughput (tok/s):", f2(m.output_throughput));
    line(
        "Peak output token throughput (tok/s):",
        f2(m.max_output_tokens_per_s),
    );
    line(
        "Peak concurrent requests:",
        m.max_concurrent_requests.to_string(),
    );
    line(
        "Total token throughput (tok/s):",
        f2(m.total_token_throughput),
    );
    for (name, upper, header) in [
        ("ttft", "TTFT", "Time to First Token"),
        ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
        ("itl", "ITL", "Inter-token Latency"),
        ("e2el", "E2EL", "End-to-end Latency"),
    ] {
        if !spec.metrics.iter().any(|x| x == name) {
            continue;
        }
        let st = stat_of(m, name);
        line_header(&mut line, header, '-');
        line(&format!("Mean {upper} (ms):"), f2(st.mean));
        line(&format!("Median {upper} (ms):"), f2(st.median));
        for (p, v) in &st.percentiles {
            line(&format!("P{} {upper} (ms):", percentile_word(*p)), f2(*v));
        }
    }
    if !m.failure_reasons.is_empty() {
        line_header(&mut line, "Failures", '-');
        for (reason, n) in &m.failure_reasons {
            line(&format!("{n} x"), reason.clone());
        }
    }
    line_header(&mut line, "", '=');
    s
}

/// A 50-column rule with a centred title, written through the table's line writer.
fn line_header(line: &mut impl FnMut(&str, String), title: &str, fill: char) {
    let pad = 50usize.saturating_sub(title.chars().count());
    let left = pad / 2;
    let text = format!(
        "{}{}{}",
        fill.to_string().repeat(left),
        title,
        fill.to_string().repeat(pad - left)
    );
    // The title row is a full line: pass it as the label with nothing after it.
    line(&text, String::new());
}

/// `{label}-{rate}qps[-concurrency{c}]-{model}-{date}.json`, vLLM's default file name.
pub fn default_filename(info: &RunInfo) -> String {
    let rate = if info.request_rate.is_finite() {
        format!("{}", info.request_rate)
    } else {
        "inf".into()
    };
    let conc = info
        .max_concurrency
        .map(|c| format!("-concurrency{c}"))
        .unwrap_or_default();
    let model = info.model_id.rsplit('/').next().unwrap_or(&info.model_id);
    format!("{}-{rate}qps{conc}-{model}-{}.json", info.label, info.date)
}

/// Writes `value` as pretty JSON, creating the directory.
pub fn write_json(dir: Option<&Path>, filename: &str, value: &Value) -> Result<PathBuf> {
    let path = dir
        .map(|d| d.join(filename))
        .unwrap_or_else(|| PathBuf::from(filename));
    let err = |e: String| BenchError::Output {
        path: path.clone(),
        reason: e,
    };
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(|e| err(e.to_string()))?;
    }
    let text = serde_json::to_string_pretty(value).map_err(|e| err(e.to_string()))?;
    std::fs::write(&path, text).map_err(|e| err(e.to_string()))?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info() -> RunInfo {
        RunInfo {
            date: "20260101-000000".into(),
            backend: "openai".into(),
            label: "openai".into(),
            model_id: "org/m".into(),
            tokenizer_id: "t".into(),
            base_url: "http://x".into(),
            endpoint: "/v1/completions".into(),
            dataset_name: "random".into(),
            num_prompts: 1,
            request_rate: f64::INFINITY,
            burstiness: 1.0,
            max_concurrency: Some(4),
            ramp_up: None,
            num_warmups: 0,
            seed: 0,
            duration_limit_s: None,
            metadata: vec![("gpu".into(), "none".into())],
        }
    }

    #[test]
    fn keys_follow_vllm_names() {
        let spec = PercentileSpec::parse("ttft,tpot", "50,99.9").unwrap();
        let out = RequestOutput {
            success: true,
            ttft: 0.1,
            latency: 0.2,
            itl: vec![0.1],
            ..Default::default()
        };
        let m = crate::metrics::calculate(
            std::slice::from_ref(&out),
            &[2],
            1.0,
            &spec.percentiles,
            None,
        );
        let v = result_json(&info(), 1.0, &m, &spec, None, &[out], &[2], Value::Null);
        for k in [
            "mean_ttft_ms",
            "median_tpot_ms",
            "p99.9_ttft_ms",
            "p50_tpot_ms",
            "output_throughput",
            "request_rate",
        ] {
            assert!(v.get(k).is_some(), "missing {k}");
        }
        assert!(v.get("mean_itl_ms").is_none(), "itl not selected");
        assert_eq!(v["request_rate"], "inf");
        assert_eq!(v["gpu"], "none");
        assert!((v["mean_tpot_ms"].as_f64().unwrap() - 100.0).abs() < 1e-9);
        assert!(summary_only(&v).get("ttfts").is_none());
        assert_eq!(
            default_filename(&info()),
            "openai-infqps-concurrency4-m-20260101-000000.json"
        );
    }

    #[test]
    fn table_lists_selected_metrics() {
        let spec = PercentileSpec::parse("ttft", "99").unwrap();
        let m = crate::metrics::calculate(&[], &[], 2.0, &spec.percentiles, None);
        let t = table(&info(), 2.0, &m, &spec);
        assert!(t.contains("Mean TTFT (ms):"));
        assert!(t.contains("P99 TTFT (ms):"));
        assert!(!t.contains("TPOT"));
    }

    #[test]
    fn percentile_spec_rejects_junk() {
        assert!(PercentileSpec::parse("ttft,foo", "99").is_err());
        assert!(PercentileSpec::parse("ttft", "101").is_err());
        assert!(PercentileSpec::parse("ttft", "x").is_err());
    }
}
