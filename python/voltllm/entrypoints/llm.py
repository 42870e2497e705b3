"""The offline Python API: `LLM(...).generate(...)` and `.chat(...)`, as vLLM spells them.

Text handling is the Rust text layer (`voltllm._core`): the same tokenizer, chat templates, incremental
detokenizer and stop-string matching that the HTTP front end uses. The engine is the same EngineCore,
run in this process without sockets.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from voltllm import _core
from voltllm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from voltllm.engine.llm_engine import LLMEngine
from voltllm.outputs import CompletionOutput, Logprob, RequestOutput
from voltllm.protocol import EngineCoreOutput, EngineCoreRequest
from voltllm.sampling_params import SamplingParams

PromptType = str | dict[str, Any]
Conversation = list[dict[str, Any]]


@dataclass
class _Sequence:
    """Front-end state of one engine request: one of the `n` completions of a prompt."""

    output: CompletionOutput
    detokenizer: _core.Detokenizer
    wants_logprobs: bool

    def add(self, out: EngineCoreOutput, text: str, taken: int, tokenizer: _core.Tokenizer) -> bool:
        """Apply one engine output, whose first `taken` tokens detokenized to `text` (all of them
        unless a stop string matched: `_core.detokenize_step`); True when this sequence just finished
        on a stop string."""
        completion = self.output
        completion.token_ids.extend(out.new_token_ids[:taken])
        completion.text += text
        if self.wants_logprobs and out.new_logprobs is not None:
            for lp in out.new_logprobs[:taken]:
                completion.logprobs.append(_logprob_dict(lp.token_ids, lp.logprobs, lp.rank, tokenizer))
                completion.cumulative_logprob += lp.logprobs[0]
        if self.detokenizer.stopped is not None:
            completion.finish_reason = "stop"
            completion.stop_reason = self.detokenizer.stopped
            return True
        if out.finish_reason is not None:
            completion.text += self.detokenizer.flush()
            completion.finish_reason = out.finish_reason
            completion.stop_reason = out.stop_reason
            if out.finish_reason == "error":
                raise RuntimeError(f"request {out.request_id} failed in the engine: {out.error}")
        return False


def _logprob_dict(
    token_ids: list[int], logprobs: list[float], rank: int, tokenizer: _core.Tokenizer
) -> dict[int, Logprob]:
    """vLLM's per-position shape: the sampled token (with its rank) and the top-N alternatives."""
    entries: dict[int, Logprob] = {}
    for k, (token_id, logprob) in enumerate(zip(token_ids, logprobs, strict=True)):
        if token_id not in entries:
            entries[token_id] = Logprob(
                logprob=logprob, rank=rank if k == 0 else k, decoded_token=tokenizer.decode([token_id], False)
            )
    return entries


