"""Stop rules on the generated text, exactly as llama-server applies them per token.

Pure logic (no llama.cpp): fed one token's bytes at a time, it decides what text is final
(stop strings held back while a partial match is pending, incomplete UTF-8 held back), and
whether generation stops (stop string, end-of-generation token, ``n_indent``,
``t_max_predict_ms``, the ``n_predict`` budget).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from localspec.engine.types import StopType


def incomplete_utf8_tail(data: bytes) -> int:
    """Length of a trailing, not yet complete UTF-8 sequence (0 when the bytes end cleanly)."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 == 0x80:  # continuation byte: keep looking for the lead byte
            continue
        if byte & 0x80 == 0:
            return 0
        need = 2 if byte & 0xE0 == 0xC0 else 3 if byte & 0xF0 == 0xE0 else 4
        return back if back < need else 0
    return 0


def find_partial_stop(text: str, word: str) -> int:
    """Start of the longest suffix of ``text`` that is a proper prefix of ``word``, or -1."""
    if not word or not text:
        return -1
    for length in range(min(len(word), len(text)), 0, -1):
        if text.endswith(word[:length]):
            return len(text) - length
    return -1


@dataclass
class StepOutcome:
    text: str  # newly final text to stream (may be "")
    stop: bool


class StopRules:
    """One request's stop state (llama-server's process_token, minus the HTTP)."""

    def __init__(
        self,
        *,
        stop: tuple[str, ...] = (),
        n_predict: int = -1,
        n_indent: int = 0,
        t_max_predict_ms: int = 0,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.words = tuple(w for w in stop if w)
        self.n_predict = n_predict
        self.n_indent = n_indent
        self.t_max_predict_ms = t_max_predict_ms
        self.clock = clock
        self.t_start = clock()
        self.raw = b""
        self.text = ""  # generated text, after cuts (complete UTF-8 only)
        self.n_sent = 0  # characters of ``text`` already handed out as final
        self.n_gen = 0
        self.has_new_line = False
        self.last_nl_pos = 0
        self.stop_type: StopType = "none"
        self.stopping_word = ""

    def _find_stop(self, test: str, last_size: int, full: bool) -> int:
        best = -1
        for word in self.words:
            if full:
                start = max(0, len(test) - (len(word) + last_size))
                pos = test.find(word, start)
            else:
                pos = find_partial_stop(test, word)
            if pos >= 0 and (best < 0 or pos < best):
                if full:
                    self.stop_type = "word"
                    self.stopping_word = word
                best = pos
        return best

    def push(self, piece: bytes, *, is_eog: bool, context_full: bool = False) -> StepOutcome:
        """Account one generated token; return the text that became final and whether to stop."""
        self.n_gen += 1
        self.raw += piece
        stop = False
        pending = incomplete_utf8_tail(self.raw)
        tentative = ""
        if not pending:
            self.text = self.raw.decode("utf-8", errors="replace")
            # text cut by a stop string stays cut: raw keeps only what text holds
            pos = min(self.n_sent, len(self.text))
            test = self.text[pos:]
            piece_len = len(piece.decode("utf-8", errors="replace"))
            send = True
            stop_pos = self._find_stop(test, piece_len, full=True)
            if stop_pos >= 0:
                self.text = self.text[: pos + stop_pos]
                self.raw = self.text.encode("utf-8")
                stop = True
            elif not is_eog:
                send = self._find_stop(test, piece_len, full=False) < 0
            if send:
                tentative = self.text[pos:]
        else:
            send = False
        if context_full and not stop:
            self.stop_type, stop = "limit", True
        if not stop and self.n_predict >= 0 and self.n_gen >= self.n_predict:
            self.stop_type, stop = "limit", True
        if self.has_new_line and self.n_indent > 0 and not pending:
            if self.last_nl_pos > 0:
                pos = self.last_nl_pos
                indent = 0
                while pos < len(self.text) and self.text[pos] in " \t":
                    indent += 1
                    pos += 1
                if pos < len(self.text) and indent < self.n_indent:
                    self.stop_type, stop = "limit", True
                    self.text = self.text[:pos]
                    self.raw = self.text.encode("utf-8")
            nl = self.text.find("\n", self.last_nl_pos)
            if nl >= 0:
                self.last_nl_pos = nl + 1
        if "\n" in tentative:
            self.has_new_line = True
            if self.past_budget():
                self.stop_type, stop = "limit", True
        if is_eog:
            self.stop_type, stop = "eos", True
        out = ""
        if send and len(self.text) > self.n_sent:
            out = self.text[self.n_sent :]
            self.n_sent = len(self.text)
        return StepOutcome(out, stop)

    def past_budget(self) -> bool:
        """Whether ``t_max_predict_ms`` has passed since the first token (none: never)."""
        elapsed_ms = (self.clock() - self.t_start) * 1000.0
        return self.t_max_predict_ms > 0 and elapsed_ms > self.t_max_predict_ms

    def flush(self) -> str:
        """At the end: whatever was held back (a pending partial stop, broken UTF-8) is final."""
        if incomplete_utf8_tail(self.raw):
            self.text = self.raw.decode("utf-8", errors="replace")
        out = self.text[self.n_sent :]
        self.n_sent = len(self.text)
        return out
