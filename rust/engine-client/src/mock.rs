//! A fake EngineCore that speaks the real ZeroMQ protocol, for front-end tests and benchmarks.
//!
//! It connects a DEALER (identity = engine index) and a PUSH, sends READY, and then, every step,
//! emits `tokens_per_step` tokens for every running request. Generated tokens echo the prompt
//! cyclically (token `i` is `prompt[i % len]`), so tests know the text in advance. It honours
//! `max_tokens`, `min_tokens`, EOS / `stop_token_ids` (unless `ignore_eos`), logprobs, and ABORT,
//! and records what it received so tests can assert on it.

use std::collections::{HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::sync::mpsc;
use voltllm_protocol::{
    EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, EngineError, EngineReady, FinishReason,
    Logprob, Message, SchedulerStats, UtilityResult, Value,
};
use zeromq::{Socket, SocketOptions, SocketRecv, SocketSend, ZmqMessage};

/// How the fake engine presents itself and how fast it generates.
#[derive(Debug, Clone)]
pub struct MockEngineConfig {
    pub input_address: String,
    pub output_address: String,
    pub engine_index: u32,
    /// The pid announced in READY (the front end watches it); tests pass a process they can kill.
    pub pid: u32,
    pub model_name: String,
    pub max_model_len: u32,
    pub vocab_size: u32,
    pub eos_token_ids: Vec<u32>,
    /// Pause between steps while requests are running; zero steps as fast as possible.
    pub step_interval: Duration,
    pub tokens_per_step: usize,
    /// Announced in READY; the front end sizes its admission queue from it.
    pub max_num_seqs: u32,
}

impl MockEngineConfig {
    /// A small engine with the given addresses, announcing this process's pid.
    pub fn new(input_address: impl Into<String>, output_address: impl Into<String>) -> Self {
        Self {
            input_address: input_address.into(),
            output_address: output_address.into(),
            engine_index: 0,
            pid: std::process::id(),
            model_name: "mock".into(),
            max_model_len: 2048,
            vocab_size: 49152,
            eos_token_ids: vec![2],
            step_interval: Duration::from_millis(1),
            tokens_per_step: 1,
            max_num_seqs: 1024,
        }
    }
}

/// What the fake engine saw, for assertions.
#[derive(Debug, Default, Clone)]
pub struct MockLog {
    pub added: Vec<EngineCoreRequest>,
    pub aborted: Vec<String>,
}

enum Control {
    Die(String),
    Stop,
}

/// Handle to a running fake engine.
pub struct MockEngine {
    log: Arc<Mutex<MockLog>>,
    control: mpsc::UnboundedSender<Control>,
    task: tokio::task::JoinHandle<()>,
}

struct Running {
    request: EngineCoreRequest,
    num_generated: u32,
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

fn frames(message: &Message) -> ZmqMessage {
    let [kind, payload] = message.encode().expect("mock messages encode");
    let frames: Vec<bytes::Bytes> = vec![kind.into(), payload.into()];
    ZmqMessage::try_from(frames).expect("two frames")
}

impl MockEngine {
    /// Connects to the front end's sockets, sends READY and starts stepping.
    pub async fn start(config: MockEngineConfig) -> Result<Self, zeromq::ZmqError> {
        let mut options = SocketOptions::default();
        options.peer_identity(
            voltllm_protocol::engine_identity(config.engine_index)
                .to_vec()
                .try_into()?,
        );
        let mut dealer = zeromq::DealerSocket::with_options(options);
        connect(&mut dealer, &config.input_address).await?;
        let mut push = zeromq::PushSocket::new();
        connect(&mut push, &config.output_address).await?;
        let ready = EngineReady {
            engine_index: config.engine_index,
            pid: config.pid,
            model_name: config.model_name.clone(),
            max_model_len: config.max_model_len,
            vocab_size: config.vocab_size,
            eos_token_ids: config.eos_token_ids.clone(),
            num_kv_blocks: 1024,
            block_size: 16,
            dtype: "float16".into(),
            max_num_seqs: config.max_num_seqs,
        };
        push.send(frames(&Message::Ready(ready))).await?;
        let log = Arc::new(Mutex::new(MockLog::default()));
        let (control, control_rx) = mpsc::unbounded_channel();
        let task = tokio::spawn(run(config, dealer, push, log.clone(), control_rx));
        Ok(Self { log, control, task })
    }

    /// A copy of what the engine received so far.
    pub fn log(&self) -> MockLog {
        self.log.lock().map(|l| l.clone()).unwrap_or_default()
    }

    /// Sends DEAD with `message`, then stops.
    pub async fn die(self, message: &str) {
        let _ = self.control.send(Control::Die(message.to_string()));
        let _ = self.task.await;
    }

    /// Stops without a word, as a crashed engine would.
    pub async fn stop(self) {
        let _ = self.control.send(Control::Stop);
        let _ = self.task.await;
    }
}

/// Connects, retrying for a while as libzmq does when the peer has not bound yet.
async fn connect<S: Socket>(socket: &mut S, address: &str) -> Result<(), zeromq::ZmqError> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        match socket.connect(address).await {
            Ok(()) => return Ok(()),
            Err(_) if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => return Err(e),
        }
    }
}

