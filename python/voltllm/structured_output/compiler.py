"""Wire constraints (`StructuredOutput`) compiled into llguidance grammars.

Every kind becomes one llguidance grammar: a JSON Schema through llguidance's JSON compiler (compact:
no whitespace between tokens, as OpenAI's strict mode writes JSON, unless the constraint carries a
`whitespace_pattern`, which llguidance then allows between tokens), `json_object` as the schema
`{"type": "object"}`, a regex as-is, a choice as a Lark alternation of string literals, a grammar as Lark
(GBNF, recognised by its `::=` rules, converted by llguidance's own converter). Compilation happens when
the engine accepts a request, so a constraint that does not compile fails that request at once.
"""

from __future__ import annotations

import json
from pathlib import Path

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from voltllm.protocol import StructuredOutput, StructuredOutputKind
from voltllm.structured_output.grammar import Grammar

# No whitespace between JSON tokens: a small model cannot pad its output with spaces forever, and the
# output is what `json.dumps(separators=(",", ":"))` writes.
_JSON_OPTIONS = {"whitespace_flexible": False}
_ANY_OBJECT_SCHEMA = '{"type": "object"}'


class StructuredOutputCompiler:
    """Builds a `Grammar` per constrained request for one model's tokenizer.

    The llguidance tokenizer (about a second to build from `tokenizer.json`) is made on the first
    constrained request, so engines that never see one do not pay for it.
    """

    def __init__(self, tokenizer_path: Path, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        """`vocab_size` is the model's (logits) width, which may exceed the tokenizer's: ids past the
        tokenizer's last token are never allowed."""
        self.tokenizer_path = Path(tokenizer_path)
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            if not self.tokenizer_path.is_file():
                raise ValueError(
                    f"structured_output: the model has no {self.tokenizer_path.name}, which the grammar "
                    "engine needs"
                )
            self._tokenizer = llguidance.LLTokenizer(
                self.tokenizer_path.read_text(encoding="utf-8"),
                n_vocab=self.vocab_size,
                eos_token=self.eos_token_ids or None,
            )
        return self._tokenizer

    def compile(self, constraint: StructuredOutput) -> Grammar:
        """The grammar of `constraint`; raises `ValueError` ("structured_output: ...") when it does not
        compile (invalid JSON, an unsupported schema, a regex or grammar syntax error)."""
        grammar = llguidance_grammar(constraint)
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_output: invalid {constraint.kind}: {matcher.get_error().strip()}")
        return Grammar(matcher)


def llguidance_grammar(constraint: StructuredOutput) -> str:
    """The llguidance grammar text of a constraint (its syntax is checked by the matcher later)."""
    kind, spec = constraint.kind, constraint.spec
    if kind in (StructuredOutputKind.JSON.value, StructuredOutputKind.JSON_OBJECT.value):
        schema = _parse_json_schema(spec) if kind == StructuredOutputKind.JSON.value else _ANY_OBJECT_SCHEMA
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_json_options(constraint))
    if constraint.whitespace_pattern is not None:
        raise ValueError(f"structured_output: whitespace_pattern applies to json and json_object, not {kind}")
    if kind == StructuredOutputKind.REGEX.value:
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == StructuredOutputKind.CHOICE.value:
        return llguidance.LLMatcher.grammar_from_lark(_choice_lark(spec))
    if kind == StructuredOutputKind.GRAMMAR.value:
        try:
            lark = any_to_lark(spec)
        except Exception as e:  # the GBNF converter raises plain Exceptions for syntax errors
            raise ValueError(f"structured_output: invalid grammar: {e}") from None
        return llguidance.LLMatcher.grammar_from_lark(lark)
    raise ValueError(f"structured_output: unknown kind {kind!r}")


def _json_options(constraint: StructuredOutput) -> dict[str, object]:
    """llguidance's JSON options: compact, or the constraint's whitespace pattern between tokens."""
    if constraint.whitespace_pattern is None:
        return _JSON_OPTIONS
    return {**_JSON_OPTIONS, "whitespace_pattern": constraint.whitespace_pattern}


def _parse_json_schema(spec: str) -> str:
    try:
        schema = json.loads(spec)
    except json.JSONDecodeError as e:
        raise ValueError(f"structured_output: invalid json: the schema is not JSON ({e})") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError("structured_output: invalid json: a JSON Schema is an object (or a boolean)")
    return spec


def _choice_lark(spec: str) -> str:
    try:
        choices = json.loads(spec)
    except json.JSONDecodeError as e:
        raise ValueError(f"structured_output: invalid choice: not a JSON array ({e})") from None
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("structured_output: invalid choice: expected a non-empty array of non-empty strings")
    # JSON string literals are valid Lark string literals (same quotes, same escapes).
    return "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
