"""The EngineCore process over real ZeroMQ, driven like the front end drives it (ROUTER + PULL)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
import zmq
from tiny_models import save_plain_model

from voltllm import protocol
from voltllm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from voltllm.engine.llm_engine import LLMEngine
from voltllm.protocol import EngineCoreRequest, EngineSamplingParams, MessageType, UtilityCall

ENGINE_INDEX = 3
IDENTITY = ENGINE_INDEX.to_bytes(2, "little")
ENGINE_ARGS = ["--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "96", "--block-size", "8",
               "--max-num-batched-tokens", "64", "--max-num-seqs", "16"]  # fmt: skip


class FrontEnd:
    def __init__(self, tmp: Path) -> None:
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to an unknown engine raises
        self.pull = self.ctx.socket(zmq.PULL)
        self.in_addr, self.out_addr = f"ipc://{tmp}/in", f"ipc://{tmp}/out"
        self.router.bind(self.in_addr)
        self.pull.bind(self.out_addr)

    def send_raw(self, *frames: bytes) -> None:
        self.router.send_multipart([IDENTITY, *frames])

    def send(self, kind: MessageType, payload: object) -> None:
        self.send_raw(*protocol.encode(kind, payload))

    def recv(self, timeout_s: float = 60.0) -> tuple[MessageType, object]:
        if not self.pull.poll(int(timeout_s * 1000)):
            raise TimeoutError("no message from the engine")
        return protocol.decode(self.pull.recv_multipart())

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def greedy(max_tokens: int) -> EngineSamplingParams:
    return EngineSamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.mark.slow
def test_engine_process_streams_aborts_and_survives_bad_input(tmp_path):
    model_dir, _ = save_plain_model("llama", tmp_path / "llama")
    rng = random.Random(0)
    requests = [
        EngineCoreRequest(f"r{i}", [rng.randrange(3, 320) for _ in range(rng.randrange(2, 40))],
                          greedy(rng.randrange(4, 16)), time.time())
        for i in range(50)
    ]  # fmt: skip
    aborted = {f"r{i}" for i in range(0, 50, 10)}

    fe = FrontEnd(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "python")}
    cmd = [sys.executable, "-m", "voltllm.engine.core_proc", str(model_dir), "--input-address", fe.in_addr,
           "--output-address", fe.out_addr, "--engine-index", str(ENGINE_INDEX), *ENGINE_ARGS]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env)
    try:
        kind, ready = fe.recv(timeout_s=120)
        assert kind is MessageType.READY and ready.engine_index == ENGINE_INDEX and ready.pid == proc.pid
        assert (ready.vocab_size, ready.num_kv_blocks, ready.block_size) == (320, 96, 8)

        for req in requests:
            fe.send(MessageType.ADD, req)
        fe.send_raw(b"\x00garbage")  # one frame, not [type, payload]
        fe.send_raw(b"\x7f", msgspec.msgpack.encode([1, 2]))  # unknown type
        fe.send_raw(MessageType.ADD.frame(), b"\xc1\xc1")  # not msgpack at all
        bad_type = msgspec.msgpack.encode(["bad-type", [5, 6], {"temperature": "hot"}, 0.0, 0])
        fe.send_raw(MessageType.ADD.frame(), bad_type)  # decodes as msgpack, id readable, wrong type
        bad_value = EngineCoreRequest("bad-value", [5, 6], EngineSamplingParams(top_p=0.0), time.time())
        fe.send(MessageType.ADD, bad_value)
        fe.send(MessageType.ADD, EngineCoreRequest("r1", [7, 8], greedy(3), time.time()))  # duplicate live id
        fe.send(MessageType.UTILITY, UtilityCall(call_id=9, method="ping"))

        streams: dict[str, list[int]] = {}
        finish: dict[str, list[str]] = {}
        errors, utility = [], None
        deadline = time.time() + 180
        expected_ids = {r.request_id for r in requests} | {"bad-type", "bad-value"}

        def done() -> bool:  # r1 finishes twice: the duplicate's error, then its own length
            return all(
                r in finish and (r.startswith("bad") or finish[r][-1] != "error") for r in expected_ids
            )

        while not done():
            assert time.time() < deadline, "engine did not finish every request in time"
            kind, msg = fe.recv()
            if kind is MessageType.ERROR:
                errors.append(msg)
            elif kind is MessageType.UTILITY_RESULT:
                utility = msg
            elif kind is MessageType.OUTPUTS:
                assert msg.engine_index == ENGINE_INDEX
                for out in msg.outputs:
                    streams.setdefault(out.request_id, []).extend(out.new_token_ids)
                    if out.request_id in aborted and streams[out.request_id] and out.finish_reason is None:
                        fe.send(MessageType.ABORT, [out.request_id])
                    if out.finish_reason is not None:
                        finish.setdefault(out.request_id, []).append(out.finish_reason)
        assert utility is not None and utility.ok and utility.result == "pong" and utility.call_id == 9
        assert len(errors) >= 3 and all(e.request_id is None for e in errors[:3])
        assert finish["bad-type"] == ["error"] and finish["bad-value"] == ["error"]
        assert finish["r1"][0] == "error"  # the duplicate, reported by id; the original went on

        reference = LLMEngine(
            EngineConfig(
                model=ModelConfig(model=str(model_dir), dtype="float32"),
                cache=CacheConfig(num_kv_blocks=256),
                scheduler=SchedulerConfig(max_num_batched_tokens=256),
                device="cpu",
            )
        ).generate_token_ids(requests)
        for req in requests:
            rid = req.request_id
            if rid in aborted:
                assert finish[rid][-1] == "abort"
                assert streams[rid] == reference[rid].new_token_ids[: len(streams[rid])]
            else:
                assert finish[rid][-1] == "length"
                assert streams[rid] == reference[rid].new_token_ids, rid

        proc.send_signal(signal.SIGTERM)
        kind, dead = fe.recv(timeout_s=20)
        while kind is not MessageType.DEAD:
            kind, dead = fe.recv(timeout_s=20)
        assert dead.engine_index == ENGINE_INDEX
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        fe.close()
