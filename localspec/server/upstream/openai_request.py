"""The ``/v1/completions`` body an OpenAI-style upstream gets for one editor request (pure).

llama-server's sampler chain is a list the client chooses (``samplers``); an OpenAI server has
fixed knobs. A sampler left out of the chain is switched off in the body (top_k -1, top_p 1,
min_p 0, temperature 1: llama.cpp's final draw is at temperature 1 when no temperature
sampler runs). ``top_k`` and ``min_p`` are extensions vLLM, SGLang, LM Studio, llama-server
and localspec take; so are ``repetition_penalty`` (llama-server's ``repeat_penalty``) and
``ignore_eos``; ``presence_penalty`` and ``frequency_penalty`` are OpenAI's own, with
llama.cpp's formula. ``infill``, ``dry``, ``xtc``, ``typ_p`` and ``top_n_sigma`` have no OpenAI
equivalent and are not applied; nor are ``logit_bias`` (its ids are this daemon's vocabulary),
``grammar`` and ``json_schema`` (each server spells constrained output its own way).
"""

from __future__ import annotations

from typing import Any

from localspec.server.requests import RANDOM_SEED, TaskParams

UNBOUNDED_MAX_TOKENS = 256  # n_predict -1 ("until a stop rule"): OpenAI servers need a number


def sampling_fields(params: TaskParams) -> dict[str, Any]:
    s = params.request.sampling
    chain = set(s.samplers)
    out: dict[str, Any] = {
        "temperature": s.temperature if "temperature" in chain else 1.0,
        "top_p": s.top_p if "top_p" in chain else 1.0,
        "top_k": s.top_k if "top_k" in chain and s.top_k > 0 else -1,
        "min_p": s.min_p if "min_p" in chain else 0.0,
    }
    if "penalties" in chain:  # only what differs from no penalty, as servers differ in range
        if s.presence_penalty:
            out["presence_penalty"] = s.presence_penalty
        if s.frequency_penalty:
            out["frequency_penalty"] = s.frequency_penalty
        if s.repeat_penalty != 1.0:
            out["repetition_penalty"] = s.repeat_penalty
    if s.ignore_eos:
        out["ignore_eos"] = True
    if s.seed != RANDOM_SEED:
        out["seed"] = s.seed
    return out


def max_tokens(n_predict: int) -> int:
    """``n_predict`` as max_tokens: 0 (a cache warm-up) asks for one token, which is thrown
    away (the upstream evaluates the prompt, which is all a warm-up wants)."""
    if n_predict < 0:
        return UNBOUNDED_MAX_TOKENS
    return max(1, n_predict)


def completion_body(
    *, prompt: str, params: TaskParams, model: str | None, end: tuple[str, ...]
) -> dict[str, Any]:
    """The upstream request: the raw prompt, streamed, ``n`` completions, the end texts as
    stop strings (with special tokens rendered, so vLLM and SGLang can match them). The
    editor's own stop strings, ``n_indent`` and ``t_max_predict_ms`` are applied here, on
    the stream, so the answer says which rule stopped it."""
    body: dict[str, Any] = {
        "prompt": prompt,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": max_tokens(params.request.n_predict),
        "n": params.n_cmpl,
        "echo": False,
        "skip_special_tokens": False,
        **sampling_fields(params),
    }
    if end:
        body["stop"] = list(end)
    if model:
        body["model"] = model
    return body
