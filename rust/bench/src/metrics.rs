//! From per-request measurements to the summary numbers. Definitions match `vllm bench serve`:
//! TPOT = (latency − TTFT) / (output tokens − 1), so it excludes the first token; ITL is per chunk;
//! statistics are numpy's (population std, linearly interpolated percentiles); throughputs divide
//! by the wall-clock duration of the measured run; only successful requests enter latency stats.

use std::collections::BTreeMap;

use crate::client::RequestOutput;
use crate::error::{BenchError, Result};

/// Service-level objectives for goodput, in milliseconds (`--goodput ttft:MS tpot:MS e2el:MS`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Slo {
    pub ttft_ms: Option<f64>,
    pub tpot_ms: Option<f64>,
    pub e2el_ms: Option<f64>,
}

impl Slo {
    /// Parses `KEY:MS` pairs; keys are ttft, tpot, e2el.
    pub fn parse(items: &[String]) -> Result<Option<Slo>> {
        if items.is_empty() {
            return Ok(None);
        }
        let mut slo = Slo::default();
        for item in items {
            let bad = || {
                BenchError::InvalidArgument(format!(
                    "--goodput expects KEY:MS with KEY in ttft,tpot,e2el, got '{item}'"
                ))
            };
            let (key, value) = item.split_once(':').ok_or_else(bad)?;
            let ms: f64 = value.trim().parse().map_err(|_| bad())?;
            if !(ms.is_finite() && ms >= 0.0) {
                return Err(bad());
            }
            match key.trim() {
                "ttft" => slo.ttft_ms = Some(ms),
                "tpot" => slo.tpot_ms = Some(ms),
                "e2el" => slo.e2el_ms = Some(ms),
                _ => return Err(bad()),
            }
        }
        Ok(Some(slo))
    }

    /// Whether a request with these latencies (seconds) meets every given objective.
    fn met(&self, ttft: f64, tpot: f64, e2el: f64) -> bool {
        let ok = |limit: Option<f64>, v: f64| limit.is_none_or(|ms| v * 1000.0 <= ms);
        ok(self.ttft_ms, ttft) && ok(self.tpot_ms, tpot) && ok(self.e2el_ms, e2el)
    }
}

/// Mean, median, std and selected percentiles of one metric, in milliseconds.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Stat {
    pub mean: f64,
    pub median: f64,
    pub std: f64,
    /// (percentile, value) in the order requested.
    pub percentiles: Vec<(f64, f64)>,
}

impl Stat {
    /// Statistics of `seconds`, reported in ms. An empty sample gives zeros (vLLM's convention).
    pub fn of(seconds: &[f64], percentiles: &[f64]) -> Stat {
        let mut v: Vec<f64> = seconds.iter().map(|s| s * 1000.0).collect();
        v.sort_by(f64::total_cmp);
        let n = v.len() as f64;
        let mean = if v.is_empty() {
            0.0
        } else {
            v.iter().sum::<f64>() / n
        };
        let std = if v.is_empty() {
            0.0
        } else {
            (v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n).sqrt()
        };
        Stat {
            mean,
            median: percentile(&v, 50.0),
            std,
            percentiles: percentiles
                .iter()
                .map(|&p| (p, percentile(&v, p)))
                .collect(),
        }
    }
}

/// numpy's default ("linear") percentile of an ascending slice.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    match sorted.len() {
        0 => 0.0,
        1 => sorted[0],
        n => {
            let rank = p / 100.0 * (n - 1) as f64;
            let lo = rank.floor() as usize;
            let hi = rank.ceil() as usize;
            sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64)
        }
    }
}

