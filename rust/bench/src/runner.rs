//! Orchestration of `serve`: check the target, build the workload once, then for each run (one, or
//! one per `--sweep` value) warm up, send the timed requests, scrape server metrics around them,
//! summarise, print and save.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::ValueEnum;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use rand::rngs::StdRng;
use rand::SeedableRng;
use serde_json::{json, Map, Value};
use tokenizers::Tokenizer;
use tokio::sync::Semaphore;

use crate::args::{DatasetName, RampUp, ServeArgs};
use crate::client::{self, PreparedRequest, RequestOutput, RequestTemplate};
use crate::dataset::{self, SampleRequest};
use crate::error::{BenchError, Result};
use crate::metrics::{self, Slo};
use crate::prom;
use crate::report::{self, PercentileSpec, RunInfo};

/// Which load knob a sweep turns.
#[derive(Debug, Clone, Copy, PartialEq)]
enum SweepParam {
    RequestRate,
    MaxConcurrency,
}

/// Parses `request_rate=1,2,inf` or `max_concurrency=1,8,64`.
fn parse_sweep(s: &str) -> Result<(SweepParam, Vec<f64>)> {
    let bad = || {
        BenchError::InvalidArgument(format!(
            "--sweep expects request_rate=R1,R2,... or max_concurrency=C1,C2,..., got '{s}'"
        ))
    };
    let (key, values) = s.split_once('=').ok_or_else(bad)?;
    let param = match key.trim().replace('-', "_").as_str() {
        "request_rate" => SweepParam::RequestRate,
        "max_concurrency" => SweepParam::MaxConcurrency,
        _ => return Err(bad()),
    };
    let values = values
        .split(',')
        .map(|v| v.trim().parse::<f64>().map_err(|_| bad()))
        .collect::<Result<Vec<_>>>()?;
    let valid = |v: &f64| match param {
        SweepParam::RequestRate => *v > 0.0,
        SweepParam::MaxConcurrency => v.is_finite() && *v >= 1.0 && v.fract() == 0.0,
    };
    if values.is_empty() || !values.iter().all(valid) {
        return Err(bad());
    }
    Ok((param, values))
}

/// Everything fixed for the whole invocation.
struct Session {
    args: ServeArgs,
    base_url: String,
    http: reqwest::Client,
    tpl: RequestTemplate,
    tokenizer: Tokenizer,
    tokenizer_id: String,
    spec: PercentileSpec,
    slo: Option<Slo>,
}

