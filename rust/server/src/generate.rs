//! The generation pipeline shared by every endpoint: prompts in, a stream of per-choice text
//! deltas out. Streaming responses forward the deltas as SSE chunks; non-streaming responses
//! collect the very same stream (one code path, as TGI does).
//!
//! Each choice is one engine request. Its outputs go through the incremental detokenizer and the
//! stop-string checker; a matched stop string ends the choice and — by dropping the engine stream,
//! whose guard sends ABORT — stops the engine from generating further. The stop token that ends a
//! request (EOS or a `stop_token_ids` entry) is counted but its text is hidden unless
//! `include_stop_str_in_output`. Dropping the returned stream (client disconnect) aborts every
//! unfinished choice the same way.

use std::pin::Pin;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use futures::stream::{self, BoxStream, StreamExt};
use serde_json::Value as Json;
use tokio::sync::OwnedSemaphorePermit;
use voltllm_engine_client::RequestStream;
use voltllm_protocol::{EngineCoreOutput, EngineCoreRequest, FinishReason, SamplingParams};
use voltllm_text::{IncrementalDetokenizer, StopChecker};

use crate::error::ApiError;
use crate::metrics::{EngineMetrics, Rejected};
use crate::openai::OutputOptions;
use crate::state::AppState;

/// One sampled token with its alternatives, as the client sees them.
#[derive(Debug, Clone)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f64,
    /// The top alternatives, best first: (token text, logprob).
    pub top: Vec<(String, f64)>,
}

/// One candidate at a prompt position.
#[derive(Debug, Clone)]
pub struct PromptCandidate {
    pub token_id: u32,
    pub token: String,
    pub logprob: f64,
    /// 1 = most likely.
    pub rank: u32,
}

/// The prompt's log-probabilities, as the engine sends them once: the first prompt token (which
/// nothing precedes, so it has no logprob) and, per later prompt position, the prompt's own token
/// first, then the top alternatives best first.
#[derive(Debug, Clone, Default)]
pub struct PromptLogprobs {
    pub first_token: String,
    pub positions: Vec<Vec<PromptCandidate>>,
}

/// What one choice gained since its previous delta.
#[derive(Debug, Clone, Default)]
pub struct ChoiceDelta {
    pub index: u32,
    pub text: String,
    pub logprobs: Vec<TokenLogprob>,
    /// Tokens generated in this step (hidden stop tokens included), for usage.
    pub num_tokens: usize,
    /// `"stop"` or `"length"` on the last delta of a choice.
    pub finish_reason: Option<&'static str>,
    /// The stop string or stop token id that ended the choice.
    pub stop_reason: Option<Json>,
    /// On the first delta of a choice whose request asked for prompt logprobs.
    pub prompt_logprobs: Option<PromptLogprobs>,
}

/// A validated request, ready to run.
pub struct Generation {
    /// Prompt token ids, one entry per prompt (completions accept several).
    pub prompts: Vec<Vec<u32>>,
    /// Engine sampling parameters per prompt (`max_tokens` depends on the prompt length).
    pub params: Vec<SamplingParams>,
    pub options: OutputOptions,
    /// Prefix of the engine request ids (`<id>-<choice index>`).
    pub request_id: String,
}

/// Seconds since the Unix epoch.
pub fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

struct Choice {
    index: u32,
    /// `None` once the choice ended; dropping it aborts the engine request if still running.
    stream: Option<RequestStream>,
    detokenizer: IncrementalDetokenizer,
    stop: StopChecker,
    include_stop_str: bool,
    want_logprobs: bool,
    state: Arc<AppState>,
    /// The series of the engine that runs this choice.
    metrics: EngineMetrics,
    prompt_len: usize,
    first_prompt_token: u32,
    arrival: Instant,
    last_output: Option<Instant>,
    /// Tokens of outputs that produced no visible delta yet, added to the next delta's count.
    carried_tokens: usize,
    _permit: OwnedSemaphorePermit,
}