fn error_output(request_id: String, message: &str) -> EngineCoreOutput {
    EngineCoreOutput {
        request_id,
        new_token_ids: vec![],
        new_logprobs: None,
        finish_reason: Some(FinishReason::Error),
        stop_reason: None,
        error: Some(message.to_string()),
        num_cached_tokens: 0,
        queued_ts: None,
        scheduled_ts: None,
        first_token_ts: None,
        prompt_logprobs: None,
    }
}

/// Prompt logprobs the mock reports: every prompt token at -1.0 with rank 1, then `n` alternatives.
fn mock_prompt_logprobs(prompt: &[u32], n: u32, vocab: u32) -> Vec<Logprob> {
    prompt[1..]
        .iter()
        .map(|&token| {
            let mut token_ids = vec![token];
            let mut logprobs = vec![-1.0];
            for k in 0..n {
                token_ids.push((token + k) % vocab);
                logprobs.push(-1.0 - k as f64);
            }
            Logprob {
                token_ids,
                logprobs,
                rank: 1,
            }
        })
        .collect()
}

struct State {
    config: MockEngineConfig,
    running: VecDeque<Running>,
    pending: Vec<EngineCoreOutput>,
    stats: SchedulerStats,
}

impl State {
    fn add(&mut self, request: EngineCoreRequest) {
        let id = request.request_id.clone();
        if request.prompt_token_ids.is_empty() {
            self.pending.push(error_output(id, "prompt is empty"));
        } else if request.prompt_token_ids.len() >= self.config.max_model_len as usize {
            self.pending.push(error_output(id, "prompt is too long"));
        } else if self.running.iter().any(|r| r.request.request_id == id) {
            self.pending.push(error_output(id, "duplicate request id"));
        } else {
            self.stats.num_prompt_tokens += request.prompt_token_ids.len() as u64;
            self.running.push_back(Running {
                request,
                num_generated: 0,
            });
        }
    }

    fn abort(&mut self, ids: &[String]) {
        let ids: HashSet<&String> = ids.iter().collect();
        let now = now();
        self.running.retain(|r| {
            if !ids.contains(&r.request.request_id) {
                return true;
            }
            let mut out = error_output(r.request.request_id.clone(), "");
            out.finish_reason = Some(FinishReason::Abort);
            out.error = None;
            out.queued_ts = Some(now);
            self.pending.push(out);
            false
        });
    }

