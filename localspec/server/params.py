"""Turn a validated request body into the engine's parameters, once, with llama-server's rules.

Soft limits clamp (top_k, top_p, min_p, temperature), hard limits were already rejected by the
schema, sampler names are normalised to llama.cpp's canonical names, and a seed of -1 means
"random" as in llama.cpp.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from typing import Any

from localspec.engine.sampling import UnknownSampler, canonical_samplers
from localspec.engine.types import GenerationRequest, PromptLayout, SamplingParams
from localspec.server.errors import InvalidRequest
from localspec.server.schemas import GenerationFields

RANDOM_SEED = 0xFFFFFFFF  # llama.cpp's LLAMA_DEFAULT_SEED


def sampler_chain(samplers: list[str] | str) -> tuple[str, ...]:
    """llama.cpp's names (any spelling it accepts), or a string of one-letter codes, as the
    engine's canonical names (one table: engine/sampling.py).

    llama-server skips unknown names with a warning in its own log; a client that misspells
    a sampler would never learn its chain changed, so an unknown name is a 400 here.
    """
    try:
        return canonical_samplers(samplers)
    except UnknownSampler as exc:
        raise InvalidRequest(str(exc).replace(":", " in 'samplers':", 1)) from None


def _clamp(value: float, low: float, high: float) -> float:
    return max(low, min(high, value))


def sampling_params(body: GenerationFields, default: SamplingParams) -> SamplingParams:
    top_k = default.top_k if body.top_k is None else max(0, body.top_k)
    top_p = default.top_p if body.top_p is None else _clamp(body.top_p, 0.0, 1.0)
    min_p = default.min_p if body.min_p is None else _clamp(body.min_p, 0.0, 1.0)
    temp = default.temperature if body.temperature is None else max(0.0, body.temperature)
    chain = default.samplers if body.samplers is None else sampler_chain(body.samplers)
    seed = default.seed if body.seed is None else body.seed & 0xFFFFFFFF
    return SamplingParams(
        samplers=chain, top_k=top_k, top_p=top_p, min_p=min_p, temperature=temp, seed=seed
    )


def stop_strings(stop: list[str] | str | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,) if stop else ()
    return tuple(s for s in stop if s)


@dataclass(frozen=True)
class TaskParams:
    """Everything a completion request asks for, parsed once; the prompt comes later."""

    request: GenerationRequest  # slot and prompt are filled in by the worker
    n_cmpl: int = 1
    id_slot: int = -1
    n_keep: int = 0  # prompt tokens kept when a too-long prompt is truncated; -1: all
    stream: bool = False
    response_fields: tuple[str, ...] = ()
    settings_json: dict[str, Any] = field(default_factory=dict)

    def seeds(self) -> list[int]:
        """Distinct seeds for n_cmpl > 1: the asked seed counts up, a random one is drawn each."""
        seed = self.request.sampling.seed
        if seed == RANDOM_SEED:
            return [random.getrandbits(32) % RANDOM_SEED for _ in range(self.n_cmpl)]
        return [(seed + i) % RANDOM_SEED for i in range(self.n_cmpl)]

    def request_for(
        self, index: int, seeds: list[int], slot: int, prompt: PromptLayout
    ) -> GenerationRequest:
        sampling = self.request.sampling
        if self.n_cmpl > 1:
            sampling = replace(sampling, seed=seeds[index])
        return replace(
            self.request,
            slot=slot,
            prompt=prompt.tokens,
            sampling=sampling,
            blocks=prompt.blocks,
            block_sink=prompt.sink,
        )


def task_params(
    body: GenerationFields,
    *,
    n_ctx: int,
    n_cmpl_max: int,
    default_sampling: SamplingParams | None = None,
    n_predict_default: int = -1,
) -> TaskParams:
    if body.n_cmpl is not None and body.n_cmpl > n_cmpl_max:
        raise InvalidRequest(
            f"Field 'n_cmpl': Value must be between 1 <= value <= {n_cmpl_max}, "
            f"but got {body.n_cmpl}"
        )
    if body.post_sampling_probs and body.n_probs:
        raise InvalidRequest(
            "post_sampling_probs is not supported: n_probs reports the model's probabilities "
            "before sampling"
        )
    sampling = sampling_params(body, default_sampling or SamplingParams())
    n_predict = n_predict_default if body.n_predict is None else body.n_predict
    stop = stop_strings(body.stop)
    t_max_predict_ms = max(0, body.t_max_predict_ms or 0)
    request = GenerationRequest(
        slot=-1,
        prompt=[],
        n_predict=n_predict,
        sampling=sampling,
        stop=stop,
        n_indent=body.n_indent or 0,
        t_max_predict_ms=t_max_predict_ms,
        cache_prompt=True if body.cache_prompt is None else body.cache_prompt,
        spec_n_max=body.speculative_n_max,
        spec_n_min=body.speculative_n_min,
        spec_p_min=body.speculative_p_min,
        n_probs=body.n_probs or 0,
    )
    stream = bool(body.stream)
    settings_json: dict[str, Any] = {
        "n_ctx": n_ctx,
        "seed": sampling.seed,
        "temperature": sampling.temperature,
        "top_k": sampling.top_k,
        "top_p": sampling.top_p,
        "min_p": sampling.min_p,
        "samplers": list(sampling.samplers),
        "stop": list(stop),
        "max_tokens": n_predict,
        "n_predict": n_predict,
        "n_keep": body.n_keep or 0,
        "n_indent": request.n_indent,
        "t_max_predict_ms": t_max_predict_ms,
        "cache_prompt": request.cache_prompt,
        "stream": stream,
        "n_cmpl": body.n_cmpl or 1,
        "n_probs": request.n_probs,
        "speculative.n_max": request.spec_n_max,
        "speculative.n_min": request.spec_n_min,
        "speculative.p_min": request.spec_p_min,
    }
    return TaskParams(
        request=request,
        n_cmpl=body.n_cmpl or 1,
        id_slot=-1 if body.id_slot is None else body.id_slot,
        n_keep=body.n_keep or 0,
        stream=stream,
        response_fields=tuple(body.response_fields or ()),
        settings_json=settings_json,
    )