impl Choice {
    fn token_text(&self, id: u32) -> String {
        self.state
            .tokenizer
            .decode(&[id], false)
            .unwrap_or_default()
    }

    fn record_timing(&mut self, num_tokens: usize) {
        let now = Instant::now();
        let m = &self.metrics;
        match self.last_output {
            None => m
                .time_to_first_token
                .observe((now - self.arrival).as_secs_f64()),
            Some(prev) if num_tokens > 0 => {
                let per_token = (now - prev).as_secs_f64() / num_tokens as f64;
                m.inter_token_latency.observe(per_token);
            }
            Some(_) => {}
        }
        self.last_output = Some(now);
        m.generation_tokens.inc_by(num_tokens as u64);
    }

    fn finish(&mut self, reason: &'static str, output: Option<&EngineCoreOutput>) {
        let m = &self.metrics;
        m.e2e_request_latency
            .observe(self.arrival.elapsed().as_secs_f64());
        m.prompt_tokens.inc_by(self.prompt_len as u64);
        if let Some(EngineCoreOutput {
            queued_ts: Some(q),
            scheduled_ts: Some(s),
            ..
        }) = output
        {
            m.request_queue_time.observe((s - q).max(0.0));
        }
        m.finished(reason);
        // Dropping the engine stream aborts the request if the engine has not finished it.
        self.stream = None;
    }

    fn token_logprob(&self, id: u32, lp: &voltllm_protocol::Logprob) -> TokenLogprob {
        TokenLogprob {
            token: self.token_text(id),
            logprob: lp.logprobs.first().copied().unwrap_or(f64::NEG_INFINITY),
            top: lp
                .token_ids
                .iter()
                .zip(&lp.logprobs)
                .skip(1)
                .map(|(&t, &l)| (self.token_text(t), l))
                .collect(),
        }
    }

    fn prompt_candidates(&self, lp: &voltllm_protocol::Logprob) -> Vec<PromptCandidate> {
        lp.token_ids
            .iter()
            .zip(&lp.logprobs)
            .enumerate()
            .map(|(k, (&token_id, &logprob))| PromptCandidate {
                token_id,
                token: self.token_text(token_id),
                logprob,
                rank: if k == 0 { lp.rank } else { k as u32 },
            })
            .collect()
    }

    /// Turns one engine output into a delta.
    fn process(&mut self, output: EngineCoreOutput) -> Result<ChoiceDelta, ApiError> {
        let tokens = &output.new_token_ids;
        // An error as a request's first output is the engine refusing it at ADD (docs/protocol.md).
        let rejected = self.last_output.is_none() && tokens.is_empty();
        self.record_timing(tokens.len());
        let mut delta = ChoiceDelta {
            index: self.index,
            ..Default::default()
        };
        if let Some(positions) = &output.prompt_logprobs {
            delta.prompt_logprobs = Some(PromptLogprobs {
                first_token: self.token_text(self.first_prompt_token),
                positions: positions
                    .iter()
                    .map(|lp| self.prompt_candidates(lp))
                    .collect(),
            });
        }
        // The stop token's text is hidden unless asked for (vLLM's behaviour).
        let hide_last = output.finish_reason == Some(FinishReason::Stop)
            && output.stop_reason.is_some()
            && output.stop_reason == tokens.last().copied()
            && !self.include_stop_str;
        let visible = if hide_last {
            tokens.len() - 1
        } else {
            tokens.len()
        };
        let mut stopped_by = None;
        for (k, &id) in tokens.iter().enumerate() {
            delta.num_tokens = k + 1;
            if self.want_logprobs {
                if let Some(lp) = output.new_logprobs.as_ref().and_then(|l| l.get(k)) {
                    delta.logprobs.push(self.token_logprob(id, lp));
                }
            }
            if k >= visible {
                break;
            }
            let piece = self.detokenizer.push(id)?;
            let update = self.stop.push(&piece);
            delta.text.push_str(&update.emit);
            if let Some(stop) = update.stopped {
                stopped_by = Some(stop);
                break;
            }
        }
        if let Some(stop) = stopped_by {
            delta.finish_reason = Some("stop");
            delta.stop_reason = Some(Json::String(stop));
            self.finish("stop", Some(&output));
            return Ok(delta);
        }
        match output.finish_reason {
            None => {}
            Some(FinishReason::Stop) | Some(FinishReason::Length) => {
                let rest = self.detokenizer.flush()?;
                let update = self.stop.push(&rest);
                delta.text.push_str(&update.emit);
                if let Some(stop) = update.stopped {
                    delta.finish_reason = Some("stop");
                    delta.stop_reason = Some(Json::String(stop));
                } else {
                    delta.text.push_str(&self.stop.flush());
                    let reason = output.finish_reason.map_or("stop", FinishReason::as_str);
                    delta.finish_reason = Some(reason);
                    delta.stop_reason = output.stop_reason.map(Json::from);
                }
                self.finish(delta.finish_reason.unwrap_or("stop"), Some(&output));
            }
            Some(FinishReason::Abort) => {
                self.finish("abort", Some(&output));
                return Err(ApiError::Engine("the engine aborted the request".into()));
            }
            Some(FinishReason::Error) => {
                self.finish("error", Some(&output));
                let why = output.error.unwrap_or_else(|| "unknown error".into());
                if rejected {
                    return Err(ApiError::BadRequest {
                        message: why,
                        param: None,
                    });
                }
                return Err(ApiError::Engine(format!(
                    "the engine failed the request: {why}"
                )));
            }
        }
        Ok(delta)
    }