/// The summary of one run.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Metrics {
    pub completed: usize,
    pub failed: usize,
    pub total_input: usize,
    pub total_output: usize,
    pub request_throughput: f64,
    /// `None` when no `--goodput` objectives were given.
    pub request_goodput: Option<f64>,
    pub output_throughput: f64,
    pub total_token_throughput: f64,
    pub ttft: Stat,
    pub tpot: Stat,
    pub itl: Stat,
    pub e2el: Stat,
    /// Peak of output tokens completed within one wall-clock second.
    pub max_output_tokens_per_s: f64,
    /// Peak number of requests in flight at once.
    pub max_concurrent_requests: usize,
    /// Error message → number of requests that failed with it.
    pub failure_reasons: BTreeMap<String, usize>,
    /// Per-request TPOT in seconds (0 for failed requests or single-token outputs).
    pub tpots: Vec<f64>,
}

/// Computes the summary. `output_lens[i]` is the output token count of request `i` (0 if failed).
pub fn calculate(
    outputs: &[RequestOutput],
    output_lens: &[usize],
    duration_s: f64,
    percentiles: &[f64],
    slo: Option<&Slo>,
) -> Metrics {
    let mut m = Metrics::default();
    let (mut ttfts, mut tpots, mut itls, mut e2els) = (vec![], vec![], vec![], vec![]);
    let mut good = 0usize;
    m.tpots = vec![0.0; outputs.len()];
    for (i, (o, &out_len)) in outputs.iter().zip(output_lens).enumerate() {
        if !o.success {
            m.failed += 1;
            *m.failure_reasons.entry(o.error.clone()).or_default() += 1;
            continue;
        }
        m.completed += 1;
        m.total_input += o.prompt_len;
        m.total_output += out_len;
        let tpot = if out_len > 1 {
            (o.latency - o.ttft) / (out_len - 1) as f64
        } else {
            0.0
        };
        if out_len > 1 {
            tpots.push(tpot);
        }
        m.tpots[i] = tpot;
        ttfts.push(o.ttft);
        e2els.push(o.latency);
        itls.extend_from_slice(&o.itl);
        if slo.is_some_and(|s| s.met(o.ttft, tpot, o.latency)) {
            good += 1;
        }
    }
    let d = duration_s.max(f64::MIN_POSITIVE);
    m.request_throughput = m.completed as f64 / d;
    m.request_goodput = slo.map(|_| good as f64 / d);
    m.output_throughput = m.total_output as f64 / d;
    m.total_token_throughput = (m.total_input + m.total_output) as f64 / d;
    m.ttft = Stat::of(&ttfts, percentiles);
    m.tpot = Stat::of(&tpots, percentiles);
    m.itl = Stat::of(&itls, percentiles);
    m.e2el = Stat::of(&e2els, percentiles);
    m.max_output_tokens_per_s = peak_tokens_per_second(outputs);
    m.max_concurrent_requests = peak_concurrency(outputs);
    m
}

/// Token completion times bucketed per second from the first send; returns the busiest bucket.
fn peak_tokens_per_second(outputs: &[RequestOutput]) -> f64 {
    let ok: Vec<&RequestOutput> = outputs.iter().filter(|o| o.success).collect();
    let Some(t0) = ok.iter().map(|o| o.start_time).reduce(f64::min) else {
        return 0.0;
    };
    let mut buckets: BTreeMap<u64, u64> = BTreeMap::new();
    for o in ok {
        let mut t = o.start_time + o.ttft;
        *buckets.entry((t - t0) as u64).or_default() += 1;
        for gap in &o.itl {
            t += gap;
            *buckets.entry((t - t0) as u64).or_default() += 1;
        }
    }
    buckets.values().copied().max().unwrap_or(0) as f64
}

