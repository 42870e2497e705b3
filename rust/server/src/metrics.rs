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
//!
//! Every per-engine series carries an `engine` label (the engine index, as vLLM labels its
//! data-parallel engines), also with one engine: the request-level ones by the engine that ran the
//! request, the scheduler state by the engine that reported it, plus `voltllm:engine_up` and
//! `voltllm:engine_requests_in_flight` (what the front end's router sees).

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
use voltllm_engine_client::{EngineClient, EngineState};

/// Label set of `vllm:request_success`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FinishedLabels {
    pub finished_reason: String,
    pub engine: String,
}

/// Label set of the per-engine series: the engine index.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EngineLabels {
    pub engine: String,
}

impl EngineLabels {
    fn of(engine: usize) -> Self {
        Self {
            engine: engine.to_string(),
        }
    }
}

type HistogramFamily = Family<EngineLabels, Histogram, fn() -> Histogram>;

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
    pub prompt_tokens: Family<EngineLabels, Counter>,
    pub generation_tokens: Family<EngineLabels, Counter>,
    pub request_success: Family<FinishedLabels, Counter>,
    pub time_to_first_token: HistogramFamily,
    pub inter_token_latency: HistogramFamily,
    pub e2e_request_latency: HistogramFamily,
    pub request_queue_time: HistogramFamily,
    pub requests_rejected: Family<RejectedLabels, Counter>,
}

/// One engine's request-level series, taken once per request (handles share the registry's
/// values, so recording needs no label lookup per token).
#[derive(Clone)]
pub struct EngineMetrics {
    engine: String,
    request_success: Family<FinishedLabels, Counter>,
    pub prompt_tokens: Counter,
    pub generation_tokens: Counter,
    pub time_to_first_token: Histogram,
    pub inter_token_latency: Histogram,
    pub e2e_request_latency: Histogram,
    pub request_queue_time: Histogram,
}

/// The `finished_reason` values a choice can end with.
const FINISHED_REASONS: [&str; 4] = ["stop", "length", "abort", "error"];

impl EngineMetrics {
    fn finished_labels(&self, reason: &str) -> FinishedLabels {
        FinishedLabels {
            finished_reason: reason.to_string(),
            engine: self.engine.clone(),
        }
    }

    /// Counts one finished choice of this engine.
    pub fn finished(&self, reason: &str) {
        self.request_success
            .get_or_create(&self.finished_labels(reason))
            .inc();
    }
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

fn latency_histogram() -> Histogram {
    Histogram::new(LATENCY_BUCKETS)
}

fn itl_histogram() -> Histogram {
    Histogram::new(ITL_BUCKETS)
}

fn e2e_histogram() -> Histogram {
    Histogram::new(E2E_BUCKETS)
}

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
        let histograms = |make: fn() -> Histogram| HistogramFamily::new_with_constructor(make);
        let m = Self {
            prompt_tokens: Family::default(),
            generation_tokens: Family::default(),
            request_success: Family::default(),
            time_to_first_token: histograms(latency_histogram),
            inter_token_latency: histograms(itl_histogram),
            e2e_request_latency: histograms(e2e_histogram),
            request_queue_time: histograms(e2e_histogram),
            requests_rejected: Family::default(),
        };
        // Every engine's series exist from the start (at zero), so a dashboard sees each engine.
        for engine in 0..client.engines().len() {
            let series = m.engine(engine);
            for reason in FINISHED_REASONS {
                drop(
                    series
                        .request_success
                        .get_or_create(&series.finished_labels(reason)),
                );
            }
        }
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

    /// The request-level series of engine `engine`.
    pub fn engine(&self, engine: usize) -> EngineMetrics {
        let labels = EngineLabels::of(engine);
        EngineMetrics {
            engine: labels.engine.clone(),
            request_success: self.request_success.clone(),
            prompt_tokens: self.prompt_tokens.get_or_create(&labels).clone(),
            generation_tokens: self.generation_tokens.get_or_create(&labels).clone(),
            time_to_first_token: self.time_to_first_token.get_or_create(&labels).clone(),
            inter_token_latency: self.inter_token_latency.get_or_create(&labels).clone(),
            e2e_request_latency: self.e2e_request_latency.get_or_create(&labels).clone(),
            request_queue_time: self.request_queue_time.get_or_create(&labels).clone(),
        }
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

/// One series with a sample per engine (`engine` label), `None` values left out.
fn per_engine<M: EncodeMetric>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    metric_type: prometheus_client::metrics::MetricType,
    values: impl IntoIterator<Item = Option<M>>,
) -> std::fmt::Result {
    let mut family = encoder.encode_descriptor(name, help, None, metric_type)?;
    for (engine, value) in values.into_iter().enumerate() {
        if let Some(metric) = value {
            let labels = EngineLabels::of(engine);
            metric.encode(family.encode_family(&labels)?)?;
        }
    }
    Ok(())
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
        use prometheus_client::metrics::MetricType::{Counter as CounterType, Gauge as GaugeType};
        let stats = self.client.scheduler_stats();
        let e = &mut encoder;
        // An engine that has not reported yet (starting, restarting) has no scheduler sample.
        let gauges = |f: fn(&voltllm_protocol::SchedulerStats) -> i64| {
            stats
                .iter()
                .map(move |s| s.as_ref().map(|s| ConstGauge::new(f(s))))
        };
        let counters = |f: fn(&voltllm_protocol::SchedulerStats) -> u64| {
            stats
                .iter()
                .map(move |s| s.as_ref().map(|s| ConstCounter::new(f(s))))
        };
        per_engine(
            e,
            "vllm:num_requests_running",
            "Number of requests in model execution batches",
            GaugeType,
            gauges(|s| s.num_running as i64),
        )?;
        per_engine(
            e,
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed",
            GaugeType,
            gauges(|s| s.num_waiting as i64),
        )?;
        per_engine(
            e,
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage",
            GaugeType,
            stats
                .iter()
                .map(|s| s.as_ref().map(|s| ConstGauge::new(s.kv_cache_usage))),
        )?;
        per_engine(
            e,
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens",
            CounterType,
            counters(|s| s.prefix_cache_queries),
        )?;
        per_engine(
            e,
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens",
            CounterType,
            counters(|s| s.prefix_cache_hits),
        )?;
        per_engine(
            e,
            "vllm:num_preemptions",
            "Cumulative number of preemptions from the engine",
            CounterType,
            counters(|s| s.num_preemptions),
        )?;
        per_engine(
            e,
            "voltllm:engine_up",
            "1 while the engine takes requests, 0 while it restarts or after it was lost",
            GaugeType,
            self.client
                .engine_states()
                .into_iter()
                .map(|s| Some(ConstGauge::new(i64::from(s == EngineState::Serving)))),
        )?;
        per_engine(
            e,
            "voltllm:engine_requests_in_flight",
            "Engine requests the front end has sent to the engine and not seen finish",
            GaugeType,
            self.client
                .engine_in_flight()
                .into_iter()
                .map(|n| Some(ConstGauge::new(n as i64))),
        )?;
        per_engine(
            e,
            "voltllm:engine_restarts",
            "Engine restarts (all engines together bounded by --max-engine-restarts)",
            CounterType,
            self.client
                .engine_restarts()
                .into_iter()
                .map(|n| Some(ConstCounter::new(n))),
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
        Ok(())
    }
}

/// Renders the registry in the Prometheus text exposition format.
pub fn render(registry: &Registry) -> Result<String, std::fmt::Error> {
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, registry)?;
    Ok(out)
}
