"""Memoized tokenization and detokenization for the editor's repeated texts.

llama-vscode resends the same ring-buffer chunks with every request, and while the user types
on one line the prefix (the lines above) and the suffix (the lines below) do not change
either; only the cursor line does. Tokenizing ~5k tokens of code costs tens of milliseconds
in llama.cpp's BPE, so whole texts are cached by their exact string (exact by construction:
the same text always gives the same tokens). Used on the worker thread only.

The answer's ``prompt`` field is the detokenized prompt. A keystroke's prompt starts like the
previous one (the ring chunks, the lines above), so the text is kept in blocks of 256 tokens
aligned to the start: the blocks a recent prompt shares are reused after a list comparison
(in C), the rest are joined from remembered per-token pieces (no Python call per token). One
cache serves one model (the vocabulary never changes).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

BLOCK = 256


class TokenCache:
    def __init__(
        self, max_tokens: int = 400_000, max_texts: int = 4096, max_recent: int = 4
    ) -> None:
        self.max_tokens = max_tokens
        self.max_texts = max_texts
        self.max_recent = max_recent
        self._texts: OrderedDict[tuple[str, bool], list[int]] = OrderedDict()
        self._n_tokens = 0
        # the last prompts detokenized, newest first, each with its text in 256-token blocks
        self._recent: list[tuple[list[int], list[bytes]]] = []
        self._pieces: dict[int, bytes] = {}  # token -> its text, special tokens rendered
        self.hits = 0
        self.misses = 0

    def tokenize(self, vocab: Any, text: str, *, special: bool) -> list[int]:
        """``vocab.tokenize(text, special=special)``, remembered; the caller must not mutate it."""
        key = (text, special)
        found = self._texts.get(key)
        if found is not None:
            self._texts.move_to_end(key)
            self.hits += 1
            return found
        self.misses += 1
        tokens = vocab.tokenize(text, special=special)
        self._texts[key] = tokens
        self._n_tokens += len(tokens)
        while self._texts and (
            self._n_tokens > self.max_tokens or len(self._texts) > self.max_texts
        ):
            _, old = self._texts.popitem(last=False)
            self._n_tokens -= len(old)
        return tokens

    def detokenize(self, vocab: Any, tokens: list[int]) -> str:
        """The prompt as text with special tokens rendered, as llama-server shows it.

        ``tokens`` is kept (as the newest recent prompt): the caller must not mutate it.
        """
        piece = getattr(vocab, "piece", None)
        if not callable(piece):
            return vocab.detokenize(tokens, special=True)
        pieces = self._pieces

        def render(block: list[int]) -> bytes:
            try:
                return b"".join(map(pieces.__getitem__, block))
            except KeyError:
                for t in block:
                    if t not in pieces:
                        pieces[t] = piece(t, special=True)
                return b"".join(map(pieces.__getitem__, block))

        parts = self._shared_head(tokens)
        for start in range(len(parts) * BLOCK, len(tokens), BLOCK):
            parts.append(render(tokens[start : start + BLOCK]))
        self._recent.insert(0, (tokens, parts))
        del self._recent[self.max_recent :]
        return b"".join(parts).decode("utf-8", errors="replace")

    def _shared_head(self, tokens: list[int]) -> list[bytes]:
        """The rendered whole blocks a recent prompt shares with ``tokens`` from the start
        (compared as list slices, in C: the same ids, mostly the same int objects)."""
        best: list[bytes] = []
        whole = len(tokens) // BLOCK * BLOCK
        for recent, parts in self._recent:
            end = min(whole, len(recent) // BLOCK * BLOCK)
            same = 0
            while same < end and tokens[same : same + BLOCK] == recent[same : same + BLOCK]:
                same += BLOCK
            if same // BLOCK > len(best):
                best = parts[: same // BLOCK]
            if same == whole:  # nothing can share more
                break
        return best
