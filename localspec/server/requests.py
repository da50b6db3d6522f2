"""What a request asks for, parsed once: its body, then the engine's parameters.

The bodies are pydantic models: the API schema (OpenAPI) and its validation, in one place.
Field names, aliases and defaults follow llama-server's ``/completion`` schema. Unknown fields
are accepted and ignored (clients send ``time``, ``lora``, ``t_max_prompt_ms``, ...), and an
explicit ``null`` means "the server default", as in llama-server. Hard limits are rejected
here with a 400.

A generation body then becomes a ``TaskParams`` with llama-server's rules: soft limits clamp
(top_k, top_p, min_p, temperature), sampler names are normalised to llama.cpp's canonical
names, and a seed of -1 means "random" as in llama.cpp.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, TypeVar

from pydantic import (
    AfterValidator,
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
)

from localspec.engine.sampling import UnknownSampler, canonical_samplers
from localspec.engine.types import GenerationRequest, PromptLayout, SamplingParams
from localspec.server.errors import InvalidRequest

INT32_MAX = 2**31 - 1
MAX_EXTRA_CHUNKS = 1024  # llama-vscode's ring buffer holds 16 by default
MAX_STOP_STRINGS = 256
SPEC_N_MAX_LIMIT = 256  # drafts longer than this never pay; bounds the policy's work
N_PROBS_LIMIT = 256  # candidates reported per token: bounds the answer's size


def _valid_unicode(text: str) -> str:
    """JSON may escape lone surrogates (``"\\ud800"``); they are not text and cannot be
    tokenized, so they are refused here with a clear 400 instead of failing in the engine."""
    if text.isascii():  # O(1) in CPython (a flag of the string): most code, no encoding
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"invalid Unicode: a lone surrogate at character {exc.start} (not UTF-8 text)"
        ) from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]
Int32 = Annotated[int, Field(ge=-(2**31), le=INT32_MAX)]
# A prompt as llama-server takes it: text, or token ids mixed with text pieces.
PromptPieces = list[int | Text]


class _Body(BaseModel):
    # NaN/Infinity are not JSON, but Python's parser accepts them: refuse them in every number
    model_config = ConfigDict(extra="ignore", populate_by_name=True, allow_inf_nan=False)


class ExtraChunk(_Body):
    """One piece of extra context (llama-vscode's ring buffer): a file or a snippet of one."""

    text: Text
    filename: Text = "tmp"


class GenerationFields(_Body):
    """The fields every completion endpoint shares (sampling, stopping, caching, output)."""

    n_predict: int | None = Field(
        None,
        ge=-1,
        le=INT32_MAX,
        validation_alias=AliasChoices("n_predict", "max_completion_tokens", "max_tokens"),
        description="Tokens to generate; -1 until a stop rule; 0 only fills the cache.",
    )
    n_cmpl: int | None = Field(
        None,
        ge=1,
        le=INT32_MAX,
        validation_alias=AliasChoices("n_cmpl", "n"),
        description="Number of completions of the same prompt; more than 1 answers an array.",
    )
    id_slot: int | None = Field(
        None, ge=-1, le=INT32_MAX, description="Pin a slot; -1 picks the best one."
    )
    stream: bool | None = None
    cache_prompt: bool | None = None
    n_indent: int | None = Field(
        None, ge=0, le=INT32_MAX, description="Minimum indentation of new lines."
    )
    t_max_predict_ms: int | None = Field(
        None,
        ge=-1,
        le=INT32_MAX,
        description="After a newline, stop once generation ran this long.",
    )
    t_max_prompt_ms: Int32 | None = Field(
        None, description="Accepted and ignored (as llama-server)."
    )
    stop: list[Text] | Text | None = Field(None, max_length=MAX_STOP_STRINGS)
    response_fields: list[str] | None = Field(
        None, description="Only these paths, flattened (e.g. timings/prompt_n)."
    )
    top_k: Int32 | None = None
    top_p: float | None = None
    min_p: float | None = None
    temperature: float | None = None
    samplers: list[str] | str | None = Field(
        None, description="Sampler names, or one letter each (k, p, m, t, ...); unknown: 400."
    )
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1, description="-1: random.")
    n_keep: int | None = Field(
        None, ge=-1, le=INT32_MAX, description="Prompt tokens kept when truncating; -1: all."
    )
    speculative_n_max: int | None = Field(
        None, ge=0, le=SPEC_N_MAX_LIMIT, alias="speculative.n_max"
    )
    speculative_n_min: int | None = Field(
        None, ge=0, le=SPEC_N_MAX_LIMIT, alias="speculative.n_min"
    )
    speculative_p_min: float | None = Field(None, ge=0.0, le=1.0, alias="speculative.p_min")
    n_probs: int | None = Field(
        None,
        ge=0,
        le=N_PROBS_LIMIT,
        description="Report each generated token's probability and the n likeliest tokens "
        "(before sampling) as completion_probabilities (/completion, /infill).",
    )
    post_sampling_probs: bool | None = Field(
        None, description="Not supported: n_probs reports probabilities before sampling."
    )
    model: Any = Field(None, description="Accepted and ignored: one model pair is served.")
    lora: Any = Field(None, description="Accepted and ignored.")


