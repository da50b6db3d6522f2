"""Memoized tokenization and detokenization for the editor's repeated texts.

llama-vscode resends the same ring-buffer chunks with every request, and while the user types
on one line the prefix (the lines above) and the suffix (the lines below) do not change
either; only the cursor line does. Tokenizing ~5k tokens of code costs tens of milliseconds
in llama.cpp's BPE, so whole texts are cached by their exact string (exact by construction:
the same text always gives the same tokens). Used on the worker thread only.

The answer's ``prompt`` field is the detokenized prompt; it is assembled from cached byte
blocks of 256 tokens aligned to the start, so the unchanged head of the prompt costs a few
dictionary lookups instead of one Python call per token.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

BLOCK = 256


class TokenCache:
    def __init__(
        self, max_tokens: int = 400_000, max_texts: int = 4096, max_blocks: int = 1024
    ) -> None:
        self.max_tokens = max_tokens
        self.max_texts = max_texts
        self.max_blocks = max_blocks
        self._texts: OrderedDict[tuple[str, bool], list[int]] = OrderedDict()
        self._n_tokens = 0
        self._blocks: OrderedDict[tuple[int, ...], bytes] = OrderedDict()
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
        """The prompt as text with special tokens rendered, as llama-server shows it."""
        piece = getattr(vocab, "piece", None)
        if not callable(piece):
            return vocab.detokenize(tokens, special=True)
        parts: list[bytes] = []
        for start in range(0, len(tokens), BLOCK):
            block = tuple(tokens[start : start + BLOCK])
            data = self._blocks.get(block)
            if data is None:
                data = b"".join(piece(t, special=True) for t in block)
                if len(block) == BLOCK:
                    self._blocks[block] = data
                    if len(self._blocks) > self.max_blocks:
                        self._blocks.popitem(last=False)
            else:
                self._blocks.move_to_end(block)
            parts.append(data)
        return b"".join(parts).decode("utf-8", errors="replace")