/// Runs `serve` to completion. Errors are returned, never printed here, so the caller decides how
/// to show them (one line on stderr for the CLI).
pub async fn serve(args: ServeArgs) -> Result<()> {
    let spec = PercentileSpec::parse(&args.percentile_metrics, &args.metric_percentiles)?;
    let slo = Slo::parse(&args.goodput)?;
    validate(&args)?;
    let sweep = args.sweep.as_deref().map(parse_sweep).transpose()?;
    let base_url = args.base_url.trim_end_matches('/').to_string();
    if !(base_url.starts_with("http://") || base_url.starts_with("https://")) {
        return Err(BenchError::InvalidArgument(format!(
            "--base-url must start with http:// or https://, got '{base_url}'"
        )));
    }
    let http = client::build_client(Duration::from_secs_f64(args.request_timeout))
        .map_err(BenchError::Runtime)?;
    let api_key = args
        .api_key
        .clone()
        .or_else(|| std::env::var("OPENAI_API_KEY").ok())
        .filter(|k| !k.is_empty());
    let (model, root) =
        resolve_model(&http, &base_url, args.model.as_deref(), api_key.as_deref()).await?;
    let (tokenizer, tokenizer_id) = resolve_tokenizer(&args, &model, root.as_deref())?;
    let extra_body = match &args.extra_body {
        None => Map::new(),
        Some(s) => match serde_json::from_str::<Value>(s) {
            Ok(Value::Object(m)) => m,
            _ => {
                return Err(BenchError::InvalidArgument(
                    "--extra-body must be a JSON object".into(),
                ))
            }
        },
    };
    let tpl = RequestTemplate {
        api_url: format!("{base_url}{}", args.endpoint()),
        model: model.clone(),
        chat: args.is_chat(),
        api_key,
        // Random prompts ask for an exact output length, which only holds if EOS is ignored (vLLM
        // turns this on for the random dataset too).
        ignore_eos: args.ignore_eos || args.dataset_name == DatasetName::Random,
        temperature: args.temperature,
        extra_body,
    };
    let session = Session {
        args,
        base_url,
        http,
        tpl,
        tokenizer,
        tokenizer_id,
        spec,
        slo,
    };

    let mut rng = StdRng::seed_from_u64(session.args.seed);
    let n = session.args.num_prompts + session.args.num_warmups;
    let mut requests = dataset::build(&session.args, &session.tokenizer, n, &mut rng)?;
    let measured = requests.split_off(session.args.num_warmups);
    let warmups = requests;

    match sweep {
        None => {
            let result = session
                .run_once(&session.args, &warmups, &measured, &mut rng)
                .await?;
            session.save(&session.args, &result)?;
        }
        Some((param, values)) => {
            let mut runs = Vec::new();
            for v in &values {
                let mut a = session.args.clone();
                match param {
                    SweepParam::RequestRate => a.request_rate = *v,
                    SweepParam::MaxConcurrency => a.max_concurrency = Some(*v as usize),
                }
                eprintln!(
                    "sweep: {} = {v}",
                    if param == SweepParam::RequestRate {
                        "request_rate"
                    } else {
                        "max_concurrency"
                    }
                );
                // Same prompts for every point, fresh arrival randomness from the same seed.
                let mut run_rng = StdRng::seed_from_u64(session.args.seed);
                let result = session
                    .run_once(&a, &warmups, &measured, &mut run_rng)
                    .await?;
                session.save(&a, &result)?;
                runs.push(report::summary_only(&result));
            }
            let name = if param == SweepParam::RequestRate {
                "request_rate"
            } else {
                "max_concurrency"
            };
            let doc = json!({
                "schema_version": report::SCHEMA_VERSION,
                "sweep_parameter": name,
                "sweep_values": values.iter().map(|v| if v.is_finite() { json!(v) } else { json!("inf") }).collect::<Vec<_>>(),
                "runs": runs,
            });
            if session.args.save_result {
                let file = match &session.args.result_filename {
                    Some(f) => format!("{}-sweep.json", f.trim_end_matches(".json")),
                    None => format!(
                        "{}-sweep-{name}-{}.json",
                        session
                            .args
                            .label
                            .as_deref()
                            .unwrap_or(session.args.backend_name()),
                        now()
                    ),
                };
                let path = report::write_json(session.args.result_dir.as_deref(), &file, &doc)?;
                eprintln!("Sweep saved to {}", path.display());
            }
        }
    }
    Ok(())
}

fn validate(args: &ServeArgs) -> Result<()> {
    let invalid = |m: &str| Err(BenchError::InvalidArgument(m.to_string()));
    if args.num_prompts == 0 {
        // With --duration the prompts are cycled, so at least one is still needed.
        return invalid("--num-prompts must be > 0");
    }
    if args.max_concurrency == Some(0) {
        return invalid("--max-concurrency must be > 0");
    }
    if let Some(d) = args.duration {
        if !(d.is_finite() && d > 0.0) {
            return invalid("--duration must be a positive number of seconds");
        }
        if args.request_rate.is_infinite()
            && args.max_concurrency.is_none()
            && args.ramp_up_strategy.is_none()
        {
            return invalid(
                "--duration needs a finite --request-rate or a --max-concurrency (else it floods)",
            );
        }
        if args.ramp_up_strategy.is_some() {
            return invalid("--ramp-up-strategy needs a request count, not --duration");
        }
    }
    if !(args.request_timeout.is_finite() && args.request_timeout > 0.0) {
        return invalid("--request-timeout must be > 0");
    }
    if args.random_input_len == 0 && args.dataset_name == DatasetName::Random {
        return invalid("--random-input-len must be > 0");
    }
    Ok(())
}

/// A model as `/v1/models` lists it: `id` is the name to send, `root` (vLLM and voltllm fill it
/// in) is often the local folder the server loaded, which then also gives the tokenizer.
struct ListedModel {
    id: String,
    root: Option<String>,
}

