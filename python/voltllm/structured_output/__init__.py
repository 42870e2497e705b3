"""Structured outputs: one grammar matcher per constrained request, and the token masks it yields.

`compiler.StructuredOutputCompiler` turns a wire `StructuredOutput` into a `Grammar` (an llguidance
matcher) when the engine accepts the request, or raises `ValueError` naming the problem. The model
runner owns the matchers' progress: in a thread while a step's forward runs, it advances each
constrained request's grammar by the previous step's token (`TokensToAccept`, in parallel over the
batch) and fills the step's next-token bitmasks, then applies them to the logits on the device
(`masks.TokenMasks`), so CUDA graphs and every sampling option see masked logits. The grammars that
ended (`EndedGrammar`) go back to the scheduler, which finishes their requests.
"""

from voltllm.structured_output.compiler import StructuredOutputCompiler
from voltllm.structured_output.grammar import EndedGrammar, Grammar, TokensToAccept, accept_tokens
from voltllm.structured_output.masks import TokenMasks

__all__ = [
    "EndedGrammar",
    "Grammar",
    "StructuredOutputCompiler",
    "TokenMasks",
    "TokensToAccept",
    "accept_tokens",
]
