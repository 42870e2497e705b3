//! The front end's side of the ZeroMQ link to one or more EngineCore processes.
//!
//! [`EngineClient::connect`] binds a ROUTER (requests) and a PULL (outputs), waits for every engine's
//! READY, then runs three tasks:
//! - a writer that owns the ROUTER and sends ADD/ABORT to the engine a request was routed to;
//! - a reader that owns the PULL and demultiplexes OUTPUTS into per-request bounded channels;
//! - a health watcher that polls every engine's pid and turns the client unhealthy on a death.
//!
//! Invariants: a request id is live in the routing table from `add_request` until its finished
//! output is delivered, its [`RequestStream`] is dropped, or its engine dies — whichever comes
//! first removes the entry and decrements the engine's load exactly once. Dropping an unfinished
//! stream sends ABORT, so a disconnected HTTP client never leaves work running in the engine.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use tokio::sync::{mpsc, oneshot, watch};
use voltllm_protocol::{
    engine_identity, EngineCoreOutput, EngineCoreRequest, EngineReady, Message, ProtocolError,
    SchedulerStats, UtilityCall, Value,
};
use zeromq::{Socket, SocketEvent, SocketRecv, SocketSend, ZmqMessage};

#[cfg(feature = "mock")]
pub mod mock;

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

struct EngineSlot {
    ready: EngineReady,
    load: AtomicUsize,
    dead: AtomicBool,
    stats: Mutex<Option<SchedulerStats>>,
}

struct Inner {
    engines: Vec<EngineSlot>,
    streams: Mutex<HashMap<String, StreamEntry>>,
    commands: mpsc::UnboundedSender<Command>,
    dead: watch::Sender<Option<String>>,
    healthy: AtomicBool,
    stream_capacity: usize,
    next_call_id: AtomicU64,
    utility_calls: Mutex<HashMap<u64, oneshot::Sender<Result<Value, String>>>>,
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

    /// Marks an engine dead: every request it held ends with an error; the client turns unhealthy.
    fn engine_died(&self, engine: usize, reason: String) {
        let Some(slot) = self.engines.get(engine) else {
            tracing::warn!(engine, %reason, "death notice from an unknown engine");
            return;
        };
        // DEAD message and pid watch can both report the same death.
        if slot.dead.swap(true, Ordering::SeqCst) {
            return;
        }
        self.healthy.store(false, Ordering::SeqCst);
        tracing::error!(engine, %reason, "engine died");
        self.dead.send_if_modified(|dead| {
            dead.get_or_insert_with(|| format!("engine {engine}: {reason}"));
            true
        });
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
        for (_, call) in lock(&self.utility_calls).drain() {
            let _ = call.send(Err(format!("engine {engine} died: {reason}")));
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
    /// Binds both sockets and waits until all `config.num_engines` engines are READY and connected.
    pub async fn connect(config: EngineClientConfig) -> Result<Self, EngineClientError> {
        let mut router = zeromq::RouterSocket::new();
        let mut router_events = router.monitor();
        bind(&mut router, &config.input_address).await?;
        let mut pull = zeromq::PullSocket::new();
        bind(&mut pull, &config.output_address).await?;

        let n = config.num_engines as usize;
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
                    if let Some(&pid) = config.startup_pids.iter().find(|&&pid| !pid_alive(pid)) {
                        return Err(EngineClientError::EngineDead {
                            engine_index: config.startup_pids.iter().position(|&p| p == pid).unwrap_or(0) as u32,
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
        let inner = Arc::new(Inner {
            engines: ready
                .into_iter()
                .flatten()
                .map(|ready| EngineSlot {
                    ready,
                    load: AtomicUsize::new(0),
                    dead: AtomicBool::new(false),
                    stats: Mutex::new(None),
                })
                .collect(),
            streams: Mutex::new(HashMap::new()),
            commands,
            dead,
            healthy: AtomicBool::new(true),
            stream_capacity: config.stream_capacity.max(1),
            next_call_id: AtomicU64::new(1),
            utility_calls: Mutex::new(HashMap::new()),
        });
        // The tasks hold weak references so that dropping the last client handle stops them.
        tokio::spawn(writer_task(Arc::downgrade(&inner), router, command_rx));
        tokio::spawn(reader_task(Arc::downgrade(&inner), pull));
        tokio::spawn(drain_events(router_events));
        if let Some(every) = config.pid_poll_interval {
            tokio::spawn(pid_watch_task(Arc::downgrade(&inner), every));
        }
        Ok(Self { inner })
    }

    /// READY of every engine, by index.
    pub fn engines(&self) -> Vec<EngineReady> {
        self.inner.engines.iter().map(|e| e.ready.clone()).collect()
    }

    /// Smallest `max_model_len` over the engines: the limit the front end enforces.
    pub fn max_model_len(&self) -> u32 {
        self.inner
            .engines
            .iter()
            .map(|e| e.ready.max_model_len)
            .min()
            .unwrap_or(0)
    }

    /// False once any engine has died (DEAD message or pid gone).
    pub fn is_healthy(&self) -> bool {
        self.inner.healthy.load(Ordering::SeqCst)
    }

    /// Resolves with the reason once an engine dies.
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

    /// Sends a request to the least-loaded engine; its outputs arrive on the returned stream.
    pub fn add_request(
        &self,
        request: EngineCoreRequest,
    ) -> Result<RequestStream, EngineClientError> {
        let engine = self
            .inner
            .engines
            .iter()
            .enumerate()
            .filter(|(_, e)| !e.dead.load(Ordering::SeqCst))
            .min_by_key(|(_, e)| e.load.load(Ordering::Relaxed))
            .map(|(i, _)| i);
        let Some(engine) = engine else {
            let reason = self.inner.dead.borrow().clone().unwrap_or_default();
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
        self.inner.engines[engine]
            .load
            .fetch_add(1, Ordering::Relaxed);
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
        let call_id = self.inner.next_call_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        lock(&self.inner.utility_calls).insert(call_id, tx);
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

async fn drain_events(mut events: futures::channel::mpsc::Receiver<SocketEvent>) {
    while let Some(event) = events.next().await {
        tracing::debug!(?event, "router socket event");
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
                if let Some(tx) = lock(&inner.utility_calls).remove(&r.call_id) {
                    let _ = tx.send(if r.ok {
                        Ok(r.result)
                    } else {
                        Err(r.error.unwrap_or_default())
                    });
                }
            }
            Ok(Message::Ready(r)) => {
                tracing::warn!(
                    engine = r.engine_index,
                    "engine sent READY again; restarts are not supported"
                )
            }
            Ok(other) => tracing::warn!(kind = ?other.kind(), "unexpected message from engine"),
            Err(e) => tracing::warn!(error = %e, "undecodable message from engine"),
        }
    }
}

async fn pid_watch_task(inner: std::sync::Weak<Inner>, every: Duration) {
    let mut ticker = tokio::time::interval(every);
    loop {
        ticker.tick().await;
        let Some(inner) = inner.upgrade() else { return };
        for (i, slot) in inner.engines.iter().enumerate() {
            if !slot.dead.load(Ordering::SeqCst) && !pid_alive(slot.ready.pid) {
                inner.engine_died(i, format!("process {} exited", slot.ready.pid));
            }
        }
    }
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