class InfillRequest(GenerationFields):
    """``POST /infill``: llama-vscode's and llama.vim's fill-in-the-middle request."""

    input_prefix: Text | PromptPieces
    input_suffix: Text | PromptPieces
    input_extra: list[ExtraChunk] | None = Field(None, max_length=MAX_EXTRA_CHUNKS)
    prompt: Text | None = Field(
        None, description="Text typed on the cursor line before the cursor."
    )

    @property
    def is_ring_warmup(self) -> bool:
        """llama-vscode's and llama.vim's ring-buffer update: only the extra context matters."""
        return (
            self.n_predict == 0
            and not self.input_prefix
            and not self.input_suffix
            and not self.prompt
        )


def one_prompt(value: Text | PromptPieces) -> Text | PromptPieces:
    """A prompt is text, token ids, or a list mixing both; llama-server reads a list of texts
    with no ids as several prompts, each answered on its own, which localspec does not do:
    refused rather than joined into one prompt that answers something else."""
    if isinstance(value, list):
        if not value:
            raise ValueError("prompt is an empty list")
        if len(value) > 1 and not any(isinstance(p, int) for p in value):
            raise ValueError(
                "a list of several prompts is not supported: send one prompt per request "
                "(a list that mixes token ids and text is one prompt)"
            )
    return value


class CompletionRequest(GenerationFields):
    """``POST /completion``: llama-server's native API."""

    prompt: Text | PromptPieces

    _one_prompt = field_validator("prompt")(one_prompt)


class OpenAICompletionRequest(GenerationFields):
    """``POST /v1/completions``; a ``suffix`` turns it into fill-in-the-middle."""

    prompt: Text | PromptPieces

    _one_prompt = field_validator("prompt")(one_prompt)
    suffix: Text | None = None
    echo: bool | None = None
    logprobs: Any = None


class StreamOptions(_Body):
    include_usage: bool = False


class ChatCompletionRequest(GenerationFields):
    """``POST /v1/chat/completions`` (and ``/apply-template``): OpenAI's chat request with
    llama-server's extensions. ``messages`` and ``tools`` are checked by ``localspec.chat``
    with llama-server's error texts, not here."""

    messages: Any = Field(
        None,
        description="OpenAI chat messages: role, content (text or text parts), tool_calls, "
        "tool_call_id. A last assistant message is continued.",
    )
    tools: Any = Field(None, description="OpenAI function tools, handed to the chat template.")
    tool_choice: Any = Field(None, description="auto, none, required, or a named function.")
    parallel_tool_calls: bool | None = None
    stream_options: StreamOptions | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | str | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Extra variables for the chat template (e.g. enable_thinking)."
    )
    response_format: Any = Field(
        None, description='Only {"type": "text"}: no grammar-constrained output.'
    )
    logprobs: bool | None = Field(
        None, description="Report each token's log-probability (before sampling)."
    )
    top_logprobs: int | None = Field(None, ge=0, le=N_PROBS_LIMIT)
    grammar: Any = Field(None, description="Not supported (no grammar sampler): a 400.")
    json_schema: Any = Field(None, description="Not supported (no grammar sampler): a 400.")


class TokenizeRequest(_Body):
    content: Text | PromptPieces = ""
    model: Any = Field(None, description="Which served model's vocabulary (chat or completion).")
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(_Body):
    tokens: list[int] = Field(default_factory=list)
    model: Any = Field(None, description="Which served model's vocabulary (chat or completion).")


# ---------------------------------------------------------------------- parsing

Body = TypeVar("Body", bound=BaseModel)


def validation_message(errors: Iterable[Any], skip: int = 0) -> str:
    """Pydantic's errors as one line: ``field.path: what is wrong; ...`` (``skip`` drops the
    leading location parts, FastAPI's ``body``)."""
    parts = []
    for err in errors:
        loc = ".".join(str(p) for p in err.get("loc", ())[skip:]) or "body"
        parts.append(f"{loc}: {err.get('msg', 'invalid')}")
    return "Invalid request: " + "; ".join(parts)


def parse_body(model: type[Body], raw: bytes) -> Body:
    """The request body as ``model``, validated straight from the raw bytes.

    pydantic's own JSON parser builds the model in one pass (for a 25 KB editor request,
    several times cheaper than ``json.loads`` and then validating the dicts). Any failure takes
    the old path instead, ``json.loads`` then validation, so a refused body gets the very
    error it always got (Python's parser also takes a BOM or UTF-16; its messages are the
    ones the clients and the tests know). Raises InvalidRequest (400).
    """
    try:
        return model.model_validate_json(raw)
    except ValidationError:
        pass
    if not raw:
        raise InvalidRequest("Invalid request: body: Field required")
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"Invalid request: {exc.pos}: JSON decode error") from None
    except (ValueError, RecursionError):  # not UTF-8/16/32 text, or nested too deep
        raise InvalidRequest("There was an error parsing the body") from None
    try:  # as FastAPI validated bodies (its messages for a body that is not an object)
        return model.model_validate(obj, from_attributes=True)
    except ValidationError as exc:
        raise InvalidRequest(validation_message(exc.errors())) from None


# --- the engine's parameters ----------------------------------------------------------------------

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
