"""Sampler chains from llama-server's sampling fields, built on llama.cpp's sampler API.

The chain is llama-server's (common/sampling.cpp ``common_sampler_init``): the logit biases
first (``logit_bias``, ``ignore_eos``), then the named samplers in the request's order and a
seeded draw (llama.cpp's ``dist``), or, with ``mirostat``, temperature and Mirostat instead.
A greedy request that nothing else shapes (``SamplingParams.plain``) is a plain argmax.

A grammar is not in the chain but beside it, as in llama-server: the chain draws, and only a
token the grammar refuses makes it draw again with the grammar applied first. Penalties and
DRY see the prompt (its tokens are accepted into the chain first); the grammar does not.

The engine draws from the same sampler once per emitted token whether or not it speculates
(a drafted token the grammar refuses is simply not drawn), so a seeded request gives the same
text either way.
"""

from __future__ import annotations

import ctypes
import math
import time
from collections.abc import Sequence

import llama_cpp.llama_cpp as C
import numpy as np

from localspec.engine.llama import Clock, Context
from localspec.engine.types import SamplingParams, TokenProbs

# llama_token_data as numpy sees it: the candidates a grammar-constrained draw works on
_TOKEN_DATA = np.dtype([("id", np.intc), ("logit", np.single), ("p", np.single)], align=True)


class GrammarError(ValueError):
    """A GBNF grammar llama.cpp's parser refuses (it prints why on stderr)."""


def check_grammar(vocab_handle: object, grammar: str) -> None:
    """Parse ``grammar`` once with llama.cpp's own parser; GrammarError when it does not
    parse (or has no ``root``), so a request is refused before it is queued."""
    if "\0" in grammar:
        raise GrammarError("failed to parse grammar: a NUL character")
    smpl = C.llama_sampler_init_grammar(vocab_handle, grammar.encode("utf-8"), b"root")
    if not smpl:
        raise GrammarError("failed to parse grammar")
    C.llama_sampler_free(smpl)


# llama-server's canonical names and aliases (common_sampler_types_from_names)
_CANONICAL = (
    "dry", "top_k", "top_p", "top_n_sigma", "typ_p", "min_p", "temperature", "xtc",
    "infill", "penalties", "adaptive_p",
)  # fmt: skip
_ALIASES = {"nucleus": "top_p", "temp": "temperature", "typ": "typ_p"}
for _name in _CANONICAL:
    if "_" in _name:
        _ALIASES[_name.replace("_", "-")] = _name
        _ALIASES[_name.replace("_", "")] = _name
# adaptive_p replaces the draw (its fields are not offered): accepted and skipped
_NOOP = {"adaptive_p"}


# llama-server's one-letter codes (common_sampler_type_to_chr)
_CHARS = {
    "d": "dry", "k": "top_k", "y": "typ_p", "p": "top_p", "s": "top_n_sigma", "m": "min_p",
    "t": "temperature", "x": "xtc", "i": "infill", "e": "penalties", "a": "adaptive_p",
}  # fmt: skip


class UnknownSampler(ValueError):
    """A sampler name (or one-letter code) llama-server does not know; ``unknown`` lists
    them and the message says what is accepted."""

    def __init__(self, unknown: list[str], *, codes: bool) -> None:
        self.unknown = unknown
        known = "".join(_CHARS) if codes else ", ".join(_CANONICAL)
        kind = "sampler code(s)" if codes else "sampler(s)"
        super().__init__(f"Unknown {kind} {', '.join(map(repr, unknown))}: use {known}")


def canonical_samplers(names: tuple[str, ...] | list[str] | str) -> tuple[str, ...]:
    """Canonical names from a list of names (any llama-server spelling) or a string of
    one-letter codes; UnknownSampler names what it does not know."""
    if isinstance(names, str):
        unknown = sorted({c for c in names if c not in _CHARS})
        if unknown:
            raise UnknownSampler(unknown, codes=True)
        return tuple(_CHARS[c] for c in names)
    out: list[str] = []
    bad: list[str] = []
    for raw in names:
        name = str(raw).lower()
        name = _ALIASES.get(name, name)
        if name not in _CANONICAL:
            bad.append(str(raw))
        out.append(name)
    if bad:
        raise UnknownSampler(sorted(set(bad)), codes=False)
    return tuple(out)