/// The model to send: `--model` checked against `/v1/models`, or the first listed model. Returns
/// the name and the listed `root`, if any.
async fn resolve_model(
    http: &reqwest::Client,
    base_url: &str,
    model: Option<&str>,
    api_key: Option<&str>,
) -> Result<(String, Option<String>)> {
    let url = format!("{base_url}/v1/models");
    let mut req = http.get(&url).timeout(Duration::from_secs(30));
    if let Some(k) = api_key {
        req = req.bearer_auth(k);
    }
    let resp = req.send().await.map_err(|e| BenchError::Unreachable {
        url: base_url.to_string(),
        reason: client::error_chain(&e),
    })?;
    let status = resp.status();
    if status.as_u16() == 401 || status.as_u16() == 403 {
        return Err(BenchError::Runtime(format!(
            "{url} refused the credentials (HTTP {status}); check --api-key"
        )));
    }
    let listed: Vec<ListedModel> = if status.is_success() {
        let text = resp.text().await.unwrap_or_default();
        let body: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        body.get("data")
            .and_then(Value::as_array)
            .map(|d| {
                d.iter()
                    .filter_map(|m| {
                        let id = m.get("id").and_then(Value::as_str)?.to_string();
                        let root = m.get("root").and_then(Value::as_str).map(String::from);
                        Some(ListedModel { id, root })
                    })
                    .collect()
            })
            .unwrap_or_default()
    } else {
        Vec::new()
    };
    match model {
        // Servers without /v1/models cannot be checked; a wrong name then shows up as failed requests.
        Some(m) if listed.is_empty() => Ok((m.to_string(), None)),
        Some(m) => {
            let available = listed
                .iter()
                .map(|x| x.id.as_str())
                .collect::<Vec<_>>()
                .join(", ");
            match listed.into_iter().find(|x| x.id == m) {
                Some(found) => Ok((found.id, found.root)),
                None => Err(BenchError::UnknownModel {
                    model: m.into(),
                    url: base_url.into(),
                    available,
                }),
            }
        }
        None => listed
            .into_iter()
            .next()
            .map(|x| (x.id, x.root))
            .ok_or(BenchError::NoModels {
                url: base_url.into(),
            }),
    }
}

/// Whether `p` is a tokenizer.json file or a folder holding one.
fn has_tokenizer(p: &Path) -> bool {
    p.join("tokenizer.json").is_file()
        || (p.is_file() && p.extension().is_some_and(|e| e == "json"))
}

/// `--tokenizer`, else `--model` or the listed model's `root` when either is a local model folder.
fn resolve_tokenizer(
    args: &ServeArgs,
    model: &str,
    root: Option<&str>,
) -> Result<(Tokenizer, String)> {
    let path = match &args.tokenizer {
        Some(p) => p.clone(),
        None => [Some(model), root]
            .into_iter()
            .flatten()
            .map(PathBuf::from)
            .find(|p| has_tokenizer(p))
            .ok_or_else(|| {
                BenchError::InvalidArgument(format!(
                    "a tokenizer is needed to count tokens: pass --tokenizer PATH (a tokenizer.json or a \
                     model folder); neither '{model}' nor the server's model root is a local folder"
                ))
            })?,
    };
    Ok((dataset::load_tokenizer(&path)?, path.display().to_string()))
}

fn now() -> String {
    chrono::Local::now().format("%Y%m%d-%H%M%S").to_string()
}

impl Session {
    /// One warm-up + measured run with the load shape in `a`. Returns the result JSON.
    async fn run_once(
        &self,
        a: &ServeArgs,
        warmups: &[SampleRequest],
        measured: &[SampleRequest],
        rng: &mut StdRng,
    ) -> Result<Value> {
        let ramp = match (a.ramp_up_strategy, a.ramp_up_start_rps, a.ramp_up_end_rps) {
            (Some(s), Some(lo), Some(hi)) => Some((s, lo, hi)),
            (Some(_), _, _) => {
                return Err(BenchError::InvalidArgument(
                    "--ramp-up-strategy needs --ramp-up-start-rps and --ramp-up-end-rps".into(),
                ))
            }
            _ => None,
        };
        let arrivals = crate::schedule::ArrivalProcess::new(a.request_rate, a.burstiness, ramp)?;
        if !warmups.is_empty() {
            eprintln!("Warming up with {} requests...", warmups.len());
            let offsets = vec![0.0; warmups.len()];
            let prepared: Vec<_> = warmups.iter().map(|r| self.tpl.prepare(r)).collect();
            let w = self
                .dispatch(&prepared, Plan::Fixed(offsets), a.max_concurrency, true)
                .await;
            let failed = w.iter().filter(|o| !o.success).count();
            if failed == w.len() {
                return Err(BenchError::AllFailed {
                    num_requests: w.len(),
                    first_error: w[0].error.clone(),
                });
            }
        }
        let before = self.scrape().await;
        let plan = match a.duration {
            Some(d) => Plan::Duration {
                limit_s: d,
                arrivals,
                seed: a.seed,
            },
            None => Plan::Fixed(arrivals.offsets(measured.len(), rng)),
        };
        let prepared: Vec<_> = measured.iter().map(|r| self.tpl.prepare(r)).collect();
        let started = Instant::now();
        let outputs = self
            .dispatch(&prepared, plan, a.max_concurrency, a.disable_tqdm)
            .await;
        let duration_s = started.elapsed().as_secs_f64();
        let after = self.scrape().await;

        if outputs.iter().all(|o| !o.success) {
            let first = outputs
                .first()
                .map(|o| o.error.clone())
                .unwrap_or_else(|| "no request was sent".into());
            return Err(BenchError::AllFailed {
                num_requests: outputs.len(),
                first_error: first,
            });
        }
        let output_lens = self.output_lens(&outputs)?;
        let m = metrics::calculate(
            &outputs,
            &output_lens,
            duration_s,
            &self.spec.percentiles,
            self.slo.as_ref(),
        );
        let info = self.info(a, outputs.len(), ramp);
        print!("{}", report::table(&info, duration_s, &m, &self.spec));
        let server = report::server_metrics_value(before, after);
        Ok(report::result_json(
            &info,
            duration_s,
            &m,
            &self.spec,
            self.slo.as_ref(),
            &outputs,
            &output_lens,
            server,
        ))
    }

