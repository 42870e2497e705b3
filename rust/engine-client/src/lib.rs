//! The front end's side of the ZeroMQ link to one or more EngineCore processes.
//!
//! [`EngineClient::connect`] binds a ROUTER (requests) and a PULL (outputs), waits for every engine's
//! READY, then runs three tasks:
//! - a writer that owns the ROUTER and sends ADD/ABORT to the engine a request was routed to;
//! - a reader that owns the PULL and demultiplexes OUTPUTS into per-request bounded channels;
//! - a health watcher that polls every engine's pid, and (with a hang timeout) declares an engine
//!   hung when it sent nothing (no OUTPUTS, no heartbeat) for that long while it holds requests;
//! - with [`EngineLaunch`], one supervisor per engine that owns the engine process and restarts it
//!   with backoff after a death or a hang, up to a bound.
//!
//! With several engines (data parallelism) each request goes where [`routing`] says: the least
//! loaded serving engine, or the one that took its prompt's prefix while that one is not
//! overloaded. An engine that dies takes only its own requests down; the others keep serving while
//! it restarts, and after it is lost for good (no launcher, restarts used up).
//!
//! Invariants: a request id is live in the routing table from `add_request` until its finished
//! output is delivered, its [`RequestStream`] is dropped, or its engine dies — whichever comes
//! first removes the entry and decrements the engine's load exactly once. Dropping an unfinished
//! stream sends ABORT, so a disconnected HTTP client never leaves work running in the engine.
//! While an engine restarts it takes no requests; the client is unhealthy until it is READY again.
//! A death that cannot be healed (no launcher, restarts exhausted) loses that engine; once every
//! engine is lost the client is finished: `wait_dead`.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
use tokio::sync::{mpsc, oneshot, watch, Notify};
use voltllm_protocol::{
    engine_identity, EngineCoreOutput, EngineCoreRequest, EngineReady, Message, ProtocolError,
    SchedulerStats, UtilityCall, Value,
};
use zeromq::{Socket, SocketEvent, SocketRecv, SocketSend, ZmqMessage};

#[cfg(feature = "mock")]
pub mod mock;
pub mod routing;

use routing::{EngineLoad, PrefixIndex, RoutingPolicy};

/// Prompt blocks hashed for prefix affinity: longer shared prefixes than this route alike.
const PREFIX_MAX_BLOCKS: usize = 256;
/// Prefix hashes remembered (about 24 bytes each).
const PREFIX_INDEX_CAPACITY: usize = 1 << 16;

/// Everything that can go wrong between the front end and the engines.
#[derive(Debug, Clone, thiserror::Error)]
pub enum EngineClientError {
    #[error("cannot bind {address}: {message}")]
    Bind { address: String, message: String },
    #[error("timed out after {waited:?} waiting for READY from engine(s) {missing:?}")]
    ReadyTimeout { waited: Duration, missing: Vec<u32> },
    #[error(
        "engine {engine_index} announced itself but only {num_engines} engine(s) were expected"
    )]
    UnexpectedEngine { engine_index: u32, num_engines: u32 },
    #[error("engine {engine_index} is dead: {reason}")]
    EngineDead { engine_index: u32, reason: String },
    #[error("request id {0:?} is already in flight")]
    DuplicateRequestId(String),
    #[error("engine failed request: {0}")]
    RequestFailed(String),
    #[error("request dropped: the client read its outputs too slowly ({0} pending outputs)")]
    Overflow(usize),
    #[error("engine client is shut down")]
    Closed,
    #[error("cannot start an engine: {0}")]
    Launch(String),
    #[error("utility call {method} failed: {message}")]
    Utility { method: String, message: String },
    #[error(transparent)]
    Protocol(#[from] Arc<ProtocolError>),
}

/// How to reach and supervise the engines.
#[derive(Debug, Clone)]
pub struct EngineClientConfig {
    /// ZeroMQ endpoint the ROUTER binds (engines connect their DEALER here).
    pub input_address: String,
    /// ZeroMQ endpoint the PULL binds (engines connect their PUSH here).
    pub output_address: String,
    /// How many engines must send READY before `connect` returns.
    pub num_engines: u32,
    /// How long to wait for all READYs.
    pub ready_timeout: Duration,
    /// Outputs buffered per request before the request is dropped as too slow.
    pub stream_capacity: usize,
    /// How often engine pids are checked; `None` disables the pid watch (engines on other hosts).
    pub pid_poll_interval: Option<Duration>,
    /// Pids of engine processes started by the caller, watched while waiting for READY so that an
    /// engine that crashes during start-up fails `connect` at once instead of at the timeout.
    pub startup_pids: Vec<u32>,
    /// An engine that holds requests but sent nothing for this long is declared hung (and, with
    /// `launch`, killed and restarted). Engines send a heartbeat while they work, so a long step
    /// is not a hang. `None`: no hang check.
    pub hang_timeout: Option<Duration>,
    /// When set, `connect` starts the engines itself and restarts them when they die.
    pub launch: Option<EngineLaunch>,
}

/// How the client starts engine processes and restarts a dead or hung one.
#[derive(Debug, Clone)]
pub struct EngineLaunch {
    /// Program and arguments of an engine; `--engine-index I` is appended for engine I.
    pub argv: Vec<String>,
    /// Restarts allowed over the client's life (all engines together); the death after the last
    /// one ends the client.
    pub max_restarts: u32,
    /// Wait before the first restart; it doubles with each failure in a row, up to `max_backoff`.
    pub initial_backoff: Duration,
    pub max_backoff: Duration,
}

impl EngineLaunch {
    /// Defaults: 5 restarts, 1 s backoff doubling to 30 s.
    pub fn new(argv: Vec<String>) -> Self {
        Self {
            argv,
            max_restarts: 5,
            initial_backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(30),
        }
    }
}

