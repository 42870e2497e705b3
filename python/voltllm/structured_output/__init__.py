"""Structured outputs: one grammar matcher per constrained request, and the token masks it yields.

`compiler.StructuredOutputCompiler` turns a wire `StructuredOutput` into a `Grammar` (an llguidance
matcher) when the engine accepts the request, or raises `ValueError` naming the problem. The scheduler
advances each request's grammar with the tokens it accepts (`accept_tokens`, in parallel over the
batch) and finishes the request when the grammar has ended; the model runner fills the next-token
bitmasks of the step's constrained requests in a thread while the forward runs and applies them to the
logits on the device (`masks.TokenMasks`), so CUDA graphs and every sampling option see masked logits.
"""

from voltllm.structured_output.compiler import StructuredOutputCompiler
from voltllm.structured_output.grammar import Grammar, accept_tokens
from voltllm.structured_output.masks import TokenMasks

__all__ = ["Grammar", "StructuredOutputCompiler", "TokenMasks", "accept_tokens"]