class Sampler:
    """One request's sampler chain (and grammar) on one context.

    ``prompt``: the request's prompt tokens, accepted into the chain first so penalties and
    DRY count them (as llama-server's ``init_sampler``); only the last tokens they look at.
    """

    def __init__(
        self,
        params: SamplingParams,
        ctx: Context,
        vocab_handle: object,
        prompt: Sequence[int] = (),
    ) -> None:
        self.ctx = ctx
        self.clock: Clock = ctx.clock
        self.chain: object | None = None
        self.grammar: object | None = None
        self.greedy = params.greedy and params.plain
        self.n_vocab = int(C.llama_vocab_n_tokens(vocab_handle))
        eos = int(C.llama_vocab_eos(vocab_handle))
        eot = int(C.llama_vocab_eot(vocab_handle))
        # what a grammar-constrained draw that has no allowed token left ends with
        self.end_token = eos if eos >= 0 else eot
        chain = C.llama_sampler_chain_init(C.llama_sampler_chain_default_params())
        self.chain = chain
        if self.greedy:
            C.llama_sampler_chain_add(chain, C.llama_sampler_init_greedy())
            history = 0
        else:
            history = self._build(params, chain, vocab_handle)
        if params.grammar:
            grammar = C.llama_sampler_init_grammar(
                vocab_handle, params.grammar.encode("utf-8"), b"root"
            )
            if not grammar:  # checked when the request was parsed: not expected here
                self.close()
                raise GrammarError("failed to parse grammar")
            self.grammar = grammar
            self._ids = np.arange(self.n_vocab, dtype=np.intc)
            self._cur = np.zeros(self.n_vocab, dtype=_TOKEN_DATA)
            self._cur_p = C.llama_token_data_array(
                data=self._cur.ctypes.data_as(C.llama_token_data_p),
                size=self.n_vocab,
                selected=-1,
                sorted=False,
            )
            self._one = np.zeros(1, dtype=_TOKEN_DATA)
            self._one_p = C.llama_token_data_array(
                data=self._one.ctypes.data_as(C.llama_token_data_p),
                size=1,
                selected=-1,
                sorted=False,
            )
        if history > 0 and prompt:
            for tok in prompt[-history:]:
                C.llama_sampler_accept(chain, tok)

    def _build(self, params: SamplingParams, chain: object, vocab: object) -> int:
        """llama-server's chain (common_sampler_init); returns how many past tokens its
        samplers look at (penalties, DRY), to be fed from the prompt."""
        history = 0
        n_vocab = self.n_vocab
        if params.logit_bias:
            arr = (C.llama_logit_bias * len(params.logit_bias))(
                *(C.llama_logit_bias(tok, bias) for tok, bias in params.logit_bias)
            )
            C.llama_sampler_chain_add(
                chain, C.llama_sampler_init_logit_bias(n_vocab, len(arr), arr)
            )
        seed = params.seed & 0xFFFFFFFF
        if params.mirostat == 1:
            C.llama_sampler_chain_add(chain, C.llama_sampler_init_temp(params.temperature))
            C.llama_sampler_chain_add(
                chain,
                C.llama_sampler_init_mirostat(
                    n_vocab, seed, params.mirostat_tau, params.mirostat_eta, 100
                ),
            )
            return 0
        if params.mirostat == 2:
            C.llama_sampler_chain_add(chain, C.llama_sampler_init_temp(params.temperature))
            C.llama_sampler_chain_add(
                chain,
                C.llama_sampler_init_mirostat_v2(seed, params.mirostat_tau, params.mirostat_eta),
            )
            return 0
        min_keep = params.min_keep
        for name in canonical_samplers(params.samplers):
            smpl = None
            if name == "top_k":
                smpl = C.llama_sampler_init_top_k(params.top_k)
            elif name == "top_p":
                smpl = C.llama_sampler_init_top_p(params.top_p, min_keep)
            elif name == "min_p":
                smpl = C.llama_sampler_init_min_p(params.min_p, min_keep)
            elif name == "temperature":
                smpl = C.llama_sampler_init_temp_ext(
                    params.temperature, params.dynatemp_range, params.dynatemp_exponent
                )
            elif name == "infill":
                smpl = C.llama_sampler_init_infill(vocab)
            elif name == "penalties" and params.penalties_on:
                smpl = C.llama_sampler_init_penalties(
                    n_vocab,
                    params.repeat_last_n,
                    params.repeat_penalty,
                    params.frequency_penalty,
                    params.presence_penalty,
                )
                history = max(history, params.repeat_last_n)
            elif name == "dry" and params.dry_on:
                breakers = [b.encode("utf-8") for b in params.dry_sequence_breakers]
                c_breakers = (ctypes.c_char_p * len(breakers))(*breakers)
                smpl = C.llama_sampler_init_dry(
                    vocab,
                    params.dry_multiplier,
                    params.dry_base,
                    params.dry_allowed_length,
                    params.dry_penalty_last_n,
                    c_breakers,
                    len(breakers),
                )
                history = max(history, params.dry_penalty_last_n)
            elif name == "typ_p" and params.typ_p < 1.0:
                smpl = C.llama_sampler_init_typical(params.typ_p, min_keep)
            elif name == "xtc" and params.xtc_probability > 0.0 and params.xtc_threshold <= 0.5:
                smpl = C.llama_sampler_init_xtc(
                    params.xtc_probability, params.xtc_threshold, min_keep, seed
                )
            elif name == "top_n_sigma" and params.top_n_sigma > 0.0:
                smpl = C.llama_sampler_init_top_n_sigma(params.top_n_sigma)
            # other names are no-ops at their values (llama.cpp's own early returns)
            if smpl is not None:
                C.llama_sampler_chain_add(chain, smpl)
        C.llama_sampler_chain_add(chain, C.llama_sampler_init_dist(seed))
        return history

    def sample(self, idx: int) -> int:
        """Draw from the logits of batch index ``idx`` of the last decode (and accept it)."""
        t0 = time.perf_counter()
        if self.grammar is None:
            tok = int(C.llama_sampler_sample(self.chain, self.ctx.handle, idx))
        else:
            tok = self._sample_grammar(idx)
        self.clock.inside_ms += (time.perf_counter() - t0) * 1000.0
        return tok

    def _fill(self, idx: int) -> None:
        cur = self._cur
        cur["id"] = self._ids
        cur["logit"] = self.ctx.logits(idx)
        cur["p"] = 0.0
        self._cur_p.data = cur.ctypes.data_as(C.llama_token_data_p)
        self._cur_p.size = self.n_vocab
        self._cur_p.selected = -1
        self._cur_p.sorted = False

    def _selected(self) -> tuple[int, float]:
        sel = self._cur_p.selected
        if sel < 0 or sel >= self._cur_p.size:
            return -1, -math.inf
        data = self._cur_p.data[sel]
        return int(data.id), float(data.logit)

    def _allowed(self, tok: int) -> bool:
        """Whether the grammar takes ``tok`` next (llama.cpp's one-candidate check)."""
        one = self._one
        one[0] = (tok, 1.0, 0.0)
        self._one_p.size = 1
        self._one_p.selected = -1
        C.llama_sampler_apply(self.grammar, ctypes.byref(self._one_p))
        return bool(np.isfinite(one[0]["logit"]))

    def _sample_grammar(self, idx: int) -> int:
        """llama-server's draw with a grammar (common_sampler_sample): the chain draws; a
        token the grammar refuses makes it draw again on the logits with the grammar applied
        first. The token is accepted by the grammar, then the chain. A grammar with nothing
        left it allows (complete while ``ignore_eos`` bans the end, or every allowed token
        banned) ends the answer with an end token it never accepts: llama.cpp aborts the
        process when a grammar accepts a token it refuses."""
        self._fill(idx)
        C.llama_sampler_apply(self.chain, ctypes.byref(self._cur_p))
        tok, logit = self._selected()
        if tok < 0 or not self._allowed(tok):
            self._fill(idx)
            C.llama_sampler_apply(self.grammar, ctypes.byref(self._cur_p))
            C.llama_sampler_apply(self.chain, ctypes.byref(self._cur_p))
            tok, logit = self._selected()
            if tok < 0 or not math.isfinite(logit) or not self._allowed(tok):
                if self.end_token < 0:
                    raise GrammarError("the grammar allows no token here")
                return self.end_token
        C.llama_sampler_accept(self.grammar, tok)
        C.llama_sampler_accept(self.chain, tok)
        return tok

    def probs(self, idx: int, token: int, n_probs: int) -> TokenProbs:
        """``token``'s probability and the ``n_probs`` likeliest tokens, from the raw logits at
        batch index ``idx`` (a softmax over the whole vocabulary, as llama-server's n_probs)."""
        logits = self.ctx.logits(idx)
        shifted = np.exp(logits - logits.max(), dtype=np.float64)
        p = shifted / shifted.sum()
        n = min(n_probs, len(logits))
        top = np.argpartition(-logits, n - 1)[:n]
        top = top[np.argsort(-logits[top], kind="stable")]
        return TokenProbs(float(p[token]), tuple((int(t), float(p[t])) for t in top))

    def close(self) -> None:
        if self.chain:
            C.llama_sampler_free(self.chain)
            self.chain = None
        if self.grammar:
            C.llama_sampler_free(self.grammar)
            self.grammar = None