/// Where the engines stand, for `/health`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EngineHealth {
    /// Every engine is READY.
    Healthy,
    /// Some engines serve while others restart or are lost; which ones and why.
    Degraded(String),
    /// No engine serves; one is being restarted. The reason of the last failure.
    Restarting(String),
    /// Every engine died for good; the client is finished.
    Dead(String),
}

/// One engine's state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EngineState {
    /// READY and taking requests.
    Serving,
    /// Died or hung; its supervisor is restarting it. Why it failed.
    Restarting(String),
    /// Died and will not come back (no launcher, or `--max-engine-restarts` used up). Why.
    Lost(String),
}

impl EngineClientConfig {
    /// Defaults for `num_engines` engines on this host.
    pub fn new(input_address: impl Into<String>, output_address: impl Into<String>) -> Self {
        Self {
            input_address: input_address.into(),
            output_address: output_address.into(),
            num_engines: 1,
            ready_timeout: Duration::from_secs(600),
            stream_capacity: 4096,
            pid_poll_interval: Some(Duration::from_millis(500)),
            startup_pids: Vec::new(),
            hang_timeout: None,
            launch: None,
        }
    }
}

/// Why a request's channel was closed without a finished output.
#[derive(Debug, Clone)]
enum CloseReason {
    Failed(EngineClientError),
}

struct StreamEntry {
    engine: usize,
    tx: mpsc::Sender<EngineCoreOutput>,
    closed: Arc<OnceLock<CloseReason>>,
}

enum Command {
    Add(usize, Box<EngineCoreRequest>),
    Abort(usize, Vec<String>),
    Utility(usize, UtilityCall),
}

/// A utility call waiting for its answer: the engine asked, and where the answer goes.
type PendingCall = (usize, oneshot::Sender<Result<Value, String>>);

struct EngineSlot {
    ready: Mutex<EngineReady>,
    load: AtomicUsize,
    /// Takes no requests: dead, or restarting.
    dead: AtomicBool,
    /// Dead for good: never restarted again.
    lost: AtomicBool,
    /// Times this engine was restarted.
    restarts: AtomicU64,
    /// Why it last died (shown by `/health` while it restarts).
    last_failure: Mutex<String>,
    /// Last message from the engine, or when it was handed work while idle (the hang check).
    last_seen: Mutex<Instant>,
    stats: Mutex<Option<SchedulerStats>>,
    /// A restarted engine is back once both its READY arrived and its DEALER connected.
    reborn: Mutex<Reborn>,
    reborn_changed: Notify,
    /// Wakes the engine's supervisor after a death.
    died: mpsc::UnboundedSender<()>,
}

#[derive(Default, Clone, Copy)]
struct Reborn {
    ready: bool,
    connected: bool,
}

struct Inner {
    engines: Vec<EngineSlot>,
    streams: Mutex<HashMap<String, StreamEntry>>,
    commands: mpsc::UnboundedSender<Command>,
    /// Set once a death cannot be healed; the client is finished.
    dead: watch::Sender<Option<String>>,
    /// A launcher exists and restarts are left.
    can_restart: AtomicBool,
    /// `shutdown_engines` began: deaths are expected and neither restart nor finish the client.
    stopping: AtomicBool,
    restarts: AtomicU64,
    /// Requests dropped because their reader fell `stream_capacity` outputs behind.
    overflows: AtomicU64,
    supervisors: Mutex<Vec<tokio::task::JoinHandle<()>>>,
    stop_engines: watch::Sender<Option<Duration>>,
    stream_capacity: usize,
    next_call_id: AtomicU64,
    /// Pending utility calls by call id.
    utility_calls: Mutex<HashMap<u64, PendingCall>>,
    policy: RoutingPolicy,
    prefixes: Mutex<PrefixIndex>,
    /// Where the next search for the least loaded engine starts, so that ties take turns.
    next_turn: AtomicUsize,
}

/// Handle to the engines; cheap to clone.
#[derive(Clone)]
pub struct EngineClient {
    inner: Arc<Inner>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A panic while holding one of these locks leaves plain maps behind, still consistent.
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Inner {
    /// Removes a live request from the routing table, releasing its engine's load slot.
    fn remove(&self, request_id: &str) -> Option<StreamEntry> {
        let entry = lock(&self.streams).remove(request_id)?;
        self.engines[entry.engine]
            .load
            .fetch_sub(1, Ordering::Relaxed);
        Some(entry)
    }

    fn fail(&self, request_id: &str, error: EngineClientError) {
        if let Some(entry) = self.remove(request_id) {
            let _ = entry.closed.set(CloseReason::Failed(error));
        }
    }

    fn deliver(&self, output: EngineCoreOutput) {
        let sent = if output.finished() {
            // Leave the routing table before the last output becomes visible, so a caller that
            // has seen the end never finds the request still counted as in flight.
            let Some(entry) = self.remove(&output.request_id) else {
                return;
            };
            if let Err(mpsc::error::TrySendError::Full(_)) = entry.tx.try_send(output) {
                self.overflows.fetch_add(1, Ordering::Relaxed);
                let overflow = EngineClientError::Overflow(self.stream_capacity);
                let _ = entry.closed.set(CloseReason::Failed(overflow));
            }
            return;
        } else {
            let streams = lock(&self.streams);
            let Some(entry) = streams.get(&output.request_id) else {
                // Already aborted or dropped: the engine's last words about it are not needed.
                return;
            };
            entry.tx.try_send(output)
        };
        match sent {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(output)) => {
                // A reader this far behind would stall every other request on the shared output
                // socket; it loses its request instead.
                tracing::warn!(request_id = %output.request_id, "output stream full, dropping request");
                if let Some(entry) = self.remove(&output.request_id) {
                    self.overflows.fetch_add(1, Ordering::Relaxed);
                    let _ = entry
                        .closed
                        .set(CloseReason::Failed(EngineClientError::Overflow(
                            self.stream_capacity,
                        )));
                    let _ = self
                        .commands
                        .send(Command::Abort(entry.engine, vec![output.request_id]));
                }
            }
            // Receiver gone: its drop guard removes the entry and aborts.
            Err(mpsc::error::TrySendError::Closed(_)) => {}
        }
    }

