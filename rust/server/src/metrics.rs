//! Prometheus metrics under vLLM's names, so existing dashboards work unchanged.
//!
//! Request-level metrics (tokens, latencies, finished requests) are recorded by the front end as
//! outputs stream through it. Scheduler state (running, waiting, KV usage, prefix cache,
//! preemptions) is what the engines last reported and is read at scrape time by a collector.
//!
//! Every bound the server enforces has a metric beside its flag, under `voltllm:` names (vLLM has
//! no such bounds): the admission capacity and what is admitted now (`--max-waiting-requests`),
//! requests turned away by reason, requests dropped for reading too slowly
//! (`--max-pending-outputs`), and engine restarts (`--max-engine-restarts`).

use std::borrow::Cow;
use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use tokio::sync::Semaphore;
use voltllm_engine_client::EngineClient;

/// Label set of `vllm:request_success`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FinishedLabels {
    pub finished_reason: String,
}

/// Label set of `voltllm:requests_rejected`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RejectedLabels {
    pub reason: &'static str,
}

/// Why a request was turned away before it reached an engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rejected {
    /// The admission capacity was in use (503).
    Capacity,
    /// An engine was restarting or dead (503).
    EngineUnavailable,
    /// The server was draining for shutdown (503).
    Draining,
    /// The body was over `--max-request-body-bytes` (413).
    BodyTooLarge,
}

impl Rejected {
    /// The `reason` label.
    pub fn label(self) -> &'static str {
        match self {
            Self::Capacity => "capacity",
            Self::EngineUnavailable => "engine_unavailable",
            Self::Draining => "draining",
            Self::BodyTooLarge => "body_too_large",
        }
    }
}

/// Front-end-recorded metrics; cloning shares the underlying values.
#[derive(Clone)]
pub struct Metrics {
    pub prompt_tokens: Counter,
    pub generation_tokens: Counter,
    pub request_success: Family<FinishedLabels, Counter>,
    pub time_to_first_token: Histogram,
    pub inter_token_latency: Histogram,
    pub e2e_request_latency: Histogram,
    pub request_queue_time: Histogram,
    pub requests_rejected: Family<RejectedLabels, Counter>,
}

const LATENCY_BUCKETS: [f64; 19] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
];
const ITL_BUCKETS: [f64; 18] = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0,
];
const E2E_BUCKETS: [f64; 16] = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
];

impl Metrics {
    /// Creates the metrics and registers them, plus the collector of the engines' stats and the
    /// server's bounds (`admission` holds `capacity` permits), in a registry whose every sample
    /// carries `model_name`.
    pub fn new(
        model_name: &str,
        client: EngineClient,
        admission: Arc<Semaphore>,
        capacity: usize,
    ) -> (Self, Registry) {
        let mut registry = Registry::with_labels(
            [(
                Cow::Borrowed("model_name"),
                Cow::Owned(model_name.to_string()),
            )]
            .into_iter(),
        );
        let m = Self {
            prompt_tokens: Counter::default(),
            generation_tokens: Counter::default(),
            request_success: Family::default(),
            time_to_first_token: Histogram::new(LATENCY_BUCKETS),
            inter_token_latency: Histogram::new(ITL_BUCKETS),
            e2e_request_latency: Histogram::new(E2E_BUCKETS),
            request_queue_time: Histogram::new(E2E_BUCKETS),
            requests_rejected: Family::default(),
        };
        registry.register(
            "vllm:prompt_tokens",
            "Number of prefill tokens processed",
            m.prompt_tokens.clone(),
        );
        registry.register(
            "vllm:generation_tokens",
            "Number of generation tokens processed",
            m.generation_tokens.clone(),
        );
        registry.register(
            "vllm:request_success",
            "Count of successfully processed requests",
            m.request_success.clone(),
        );
        registry.register(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds",
            m.time_to_first_token.clone(),
        );
        registry.register(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds",
            m.inter_token_latency.clone(),
        );
        registry.register(
            "vllm:e2e_request_latency_seconds",
            "Histogram of end to end request latency in seconds",
            m.e2e_request_latency.clone(),
        );
        registry.register(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request",
            m.request_queue_time.clone(),
        );
        registry.register(
            "voltllm:requests_rejected",
            "Requests turned away before reaching an engine, by reason",
            m.requests_rejected.clone(),
        );
        registry.register_collector(Box::new(StatsCollector {
            client,
            admission,
            capacity,
        }));
        (m, registry)
    }