    async fn next_delta(&mut self) -> Option<Result<ChoiceDelta, ApiError>> {
        loop {
            let stream = self.stream.as_mut()?;
            let result = match stream.next_output().await? {
                Ok(output) => self.process(output),
                Err(e) => {
                    self.finish("error", None);
                    Err(e.into())
                }
            };
            match result {
                // Nothing visible yet (e.g. half a UTF-8 character): wait for more.
                Ok(d)
                    if d.text.is_empty()
                        && d.finish_reason.is_none()
                        && d.logprobs.is_empty()
                        && d.prompt_logprobs.is_none() =>
                {
                    self.carried_tokens += d.num_tokens;
                    continue;
                }
                Ok(mut d) => {
                    d.num_tokens += std::mem::take(&mut self.carried_tokens);
                    return Some(Ok(d));
                }
                Err(e) => return Some(Err(e)),
            }
        }
    }
}

/// Deltas of all choices of a request, interleaved as they arrive.
pub type DeltaStream = BoxStream<'static, Result<ChoiceDelta, ApiError>>;

/// Starts every choice of `generation` in the engines.
///
/// Fails fast (before anything is sent) when the engines are unhealthy or the waiting queue is
/// full. Choice `i * n + j` is the `j`-th sample of prompt `i`.
pub fn start(state: &Arc<AppState>, generation: Generation) -> Result<DeltaStream, ApiError> {
    let n = generation.options.n;
    let num_choices = generation.prompts.len() as u32 * n;
    if num_choices as usize > state.admission_capacity {
        // Waiting would never help: say so instead of a 503 whose retries all fail.
        return Err(ApiError::bad(
            "n",
            format!(
                "{num_choices} choices ({} prompt(s) x n = {n}) are more than this server runs \
                 or queues at once ({})",
                generation.prompts.len(),
                state.admission_capacity
            ),
        ));
    }
    if !state.client.is_serving() {
        state.metrics.rejected(Rejected::EngineUnavailable);
        return Err(ApiError::Unavailable("no engine is serving".into()));
    }
    let permits = state
        .admission
        .clone()
        .try_acquire_many_owned(num_choices)
        .map_err(|_| {
            state.metrics.rejected(Rejected::Capacity);
            ApiError::Unavailable(
                "the server is at capacity (too many waiting requests); retry later".into(),
            )
        })?;
    let mut permits = Some(permits);
    let arrival = Instant::now();
    let arrival_time = unix_now();
    let mut choices = Vec::with_capacity(num_choices as usize);
    for (i, (prompt, params)) in generation
        .prompts
        .iter()
        .zip(&generation.params)
        .enumerate()
    {
        for j in 0..n {
            let index = i as u32 * n + j;
            let mut params = params.clone();
            // Seeded samples of the same prompt must still differ from each other (vLLM does the same).
            params.seed = params.seed.map(|s| s.wrapping_add(j as i64));
            let request = EngineCoreRequest {
                request_id: format!("{}-{index}", generation.request_id),
                prompt_token_ids: prompt.clone(),
                sampling_params: params,
                arrival_time,
                priority: generation.options.priority,
            };
            let permit = permits
                .as_mut()
                .and_then(|p| p.split(1))
                .ok_or_else(|| ApiError::Internal("admission permits miscounted".into()))?;
            // Built before the request is sent so that a bad prompt never reaches the engine.
            let detokenizer = IncrementalDetokenizer::new(
                state.tokenizer.clone(),
                prompt,
                generation.options.skip_special_tokens,
            )?;
            let stop = StopChecker::new(
                generation.options.stop.iter().cloned(),
                generation.options.include_stop_str_in_output,
            )?;
            let stream = state.client.add_request(request)?;
            choices.push(Choice {
                metrics: state.metrics.engine(stream.engine()),
                index,
                stream: Some(stream),
                detokenizer,
                stop,
                include_stop_str: generation.options.include_stop_str_in_output,
                want_logprobs: generation.options.logprobs.is_some(),
                state: state.clone(),
                prompt_len: prompt.len(),
                first_prompt_token: prompt.first().copied().unwrap_or(0),
                arrival,
                last_output: None,
                carried_tokens: 0,
                _permit: permit,
            });
        }
    }
    let streams = choices.into_iter().map(|choice| {
        stream::unfold(choice, |mut c| async move {
            c.next_delta().await.map(|d| (d, c))
        })
        .boxed()
    });
    Ok(stream::select_all(streams).boxed())
}

