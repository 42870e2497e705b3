"""Engine configuration: small dataclasses, one per concern, built once from user arguments.

`EngineConfig` bundles them; components take only the part they need.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DTYPES = ("auto", "float32", "float16", "bfloat16")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
# `--quantization` values, spelled as vLLM does; each is a registered format in voltllm.layers.quantization.
QUANTIZATION_METHODS = ("awq", "gptq", "compressed-tensors", "fp8")


@dataclass
class ModelConfig:
    """What to load and how. `model=None` means the embedded default model (SmolLM2-135M-Instruct)."""

    model: str | None = None
    dtype: str = "auto"  # "auto": fp16 on CUDA (Volta has no bf16 tensor cores), fp32 on CPU
    max_model_len: int | None = None  # None: the model's own limit
    load_format: str = "auto"
    seed: int = 0
    served_model_name: str | None = None
    # None: what the checkpoint's quantization_config says; a method name must agree with it.
    quantization: str | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be one of {QUANTIZATION_METHODS}, got {self.quantization!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")


@dataclass
class CacheConfig:
    """Paged KV cache sizing. On CUDA the size comes from `gpu_memory_utilization` after a profiling
    run; on CPU from `num_kv_blocks` or `kv_cache_memory_bytes` (default 1 GiB)."""

    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")


@dataclass
class SchedulerConfig:
    """Per-step limits. `max_num_batched_tokens` is the token budget shared by prefills and decodes."""

    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"  # or "priority"

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: str = "auto"  # "auto": cuda when available, else cpu
    attention_backend: str = "auto"  # "auto": sm70 kernels on CUDA, torch reference on CPU
    enforce_eager: bool = False  # no CUDA graphs
    # Ranks the model is sharded over, one process each; this one is rank 0 (`engine.tensor_parallel`).
    tensor_parallel_size: int = 1
    # Engine processes (replicas, each of tensor_parallel_size ranks) behind one front end: only
    # `voltllm serve` runs more than one (`engine.data_parallel`); each engine holds its own copy.
    data_parallel_size: int = 1
    # torch's intra-op threads on the CPU; None leaves torch's default. An engine process beside a
    # front end does better with one core left free: on a busy CPU each parallel op otherwise waits
    # for a descheduled thread (measured 5-10x slower steps on 2 shared cores).
    cpu_threads: int | None = None
    # Plan and launch step N+1 while step N runs on the device (`docs/engine.md`, "Asynchronous
    # scheduling"); None: the engine's default with CUDA (`engine.core.ASYNC_SCHEDULING_BY_DEFAULT`),
    # off on the CPU (where it hides nothing). Not with tensor parallelism, whose step command carries
    # the last step's ids.
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be True, False or None, got {self.async_scheduling!r}")
        if self.async_scheduling and self.tensor_parallel_size > 1:
            raise ValueError(
                "async_scheduling is not supported with tensor_parallel_size > 1 (the step command "
                "carries the last step's sampled ids): leave it unset or pass --no-async-scheduling"
            )
        for name in ("tensor_parallel_size", "data_parallel_size"):
            size = getattr(self, name)
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {size!r}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be >= 1, got {self.cpu_threads}")
