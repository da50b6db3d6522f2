"""What a request asks for, parsed once: its body, then the engine's parameters.

The bodies are pydantic models: the API schema (OpenAPI) and its validation, in one place.
Field names, aliases and defaults follow llama-server's ``/completion`` schema. Unknown fields
are accepted and ignored (clients send ``time``, ``lora``, ...), and an
explicit ``null`` means "the server default", as in llama-server. Hard limits are rejected
here with a 400.

A generation body then becomes a ``TaskParams`` with llama-server's rules: soft limits clamp
(top_k, top_p, min_p, temperature, xtc, mirostat), sampler names are normalised to llama.cpp's
canonical names, a seed of -1 means "random" as in llama.cpp, text logit biases are tokenized,
and a grammar (or a JSON schema, converted) is parsed once by llama.cpp's parser: a bad one is
a 400 here, never a failure on the engine's thread.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, TypeVar

from llama_cpp.llama_grammar import json_schema_to_gbnf
from pydantic import (
    AfterValidator,
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
)

from localspec.engine.sampling import (
    GrammarError,
    UnknownSampler,
    canonical_samplers,
    check_grammar,
)
from localspec.engine.types import GenerationRequest, PromptLayout, SamplingParams
from localspec.engine.vocab import Vocab
from localspec.server.errors import InvalidRequest

INT32_MAX = 2**31 - 1
MAX_EXTRA_CHUNKS = 1024  # llama-vscode's ring buffer holds 16 by default
MAX_STOP_STRINGS = 256
SPEC_N_MAX_LIMIT = 256  # drafts longer than this never pay; bounds the policy's work
N_PROBS_LIMIT = 256  # candidates reported per token: bounds the answer's size
FLOAT32_MAX = 3.4028234663852886e38  # llama.cpp's penalties take a float: 1/penalty must fit


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
        None,
        description="/infill with cache.jump_policy budget: answer within this many ms of "
        "prompt evaluation from the nearest lines (llama-server ignores it).",
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
    top_n_sigma: float | None = Field(None, description="< 0: off.")
    xtc_probability: float | None = Field(None, description="Clamped to 0..1; 0: off.")
    xtc_threshold: float | None = Field(None, description="Clamped to 0..1; > 0.5: off.")
    typical_p: float | None = Field(None, description="1: off.")
    dynatemp_range: float | None = Field(None, description="0: off.")
    dynatemp_exponent: float | None = None
    repeat_last_n: int | None = Field(
        None, ge=-1, le=INT32_MAX, description="Tokens the penalties see; -1: the context."
    )
    repeat_penalty: float | None = Field(None, description="> 0; 1: off.")
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    dry_multiplier: float | None = Field(None, description="0: DRY off.")
    dry_base: float | None = Field(None, description="< 1 means the default, 1.75.")
    dry_allowed_length: int | None = Field(None, ge=0, le=INT32_MAX)
    dry_penalty_last_n: int | None = Field(
        None, ge=-1, le=INT32_MAX, description="Tokens DRY scans; -1: the context."
    )
    dry_sequence_breakers: list[Text] | None = None
    mirostat: Int32 | None = Field(None, description="0 off, 1 Mirostat, 2 Mirostat 2.0.")
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    min_keep: int | None = Field(None, ge=0, le=INT32_MAX)
    logit_bias: Any = Field(
        None,
        description='[[token, bias], ...] or {"token": bias}; a token may be text (each of '
        "its tokens); a bias of false bans.",
    )
    ignore_eos: bool | None = Field(None, description="Ban the end-of-generation tokens.")
    grammar: Text | None = Field(None, description="A GBNF grammar the answer must match.")
    json_schema: Any = Field(
        None, description="A JSON schema the answer must match ({}: any object)."
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
    language: Text | None = Field(
        None, description="The code's language (e.g. python; VS Code ids too), for statistics."
    )
    filename: Text | None = Field(
        None, description="The edited file's name: its language, when no language is given."
    )


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
        None, description='{"type": "text" | "json_object" | "json_schema", ...}.'
    )
    logprobs: bool | None = Field(
        None, description="Report each token's log-probability (before sampling)."
    )
    top_logprobs: int | None = Field(None, ge=0, le=N_PROBS_LIMIT)


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


def _field(name: str, message: str) -> InvalidRequest:
    """A 400 worded as llama-server words a field's error."""
    return InvalidRequest(f"Field '{name}': {message}")


_TOKEN_ID = re.compile(r"\s*[+-]?\d+")


