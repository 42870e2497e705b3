"""Baseline: a minimal Python asyncio front end doing the Rust server's job for `/v1/completions`.

aiohttp for HTTP and SSE, `tokenizers` for tokenization and vLLM-style incremental detokenization,
pyzmq (asyncio) + the msgspec protocol structs for the engine link, a stop-string check per delta,
ABORT on client disconnect. It implements only what the benchmark exercises; it is the yardstick
for `run.py`, not a product.

Usage: python py_frontend.py --model DIR --port P --engine-input-address A --engine-output-address B
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from pathlib import Path

import zmq
import zmq.asyncio
from aiohttp import web
from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))
from voltllm import protocol as P  # noqa: E402

PROMPT_CONTEXT_TOKENS = 5


class Detokenizer:
    """vLLM's incremental detokenization: decode a sliding window, emit the new suffix."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix) :]
        return ""


class Frontend:
    def __init__(self, tokenizer: Tokenizer, input_address: str, output_address: str) -> None:
        self.tokenizer = tokenizer
        self.ctx = zmq.asyncio.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind(input_address)
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.bind(output_address)
        self.queues: dict[str, asyncio.Queue] = {}
        self.identity = (0).to_bytes(2, "little")
        self.max_model_len = 0

    async def wait_ready(self) -> None:
        kind, ready = P.decode(await self.pull.recv_multipart())
        assert kind == P.MessageType.READY, kind
        self.max_model_len = ready.max_model_len

    async def reader(self) -> None:
        while True:
            kind, msg = P.decode(await self.pull.recv_multipart())
            if kind != P.MessageType.OUTPUTS:
                continue
            for out in msg.outputs:
                q = self.queues.get(out.request_id)
                if q is not None:
                    q.put_nowait(out)

    async def send(self, kind: P.MessageType, payload: object) -> None:
        await self.router.send_multipart([self.identity, *P.encode(kind, payload)])

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        prompt = body["prompt"]
        max_tokens = int(body.get("max_tokens", 16))
        stops = body.get("stop") or []
        stops = [stops] if isinstance(stops, str) else stops
        prompt_ids = await asyncio.get_running_loop().run_in_executor(
            None, lambda: self.tokenizer.encode(prompt).ids
        )
        if len(prompt_ids) + max_tokens > self.max_model_len:
            return web.json_response(
                {"error": {"message": "too long", "type": "BadRequestError"}}, status=400
            )
        request_id = f"cmpl-{uuid.uuid4().hex}"
        params = P.EngineSamplingParams(max_tokens=max_tokens, ignore_eos=bool(body.get("ignore_eos", False)))
        queue: asyncio.Queue = asyncio.Queue()
        self.queues[request_id] = queue
        await self.send(P.MessageType.ADD, P.EngineCoreRequest(request_id, prompt_ids, params, time.time()))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        detok = Detokenizer(self.tokenizer, prompt_ids)
        created = int(time.time())
        finished = False
        try:
            await resp.prepare(request)
            text_so_far = ""
            while not finished:
                out = await queue.get()
                text = "".join(detok.push(t) for t in out.new_token_ids)
                finish = out.finish_reason
                if stops:
                    text_so_far += text
                    for s in stops:
                        if s in text_so_far:
                            finish = "stop"
                finished = finish is not None
                chunk = {
                    "id": request_id,
                    "object": "text_completion",
                    "created": created,
                    "model": body.get("model"),
                    "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
                }
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
        except ConnectionResetError:
            pass  # the client went away; the engine request is aborted below
        finally:
            self.queues.pop(request_id, None)
            if not finished:
                await self.send(P.MessageType.ABORT, [request_id])
        return resp


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--engine-input-address", required=True)
    p.add_argument("--engine-output-address", required=True)
    a = p.parse_args()
    fe = Frontend(
        Tokenizer.from_file(str(Path(a.model) / "tokenizer.json")),
        a.engine_input_address,
        a.engine_output_address,
    )
    await fe.wait_ready()
    asyncio.get_running_loop().create_task(fe.reader())
    app = web.Application()
    app.router.add_post("/v1/completions", fe.completions)
    app.router.add_get("/health", lambda _: web.Response(text=""))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", a.port).start()
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main())
