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

    def draft(self, n_max: int, *, max_candidates: int = 16) -> tuple[list[int], int]:
        """Up to ``n_max`` proposed tokens and the match length they rest on ((), 0 if none)."""
        toks, n = self.tokens, self.n_min
        if n_max <= 0 or len(toks) <= n:
            return [], 0
        end = len(toks)
        cands = self.index.get(tuple(toks[end - n :]))
        if not cands:
            return [], 0
        best_start, best_len = -1, 0
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
            if length > best_len:
                best_start, best_len = start, length
        if best_start < 0:
            return [], 0
        follow = best_start + n
        period = end - follow  # the tail repeats what came this many tokens earlier
        if period >= n_max:
            return toks[follow : follow + n_max], best_len
        # a continuation that runs into the tail goes on with the same period: a table row,
        # a run of "0, 0, 0" (copying the draft itself, as if the text kept repeating)
        out = toks[follow:end]
        while len(out) < n_max:
            out.append(out[len(out) - period])
        return out, best_len
