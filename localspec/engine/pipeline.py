"""The draft model on its own thread: it drafts ahead while the target verifies.

On a CPU the draft model's tokens cost the target's thread about half a target token each,
which caps sequential draft-then-verify near the break-even point. The two llama contexts
are independent and ctypes releases the GIL inside ``llama_decode``, so with a free core the
draft model runs beside the target: while the target verifies ``[last, d1..dk]`` the draft
keeps going as if all of it were accepted (decoding ``dk``, guessing the bonus token as its
own next greedy token, and so on). When the step's outcome matches the draft's chain, the
next draft is already there; otherwise the draft thread cuts its KV back to the verified
tokens (it never keeps a rejected proposal) and catches up.

Ownership: while a pipeline runs, its thread is the only user of the draft context and the
draft's ``SlotCaches``. The request's thread only appends verified tokens (``confirm``) and
reads the chain (``proposals``), both under one lock, and never waits for the draft, except
in ``finish``. A finished request does not wait either: ``stop`` only signals, and whoever
next needs the draft cache (the next request's draft thread, or the engine) calls ``finish``,
which joins the thread and leaves the draft cache holding verified tokens only.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from localspec.engine.cache import PrefillPolicy, PrefillResult, SeqState, SlotCaches
from localspec.engine.errors import DecodeError


class DraftPipeline:
    """One request's draft thread on one slot's draft sequence."""

    def __init__(
        self,
        dcache: SlotCaches,
        st: SeqState,
        base: list[int],
        *,
        p_min: float,
        p_chain: float,
        ahead: int,
        n_ctx: int,
        n_target_vocab: int,
        prefill: PrefillPolicy,
        previous: DraftPipeline | None = None,
    ) -> None:
        self.dcache = dcache
        self.st = st
        self.base = list(base)
        self.p_min = p_min
        self.p_chain = min(p_chain, p_min)
        self.ahead = max(1, ahead)
        self.n_ctx = n_ctx
        self.n_target_vocab = n_target_vocab
        self._prefill = prefill
        self._previous = previous
        self._cv = threading.Condition()
        self._stop_ev = threading.Event()
        # shared state (under _cv): the verified tokens, and the draft's chain = the tokens
        # in its KV (``_w``, with the draft's probability of each: 1 for verified ones) +
        # its guess of the next one, or None
        self._confirmed: list[int] = list(base)
        self._w: list[int] = []
        self._wp: list[float] = []
        self._guess: tuple[int, float] | None = None
        self._active = True
        self._stopped = False
        self._idle = False  # the thread waits for new verified tokens (nothing to do)
        self.usable = True  # False once the draft cannot continue (error, context, vocab)
        self.error: BaseException | None = None
        # stats, written by the thread
        self.prefill_result: PrefillResult | None = None
        self.prefill_ms = 0.0
        self.decode_ms = 0.0
        self.n_decoded = 0
        self._thread = threading.Thread(target=self._main, name="localspec-draft", daemon=True)
        self._finished = False

    # --- the request's side ---------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def confirm(self, tokens: list[int]) -> None:
        """Tokens the target emitted, in order (the draft's chain is checked against them)."""
        if not tokens:
            return
        with self._cv:
            self._confirmed.extend(tokens)
            self._idle = False
            self._cv.notify_all()

    def proposals(self, limit: int, wait_for: int = 0, timeout_s: float = 1.0) -> list[int]:
        """The draft's continuation of the verified tokens, as far as it has got (at most
        ``limit`` tokens); empty while it is catching up or after it went another way.
        ``wait_for``: wait until that many are ready, unless the thread has stopped working
        (unsure, too far ahead, done)."""
        deadline = time.perf_counter() + timeout_s
        with self._cv:
            while True:
                out = self._proposals(limit)
                if len(out) >= min(wait_for, limit) or self._idle or self._stopped:
                    return out
                left = deadline - time.perf_counter()
                if left <= 0 or not self.usable or not self._thread.is_alive():
                    return out
                self._cv.wait(left)

    def _proposals(self, limit: int) -> list[int]:
        """Under the lock: the chain past the verified tokens, cut at a token below p_min."""
        c, w, g = self._confirmed, self._w, self._guess
        n = len(c)
        if len(w) < n or w[:n] != c:
            return []
        out: list[int] = []
        for i in range(n, min(len(w), n + limit)):
            if self._wp[i] < self.p_min:
                return out
            out.append(w[i])
        ready = len(out) < limit and len(w) - n == len(out)
        if ready and g is not None and g[1] >= self.p_min:
            out.append(g[0])
        return out

    def set_active(self, active: bool) -> None:
        """An inactive draft stops drafting ahead (it still follows the verified tokens
        lazily: nothing is decoded until it is active again)."""
        with self._cv:
            if active != self._active:
                self._active = active
                self._idle = False
                self._cv.notify_all()

    def stop(self) -> None:
        """End the request's drafting; does not wait (see ``finish``)."""
        self._stop_ev.set()
        with self._cv:
            self._stopped = True
            self._cv.notify_all()

    def finish(self) -> None:
        """Stop, join the thread, and cut the draft's KV to the verified tokens (except the
        newest, which the target has not decoded either). Idempotent."""
        if self._finished:
            return
        self.stop()
        self._thread.join()
        self._finished = True
        if isinstance(self.error, DecodeError):
            self.dcache.clear(self.st)  # llama.cpp may keep part of a failed batch
            return
        have = self.st.tokens
        seq = self._confirmed
        limit = min(len(have), len(seq) - 1)
        n = 0
        while n < limit and have[n] == seq[n]:
            n += 1
        self.dcache.truncate(self.st, n)

    # --- the draft thread ---------------------------------------------------------------
    def _main(self) -> None:
        try:
            if self._previous is not None:
                self._previous.finish()
                self._previous = None
            t0 = time.perf_counter()
            pre = self.dcache.prefill(self.st, self.base, self._prefill, cancel=self._stop_ev)
            self.prefill_ms = (time.perf_counter() - t0) * 1000.0
            self.prefill_result = pre
            if pre.cancelled:
                return
            guess = self._guess_from_logits()
            with self._cv:
                self._w = list(self.st.tokens)
                self._wp = [1.0] * len(self._w)
                self._guess = guess
            self._loop()
        except BaseException as exc:  # reported to the request's thread (finish, usable)
            self.error = exc
            self.usable = False
        finally:
            with self._cv:
                self._idle = True
                self._cv.notify_all()

    def _loop(self) -> None:
        dcache, st = self.dcache, self.st
        n_batch = dcache.ctx.n_batch
        n_vocab = dcache.ctx.n_vocab
        while True:
            with self._cv:
                while True:
                    if self._stopped:
                        return
                    cut, todo = self._next_action()
                    if cut is not None or todo:
                        self._idle = False
                        break
                    self._idle = True
                    self._cv.notify_all()
                    self._cv.wait()
            if cut is not None:
                dcache.truncate(st, cut)
                with self._cv:
                    del self._w[cut:]
                    del self._wp[cut:]
                    self._guess = None
                continue
            if len(self._w) + len(todo) + 1 >= self.n_ctx or any(t >= n_vocab for t in todo):
                self.usable = False  # out of draft context, or a target-only (padding) id
                return
            todo = todo[:n_batch]
            t0 = time.perf_counter()
            own = self._guess if len(todo) == 1 and self._guess is not None else None
            dcache.append(st, todo, logits="last")
            guess = self._guess_from_logits()
            self.decode_ms += (time.perf_counter() - t0) * 1000.0
            self.n_decoded += len(todo)
            with self._cv:
                self._w.extend(todo)
                # a decoded guess keeps its probability until the target verifies it
                chained = own is not None and len(self._w) > len(self._confirmed)
                self._wp.extend([own[1]] if chained else [1.0] * len(todo))
                self._guess = guess
                self._cv.notify_all()

    def _next_action(self) -> tuple[int | None, list[int]]:
        """Under the lock: (a KV cut, None) when the chain left the verified tokens, else
        (None, tokens to decode next): the verified tokens it lacks, or its own guess."""
        w, c = self._w, self._confirmed
        n = min(len(w), len(c))
        if w[:n] != c[:n]:
            m = next(i for i in range(n) if w[i] != c[i])
            return m, []
        if len(w) < len(c):
            return None, c[len(w) :]
        g = self._guess
        if (
            self._active
            and g is not None
            and g[1] >= self.p_chain
            and len(w) - len(c) < self.ahead
            and len(w) + 2 < self.n_ctx
        ):
            return None, [g[0]]
        return None, []

    def _guess_from_logits(self) -> tuple[int, float] | None:
        """The draft's greedy next token and its probability."""
        row = self.dcache.ctx.logits(-1)
        tok, p = self.pick(row)
        if tok >= self.n_target_vocab:
            return None
        return tok, p

    @staticmethod
    def pick(row: np.ndarray) -> tuple[int, float]:
        """Greedy choice and its probability (a method so tests can steer the draft)."""
        tok = int(row.argmax())
        return tok, 1.0 / float(np.exp(row - row[tok]).sum())