    /// Marks an engine dead: every request it held ends with an error at once. With a launcher
    /// its supervisor restarts it; otherwise the client is finished.
    fn engine_died(&self, engine: usize, reason: String) {
        let Some(slot) = self.engines.get(engine) else {
            tracing::warn!(engine, %reason, "death notice from an unknown engine");
            return;
        };
        // DEAD message, pid watch, hang check and the supervisor can all report the same death.
        if slot.dead.swap(true, Ordering::SeqCst) {
            return;
        }
        *lock(&slot.last_failure) = reason.clone();
        // A restarted engine starts with an empty cache and reports its own stats.
        *lock(&slot.stats) = None;
        lock(&self.prefixes).forget_engine(engine);
        let stopping = self.stopping.load(Ordering::SeqCst);
        let restart = self.can_restart.load(Ordering::SeqCst) && !stopping;
        if stopping {
            tracing::info!(engine, %reason, "engine stopped");
        } else {
            tracing::error!(engine, %reason, restart, "engine died");
        }
        let ids: Vec<String> = lock(&self.streams)
            .iter()
            .filter(|(_, e)| e.engine == engine)
            .map(|(k, _)| k.clone())
            .collect();
        for id in ids {
            self.fail(
                &id,
                EngineClientError::EngineDead {
                    engine_index: engine as u32,
                    reason: reason.clone(),
                },
            );
        }
        let calls: Vec<u64> = lock(&self.utility_calls)
            .iter()
            .filter(|(_, (e, _))| *e == engine)
            .map(|(&id, _)| id)
            .collect();
        for id in calls {
            if let Some((_, call)) = lock(&self.utility_calls).remove(&id) {
                let _ = call.send(Err(format!("engine {engine} died: {reason}")));
            }
        }
        if restart {
            let _ = slot.died.send(());
        } else if !stopping {
            self.lose(engine, format!("engine {engine}: {reason}"));
        }
    }

    /// Engine `engine` will not come back; the client is finished once no engine is left.
    fn lose(&self, engine: usize, reason: String) {
        self.engines[engine].lost.store(true, Ordering::SeqCst);
        *lock(&self.engines[engine].last_failure) = reason.clone();
        let left = self
            .engines
            .iter()
            .filter(|e| !e.lost.load(Ordering::SeqCst))
            .count();
        if left == 0 {
            self.give_up(reason);
        } else {
            tracing::error!(engine, %reason, left, "engine lost; the others keep serving");
        }
    }

    /// The client is finished: `wait_dead` resolves with `reason`.
    fn give_up(&self, reason: String) {
        self.can_restart.store(false, Ordering::SeqCst);
        self.dead.send_if_modified(|dead| {
            if dead.is_some() {
                return false;
            }
            *dead = Some(reason);
            true
        });
    }

    fn touch(&self, engine: usize) {
        if let Some(slot) = self.engines.get(engine) {
            *lock(&slot.last_seen) = Instant::now();
        }
    }

    fn update_reborn(&self, engine: usize, f: impl FnOnce(&mut Reborn)) {
        if let Some(slot) = self.engines.get(engine) {
            f(&mut lock(&slot.reborn));
            slot.reborn_changed.notify_waiters();
        }
    }
}

fn zmq_message(frames: Vec<Vec<u8>>) -> ZmqMessage {
    let frames: Vec<Bytes> = frames.into_iter().map(Bytes::from).collect();
    // Every caller passes at least the two protocol frames, so the message is never empty.
    ZmqMessage::try_from(frames).expect("non-empty message")
}

async fn bind<S: Socket>(socket: &mut S, address: &str) -> Result<(), EngineClientError> {
    socket
        .bind(address)
        .await
        .map(|_| ())
        .map_err(|e| EngineClientError::Bind {
            address: address.to_string(),
            message: e.to_string(),
        })
}

fn decode(msg: ZmqMessage) -> Result<Message, ProtocolError> {
    let frames = msg.into_vec();
    Message::decode(&frames)
}

/// True while `pid` names a live, non-zombie process.
fn pid_alive(pid: u32) -> bool {
    use nix::errno::Errno;
    use nix::sys::signal::kill;
    use nix::unistd::Pid;
    match kill(Pid::from_raw(pid as i32), None) {
        Ok(()) | Err(Errno::EPERM) => {}
        Err(_) => return false,
    }
    // An exited child that nobody has reaped yet still answers kill(pid, 0); its state says Z.
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            let state = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().next());
            !matches!(state, Some("Z") | Some("X"))
        }
        Err(_) => true,
    }
}

