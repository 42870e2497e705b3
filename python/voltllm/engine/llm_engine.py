"""The in-process engine behind the offline `LLM` API: the same EngineCore, called directly."""

from __future__ import annotations

from pathlib import Path

from voltllm.config import EngineConfig
from voltllm.engine.core import EngineCore
from voltllm.protocol import EngineCoreOutput, EngineCoreRequest, SchedulerStats


class LLMEngine:
    """add_request / step / abort_requests / has_unfinished_requests, without sockets or threads."""

    def __init__(self, config: EngineConfig, core: EngineCore | None = None) -> None:
        """Load the model named by `config`, or wrap an already built `core` (tests, benchmarks).
        One process runs one engine: `data_parallel_size` > 1 is refused (vLLM refuses it too)."""
        if config.data_parallel_size > 1:
            raise ValueError(
                f"data_parallel_size {config.data_parallel_size} needs one engine process per replica, "
                "which an in-process LLM does not start: serve with `voltllm serve --data-parallel-size "
                f"{config.data_parallel_size}`, or run one LLM per process"
            )
        self.config = config
        self.core = core if core is not None else EngineCore.from_config(config)

    @property
    def model_dir(self) -> Path:
        return self.core.model_dir

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.core.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.core.eos_token_ids

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks, if any."""
        self.core.shutdown()

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request; an invalid one comes back from `step()` finished with "error"."""
        self.core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.core.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        """Advance every request by one engine step; returns the outputs of requests that advanced."""
        return self.core.step().outputs

    def get_stats(self) -> SchedulerStats:
        return self.core.get_stats()

    def reset_prefix_cache(self) -> bool:
        return self.core.reset_prefix_cache()

    def generate_token_ids(self, requests: list[EngineCoreRequest]) -> dict[str, EngineCoreOutput]:
        """Run `requests` to completion; returns, per id, one output with all its tokens (tests,
        benchmarks). Raises `RuntimeError` when a request fails."""
        merged: dict[str, EngineCoreOutput] = {}
        for request in requests:
            self.add_request(request)
            merged[request.request_id] = EngineCoreOutput(request.request_id, [], [])
        while self.has_unfinished_requests():
            for out in self.step():
                acc = merged[out.request_id]
                acc.new_token_ids += out.new_token_ids
                if out.new_logprobs is not None:
                    acc.new_logprobs += out.new_logprobs
                acc.finish_reason, acc.stop_reason, acc.error = out.finish_reason, out.stop_reason, out.error
                acc.num_cached_tokens = out.num_cached_tokens
                if out.finish_reason == "error":
                    raise RuntimeError(f"request {out.request_id} failed: {out.error}")
        return merged
