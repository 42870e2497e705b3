"""`voltllm chat`: an interactive terminal chat, streaming the answer as it is generated.

Against a running server (`--url`, OpenAI chat completions with `stream: true`) or with the model in
this process. Ctrl-D on an empty prompt leaves; Ctrl-C stops the current answer.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

Messages = list[dict[str, Any]]


def stream_from_server(
    url: str, api_key: str | None, model: str | None, temperature: float, max_tokens: int
) -> Callable[[Messages], Iterator[str]]:
    """A function that sends the conversation to `url`/chat/completions and yields content deltas."""
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    base = url.rstrip("/")
    if model is None:
        with urllib.request.urlopen(urllib.request.Request(f"{base}/models", headers=headers)) as r:
            model = json.load(r)["data"][0]["id"]

    def answer(messages: Messages) -> Iterator[str]:
        body = {
            "model": model,
            "messages": messages,
            "stream": True,
            "temperature": temperature,
            "max_tokens": max_tokens,
        }
        req = urllib.request.Request(
            f"{base}/chat/completions", data=json.dumps(body).encode(), headers=headers
        )
        with urllib.request.urlopen(req) as resp:
            for raw in resp:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    return
                event = json.loads(data)
                if "error" in event:
                    raise RuntimeError(event["error"].get("message", "server error"))
                for choice in event.get("choices", []):
                    delta = choice.get("delta", {}).get("content")
                    if delta:
                        yield delta

    return answer


def run_chat(args: argparse.Namespace) -> int:
    from voltllm.entrypoints.cli import CliError

    if args.url:
        try:
            answer = stream_from_server(args.url, args.api_key, args.model, args.temperature, args.max_tokens)
        except (urllib.error.URLError, OSError) as e:
            raise CliError(f"cannot reach {args.url}: {e}") from None
    else:
        from voltllm.entrypoints.cli import make_llm
        from voltllm.sampling_params import SamplingParams

        llm = make_llm(args)
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)

        def answer(messages: Messages) -> Iterator[str]:
            return llm.chat_stream(messages, params)

    messages: Messages = [{"role": "system", "content": args.system}] if args.system else []
    print("voltllm chat: type a message and press Enter; Ctrl-D to leave.", flush=True)
    while True:
        try:
            prompt = input("> ")
        except EOFError:
            print()
            return 0
        if not prompt.strip():
            continue
        messages.append({"role": "user", "content": prompt})
        reply = []
        try:
            for delta in answer(messages):
                reply.append(delta)
                sys.stdout.write(delta)
                sys.stdout.flush()
        except KeyboardInterrupt:
            print(" [stopped]", end="")
        except (urllib.error.URLError, RuntimeError) as e:
            print(f"\nerror: {e}", file=sys.stderr)
            messages.pop()
            continue
        print(flush=True)
        messages.append({"role": "assistant", "content": "".join(reply)})