impl EngineClient {
    /// Binds both sockets, starts the engines when `config.launch` says how, and waits until all
    /// `config.num_engines` engines are READY and connected.
    pub async fn connect(config: EngineClientConfig) -> Result<Self, EngineClientError> {
        let mut router = zeromq::RouterSocket::new();
        let mut router_events = router.monitor();
        bind(&mut router, &config.input_address).await?;
        let mut pull = zeromq::PullSocket::new();
        bind(&mut pull, &config.output_address).await?;

        let n = config.num_engines as usize;
        let mut children = Vec::new();
        let mut startup_pids = config.startup_pids.clone();
        if let Some(launch) = &config.launch {
            for i in 0..n {
                let child = spawn_engine(launch, i)?;
                startup_pids.push(child.id().unwrap_or(0));
                children.push(child);
            }
        }
        let mut ready: Vec<Option<EngineReady>> = vec![None; n];
        let mut connected = vec![false; n];
        let deadline = tokio::time::Instant::now() + config.ready_timeout;
        let mut startup_watch = tokio::time::interval(Duration::from_millis(200));
        // READY comes over PULL, but ADDs can only be routed once the engine's DEALER finished its
        // handshake with the ROUTER, so both are awaited.
        while ready.iter().any(Option::is_none) || connected.iter().any(|c| !c) {
            let event = tokio::select! {
                msg = pull.recv() => Some(msg),
                event = router_events.next() => {
                    if let Some(i) = event.as_ref().and_then(|e| accepted_index(e, n)) {
                        connected[i] = true;
                    }
                    None
                }
                _ = startup_watch.tick() => {
                    if let Some(&pid) = startup_pids.iter().find(|&&pid| !pid_alive(pid)) {
                        return Err(EngineClientError::EngineDead {
                            engine_index: startup_pids.iter().position(|&p| p == pid).unwrap_or(0) as u32,
                            reason: format!("process {pid} exited before sending READY"),
                        });
                    }
                    None
                }
                _ = tokio::time::sleep_until(deadline) => {
                    let missing = (0..n).filter(|&i| ready[i].is_none() || !connected[i]).map(|i| i as u32).collect();
                    return Err(EngineClientError::ReadyTimeout { waited: config.ready_timeout, missing });
                }
            };
            let Some(msg) = event else { continue };
            let msg = msg.map_err(|e| EngineClientError::RequestFailed(e.to_string()))?;
            match decode(msg) {
                Ok(Message::Ready(r)) => {
                    let i = r.engine_index as usize;
                    if i >= n {
                        return Err(EngineClientError::UnexpectedEngine {
                            engine_index: r.engine_index,
                            num_engines: config.num_engines,
                        });
                    }
                    tracing::info!(engine = i, pid = r.pid, model = %r.model_name, "engine ready");
                    ready[i] = Some(r);
                }
                Ok(Message::Dead(e)) | Ok(Message::Error(e)) => {
                    return Err(EngineClientError::EngineDead {
                        engine_index: e.engine_index,
                        reason: e.message,
                    })
                }
                Ok(other) => tracing::warn!(kind = ?other.kind(), "ignoring message before READY"),
                Err(e) => tracing::warn!(error = %e, "undecodable message before READY"),
            }
        }

        let (commands, command_rx) = mpsc::unbounded_channel();
        let (dead, _) = watch::channel(None);
        let (stop_engines, _) = watch::channel(None);
        let mut deaths = Vec::new();
        let engines = ready
            .into_iter()
            .flatten()
            .map(|ready| {
                let (died, died_rx) = mpsc::unbounded_channel();
                deaths.push(died_rx);
                EngineSlot {
                    ready: Mutex::new(ready),
                    load: AtomicUsize::new(0),
                    dead: AtomicBool::new(false),
                    lost: AtomicBool::new(false),
                    restarts: AtomicU64::new(0),
                    last_failure: Mutex::new(String::new()),
                    last_seen: Mutex::new(Instant::now()),
                    stats: Mutex::new(None),
                    reborn: Mutex::new(Reborn::default()),
                    reborn_changed: Notify::new(),
                    died,
                }
            })
            .collect::<Vec<EngineSlot>>();
        let block_size = engines
            .first()
            .map_or(1, |e| lock(&e.ready).block_size as usize);
        let inner = Arc::new(Inner {
            engines,
            streams: Mutex::new(HashMap::new()),
            commands,
            dead,
            can_restart: AtomicBool::new(config.launch.is_some()),
            stopping: AtomicBool::new(false),
            restarts: AtomicU64::new(0),
            overflows: AtomicU64::new(0),
            supervisors: Mutex::new(Vec::new()),
            stop_engines,
            stream_capacity: config.stream_capacity.max(1),
            next_call_id: AtomicU64::new(1),
            utility_calls: Mutex::new(HashMap::new()),
            policy: RoutingPolicy::default(),
            prefixes: Mutex::new(PrefixIndex::new(
                block_size,
                PREFIX_MAX_BLOCKS,
                PREFIX_INDEX_CAPACITY,
            )),
            next_turn: AtomicUsize::new(0),
        });
        // The tasks hold weak references so that dropping the last client handle stops them.
        tokio::spawn(writer_task(Arc::downgrade(&inner), router, command_rx));
        tokio::spawn(reader_task(Arc::downgrade(&inner), pull));
        tokio::spawn(drain_events(Arc::downgrade(&inner), router_events));
        if config.pid_poll_interval.is_some() || config.hang_timeout.is_some() {
            let every = config
                .pid_poll_interval
                .unwrap_or(Duration::from_millis(500));
            tokio::spawn(health_task(
                Arc::downgrade(&inner),
                every,
                config.pid_poll_interval.is_some(),
                config.hang_timeout,
            ));
        }
        if let Some(launch) = &config.launch {
            let mut handles = lock(&inner.supervisors);
            for (i, (child, died)) in children.into_iter().zip(deaths).enumerate() {
                handles.push(tokio::spawn(supervise(
                    Arc::downgrade(&inner),
                    i,
                    child,
                    died,
                    launch.clone(),
                    config.ready_timeout,
                )));
            }
        }
        Ok(Self { inner })
    }

    /// READY of every engine, by index.
    pub fn engines(&self) -> Vec<EngineReady> {
        self.inner
            .engines
            .iter()
            .map(|e| lock(&e.ready).clone())
            .collect()
    }

    /// Smallest `max_model_len` over the engines: the limit the front end enforces.
    pub fn max_model_len(&self) -> u32 {
        self.inner
            .engines
            .iter()
            .map(|e| lock(&e.ready).max_model_len)
            .min()
            .unwrap_or(0)
    }

