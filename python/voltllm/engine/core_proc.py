"""The EngineCore process: ZeroMQ in, ZeroMQ out, the busy loop in between (docs/protocol.md).

Threads, so the loop never blocks on a socket:
- input thread: DEALER socket -> decode -> `input_queue` (undecodable messages are answered with ERROR
  right there, through the output queue);
- main thread: drains `input_queue` (ADD / ABORT / UTILITY), runs `EngineCore.step()` while there is
  work, and queues one OUTPUTS per step;
- output thread: `output_queue` -> encode -> PUSH socket;
- heartbeat thread (after READY): an empty OUTPUTS every second, so the front end can tell a long
  step from a hung or stopped process (docs/protocol.md, "Heartbeat").
SIGTERM / SIGINT stop the loop; the engine then sends DEAD and exits. A fatal error in the loop also
sends DEAD (with the reason) before the process exits non-zero.
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import signal
import sys
import threading
import time
from typing import Any

import msgspec
import zmq

from voltllm import protocol
from voltllm.engine.args import add_engine_args, engine_config_from_args
from voltllm.engine.core import EngineCore, settle_garbage_collector
from voltllm.engine.data_parallel import claim_engine_devices
from voltllm.protocol import EngineCoreOutputs, EngineError, MessageType, UtilityCall, UtilityResult

logger = logging.getLogger("voltllm.engine")

_POLL_MS = 100  # how often the I/O threads look at the stop flag
_IDLE_WAIT_S = 0.1  # how long the idle loop sleeps on the input queue before re-checking the stop flag
_HEARTBEAT_S = 1.0  # well under the front end's hang timeout (--engine-hang-timeout, 30 s by default)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m voltllm.engine.core_proc", description=__doc__.split("\n")[0])
    add_engine_args(p)
    p.add_argument("--model", dest="model_flag", default=None, help="the model folder, as a flag")
    p.add_argument("--input-address", required=True)
    p.add_argument("--output-address", required=True)
    p.add_argument("--engine-index", type=int, default=0)
    p.add_argument("--served-model-name", default=None)
    args = p.parse_args(argv)
    if args.model_flag is not None and args.model is not None and args.model_flag != args.model:
        p.error("give the model once: positionally or with --model")
    args.model = args.model or args.model_flag
    return args


class EngineCoreProc:
    """Runs one EngineCore behind the two sockets until stopped."""

    def __init__(self, input_address: str, output_address: str, engine_index: int) -> None:
        self.engine_index = engine_index
        self.ctx = zmq.Context()
        self.stop_event = threading.Event()
        self.loaded = False  # until then a signal must interrupt the (blocking) model load
        self.input_queue: queue.Queue[tuple[MessageType, Any]] = queue.Queue()
        self.output_queue: queue.Queue[list[bytes] | None] = queue.Queue()
        # Sockets are created inside their threads: a zmq socket must stay on one thread.
        self._input_thread = threading.Thread(
            target=self._input_loop, args=(input_address,), name="engine-input", daemon=True
        )
        self._output_thread = threading.Thread(
            target=self._output_loop, args=(output_address,), name="engine-output", daemon=True
        )
        # Both connect at once, so the front end's ROUTER knows this engine by READY time; requests
        # that arrive while the model loads wait in the input queue.
        self._output_thread.start()
        self._input_thread.start()

    # ----- I/O threads -----------------------------------------------------------------------------

    def _input_loop(self, address: str) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.engine_index.to_bytes(2, "little"))
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        try:
            while not self.stop_event.is_set():
                if not sock.poll(_POLL_MS):
                    continue
                frames = sock.recv_multipart()
                try:
                    self.input_queue.put(protocol.decode(frames))
                except ValueError as e:
                    self._reject_undecodable(frames, str(e))
        finally:
            sock.close()

    def _reject_undecodable(self, frames: list[bytes], reason: str) -> None:
        """A malformed ADD whose id can still be read fails that request; anything else gets ERROR."""
        request_id = _peek_request_id(frames)
        if request_id is not None:
            self.input_queue.put((MessageType.ADD, _FailedRequest(request_id, reason)))
        else:
            self.send(MessageType.ERROR, EngineError(engine_index=self.engine_index, message=reason))

    def _output_loop(self, address: str) -> None:
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 2000)  # let DEAD reach the front end on the way out
        # A PUSH with no reachable peer blocks in send; the timeout lets this thread see a shutdown
        # instead of hanging forever once the front end is gone.
        sock.setsockopt(zmq.SNDTIMEO, _POLL_MS)
        sock.connect(address)
        try:
            while (frames := self.output_queue.get()) is not None:
                while not self._send_or_timeout(sock, frames):
                    if self.stop_event.is_set():
                        return
        finally:
            sock.close()

    @staticmethod
    def _send_or_timeout(sock: zmq.Socket, frames: list[bytes]) -> bool:
        try:
            sock.send_multipart(frames)
            return True
        except zmq.Again:
            return False

    def send(self, kind: MessageType, payload: object) -> None:
        self.output_queue.put(protocol.encode(kind, payload))

    def start_heartbeat(self) -> None:
        threading.Thread(target=self._heartbeat_loop, name="engine-heartbeat", daemon=True).start()

    def _heartbeat_loop(self) -> None:
        while not self.stop_event.wait(_HEARTBEAT_S):
            self.send(MessageType.OUTPUTS, EngineCoreOutputs(self.engine_index, [], timestamp=time.time()))

    # ----- the busy loop ---------------------------------------------------------------------------

    def run(self, core: EngineCore) -> None:
        parent = os.getppid()
        while not self.stop_event.is_set():
            if os.getppid() != parent:  # the front end that started us is gone: nobody reads our outputs
                logger.warning("parent process %d exited; shutting down", parent)
                return
            self._drain_inputs(core, block=not core.has_unfinished_requests())
            if core.has_unfinished_requests():
                self.send(MessageType.OUTPUTS, core.step())

    def _drain_inputs(self, core: EngineCore, block: bool) -> None:
        try:
            item = self.input_queue.get(timeout=_IDLE_WAIT_S) if block else self.input_queue.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(core, *item)
            try:
                item = self.input_queue.get_nowait()
            except queue.Empty:
                return

    def _handle(self, core: EngineCore, kind: MessageType, payload: Any) -> None:
        if kind is MessageType.ADD:
            if isinstance(payload, _FailedRequest):
                if payload.request_id in core.scheduler.requests:
                    # Failing it by id would end the live request of that id: report it apart.
                    self.send(
                        MessageType.ERROR,
                        EngineError(
                            engine_index=self.engine_index,
                            request_id=payload.request_id,
                            message=payload.reason,
                        ),
                    )
                else:
                    core.fail_request(payload.request_id, payload.reason)
            else:
                core.add_request(payload)
        elif kind is MessageType.ABORT:
            core.abort_requests(payload)
        elif kind is MessageType.UTILITY:
            self.send(MessageType.UTILITY_RESULT, _call_utility(core, payload))
        else:
            message = f"message type {kind.name} is not accepted by an engine"
            self.send(MessageType.ERROR, EngineError(engine_index=self.engine_index, message=message))

    def shutdown(self, reason: str) -> None:
        """Send DEAD, flush the output socket and stop the I/O threads."""
        self.stop_event.set()
        self.send(MessageType.DEAD, EngineError(engine_index=self.engine_index, message=reason))
        self.output_queue.put(None)
        self._output_thread.join(timeout=5)
        if self._input_thread.is_alive():
            self._input_thread.join(timeout=1)
        self.ctx.term()


class _FailedRequest(msgspec.Struct):
    request_id: str
    reason: str


def _peek_request_id(frames: list[bytes]) -> str | None:
    """The request id of an ADD that did not decode as a whole (e.g. a bad sampling value)."""
    if len(frames) != 2 or frames[0] != MessageType.ADD.frame():
        return None
    try:
        raw = msgspec.msgpack.decode(frames[1])
    except msgspec.DecodeError:
        return None
    if isinstance(raw, list) and raw and isinstance(raw[0], str) and raw[0]:
        return raw[0]
    return None


def _call_utility(core: EngineCore, call: UtilityCall) -> UtilityResult:
    try:
        return UtilityResult(call_id=call.call_id, ok=True, result=core.call_utility(call.method, call.args))
    except ValueError as e:
        return UtilityResult(call_id=call.call_id, ok=False, error=str(e))


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(levelname)s %(message)s")
    args = parse_args(argv)
    proc = EngineCoreProc(args.input_address, args.output_address, args.engine_index)

    def on_signal(signum: int, _frame: object) -> None:
        # Only set a flag: the loop finishes its current step and exits within one step.
        logger.info("received %s, shutting down", signal.Signals(signum).name)
        proc.stop_event.set()
        if not proc.loaded:
            raise KeyboardInterrupt  # still loading: no loop to notice the flag

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        config = engine_config_from_args(args)
        # Before anything touches CUDA: a data-parallel engine sees only its own GPUs.
        claim_engine_devices(args.engine_index, config)
        core = EngineCore.from_config(config, engine_index=args.engine_index)
        proc.loaded = True
        settle_garbage_collector(freeze=True)  # this process only runs the engine from here on
        proc.send(MessageType.READY, core.ready_message(args.served_model_name or args.model))
        proc.start_heartbeat()
        logger.info(
            "engine %d ready: %d KV blocks of %d, max_model_len %d, pid %d",
            args.engine_index,
            core.scheduler.kv.num_blocks,
            core.scheduler.kv.block_size,
            core.max_model_len,
            os.getpid(),
        )
        proc.run(core)
    except KeyboardInterrupt:
        proc.shutdown("engine interrupted")
        return 0
    except Exception as e:  # fatal: tell the front end why before going down
        logger.exception("engine failed")
        proc.shutdown(f"engine failed: {type(e).__name__}: {e}")
        return 1
    proc.shutdown("engine shut down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