class LLM:
    """Offline batch generation on one model.

    `LLM()` loads the embedded default model (SmolLM2-135M-Instruct). Arguments follow vLLM's `LLM`.
    `tensor_parallel_size=N` shards the model over N ranks: this process is rank 0 and starts the
    others as worker processes (or meets them through torchrun's variables: `docs/parallel.md`).
    `data_parallel_size` above 1 is refused, as vLLM's `LLM` refuses it: one process runs one engine
    (`voltllm serve --data-parallel-size N` runs N behind one endpoint).
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str = "auto",
        max_model_len: int | None = None,
        gpu_memory_utilization: float = 0.9,
        tensor_parallel_size: int = 1,
        data_parallel_size: int = 1,
        seed: int = 0,
        load_format: str = "auto",
        quantization: str | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        enforce_eager: bool = False,
        num_kv_blocks: int | None = None,
        enable_prefix_caching: bool = True,
        device: str = "auto",
        async_scheduling: bool | None = None,
    ) -> None:
        config = EngineConfig(
            model=ModelConfig(
                model=model,
                dtype=dtype,
                max_model_len=max_model_len,
                load_format=load_format,
                seed=seed,
                quantization=quantization,
            ),
            cache=CacheConfig(
                gpu_memory_utilization=gpu_memory_utilization,
                num_kv_blocks=num_kv_blocks,
                enable_prefix_caching=enable_prefix_caching,
            ),
            scheduler=SchedulerConfig(
                max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs
            ),
            device=device,
            enforce_eager=enforce_eager,
            tensor_parallel_size=tensor_parallel_size,
            data_parallel_size=data_parallel_size,
            async_scheduling=async_scheduling,
        )
        self._start(config)

    @classmethod
    def from_engine_config(cls, config: EngineConfig) -> LLM:
        """An `LLM` over an already built `EngineConfig` (what the CLI's flags describe)."""
        llm = cls.__new__(cls)
        llm._start(config)
        return llm

    def _start(self, config: EngineConfig) -> None:
        self.engine = LLMEngine(config)
        model_dir = str(self.engine.model_dir)
        self.tokenizer = _core.Tokenizer.from_model_dir(model_dir)
        self.chat_template = _core.ChatTemplate.from_model_dir(model_dir)
        self._request_counter = itertools.count()

    def shutdown(self) -> None:
        """Stop the engine's other tensor-parallel ranks now (dropping the `LLM` also does); no
        generation afterwards."""
        self.engine.shutdown()

    def get_tokenizer(self) -> _core.Tokenizer:
        return self.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (a string, or `{"prompt_token_ids": [...]}`); results in input order."""
        prompt_list = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        params = _per_prompt(sampling_params, len(prompt_list))
        return self._run([self._tokenize(p) for p in prompt_list], params, use_tqdm)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenized = self._render_chat(conversations, chat_template_kwargs, add_generation_prompt, tools)
        return self._run(tokenized, _per_prompt(sampling_params, len(tokenized)), use_tqdm)

    def _render_chat(
        self,
        conversations: list[Conversation],
        chat_template_kwargs: dict[str, Any] | None,
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None,
    ) -> list[tuple[str, list[int]]]:
        if self.chat_template is None:
            raise ValueError("this model has no chat template; use generate() with a plain prompt")
        rendered = []
        for conv in conversations:
            text = self.chat_template.render(
                conv,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                kwargs=chat_template_kwargs or {},
            )
            # Chat templates already carry the special tokens (BOS included): add no more.
            rendered.append((text, self.tokenizer.encode(text, False)))
        return rendered

    def chat_stream(
        self,
        messages: Conversation,
        sampling_params: SamplingParams | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> Iterator[str]:
        """Answer one conversation, yielding the text as it is generated (a voltllm extension)."""
        [(text, token_ids)] = self._render_chat([messages], chat_template_kwargs, True, None)
        sp = sampling_params or SamplingParams()
        self._check_prompt(token_ids)
        result = RequestOutput(
            request_id=str(next(self._request_counter)), prompt=text, prompt_token_ids=token_ids
        )
        [(request_id, (_, seq))] = self._add_sequence(result, 0, token_ids, sp).items()
        try:
            while seq.output.finish_reason is None:
                for out in self.engine.step():
                    if out.request_id != request_id:
                        continue
                    before = len(seq.output.text)
                    text, taken = seq.detokenizer.push_many(out.new_token_ids)
                    if seq.add(out, text, taken, self.tokenizer):
                        self.engine.abort_requests([request_id])
                    yield seq.output.text[before:]
        finally:
            if seq.output.finish_reason is None:
                self.engine.abort_requests([request_id])

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, True)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
        raise ValueError("a prompt must be a string or a dict with 'prompt_token_ids'")

    def _run(
        self,
        prompts: list[tuple[str | None, list[int]]],
        params: list[SamplingParams],
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        results: list[RequestOutput] = []
        live: dict[str, tuple[RequestOutput, _Sequence]] = {}
        for _, token_ids in prompts:  # every prompt before any is added: a bad one leaves no orphan
            self._check_prompt(token_ids)
        for (text, token_ids), sp in zip(prompts, params, strict=True):
            result = RequestOutput(
                request_id=str(next(self._request_counter)), prompt=text, prompt_token_ids=token_ids
            )
            results.append(result)
            for index in range(sp.n):
                live.update(self._add_sequence(result, index, token_ids, sp))
        with tqdm(total=len(results), desc="generating", disable=not use_tqdm, unit="prompt") as bar:
            try:
                self._drive(live, bar)
            except BaseException:
                self.engine.abort_requests(list(live))
                raise
        for result in results:
            result.outputs.sort(key=lambda c: c.index)
        return results

    def _add_sequence(
        self, result: RequestOutput, index: int, token_ids: list[int], sp: SamplingParams
    ) -> dict[str, tuple[RequestOutput, _Sequence]]:
        request_id = f"{result.request_id}-{index}"
        wire = sp.to_wire()
        if wire.seed is not None:
            wire.seed += index  # n seeded completions must differ from each other, reproducibly
        self.engine.add_request(EngineCoreRequest(request_id, token_ids, wire, time.time()))
        wants_logprobs = sp.logprobs is not None
        completion = CompletionOutput(
            index=index,
            text="",
            token_ids=[],
            cumulative_logprob=0.0 if wants_logprobs else None,
            logprobs=[] if wants_logprobs else None,
        )
        stops = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop or [])
        detok = _core.Detokenizer(
            self.tokenizer, token_ids, sp.skip_special_tokens, stops, sp.include_stop_str_in_output
        )
        return {request_id: (result, _Sequence(completion, detok, wants_logprobs))}

    def _drive(self, live: dict[str, tuple[RequestOutput, _Sequence]], bar: tqdm) -> None:
        pending = Counter(id(result) for result, _ in live.values())  # sequences still running per prompt
        while live:
            # e.g. the abort notice of a sequence already stopped by a stop string is not live
            outs = [out for out in self.engine.step() if out.request_id in live]
            texts = _core.detokenize_step(
                [live[out.request_id][1].detokenizer for out in outs], [out.new_token_ids for out in outs]
            )  # one call into the text layer per step, not one per token
            for out, (text, taken) in zip(outs, texts, strict=True):
                result, seq = live[out.request_id]
                if out.prompt_logprobs is not None and result.prompt_logprobs is None:
                    result.prompt_logprobs = [None] + [
                        _logprob_dict(lp.token_ids, lp.logprobs, lp.rank, self.tokenizer)
                        for lp in out.prompt_logprobs
                    ]
                stopped = seq.add(out, text, taken, self.tokenizer)
                if stopped:
                    self.engine.abort_requests([out.request_id])
                if seq.output.finish_reason is None:
                    continue
                del live[out.request_id]
                result.outputs.append(seq.output)
                result.num_cached_tokens = max(result.num_cached_tokens, out.num_cached_tokens)
                pending[id(result)] -= 1
                if pending[id(result)] == 0:
                    result.finished = True
                    bar.update(1)

    def _check_prompt(self, token_ids: list[int]) -> None:
        """Raise ValueError for an empty or over-long prompt, or an id outside the model's vocabulary
        (ids past the tokenizer's last token but below `vocab_size`, a padded embedding, are valid)."""
        if not token_ids:
            raise ValueError("the prompt is empty")
        vocab_size = self.engine.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt_token_ids contains {bad}, outside the vocabulary [0, {vocab_size})")
        limit = self.engine.max_model_len
        if len(token_ids) >= limit:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens; this model's max_model_len is {limit}, "
                "which must also leave room for at least one generated token"
            )


def _per_prompt(
    sampling_params: SamplingParams | Sequence[SamplingParams] | None, num_prompts: int
) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * num_prompts
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num_prompts
    params = list(sampling_params)
    if len(params) != num_prompts:
        raise ValueError(f"got {len(params)} sampling_params for {num_prompts} prompts")
    return params