    /// True while every engine is READY and serving.
    pub fn is_healthy(&self) -> bool {
        self.health() == EngineHealth::Healthy
    }

    /// True while at least one engine takes requests.
    pub fn is_serving(&self) -> bool {
        self.inner.dead.borrow().is_none()
            && self
                .inner
                .engines
                .iter()
                .any(|e| !e.dead.load(Ordering::SeqCst))
    }

    /// Each engine's state, by index.
    pub fn engine_states(&self) -> Vec<EngineState> {
        self.inner
            .engines
            .iter()
            .map(|e| {
                if !e.dead.load(Ordering::SeqCst) {
                    EngineState::Serving
                } else if e.lost.load(Ordering::SeqCst) {
                    EngineState::Lost(lock(&e.last_failure).clone())
                } else {
                    EngineState::Restarting(lock(&e.last_failure).clone())
                }
            })
            .collect()
    }

    /// Whether every engine serves, some do, none does while one restarts, or the client is
    /// finished.
    pub fn health(&self) -> EngineHealth {
        if let Some(reason) = self.inner.dead.borrow().clone() {
            return EngineHealth::Dead(reason);
        }
        let states = self.engine_states();
        let down: Vec<String> = states
            .iter()
            .enumerate()
            .filter_map(|(i, s)| match s {
                EngineState::Serving => None,
                EngineState::Restarting(why) => Some(format!("engine {i} restarting ({why})")),
                EngineState::Lost(why) => Some(format!("engine {i} lost ({why})")),
            })
            .collect();
        let serving = states.len() - down.len();
        if down.is_empty() {
            EngineHealth::Healthy
        } else if serving > 0 {
            EngineHealth::Degraded(down.join("; "))
        } else {
            EngineHealth::Restarting(down.join("; "))
        }
    }

    /// Engine restarts so far (all engines together).
    pub fn num_restarts(&self) -> u64 {
        self.inner.restarts.load(Ordering::SeqCst)
    }

    /// Restarts of each engine, by index.
    pub fn engine_restarts(&self) -> Vec<u64> {
        self.inner
            .engines
            .iter()
            .map(|e| e.restarts.load(Ordering::SeqCst))
            .collect()
    }

    /// Requests in flight on each engine, by index.
    pub fn engine_in_flight(&self) -> Vec<usize> {
        self.inner
            .engines
            .iter()
            .map(|e| e.load.load(Ordering::Relaxed))
            .collect()
    }

    /// Requests dropped so far because their reader fell `stream_capacity` outputs behind.
    pub fn num_overflows(&self) -> u64 {
        self.inner.overflows.load(Ordering::Relaxed)
    }

    /// Stops restarting, asks every launched engine to exit (SIGTERM), and waits for each up to
    /// `grace` before killing it. A no-op for engines the caller started.
    pub async fn shutdown_engines(&self, grace: Duration) {
        self.inner.stopping.store(true, Ordering::SeqCst);
        self.inner.stop_engines.send_replace(Some(grace));
        let handles: Vec<_> = lock(&self.inner.supervisors).drain(..).collect();
        for handle in handles {
            let _ = handle.await;
        }
    }

    /// Resolves with the reason once an engine died for good (no launcher, or restarts used up).
    pub async fn wait_dead(&self) -> String {
        let mut rx = self.inner.dead.subscribe();
        loop {
            if let Some(reason) = rx.borrow_and_update().clone() {
                return reason;
            }
            if rx.changed().await.is_err() {
                return "engine client shut down".into();
            }
        }
    }

    /// Latest scheduler stats of each engine (`None` until its first OUTPUTS with stats).
    pub fn scheduler_stats(&self) -> Vec<Option<SchedulerStats>> {
        self.inner
            .engines
            .iter()
            .map(|e| lock(&e.stats).clone())
            .collect()
    }

    /// Number of requests in flight through this client.
    pub fn num_in_flight(&self) -> usize {
        lock(&self.inner.streams).len()
    }

    /// The engine a request with this prompt goes to (module [`routing`]), remembering its prefix
    /// there; `None` when no engine serves.
    fn route(&self, prompt: &[u32]) -> Option<usize> {
        let engines = &self.inner.engines;
        let loads: Vec<Option<EngineLoad>> = engines
            .iter()
            .map(|e| {
                (!e.dead.load(Ordering::SeqCst)).then(|| EngineLoad {
                    in_flight: e.load.load(Ordering::Relaxed),
                    kv_cache_usage: lock(&e.stats).as_ref().map_or(0.0, |s| s.kv_cache_usage),
                })
            })
            .collect();
        let start = self.inner.next_turn.fetch_add(1, Ordering::Relaxed);
        if engines.len() == 1 {
            return self.inner.policy.least_loaded(&loads, start);
        }
        let mut prefixes = lock(&self.inner.prefixes);
        let hashes = prefixes.block_hashes(prompt);
        let affine = prefixes.lookup(&hashes);
        let engine = self.inner.policy.choose(&loads, affine, start)?;
        prefixes.record(&hashes, engine);
        Some(engine)
    }

