"""EngineCore: the scheduler, the KV cache and the model runner behind one `step()`.

It knows token ids only and is transport-free: `core_proc` drives it from ZeroMQ, `LLMEngine` from the
offline Python API. Bad requests never raise out of it: they finish at once with `finish_reason =
"error"` and a message, in the next step's outputs, and the engine keeps serving the others.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import torch

from voltllm.config import EngineConfig
from voltllm.core.kv_cache_manager import KVCacheManager
from voltllm.core.request import Request
from voltllm.core.sched_output import SchedulerOutput
from voltllm.core.scheduler import Scheduler
from voltllm.protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineReady,
    EngineSamplingParams,
    FinishReason,
    SchedulerStats,
)
from voltllm.sampling_params import validate_wire_params
from voltllm.structured_output import StructuredOutputCompiler
from voltllm.worker.model_runner import ModelRunner, StepHandle

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    """ "auto" is cuda when a GPU is visible, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was requested but no CUDA GPU is available")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """ "auto" is fp16 on CUDA (Volta has no bf16 tensor cores) and fp32 on the CPU."""
    if name == "auto":
        return torch.float16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {name!r}")
    return _DTYPES[name]


@dataclass
class EngineStepTimings:
    """Where one `EngineCore.step()` spent its time, in seconds (perf_counter, refreshed every step).

    `execute_s` is the whole `runner.execute_model` call; `prepare_s` / `forward_s` / `sync_s` /
    `post_s` are its split as the runner reports it (`ModelRunner.last_timings`), all 0 when the runner
    reports none. `sync_s` is time spent waiting for the device, so it is the one part that is not host
    work.
    """

    schedule_s: float = 0.0
    execute_s: float = 0.0
    prepare_s: float = 0.0
    forward_s: float = 0.0
    sync_s: float = 0.0
    post_s: float = 0.0
    update_s: float = 0.0
    outputs_s: float = 0.0
    total_s: float = 0.0

    @property
    def host_s(self) -> float:
        """Wall time of the step minus the wait for the device."""
        return self.total_s - self.sync_s


# Young-generation collections at the default threshold (700 allocations) run several times per decode
# step at large batches (each step allocates an output per request), and each older collection walks the
# whole heap (the block pool alone is one object per KV block). Steps allocate short-lived, acyclic
# objects: collecting every 50,000 allocations instead loses nothing and takes the scans off the steps.
GC_YOUNG_THRESHOLD = 50_000


# Whether `async_scheduling=None` turns it on with CUDA, where it pays: the H200 measured LLM.generate
# on the nano-vllm workload at T=0.6 1.39x faster with it (benches/RESULTS.md, "Asynchronous
# scheduling (issue 21) — session 10").
ASYNC_SCHEDULING_BY_DEFAULT = True


def settle_garbage_collector(freeze: bool) -> None:
    """Make young collections rare; with `freeze`, also move everything alive now (start-up objects)
    out of the collector's reach for good (the engine-core process does this once it is built)."""
    young, older, oldest = gc.get_threshold()
    gc.set_threshold(max(GC_YOUNG_THRESHOLD, young), older, oldest)
    if freeze:
        gc.collect()
        gc.freeze()


def engine_max_model_len(config: EngineConfig, loaded: Any) -> int:
    """The model's context length, capped by the configured one."""
    max_model_len = int(loaded.max_model_len)
    if config.model.max_model_len is not None:
        max_model_len = min(max_model_len, config.model.max_model_len)
    return max_model_len


def build_model_runner(
    config: EngineConfig, loaded: Any, device: torch.device, samples: bool = True
) -> ModelRunner:
    """The runner of `loaded` under `config` (one per tensor-parallel rank; `samples` on rank 0)."""
    sched = config.scheduler
    return ModelRunner(
        loaded.model,
        device=device,
        dtype=loaded.dtype,
        vocab_size=int(loaded.vocab_size),
        eos_token_ids=tuple(int(t) for t in loaded.eos_token_ids),
        block_size=config.cache.block_size,
        max_model_len=engine_max_model_len(config, loaded),
        max_num_batched_tokens=sched.max_num_batched_tokens,
        max_num_seqs=sched.max_num_seqs,
        seed=config.model.seed,
        enforce_eager=config.enforce_eager,
        samples=samples,
    )