    async fn scrape(&self) -> Option<prom::Samples> {
        if self.args.no_server_metrics {
            return None;
        }
        prom::scrape(&self.http, &self.base_url, self.tpl.api_key.as_deref()).await
    }

    /// Output tokens per request: the server's `usage` when reported, else the generated text
    /// re-tokenized (as vLLM does when usage is missing).
    fn output_lens(&self, outputs: &[RequestOutput]) -> Result<Vec<usize>> {
        outputs
            .iter()
            .map(|o| match (o.success, o.output_tokens) {
                (false, _) => Ok(0),
                (true, Some(n)) => Ok(n),
                (true, None) => dataset::count_tokens(&self.tokenizer, &o.generated_text),
            })
            .collect()
    }

    fn info(&self, a: &ServeArgs, sent: usize, ramp: Option<(RampUp, f64, f64)>) -> RunInfo {
        RunInfo {
            date: now(),
            backend: a.backend_name().into(),
            label: a.label.clone().unwrap_or_else(|| a.backend_name().into()),
            model_id: self.tpl.model.clone(),
            tokenizer_id: self.tokenizer_id.clone(),
            base_url: self.base_url.clone(),
            endpoint: a.endpoint().into(),
            dataset_name: a
                .dataset_name
                .to_possible_value()
                .map(|v| v.get_name().to_string())
                .unwrap_or_default(),
            num_prompts: sent,
            request_rate: a.request_rate,
            burstiness: a.burstiness,
            max_concurrency: a.max_concurrency,
            ramp_up: ramp.map(|(s, lo, hi)| {
                (
                    if s == RampUp::Linear {
                        "linear"
                    } else {
                        "exponential"
                    }
                    .to_string(),
                    lo,
                    hi,
                )
            }),
            num_warmups: a.num_warmups,
            seed: a.seed,
            duration_limit_s: a.duration,
            metadata: a
                .metadata
                .iter()
                .filter_map(|kv| {
                    kv.split_once('=')
                        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
                })
                .collect(),
        }
    }

    fn save(&self, a: &ServeArgs, result: &Value) -> Result<()> {
        if !a.save_result {
            return Ok(());
        }
        let file = match (&a.result_filename, &a.sweep) {
            (Some(f), None) => f.clone(),
            // In a sweep every point needs its own file.
            (Some(f), Some(_)) => format!(
                "{}-{}qps-c{}.json",
                f.trim_end_matches(".json"),
                a.request_rate,
                a.max_concurrency
                    .map(|c| c.to_string())
                    .unwrap_or_else(|| "none".into())
            ),
            (None, _) => report::default_filename(&self.info(a, 0, None)),
        };
        let path = report::write_json(a.result_dir.as_deref(), &file, result)?;
        eprintln!("Result saved to {}", path.display());
        Ok(())
    }

