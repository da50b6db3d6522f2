"""Sampler chains from llama-server's ``samplers`` names, built on llama.cpp's sampler API.

The chain applies the named samplers in the request's order and ends in a seeded draw
(llama.cpp's ``dist``), or is a plain argmax when the request is greedy (``top_k == 1`` or
``temperature <= 0``). The engine draws from the same chain once per emitted token whether
or not it speculates, so a seeded request gives the same text either way.
"""

from __future__ import annotations

import time

import llama_cpp.llama_cpp as C
import numpy as np

from localspec.engine.llama import Clock, Context
from localspec.engine.types import SamplingParams, TokenProbs

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
# samplers that are no-ops at llama-server's defaults (penalty 1.0, dry 0, typ_p 1, xtc 0,
# top_n_sigma -1): accepted and skipped; adaptive_p replaces the draw and is not offered
_NOOP = {"dry", "typ_p", "xtc", "penalties", "top_n_sigma", "adaptive_p"}


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
    """One request's sampler chain on one context."""

    def __init__(self, params: SamplingParams, ctx: Context, vocab_handle: object) -> None:
        self.ctx = ctx
        self.clock: Clock = ctx.clock
        self.greedy = params.greedy
        names = canonical_samplers(params.samplers)
        chain = C.llama_sampler_chain_init(C.llama_sampler_chain_default_params())
        if self.greedy:
            C.llama_sampler_chain_add(chain, C.llama_sampler_init_greedy())
        else:
            for name in names:
                smpl = None
                if name == "top_k":
                    smpl = C.llama_sampler_init_top_k(params.top_k)
                elif name == "top_p":
                    smpl = C.llama_sampler_init_top_p(params.top_p, 1)
                elif name == "min_p":
                    smpl = C.llama_sampler_init_min_p(params.min_p, 1)
                elif name == "temperature":
                    smpl = C.llama_sampler_init_temp(params.temperature)
                elif name == "infill":
                    smpl = C.llama_sampler_init_infill(vocab_handle)
                if smpl is not None:
                    C.llama_sampler_chain_add(chain, smpl)
            C.llama_sampler_chain_add(chain, C.llama_sampler_init_dist(params.seed & 0xFFFFFFFF))
        self.chain = chain

    def sample(self, idx: int) -> int:
        """Draw from the logits of batch index ``idx`` of the last decode (and accept it)."""
        t0 = time.perf_counter()
        tok = int(C.llama_sampler_sample(self.chain, self.ctx.handle, idx))
        self.clock.inside_ms += (time.perf_counter() - t0) * 1000.0
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