    /// Counts one request turned away.
    pub fn rejected(&self, reason: Rejected) {
        self.requests_rejected
            .get_or_create(&RejectedLabels {
                reason: reason.label(),
            })
            .inc();
    }

    /// Counts one finished choice.
    pub fn finished(&self, reason: &str) {
        self.request_success
            .get_or_create(&FinishedLabels {
                finished_reason: reason.to_string(),
            })
            .inc();
    }
}

/// At scrape time: sums the engines' last scheduler stats, reads the admission semaphore and the
/// engine client's counters.
struct StatsCollector {
    client: EngineClient,
    admission: Arc<Semaphore>,
    capacity: usize,
}

impl std::fmt::Debug for StatsCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StatsCollector")
    }
}

fn gauge<N>(encoder: &mut DescriptorEncoder, name: &str, help: &str, value: N) -> std::fmt::Result
where
    ConstGauge<N>: EncodeMetric,
{
    let metric = ConstGauge::new(value);
    metric.encode(encoder.encode_descriptor(name, help, None, metric.metric_type())?)
}

fn counter(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    value: u64,
) -> std::fmt::Result {
    let metric = ConstCounter::new(value);
    metric.encode(encoder.encode_descriptor(name, help, None, metric.metric_type())?)
}

impl Collector for StatsCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let stats: Vec<_> = self
            .client
            .scheduler_stats()
            .into_iter()
            .flatten()
            .collect();
        let sum =
            |f: fn(&voltllm_protocol::SchedulerStats) -> u64| stats.iter().map(f).sum::<u64>();
        let kv_usage = if stats.is_empty() {
            0.0
        } else {
            stats.iter().map(|s| s.kv_cache_usage).sum::<f64>() / stats.len() as f64
        };
        let e = &mut encoder;
        gauge(
            e,
            "vllm:num_requests_running",
            "Number of requests in model execution batches",
            sum(|s| s.num_running) as i64,
        )?;
        gauge(
            e,
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed",
            sum(|s| s.num_waiting) as i64,
        )?;
        gauge(
            e,
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage",
            kv_usage,
        )?;
        counter(
            e,
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens",
            sum(|s| s.prefix_cache_queries),
        )?;
        counter(
            e,
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens",
            sum(|s| s.prefix_cache_hits),
        )?;
        counter(
            e,
            "vllm:num_preemptions",
            "Cumulative number of preemptions from the engine",
            sum(|s| s.num_preemptions),
        )?;
        gauge(
            e,
            "voltllm:request_capacity",
            "Engine requests that may be running or waiting at once (engines' max_num_seqs + --max-waiting-requests)",
            self.capacity as i64,
        )?;
        gauge(
            e,
            "voltllm:requests_admitted",
            "Engine requests admitted now (running or waiting)",
            self.capacity
                .saturating_sub(self.admission.available_permits()) as i64,
        )?;
        counter(
            e,
            "voltllm:requests_dropped_slow_reader",
            "Requests dropped because their client fell --max-pending-outputs outputs behind",
            self.client.num_overflows(),
        )?;
        counter(
            e,
            "voltllm:engine_restarts",
            "Engine restarts (bounded by --max-engine-restarts)",
            self.client.num_restarts(),
        )?;
        Ok(())
    }
}

/// Renders the registry in the Prometheus text exposition format.
pub fn render(registry: &Registry) -> Result<String, std::fmt::Error> {
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, registry)?;
    Ok(out)
}