def logit_biases(value: Any, vocab: Vocab | None) -> tuple[tuple[int, float], ...]:
    """llama-server's ``logit_bias`` forms as (token, bias) pairs: ``[[token, bias], ...]`` or
    ``{"token": bias}``, a token given as text meaning each of its tokens, a bias of ``false``
    meaning a ban (-inf). llama-server skips an entry it cannot read; a client would then never
    learn its bias is not applied, so here that is a 400 naming the entry."""
    n_vocab = vocab.n_vocab if vocab is not None else INT32_MAX

    def bias_of(v: Any, where: str) -> float:
        if v is False:
            return -math.inf
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            return float(v)
        raise _field("logit_bias", f"{where}: the bias must be a number or false, got {v!r}")

    def tokens_of(tok: Any, where: str) -> list[int]:
        if isinstance(tok, int) and not isinstance(tok, bool):
            if not 0 <= tok < n_vocab:
                raise _field("logit_bias", f"{where}: token {tok} is not in the vocabulary")
            return [tok]
        if isinstance(tok, str):  # without a vocabulary (an upstream's request): not applied
            return vocab.tokenize(tok) if vocab is not None else []
        raise _field("logit_bias", f"{where}: a token must be an id or a text, got {tok!r}")

    out: list[tuple[int, float]] = []
    if isinstance(value, list):
        for i, el in enumerate(value):
            if not isinstance(el, list) or len(el) != 2:
                raise _field("logit_bias", f"entry {i} must be a [token, bias] pair, got {el!r}")
            bias = bias_of(el[1], f"entry {i}")
            out += [(t, bias) for t in tokens_of(el[0], f"entry {i}")]
    elif isinstance(value, dict):
        for key, v in value.items():
            bias = bias_of(v, f"key {key!r}")
            tok: int | str = int(key) if _TOKEN_ID.fullmatch(key) else key
            out += [(t, bias) for t in tokens_of(tok, f"key {key!r}")]
    else:
        raise _field(
            "logit_bias", "must be an array of [token, bias] pairs or an object {token: bias}"
        )
    return tuple(out)


def schema_grammar(schema: Any) -> str:
    """A JSON schema as GBNF, by llama-cpp-python's converter (llama.cpp's, in Python); an
    empty schema means any object, as in llama-server."""
    if isinstance(schema, dict) and not schema:
        schema = {"type": "object"}
    if not isinstance(schema, dict):
        raise _field("json_schema", f'"json_schema": must be an object, got {schema!r}')
    try:
        return json_schema_to_gbnf(json.dumps(schema))
    except Exception as exc:  # the converter's asserts, KeyErrors, ...: the schema is bad
        why = str(exc) or type(exc).__name__
        raise _field("json_schema", f'"json_schema": {why}') from None


def body_grammar(body: GenerationFields, vocab: Vocab | None) -> str:
    """The body's grammar (GBNF text, or "" for none), parsed once by llama.cpp's parser: a
    ``json_schema`` is converted unless a ``grammar`` is given too (llama-server's rule)."""
    if body.json_schema is not None and body.grammar is None:
        grammar, name = schema_grammar(body.json_schema), "json_schema"
    else:
        grammar, name = body.grammar or "", "grammar"
    if grammar and vocab is not None:
        try:
            check_grammar(vocab.handle, grammar)
        except GrammarError as exc:
            raise _field(name, str(exc)) from None
    return grammar


