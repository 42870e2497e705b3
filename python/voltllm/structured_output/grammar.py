"""A constrained request's grammar state: an llguidance matcher, advanced token by token."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import llguidance


class Grammar:
    """The matcher of one request. It lives as long as the request (preemption keeps it: the request
    keeps its tokens, so the matcher's state stays right) and is dropped when the request finishes."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def __reduce__(self) -> tuple:
        """A grammar does not cross processes: the plan a tensor-parallel driver sends its other ranks
        carries None in its place (those ranks sample nothing, so they need no mask)."""
        return (_no_grammar, ())

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False when the grammar rejects it (the matcher is then in
        its error state)."""
        return self.matcher.consume_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        """Forget the last `num_tokens` accepted tokens."""
        if not self.matcher.rollback(num_tokens):
            raise RuntimeError(f"grammar cannot roll back {num_tokens} tokens: {self.matcher.get_error()}")

    @property
    def is_terminated(self) -> bool:
        """The constraint is complete: no token but EOS may follow (or the matcher failed)."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return self.matcher.get_error()


def _no_grammar() -> None:
    return None


def accept_tokens(grammars: list[Grammar], token_ids: list[int]) -> list[bool]:
    """`Grammar.accept` for many requests at once, one after another on this thread."""
    return [g.accept(t) for g, t in zip(grammars, token_ids, strict=True)]


@dataclass(frozen=True, slots=True)
class EndedGrammar:
    """A constrained request whose grammar ended with the token it just accepted (`error` None: only
    EOS may follow), or rejected it (`error` says why; only an engine bug can cause that)."""

    request_id: str
    grammar: Grammar
    error: str | None


@dataclass(slots=True)
class TokensToAccept:
    """One step's sampled tokens of its constrained requests, fed to their grammars later (the next
    step does it in its mask thread, while its forward runs). Under asynchronous scheduling the tokens
    may still be on the device when this is made: `token_ids` is then None and `arrive` (called in the
    mask thread, when the accept starts) waits for them and returns them."""

    request_ids: list[str]
    grammars: list[Grammar]
    token_ids: list[int] | None
    arrive: Callable[[], list[int]] | None = None

    def accept(self) -> list[EndedGrammar]:
        """Advance every grammar by its token (`accept_tokens`); returns those that ended or rejected
        it."""
        if self.token_ids is None:
            self.token_ids = self.arrive()
        accepted = accept_tokens(self.grammars, self.token_ids)
        ended = []
        for request_id, grammar, token_id, ok in zip(
            self.request_ids, self.grammars, self.token_ids, accepted, strict=True
        ):
            if not ok:
                why = f"structured_output: the grammar rejected token {token_id}: {grammar.error}"
                ended.append(EndedGrammar(request_id, grammar, why))
            elif grammar.matcher.is_stopped():
                ended.append(EndedGrammar(request_id, grammar, None))
        return ended