    /// Sends a request to the engine [`routing`] picks; its outputs arrive on the returned stream.
    pub fn add_request(
        &self,
        request: EngineCoreRequest,
    ) -> Result<RequestStream, EngineClientError> {
        let Some(engine) = self.route(&request.prompt_token_ids) else {
            let reason = match self.health() {
                EngineHealth::Dead(reason) => reason,
                EngineHealth::Restarting(reason) | EngineHealth::Degraded(reason) => reason,
                EngineHealth::Healthy => "no engine is ready".into(),
            };
            return Err(EngineClientError::EngineDead {
                engine_index: 0,
                reason,
            });
        };
        let (tx, rx) = mpsc::channel(self.inner.stream_capacity);
        let closed = Arc::new(OnceLock::new());
        {
            let mut streams = lock(&self.inner.streams);
            if streams.contains_key(&request.request_id) {
                return Err(EngineClientError::DuplicateRequestId(request.request_id));
            }
            streams.insert(
                request.request_id.clone(),
                StreamEntry {
                    engine,
                    tx,
                    closed: closed.clone(),
                },
            );
        }
        if self.inner.engines[engine]
            .load
            .fetch_add(1, Ordering::Relaxed)
            == 0
        {
            // An idle engine owes no output yet: the hang clock starts with its first request.
            self.inner.touch(engine);
        }
        let request_id = request.request_id.clone();
        if self
            .inner
            .commands
            .send(Command::Add(engine, Box::new(request)))
            .is_err()
        {
            self.inner.remove(&request_id);
            return Err(EngineClientError::Closed);
        }
        Ok(RequestStream {
            request_id,
            engine,
            rx,
            closed,
            finished: false,
            inner: self.inner.clone(),
        })
    }

    /// Ends every request in flight with `message` as its error and aborts it in its engine.
    pub fn fail_all(&self, message: &str) {
        let ids: Vec<String> = lock(&self.inner.streams).keys().cloned().collect();
        let mut by_engine: HashMap<usize, Vec<String>> = HashMap::new();
        for id in ids {
            if let Some(entry) = self.inner.remove(&id) {
                let error = EngineClientError::RequestFailed(message.to_string());
                let _ = entry.closed.set(CloseReason::Failed(error));
                by_engine.entry(entry.engine).or_default().push(id);
            }
        }
        for (engine, ids) in by_engine {
            let _ = self.inner.commands.send(Command::Abort(engine, ids));
        }
    }

    /// Aborts requests wherever they run; unknown or finished ids are ignored.
    pub fn abort(&self, request_ids: &[String]) {
        let mut by_engine: HashMap<usize, Vec<String>> = HashMap::new();
        for id in request_ids {
            if let Some(entry) = self.inner.remove(id) {
                let _ = entry
                    .closed
                    .set(CloseReason::Failed(EngineClientError::RequestFailed(
                        "aborted".into(),
                    )));
                by_engine.entry(entry.engine).or_default().push(id.clone());
            }
        }
        for (engine, ids) in by_engine {
            let _ = self.inner.commands.send(Command::Abort(engine, ids));
        }
    }

    /// Calls a utility method on one engine (`ping`, `reset_prefix_cache`, `get_stats`).
    pub async fn utility(
        &self,
        engine: usize,
        method: &str,
        args: Vec<Value>,
    ) -> Result<Value, EngineClientError> {
        // A call sent to an engine that is down would never be answered.
        match self.engine_states().get(engine) {
            Some(EngineState::Serving) => {}
            Some(EngineState::Restarting(reason) | EngineState::Lost(reason)) => {
                return Err(EngineClientError::EngineDead {
                    engine_index: engine as u32,
                    reason: reason.clone(),
                })
            }
            None => {
                return Err(EngineClientError::Utility {
                    method: method.to_string(),
                    message: format!("there is no engine {engine}"),
                })
            }
        }
        let call_id = self.inner.next_call_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        lock(&self.inner.utility_calls).insert(call_id, (engine, tx));
        let call = UtilityCall {
            call_id,
            method: method.to_string(),
            args,
        };
        self.inner
            .commands
            .send(Command::Utility(engine, call))
            .map_err(|_| EngineClientError::Closed)?;
        match rx.await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(message)) => Err(EngineClientError::Utility {
                method: method.to_string(),
                message,
            }),
            Err(_) => Err(EngineClientError::Closed),
        }
    }
}

fn accepted_index(event: &SocketEvent, n: usize) -> Option<usize> {
    let SocketEvent::Accepted(_, peer) = event else {
        return None;
    };
    let id: &[u8] = peer.as_ref();
    let index = u16::from_le_bytes(id.try_into().ok()?) as usize;
    (index < n).then_some(index)
}

async fn drain_events(
    inner: std::sync::Weak<Inner>,
    mut events: futures::channel::mpsc::Receiver<SocketEvent>,
) {
    while let Some(event) = events.next().await {
        tracing::debug!(?event, "router socket event");
        let Some(inner) = inner.upgrade() else { return };
        if let Some(i) = accepted_index(&event, inner.engines.len()) {
            inner.update_reborn(i, |r| r.connected = true);
        }
    }
}

async fn writer_task(
    inner: std::sync::Weak<Inner>,
    mut router: zeromq::RouterSocket,
    mut commands: mpsc::UnboundedReceiver<Command>,
) {
    while let Some(command) = commands.recv().await {
        let (engine, message, request_id) = match command {
            Command::Add(engine, request) => {
                let id = request.request_id.clone();
                (engine, Message::Add(*request), Some(id))
            }
            Command::Abort(engine, ids) => (engine, Message::Abort(ids), None),
            Command::Utility(engine, call) => (engine, Message::Utility(call), None),
        };
        let sent = match message.encode() {
            Ok([kind, payload]) => {
                let frames = vec![engine_identity(engine as u32).to_vec(), kind, payload];
                router
                    .send(zmq_message(frames))
                    .await
                    .map_err(|e| e.to_string())
            }
            Err(e) => Err(e.to_string()),
        };
        if let Err(e) = sent {
            let Some(inner) = inner.upgrade() else { return };
            match request_id {
                Some(id) => {
                    tracing::error!(engine, error = %e, "cannot send a request to the engine");
                    let error = EngineClientError::RequestFailed(format!("send to engine: {e}"));
                    inner.fail(&id, error);
                }
                // A lost ABORT/UTILITY only matters if the engine is alive; its death is reported
                // by the health watch, so this stays quiet (it happens at every shutdown).
                None => tracing::debug!(engine, error = %e, "cannot send to engine"),
            }
        }
    }
}

