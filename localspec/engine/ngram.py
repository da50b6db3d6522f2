"""The n-gram drafter: propose what followed the last few tokens earlier in the context.

Free (no model call) and strong on code, which repeats itself: the FIM suffix the completion
reconnects with, the next line of a pattern, an identifier used above. It finds the longest
match (at least ``n_min`` tokens, preferring the most recent among equals) of the context's
tail and proposes the tokens that followed that match; when those run into the tail itself
(the text repeats with a short period), the draft goes on with that period.
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    """Positions of every ``n_min``-gram of a growing token list (one request's context)."""

    def __init__(self, tokens: Sequence[int], *, n_min: int = 2, n_match_max: int = 16) -> None:
        self.n_min = max(1, n_min)
        self.n_match_max = max(self.n_min, n_match_max)
        self.tokens: list[int] = []
        self.index: dict[tuple[int, ...], list[int]] = {}
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        toks, n = self.tokens, self.n_min
        for t in tokens:
            toks.append(t)
            if len(toks) >= n:
                start = len(toks) - n
                self.index.setdefault(tuple(toks[start:]), []).append(start)

    def draft(
        self, n_max: int, *, max_candidates: int = 16, agree: bool = False
    ) -> tuple[list[int], int]:
        """Up to ``n_max`` proposed tokens and the match length they rest on ((), 0 if none).
        ``agree``: the draft ends where the other occurrences of a match as long disagree on
        what followed (the text went on in more than one way there; the target picks one)."""
        toks, n = self.tokens, self.n_min
        if n_max <= 0 or len(toks) <= n:
            return [], 0
        end = len(toks)
        cands = self.index.get(tuple(toks[end - n :]))
        if not cands:
            return [], 0
        best_start, best_len = -1, 0
        found: list[tuple[int, int]] = []
        # most recent first; the last entry is the tail itself
        for start in reversed(cands[-max_candidates - 1 :]):
            if start + n >= end:
                continue
            length = n
            while (
                length < self.n_match_max
                and start - (length - n) - 1 >= 0
                and toks[start - (length - n) - 1] == toks[end - length - 1]
            ):
                length += 1
            found.append((start, length))
            if length > best_len:
                best_start, best_len = start, length
        if best_start < 0:
            return [], 0
        follow = best_start + n
        period = end - follow  # the tail repeats what came this many tokens earlier
        if period >= n_max:
            out = toks[follow : follow + n_max]
        else:
            # a continuation that runs into the tail goes on with the same period: a table
            # row, a run of "0, 0, 0" (copying the draft itself, as if the text kept repeating)
            out = toks[follow:end]
            while len(out) < n_max:
                out.append(out[len(out) - period])
        if agree:
            out = out[: self._agreed(out, found, best_start, best_len)]
        return out, best_len

    def _agreed(
        self, out: list[int], found: list[tuple[int, int]], best: int, best_len: int
    ) -> int:
        """How many of ``out``'s tokens every other occurrence of a match of ``best_len``
        tokens continued with too (as far as each occurrence's continuation goes)."""
        toks, n, end = self.tokens, self.n_min, len(self.tokens)
        agreed = len(out)
        for start, length in found:
            if start == best or length < best_len:
                continue
            follow = start + n
            j = 0
            while j < agreed and follow + j < end and toks[follow + j] == out[j]:
                j += 1
            if follow + j < end:  # stopped on a disagreement, not on the context's end
                agreed = j
        return agreed