def load_engine_model(config: EngineConfig, device: torch.device) -> Any:
    """Load the model `config` names onto `device` (this rank's shard under tensor parallelism)."""
    from voltllm.layers.attention import AttentionBackend
    from voltllm.layers.attention.selector import get_attention_backend
    from voltllm.loader import load_model
    from voltllm.models.decoder import head_size_of

    dtype = resolve_dtype(config.model.dtype, device)
    torch.manual_seed(config.model.seed)  # dummy weights and anything else random at load time

    def choose_backend(hf_config: Any) -> AttentionBackend:
        return get_attention_backend(config.attention_backend, device, head_size_of(hf_config))

    return load_model(config.model, device, dtype, choose_backend)


class EngineCore:
    """One engine: `add_request` / `abort_requests` between steps, `step()` to advance every request."""

    def __init__(
        self,
        config: EngineConfig,
        loaded: Any,
        device: torch.device,
        engine_index: int = 0,
        runner: Any = None,
    ):
        """`loaded` is a `voltllm.loader.LoadedModel` (model, model_dir, max_model_len, vocab_size,
        eos_token_ids, dtype), or anything with those attributes. `runner` replaces the
        `build_model_runner` one (the tensor-parallel driver, which runs it on every rank)."""
        self.config = config
        self.engine_index = engine_index
        self.model_dir = Path(loaded.model_dir)
        self.vocab_size = int(loaded.vocab_size)
        self.eos_token_ids = tuple(int(t) for t in loaded.eos_token_ids)
        self.dtype: torch.dtype = loaded.dtype
        max_model_len = engine_max_model_len(config, loaded)
        sched = config.scheduler
        if not sched.enable_chunked_prefill and sched.max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"without chunked prefill, max_num_batched_tokens ({sched.max_num_batched_tokens}) must be "
                f">= max_model_len ({max_model_len}), or long prompts could never be scheduled"
            )
        block_size = config.cache.block_size
        self.runner = runner if runner is not None else build_model_runner(config, loaded, device)
        num_blocks = self.runner.determine_num_blocks(config.cache)
        if num_blocks * block_size < max_model_len:
            # A lone request must always fit, or preemption could not make progress.
            logger.warning(
                "KV cache holds %d tokens: max_model_len lowered from %d",
                num_blocks * block_size,
                max_model_len,
            )
            max_model_len = num_blocks * block_size
        if max_model_len < 2:
            raise ValueError(f"the KV cache ({num_blocks} blocks of {block_size}) cannot hold 2 tokens")
        self.max_model_len = max_model_len
        self.runner.max_model_len = max_model_len
        self.runner.initialize_kv_cache(num_blocks)
        self.runner.capture_cuda_graphs()  # warm-up at start-up, not on the first request
        kv = KVCacheManager(num_blocks, block_size, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(sched, kv, max_model_len)
        self._pending: list[EngineCoreOutput] = []  # error / abort notices for the next step
        self.structured_output = StructuredOutputCompiler(
            self.model_dir / "tokenizer.json", self.vocab_size, self.eos_token_ids
        )
        self.last_step_timings = EngineStepTimings()
        # Under asynchronous scheduling: the step launched by the last `step()` and still running.
        self._in_flight: tuple[SchedulerOutput, StepHandle] | None = None
        self.async_scheduling = False
        self.set_async_scheduling(self._wants_async_scheduling(config, device))
        settle_garbage_collector(freeze=False)

    def set_async_scheduling(self, enabled: bool) -> None:
        """Turn asynchronous scheduling on or off between steps (benchmarks compare both on one
        engine). A step still running is finished first, its outputs delivered by the next `step()`.
        Refused (`ValueError`) for a runner that cannot launch steps."""
        if self._in_flight is not None:
            plan, handle = self._in_flight
            self._in_flight = None
            self._pending += self.scheduler.update_from_output(plan, self.runner.collect(handle))
        if not hasattr(self.runner, "enqueue"):
            if enabled:
                raise ValueError(
                    "async_scheduling needs a runner that launches steps (not tensor parallelism)"
                )
            return
        self.async_scheduling = enabled
        self.runner.async_scheduling = enabled
        self.runner.inputs.host_waits_for_samples = not enabled

    def _wants_async_scheduling(self, config: EngineConfig, device: torch.device) -> bool:
        """`config.async_scheduling`, or (None) whether it pays: on CUDA. A runner that can only run a
        step to its end (the tensor-parallel driver) steps synchronously."""
        if config.async_scheduling is None:
            return ASYNC_SCHEDULING_BY_DEFAULT and hasattr(self.runner, "enqueue") and device.type == "cuda"
        return config.async_scheduling

    @classmethod
    def from_config(cls, config: EngineConfig, engine_index: int = 0) -> EngineCore:
        """Load the model named by `config` and build an engine around it; at
        `tensor_parallel_size > 1` this process is rank 0 and the other ranks start or join
        (`engine.tensor_parallel`)."""
        if config.tensor_parallel_size > 1:
            from voltllm.engine.tensor_parallel import start_tensor_parallel_engine

            return start_tensor_parallel_engine(cls, config, engine_index)
        device = resolve_device(config.device)
        if config.cpu_threads is not None:
            torch.set_num_threads(config.cpu_threads)
        return cls(config, load_engine_model(config, device), device, engine_index)

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks, if any (the engine cannot step afterwards)."""
        shutdown = getattr(self.runner, "shutdown", None)
        if shutdown is not None:
            shutdown()

    # ----- requests ------------------------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request; an invalid one is answered with an "error" output in the next step."""
        try:
            self._validate(request)
            constraint = request.sampling_params.structured_output
            grammar = None if constraint is None else self.structured_output.compile(constraint)
        except ValueError as e:
            self.fail_request(request.request_id, str(e))
            return
        engine_request = Request.from_wire(request, self.eos_token_ids)
        engine_request.grammar = grammar
        self.scheduler.add_request(engine_request)

    def fail_request(self, request_id: str, message: str) -> None:
        """Answer a request the engine could not accept (it holds no resources)."""
        self._pending.append(
            EngineCoreOutput(
                request_id=request_id,
                new_token_ids=[],
                finish_reason=FinishReason.ERROR.value,
                error=message,
                queued_ts=time.time(),
            )
        )

    def abort_requests(self, request_ids: list[str]) -> None:
        for request in self.scheduler.abort_requests(request_ids):
            self._pending.append(
                self.scheduler.make_output(request, [], finish_reason=request.status.finish_reason)
            )

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._pending) or self._in_flight is not None

    # ----- the loop body -------------------------------------------------------------------------

    def step(self) -> EngineCoreOutputs:
        """Schedule -> execute -> update. Returns every output produced since the last step; where the
        time went is left in `last_step_timings`. Under asynchronous scheduling a step launches the
        next plan before it waits for the one launched last time, whose outputs it returns."""
        t = EngineStepTimings()
        start = time.perf_counter()
        outputs, self._pending = self._pending, []
        if self.async_scheduling:
            self._step_async(outputs, t, start)
        elif self.scheduler.has_work():
            plan = self.scheduler.schedule()
            t0 = time.perf_counter()
            runner_output = self.runner.execute_model(plan)
            t1 = time.perf_counter()
            outputs += self.scheduler.update_from_output(plan, runner_output)
            t2 = time.perf_counter()
            t.schedule_s, t.execute_s, t.update_s = t0 - start, t1 - t0, t2 - t1
            self._copy_runner_timings(t)
        t3 = time.perf_counter()
        result = EngineCoreOutputs(
            engine_index=self.engine_index,
            outputs=outputs,
            scheduler_stats=self.scheduler.get_stats(),
            timestamp=time.time(),
        )
        end = time.perf_counter()
        t.outputs_s, t.total_s = end - t3, end - start
        self.last_step_timings = t
        return result

    def _step_async(self, outputs: list[EngineCoreOutput], t: EngineStepTimings, start: float) -> None:
        """One asynchronous step: count the running step's tokens as computed (their ids still on the
        device), plan and launch the next step, then wait for the running one and update from it. A
        launched step the runner finished at once (structured outputs, logprobs, penalties...) is
        updated from right away; the next launch then has nothing to overlap."""
        running, self._in_flight = self._in_flight, None
        if running is not None:
            self.scheduler.advance(running[0])
        launched = None
        t1 = time.perf_counter()
        if self.scheduler.has_work():
            plan = self.scheduler.schedule()
            t1 = time.perf_counter()
            launched = (plan, self.runner.enqueue(plan))
            self._copy_runner_timings(t)
        t2 = time.perf_counter()
        if running is not None:
            runner_output = self.runner.collect(running[1])
            t.sync_s += time.perf_counter() - t2  # the wait for its ids
            outputs += self.scheduler.update_from_output(running[0], runner_output)
        if launched is not None:
            plan, handle = launched
            if handle.is_running:
                self._in_flight = launched
            else:
                outputs += self.scheduler.update_from_output(plan, handle.output)
        t3 = time.perf_counter()
        t.schedule_s, t.execute_s, t.update_s = t1 - start, t2 - t1, t3 - t2

    def _copy_runner_timings(self, t: EngineStepTimings) -> None:
        # A runner without `last_timings` (or an empty plan's stale one) leaves the split at 0.
        runner = getattr(self.runner, "last_timings", None)
        if runner is not None:
            t.prepare_s, t.forward_s, t.sync_s, t.post_s = (
                runner.prepare_s,
                runner.forward_s,
                runner.sync_s,
                runner.post_s,
            )

    # ----- utilities -----------------------------------------------------------------------------

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.get_stats()

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.kv.reset_prefix_cache()

    def call_utility(self, method: str, args: list) -> Any:
        """Run a UTILITY method by name; raises `ValueError` for an unknown one or wrong arguments."""
        handlers = {
            "reset_prefix_cache": self.reset_prefix_cache,
            "get_stats": lambda: msgspec.structs.asdict(self.get_stats()),
            "ping": lambda: "pong",
        }
        if method not in handlers:
            raise ValueError(f"unknown utility method {method!r}; known: {', '.join(handlers)}")
        if args:
            raise ValueError(f"{method} takes no arguments, got {len(args)}")
        return handlers[method]()

    def ready_message(self, model_name: str | None = None) -> EngineReady:
        import os

        return EngineReady(
            engine_index=self.engine_index,
            pid=os.getpid(),
            model_name=model_name or self.config.model.served_model_name or str(self.model_dir),
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            eos_token_ids=list(self.eos_token_ids),
            num_kv_blocks=self.scheduler.kv.num_blocks,
            block_size=self.scheduler.kv.block_size,
            dtype=str(self.dtype).removeprefix("torch."),
            max_num_seqs=self.config.scheduler.max_num_seqs,
        )

    # ----- validation ----------------------------------------------------------------------------

    def _validate(self, request: EngineCoreRequest) -> None:
        if not isinstance(request.request_id, str) or not request.request_id:
            raise ValueError("request_id must be a non-empty string")
        if request.request_id in self.scheduler.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}: a request with it is running")
        prompt = request.prompt_token_ids
        if not prompt:
            raise ValueError("prompt_token_ids is empty")
        if len(prompt) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt)} tokens; max_model_len is {self.max_model_len} and must "
                "leave room for at least one generated token"
            )
        if any(isinstance(t, bool) or not isinstance(t, int) for t in prompt):
            raise ValueError("prompt_token_ids must be integers")
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            bad = next(t for t in prompt if not 0 <= t < self.vocab_size)
            raise ValueError(
                f"prompt_token_ids contains {bad}, outside the vocabulary [0, {self.vocab_size})"
            )
        if isinstance(request.priority, bool) or not isinstance(request.priority, int):
            raise ValueError(f"priority must be an integer, got {request.priority!r}")
        if not isinstance(request.sampling_params, EngineSamplingParams):
            raise ValueError("sampling_params must be an EngineSamplingParams struct")
        validate_wire_params(request.sampling_params, self.vocab_size)