    /// Sends `requests` following `plan`, at most `max_concurrency` in flight, and returns one
    /// output per request sent, in send order.
    async fn dispatch(
        &self,
        requests: &[PreparedRequest],
        plan: Plan,
        max_concurrency: Option<usize>,
        hide_progress: bool,
    ) -> Vec<RequestOutput> {
        let limit = max_concurrency.map(|c| Arc::new(Semaphore::new(c)));
        let pb = progress_bar(&plan, requests.len(), hide_progress);
        let start = Instant::now();
        let tpl = Arc::new(self.tpl.clone());
        let mut tasks = Vec::new();
        let mut spawn =
            |req: PreparedRequest, permit: Option<tokio::sync::OwnedSemaphorePermit>| {
                let (http, tpl, pb, limit) =
                    (self.http.clone(), tpl.clone(), pb.clone(), limit.clone());
                tasks.push(tokio::spawn(async move {
                    // With an open-loop rate the request "arrives" on schedule and then waits for a
                    // concurrency slot here, as in vLLM; its timing starts when it is actually sent.
                    let _permit = match (permit, limit) {
                        (Some(p), _) => Some(p),
                        (None, Some(sem)) => sem.acquire_owned().await.ok(),
                        (None, None) => None,
                    };
                    let out = client::send(&http, &tpl, &req, start).await;
                    pb.inc(1);
                    out
                }));
            };
        match plan {
            Plan::Fixed(offsets) => {
                for (req, off) in requests.iter().zip(offsets) {
                    let at = start + Duration::from_secs_f64(off);
                    // Only yield to the timer when there is time to wait: a burst (rate inf) then
                    // goes out in one pass instead of one scheduler round trip per request.
                    if at > Instant::now() {
                        tokio::time::sleep_until(at.into()).await;
                    }
                    spawn(req.clone(), None);
                }
            }
            Plan::Duration {
                limit_s,
                arrivals,
                seed,
            } => {
                let mut rng = StdRng::seed_from_u64(seed ^ 0x5eed);
                let deadline = start + Duration::from_secs_f64(limit_s);
                let mut off = 0.0;
                for req in requests.iter().cycle() {
                    let at = start + Duration::from_secs_f64(off);
                    if at >= deadline {
                        break;
                    }
                    if at > Instant::now() {
                        tokio::time::sleep_until(at.into()).await;
                    }
                    // Closed loop without a rate: take the slot before spawning, so the number of
                    // parked tasks stays bounded.
                    let permit = match (&limit, arrivals.request_rate.is_infinite()) {
                        (Some(sem), true) => {
                            match tokio::time::timeout_at(
                                deadline.into(),
                                sem.clone().acquire_owned(),
                            )
                            .await
                            {
                                Ok(Ok(p)) => Some(p),
                                _ => break,
                            }
                        }
                        _ => None,
                    };
                    spawn(req.clone(), permit);
                    off = arrivals.next_offset(off, &mut rng);
                }
            }
        }
        let mut outputs = Vec::with_capacity(tasks.len());
        for t in tasks {
            outputs.push(t.await.unwrap_or_else(|e| RequestOutput {
                error: format!("task failed: {e}"),
                ..Default::default()
            }));
        }
        pb.finish_and_clear();
        outputs
    }
}

/// When requests go out.
enum Plan {
    /// One offset (seconds from start) per request.
    Fixed(Vec<f64>),
    /// Keep sending until `limit_s` has passed.
    Duration {
        limit_s: f64,
        arrivals: crate::schedule::ArrivalProcess,
        seed: u64,
    },
}

fn progress_bar(plan: &Plan, n: usize, hidden: bool) -> ProgressBar {
    if hidden {
        return ProgressBar::hidden();
    }
    let pb = match plan {
        Plan::Fixed(_) => {
            let pb = ProgressBar::with_draw_target(Some(n as u64), ProgressDrawTarget::stderr());
            pb.set_style(
                ProgressStyle::with_template(
                    "{bar:40} {pos}/{len} [{elapsed_precise}<{eta_precise}, {per_sec}]",
                )
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            pb
        }
        Plan::Duration { .. } => {
            let pb = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
            pb.set_style(
                ProgressStyle::with_template(
                    "{spinner} {pos} requests done [{elapsed_precise}, {per_sec}]",
                )
                .unwrap_or_else(|_| ProgressStyle::default_spinner()),
            );
            pb
        }
    };
    pb.enable_steady_tick(Duration::from_millis(200));
    pb
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sweep_spec_parses() {
        assert_eq!(
            parse_sweep("request_rate=1,2.5,inf").unwrap().1,
            vec![1.0, 2.5, f64::INFINITY]
        );
        assert_eq!(
            parse_sweep("max-concurrency=1,8").unwrap().0,
            SweepParam::MaxConcurrency
        );
        assert!(parse_sweep("max_concurrency=0").is_err());
        assert!(parse_sweep("max_concurrency=1.5").is_err());
        assert!(parse_sweep("rate=1").is_err());
        assert!(parse_sweep("request_rate=").is_err());
    }
}