async fn reader_task(inner: std::sync::Weak<Inner>, mut pull: zeromq::PullSocket) {
    loop {
        let received = pull.recv().await;
        let Some(inner) = inner.upgrade() else { return };
        let msg = match received {
            Ok(msg) => msg,
            Err(e) => {
                tracing::error!(error = %e, "output socket failed");
                for i in 0..inner.engines.len() {
                    inner.engine_died(i, format!("output socket failed: {e}"));
                }
                return;
            }
        };
        match decode(msg) {
            Ok(Message::Outputs(outputs)) => {
                // An OUTPUTS with no outputs and no stats is the engine's heartbeat.
                inner.touch(outputs.engine_index as usize);
                if let Some(slot) = inner.engines.get(outputs.engine_index as usize) {
                    if let Some(stats) = outputs.scheduler_stats {
                        *lock(&slot.stats) = Some(stats);
                    }
                }
                for output in outputs.outputs {
                    inner.deliver(output);
                }
            }
            Ok(Message::Error(e)) => match e.request_id {
                Some(id) => inner.fail(&id, EngineClientError::RequestFailed(e.message)),
                None => {
                    tracing::warn!(engine = e.engine_index, message = %e.message, "engine error")
                }
            },
            Ok(Message::Dead(e)) => inner.engine_died(e.engine_index as usize, e.message),
            Ok(Message::UtilityResult(r)) => {
                if let Some((_, tx)) = lock(&inner.utility_calls).remove(&r.call_id) {
                    let _ = tx.send(if r.ok {
                        Ok(r.result)
                    } else {
                        Err(r.error.unwrap_or_default())
                    });
                }
            }
            Ok(Message::Ready(r)) => {
                let i = r.engine_index as usize;
                match inner.engines.get(i) {
                    Some(slot) if slot.dead.load(Ordering::SeqCst) => {
                        tracing::info!(engine = i, pid = r.pid, "restarted engine ready");
                        *lock(&slot.ready) = r;
                        inner.update_reborn(i, |r| r.ready = true);
                    }
                    _ => tracing::warn!(engine = i, "READY from an engine that is not restarting"),
                }
            }
            Ok(other) => tracing::warn!(kind = ?other.kind(), "unexpected message from engine"),
            Err(e) => tracing::warn!(error = %e, "undecodable message from engine"),
        }
    }
}

async fn health_task(
    inner: std::sync::Weak<Inner>,
    every: Duration,
    watch_pids: bool,
    hang_timeout: Option<Duration>,
) {
    let mut ticker = tokio::time::interval(every);
    loop {
        ticker.tick().await;
        let Some(inner) = inner.upgrade() else { return };
        for (i, slot) in inner.engines.iter().enumerate() {
            if slot.dead.load(Ordering::SeqCst) {
                continue;
            }
            let pid = lock(&slot.ready).pid;
            if watch_pids && !pid_alive(pid) {
                inner.engine_died(i, format!("process {pid} exited"));
                continue;
            }
            let load = slot.load.load(Ordering::Relaxed);
            let quiet = lock(&slot.last_seen).elapsed();
            if let Some(limit) = hang_timeout.filter(|&limit| load > 0 && quiet > limit) {
                let reason = format!(
                    "hung: no output or heartbeat for {:.1} s (limit {:.1} s) with {load} request(s) in flight",
                    quiet.as_secs_f64(),
                    limit.as_secs_f64()
                );
                inner.engine_died(i, reason);
            }
        }
    }
}

fn spawn_engine(
    launch: &EngineLaunch,
    engine: usize,
) -> Result<tokio::process::Child, EngineClientError> {
    let (program, args) = launch
        .argv
        .split_first()
        .ok_or_else(|| EngineClientError::Launch("the engine command is empty".into()))?;
    let mut command = tokio::process::Command::new(program);
    command
        .args(args)
        .arg("--engine-index")
        .arg(engine.to_string())
        // A terminal's Ctrl-C goes to the foreground process group: the engine must not stop
        // before the front end has drained, so it gets a group of its own and is stopped by us.
        .process_group(0)
        .kill_on_drop(true);
    let child = command
        .spawn()
        .map_err(|e| EngineClientError::Launch(format!("cannot start {program}: {e}")))?;
    tracing::info!(engine, pid = child.id(), "engine process started");
    Ok(child)
}