    /// One step: every running request gains up to `tokens_per_step` tokens.
    fn step(&mut self) -> Vec<EngineCoreOutput> {
        let mut outputs = std::mem::take(&mut self.pending);
        let now = now();
        let eos = self.config.eos_token_ids.clone();
        let vocab = self.config.vocab_size.max(1);
        let mut generated = 0u64;
        let per_step = self.config.tokens_per_step.max(1);
        self.running.retain_mut(|r| {
            let p = &r.request.sampling_params;
            let prompt = &r.request.prompt_token_ids;
            let mut out = EngineCoreOutput {
                request_id: r.request.request_id.clone(),
                new_token_ids: Vec::with_capacity(per_step),
                new_logprobs: p.logprobs.map(|_| Vec::new()),
                finish_reason: None,
                stop_reason: None,
                error: None,
                num_cached_tokens: 0,
                queued_ts: Some(r.request.arrival_time),
                scheduled_ts: Some(r.request.arrival_time),
                first_token_ts: Some(now),
                prompt_logprobs: None,
            };
            if r.num_generated == 0 {
                out.prompt_logprobs = p
                    .prompt_logprobs
                    .map(|n| mock_prompt_logprobs(prompt, n, vocab));
            }
            for _ in 0..per_step {
                let token = prompt[r.num_generated as usize % prompt.len()];
                r.num_generated += 1;
                generated += 1;
                out.new_token_ids.push(token);
                if let (Some(n), Some(lps)) = (p.logprobs, out.new_logprobs.as_mut()) {
                    let mut token_ids = vec![token];
                    let mut logprobs = vec![-0.25];
                    for k in 0..n {
                        token_ids.push((token + k) % vocab);
                        logprobs.push(-0.25 - k as f64);
                    }
                    lps.push(Logprob {
                        token_ids,
                        logprobs,
                        rank: 1,
                    });
                }
                let may_stop = !p.ignore_eos && r.num_generated > p.min_tokens;
                if may_stop && (eos.contains(&token) || p.stop_token_ids.contains(&token)) {
                    out.finish_reason = Some(FinishReason::Stop);
                    out.stop_reason = Some(token);
                    break;
                }
                if r.num_generated >= p.max_tokens {
                    out.finish_reason = Some(FinishReason::Length);
                    break;
                }
            }
            let finished = out.finished();
            outputs.push(out);
            !finished
        });
        self.stats.num_generation_tokens += generated;
        self.stats.num_running = self.running.len() as u64;
        outputs
    }
}

async fn run(
    config: MockEngineConfig,
    mut dealer: zeromq::DealerSocket,
    mut push: zeromq::PushSocket,
    log: Arc<Mutex<MockLog>>,
    mut control: mpsc::UnboundedReceiver<Control>,
) {
    let engine_index = config.engine_index;
    let step_interval = config.step_interval;
    let mut state = State {
        config,
        running: VecDeque::new(),
        pending: Vec::new(),
        stats: SchedulerStats::default(),
    };
    loop {
        let busy = !state.running.is_empty() || !state.pending.is_empty();
        tokio::select! {
            biased;
            c = control.recv() => {
                if let Some(Control::Die(message)) = c {
                    let dead = EngineError { engine_index, request_id: None, message };
                    let _ = push.send(frames(&Message::Dead(dead))).await;
                }
                return;
            }
            msg = dealer.recv() => {
                let Ok(msg) = msg else { return };
                match Message::decode(&msg.into_vec()) {
                    Ok(Message::Add(request)) => {
                        if let Ok(mut l) = log.lock() { l.added.push(request.clone()); }
                        state.add(request);
                    }
                    Ok(Message::Abort(ids)) => {
                        if let Ok(mut l) = log.lock() { l.aborted.extend(ids.iter().cloned()); }
                        state.abort(&ids);
                    }
                    Ok(Message::Utility(call)) => {
                        let result = UtilityResult { call_id: call.call_id, ok: call.method == "ping",
                            result: if call.method == "ping" { Value::from("pong") } else { Value::Nil },
                            error: (call.method != "ping").then(|| format!("unknown method {}", call.method)) };
                        let _ = push.send(frames(&Message::UtilityResult(result))).await;
                    }
                    Ok(other) => {
                        let error = EngineError { engine_index, request_id: None, message: format!("unexpected {:?}", other.kind()) };
                        let _ = push.send(frames(&Message::Error(error))).await;
                    }
                    Err(e) => {
                        let error = EngineError { engine_index, request_id: None, message: e.to_string() };
                        let _ = push.send(frames(&Message::Error(error))).await;
                    }
                }
            }
            _ = tokio::time::sleep(step_interval), if busy => {
                let outputs = state.step();
                let message = Message::Outputs(EngineCoreOutputs {
                    engine_index,
                    outputs,
                    scheduler_stats: Some(state.stats.clone()),
                    timestamp: now(),
                });
                if push.send(frames(&message)).await.is_err() {
                    return;
                }
            }
        }
    }
}