def sampling_params(
    body: GenerationFields,
    default: SamplingParams,
    *,
    n_ctx: int = 0,
    vocab: Vocab | None = None,
) -> SamplingParams:
    """The body's sampling fields with llama-server's rules: soft limits clamp, hard limits
    are 400s, ``-1`` windows mean the context (``n_ctx``); ``vocab`` tokenizes text biases,
    knows the end tokens ``ignore_eos`` bans and checks the grammar."""
    d = default

    def pick(value: Any, fallback: Any) -> Any:
        return fallback if value is None else value

    top_k = d.top_k if body.top_k is None else max(0, body.top_k)
    top_p = d.top_p if body.top_p is None else _clamp(body.top_p, 0.0, 1.0)
    min_p = d.min_p if body.min_p is None else _clamp(body.min_p, 0.0, 1.0)
    temp = d.temperature if body.temperature is None else max(0.0, body.temperature)
    chain = d.samplers if body.samplers is None else sampler_chain(body.samplers)
    seed = d.seed if body.seed is None else body.seed & 0xFFFFFFFF
    repeat_penalty = pick(body.repeat_penalty, d.repeat_penalty)
    if repeat_penalty <= 0.0 or 1.0 / repeat_penalty > FLOAT32_MAX:
        raise _field("repeat_penalty", "penalty_repeat must be finite and greater than 0")
    breakers = pick(body.dry_sequence_breakers, d.dry_sequence_breakers)
    if not breakers:
        raise _field(
            "dry_sequence_breakers",
            "Error: dry_sequence_breakers must be a non-empty array of strings",
        )
    dry_base = pick(body.dry_base, d.dry_base)
    ignore_eos = pick(body.ignore_eos, d.ignore_eos)
    bias = d.logit_bias if body.logit_bias is None else logit_biases(body.logit_bias, vocab)
    if ignore_eos and vocab is not None:
        bias += tuple((t, -math.inf) for t in sorted(vocab.eog))

    def window(n: int | None, fallback: int) -> int:
        n = fallback if n is None else n
        return n_ctx if n == -1 and n_ctx > 0 else n

    return SamplingParams(
        samplers=chain,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        temperature=temp,
        seed=seed,
        top_n_sigma=pick(body.top_n_sigma, d.top_n_sigma),
        typ_p=pick(body.typical_p, d.typ_p),
        xtc_probability=_clamp(pick(body.xtc_probability, d.xtc_probability), 0.0, 1.0),
        xtc_threshold=_clamp(pick(body.xtc_threshold, d.xtc_threshold), 0.0, 1.0),
        dynatemp_range=pick(body.dynatemp_range, d.dynatemp_range),
        dynatemp_exponent=pick(body.dynatemp_exponent, d.dynatemp_exponent),
        repeat_last_n=window(body.repeat_last_n, d.repeat_last_n),
        repeat_penalty=repeat_penalty,
        frequency_penalty=pick(body.frequency_penalty, d.frequency_penalty),
        presence_penalty=pick(body.presence_penalty, d.presence_penalty),
        dry_multiplier=pick(body.dry_multiplier, d.dry_multiplier),
        dry_base=d.dry_base if dry_base < 1.0 else dry_base,
        dry_allowed_length=pick(body.dry_allowed_length, d.dry_allowed_length),
        dry_penalty_last_n=window(body.dry_penalty_last_n, d.dry_penalty_last_n),
        dry_sequence_breakers=tuple(breakers),
        mirostat=int(_clamp(pick(body.mirostat, d.mirostat), 0, 2)),
        mirostat_tau=pick(body.mirostat_tau, d.mirostat_tau),
        mirostat_eta=pick(body.mirostat_eta, d.mirostat_eta),
        min_keep=pick(body.min_keep, d.min_keep),
        logit_bias=bias,
        ignore_eos=ignore_eos,
        grammar=body_grammar(body, vocab) or d.grammar,
    )


def sampling_json(s: SamplingParams) -> dict[str, Any]:
    """The sampling part of llama-server's ``generation_settings`` (task_params::to_json)."""
    return {
        "seed": s.seed,
        "temperature": s.temperature,
        "dynatemp_range": s.dynatemp_range,
        "dynatemp_exponent": s.dynatemp_exponent,
        "top_k": s.top_k,
        "top_p": s.top_p,
        "min_p": s.min_p,
        "top_n_sigma": s.top_n_sigma,
        "xtc_probability": s.xtc_probability,
        "xtc_threshold": s.xtc_threshold,
        "typical_p": s.typ_p,
        "repeat_last_n": s.repeat_last_n,
        "repeat_penalty": s.repeat_penalty,
        "presence_penalty": s.presence_penalty,
        "frequency_penalty": s.frequency_penalty,
        "dry_multiplier": s.dry_multiplier,
        "dry_base": s.dry_base,
        "dry_allowed_length": s.dry_allowed_length,
        "dry_penalty_last_n": s.dry_penalty_last_n,
        "dry_sequence_breakers": list(s.dry_sequence_breakers),
        "mirostat": s.mirostat,
        "mirostat_tau": s.mirostat_tau,
        "mirostat_eta": s.mirostat_eta,
        "ignore_eos": s.ignore_eos,
        # a ban (-inf) is null, as llama-server's JSON writes a non-finite float
        "logit_bias": [
            {"bias": b if math.isfinite(b) else None, "token": t} for t, b in s.logit_bias
        ],
        "min_keep": s.min_keep,
        "grammar": s.grammar,
        "samplers": list(s.samplers),
    }


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
    t_max_prompt_ms: int = 0  # the prompt evaluation's budget (server/jump.py); <= 0: none

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
            block_sink=prompt.block_sink,
        )


def task_params(
    body: GenerationFields,
    *,
    n_ctx: int,
    n_cmpl_max: int,
    default_sampling: SamplingParams | None = None,
    n_predict_default: int = -1,
    vocab: Vocab | None = None,
) -> TaskParams:
    """``vocab``: the served model's (text logit biases, ``ignore_eos``, the grammar check)."""
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
    sampling = sampling_params(body, default_sampling or SamplingParams(), n_ctx=n_ctx, vocab=vocab)
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
        **sampling_json(sampling),
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
        t_max_prompt_ms=body.t_max_prompt_ms or 0,
    )
