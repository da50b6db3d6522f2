"""The best any draft-length policy can do with a given draft model and the n-gram drafter:
it knows the target's greedy continuation, so every step drafts exactly the tokens the
target will accept, from whichever source has the longer accepted run per ms, or nothing.

A benchmark's ceiling (``localspec bench languages``), not a policy a request can use: it
needs the answer before it is computed. What is left between it and a real policy is what
better depth decisions could still win; what it does not reach, no depth policy reaches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from localspec.engine.policy import VerifyCost


@dataclass(frozen=True)
class DepthOracle:
    """``target``: the target's greedy output for the request; ``draft_runs[i]``: how many
    tokens, from output position i on, the draft model's own greedy chain equals it (the
    draft's argmax after the prompt's draft window and ``target[:j]`` equals ``target[j]``
    for j = i, i+1, ...); ``draft_ms``: one draft-model token's decode, measured before the
    request (< 0: the request's own measurement, once it has one)."""

    target: tuple[int, ...]
    draft_runs: tuple[int, ...]
    draft_ms: float = -1.0

    @classmethod
    def of(
        cls, target: Sequence[int], draft_greedy: Sequence[int], draft_ms: float = -1.0
    ) -> DepthOracle:
        """From the draft model's greedy token at each position of the target's output."""
        runs = [0] * (len(target) + 1)
        for i in range(len(target) - 1, -1, -1):
            ok = i < len(draft_greedy) and draft_greedy[i] == target[i]
            runs[i] = runs[i + 1] + 1 if ok else 0
        return cls(tuple(target), tuple(runs[:-1]), draft_ms)

    def accepted(self, pos: int, draft: Sequence[int]) -> int:
        """How many of ``draft``, offered after ``pos`` emitted tokens, the target accepts."""
        n = 0
        for tok in draft:
            if pos + n >= len(self.target) or self.target[pos + n] != tok:
                break
            n += 1
        return n

    def draft_run(self, pos: int) -> int:
        return self.draft_runs[pos] if 0 <= pos < len(self.draft_runs) else 0

    @staticmethod
    def choose(
        ngram_run: int, draft_run: int, verify: VerifyCost, draft_ms: float
    ) -> tuple[str, int]:
        """("ngram" | "draft" | "", length): the source whose accepted run yields the most
        tokens per ms (a draft-model token costs ``draft_ms``; n-grams are free), or a plain
        step ("", 0) when neither beats it."""
        t1 = verify.t1
        if t1 <= 0:
            return "", 0  # a plain step first: its cost is what drafting is weighed against
        best, choice = 1.0 / t1, ("", 0)
        for source, run, cost in (("ngram", ngram_run, 0.0), ("draft", draft_run, draft_ms)):
            if run <= 0:
                continue
            rate = (run + 1) / (run * max(cost, 0.0) + verify.cost(run + 1))
            if rate > best:
                best, choice = rate, (source, run)
        return choice