/// [`start`], but for a request with a structured-output constraint it waits for the first delta
/// before returning, so that a constraint the engine could not compile is a 400 and not an error in
/// the middle of a 200 stream (the engine answers a rejected request at once).
pub async fn start_checked(
    state: &Arc<AppState>,
    generation: Generation,
) -> Result<DeltaStream, ApiError> {
    let constrained = generation
        .params
        .iter()
        .any(|p| p.structured_output.is_some());
    let mut deltas = start(state, generation)?;
    if !constrained {
        return Ok(deltas);
    }
    match deltas.next().await {
        None => Ok(deltas),
        Some(Err(e)) => Err(e),
        Some(Ok(first)) => Ok(stream::once(async { Ok(first) }).chain(deltas).boxed()),
    }
}

/// Everything one choice produced, for non-streaming responses.
#[derive(Debug, Clone, Default)]
pub struct CollectedChoice {
    pub text: String,
    pub logprobs: Vec<TokenLogprob>,
    pub num_tokens: usize,
    pub finish_reason: Option<&'static str>,
    pub stop_reason: Option<Json>,
    pub prompt_logprobs: Option<PromptLogprobs>,
}

/// Drains a delta stream into per-choice results; the first error fails the whole request.
pub async fn collect(
    mut deltas: Pin<Box<dyn futures::Stream<Item = Result<ChoiceDelta, ApiError>> + Send>>,
    num_choices: usize,
) -> Result<Vec<CollectedChoice>, ApiError> {
    let mut out = vec![CollectedChoice::default(); num_choices];
    while let Some(delta) = deltas.next().await {
        let delta = delta?;
        let c = &mut out[delta.index as usize];
        c.text.push_str(&delta.text);
        c.logprobs.extend(delta.logprobs);
        c.num_tokens += delta.num_tokens;
        if delta.prompt_logprobs.is_some() {
            c.prompt_logprobs = delta.prompt_logprobs;
        }
        if delta.finish_reason.is_some() {
            c.finish_reason = delta.finish_reason;
            c.stop_reason = delta.stop_reason;
        }
    }
    Ok(out)
}