/// Owns engine `engine`'s process: restarts it after each death until restarts run out, and
/// stops it when `shutdown_engines` asks.
async fn supervise(
    weak: std::sync::Weak<Inner>,
    engine: usize,
    mut child: tokio::process::Child,
    mut died: mpsc::UnboundedReceiver<()>,
    launch: EngineLaunch,
    ready_timeout: Duration,
) {
    let Some(mut stop) = weak.upgrade().map(|i| i.stop_engines.subscribe()) else {
        return;
    };
    let mut failures_in_a_row = 0u32;
    let mut up_since = Instant::now();
    loop {
        let stopping = tokio::select! {
            _ = died.recv() => false,
            status = child.wait() => {
                let Some(inner) = weak.upgrade() else { return };
                let status = status.map_or_else(|e| e.to_string(), |s| s.to_string());
                inner.engine_died(engine, format!("process exited ({status})"));
                false
            }
            _ = stop.wait_for(Option::is_some) => true,
        };
        if stopping {
            let grace = stop.borrow().unwrap_or_default();
            stop_child(&mut child, grace).await;
            return;
        }
        if up_since.elapsed() > Duration::from_secs(60) {
            failures_in_a_row = 0;
        }
        loop {
            // A hung or stopped engine must be gone before its replacement takes its identity.
            let _ = child.start_kill();
            let _ = child.wait().await;
            let Some(inner) = weak.upgrade() else { return };
            if inner.stopping.load(Ordering::SeqCst) {
                return;
            }
            let used = inner.restarts.fetch_add(1, Ordering::SeqCst);
            let slot = &inner.engines[engine];
            if used >= u64::from(launch.max_restarts) {
                inner.restarts.fetch_sub(1, Ordering::SeqCst);
                let failure = lock(&slot.last_failure).clone();
                inner.lose(
                    engine,
                    format!(
                        "engine {engine}: {failure} (gave up after {} restart(s), --max-engine-restarts)",
                        launch.max_restarts
                    ),
                );
                return;
            }
            slot.restarts.fetch_add(1, Ordering::SeqCst);
            let backoff = launch
                .initial_backoff
                .saturating_mul(1 << failures_in_a_row.min(16))
                .min(launch.max_backoff);
            failures_in_a_row += 1;
            tracing::warn!(engine, attempt = used + 1, ?backoff, "restarting engine");
            tokio::select! {
                _ = tokio::time::sleep(backoff) => {}
                _ = stop.wait_for(Option::is_some) => return,
            }
            *lock(&slot.reborn) = Reborn::default();
            child = match spawn_engine(&launch, engine) {
                Ok(child) => child,
                Err(e) => {
                    inner.lose(engine, format!("engine {engine}: {e}"));
                    return;
                }
            };
            match wait_reborn(slot, &mut child, ready_timeout, &mut stop).await {
                Ok(()) => {
                    // Whatever was reported during the restart was about the old process.
                    while died.try_recv().is_ok() {}
                    inner.touch(engine);
                    slot.dead.store(false, Ordering::SeqCst);
                    up_since = Instant::now();
                    tracing::info!(engine, pid = child.id(), "engine restarted and ready");
                    break;
                }
                Err(reason) => {
                    if inner.stopping.load(Ordering::SeqCst) {
                        stop_child(&mut child, Duration::ZERO).await;
                        return;
                    }
                    tracing::error!(engine, %reason, "restarted engine failed");
                    *lock(&slot.last_failure) = reason;
                }
            }
        }
    }
}

/// Waits until a restarted engine's READY arrived and its DEALER connected.
async fn wait_reborn(
    slot: &EngineSlot,
    child: &mut tokio::process::Child,
    ready_timeout: Duration,
    stop: &mut watch::Receiver<Option<Duration>>,
) -> Result<(), String> {
    let deadline = tokio::time::Instant::now() + ready_timeout;
    loop {
        let changed = slot.reborn_changed.notified();
        tokio::pin!(changed);
        // Registered before the state is read, so a change in between is not missed.
        changed.as_mut().enable();
        let reborn = *lock(&slot.reborn);
        if reborn.ready && reborn.connected {
            return Ok(());
        }
        tokio::select! {
            _ = changed => {}
            status = child.wait() => {
                let status = status.map_or_else(|e| e.to_string(), |s| s.to_string());
                return Err(format!("restarted process exited before READY ({status})"));
            }
            _ = tokio::time::sleep_until(deadline) => {
                return Err(format!("restarted engine not READY within {ready_timeout:?}"));
            }
            _ = stop.wait_for(Option::is_some) => return Err("shutting down".into()),
        }
    }
}

/// SIGTERM, then SIGKILL if the engine has not exited within `grace`.
async fn stop_child(child: &mut tokio::process::Child, grace: Duration) {
    if let Some(pid) = child.id() {
        use nix::sys::signal::{kill, Signal};
        let _ = kill(nix::unistd::Pid::from_raw(pid as i32), Signal::SIGTERM);
        if tokio::time::timeout(grace, child.wait()).await.is_ok() {
            return;
        }
        tracing::warn!(pid, "engine did not exit within {grace:?}; killing it");
    }
    let _ = child.start_kill();
    let _ = child.wait().await;
}

/// The outputs of one request. Yields each engine output; ends after the finished one.
/// Dropping it before the end aborts the request in the engine.
pub struct RequestStream {
    request_id: String,
    engine: usize,
    rx: mpsc::Receiver<EngineCoreOutput>,
    closed: Arc<OnceLock<CloseReason>>,
    finished: bool,
    inner: Arc<Inner>,
}

impl RequestStream {
    /// The engine request id.
    pub fn request_id(&self) -> &str {
        &self.request_id
    }

    /// The index of the engine that runs it.
    pub fn engine(&self) -> usize {
        self.engine
    }

    /// The next output; `None` after the finished output was returned.
    pub async fn next_output(&mut self) -> Option<Result<EngineCoreOutput, EngineClientError>> {
        std::future::poll_fn(|cx| self.poll_output(cx)).await
    }

    fn poll_output(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<EngineCoreOutput, EngineClientError>>> {
        if self.finished {
            return Poll::Ready(None);
        }
        match self.rx.poll_recv(cx) {
            Poll::Ready(Some(output)) => {
                self.finished = output.finished();
                Poll::Ready(Some(Ok(output)))
            }
            Poll::Ready(None) => {
                self.finished = true;
                let error = match self.closed.get() {
                    Some(CloseReason::Failed(e)) => e.clone(),
                    None => EngineClientError::Closed,
                };
                Poll::Ready(Some(Err(error)))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl futures::Stream for RequestStream {
    type Item = Result<EngineCoreOutput, EngineClientError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.get_mut().poll_output(cx)
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        if self.inner.remove(&self.request_id).is_some() {
            let _ = self
                .inner
                .commands
                .send(Command::Abort(self.engine, vec![self.request_id.clone()]));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_pid_is_alive_and_reaped_child_is_not() {
        assert!(pid_alive(std::process::id()));
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        // Unreaped: zombie, must already count as dead.
        std::thread::sleep(Duration::from_millis(200));
        assert!(!pid_alive(pid));
        child.wait().unwrap();
        assert!(!pid_alive(pid));
    }
}