/// Sweep over half-open [start, end) intervals of successful requests.
fn peak_concurrency(outputs: &[RequestOutput]) -> usize {
    let mut events: Vec<(f64, i32)> = outputs
        .iter()
        .filter(|o| o.success)
        .flat_map(|o| [(o.start_time, 1), (o.start_time + o.latency, -1)])
        .collect();
    // Departures sort before arrivals at the same instant.
    events.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let (mut cur, mut peak) = (0i64, 0i64);
    for (_, d) in events {
        cur += d as i64;
        peak = peak.max(cur);
    }
    peak as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(start: f64, ttft: f64, itl: &[f64]) -> RequestOutput {
        RequestOutput {
            success: true,
            prompt_len: 10,
            start_time: start,
            ttft,
            itl: itl.to_vec(),
            latency: ttft + itl.iter().sum::<f64>(),
            ..Default::default()
        }
    }

    #[test]
    fn percentile_matches_numpy_linear() {
        let v = [1.0, 2.0, 3.0, 4.0];
        // numpy.percentile([1,2,3,4], [0,50,90,99,100]) = 1, 2.5, 3.7, 3.97, 4
        assert_eq!(percentile(&v, 0.0), 1.0);
        assert_eq!(percentile(&v, 50.0), 2.5);
        assert!((percentile(&v, 90.0) - 3.7).abs() < 1e-12);
        assert!((percentile(&v, 99.0) - 3.97).abs() < 1e-12);
        assert_eq!(percentile(&v, 100.0), 4.0);
        assert_eq!(percentile(&[], 50.0), 0.0);
    }

    #[test]
    fn tpot_excludes_first_token_and_itl_is_per_chunk() {
        // 100 ms to first token, then 4 chunks 10 ms apart, 5 tokens total.
        let outs = vec![ok(0.0, 0.1, &[0.01; 4])];
        let m = calculate(&outs, &[5], 1.0, &[99.0], None);
        assert!((m.ttft.mean - 100.0).abs() < 1e-9);
        assert!((m.tpot.mean - 10.0).abs() < 1e-9);
        assert!((m.itl.mean - 10.0).abs() < 1e-9);
        assert!((m.e2el.mean - 140.0).abs() < 1e-9);
        // Same request but the server bundled 2 tokens per chunk: ITL doubles, TPOT does not.
        let outs = vec![ok(0.0, 0.1, &[0.02; 2])];
        let m = calculate(&outs, &[5], 1.0, &[99.0], None);
        assert!((m.itl.mean - 20.0).abs() < 1e-9);
        assert!((m.tpot.mean - 10.0).abs() < 1e-9);
    }

    #[test]
    fn throughput_goodput_and_failures() {
        let mut failed = RequestOutput {
            error: "HTTP 500: boom".into(),
            ..Default::default()
        };
        failed.prompt_len = 99;
        let outs = vec![
            ok(0.0, 0.1, &[0.01; 9]),
            ok(0.1, 0.6, &[0.01; 9]),
            failed.clone(),
            failed,
        ];
        let slo = Slo::parse(&["ttft:200".into()]).unwrap().unwrap();
        let m = calculate(&outs, &[10, 10, 0, 0], 2.0, &[50.0], Some(&slo));
        assert_eq!((m.completed, m.failed), (2, 2));
        assert_eq!(m.total_input, 20, "failed requests do not count as input");
        assert_eq!(m.total_output, 20);
        assert_eq!(m.request_throughput, 1.0);
        assert_eq!(m.output_throughput, 10.0);
        assert_eq!(m.total_token_throughput, 20.0);
        assert_eq!(
            m.request_goodput,
            Some(0.5),
            "only the first meets ttft <= 200 ms"
        );
        assert_eq!(m.failure_reasons.get("HTTP 500: boom"), Some(&2));
        assert_eq!(m.max_concurrent_requests, 2);
    }

    #[test]
    fn peak_concurrency_is_half_open() {
        let outs = vec![
            ok(0.0, 0.5, &[0.5]),
            ok(1.0, 0.5, &[0.5]),
            ok(1.5, 0.1, &[]),
        ];
        assert_eq!(peak_concurrency(&outs), 2);
    }

    #[test]
    fn goodput_parse_rejects_junk() {
        assert!(Slo::parse(&["ttft:abc".into()]).is_err());
        assert!(Slo::parse(&["foo:1".into()]).is_err());
        assert!(Slo::parse(&["ttft".into()]).is_err());
        let s = Slo::parse(&["tpot:50".into(), "e2el:1000".into()])
            .unwrap()
            .unwrap();
        assert_eq!(
            (s.ttft_ms, s.tpot_ms, s.e2el_ms),
            (None, Some(50.0), Some(1000.0))
        );
    }
}
