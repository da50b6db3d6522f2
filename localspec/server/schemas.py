"""Request bodies as pydantic models: the API schema (OpenAPI) and its validation, in one place.

Field names, aliases and defaults follow llama-server's ``/completion`` schema. Unknown fields
are accepted and ignored (clients send ``time``, ``lora``, ``t_max_prompt_ms``, ...), and an
explicit ``null`` means "the server default", as in llama-server.
"""

from __future__ import annotations

from typing import Any

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator

# A prompt as llama-server takes it: text, or token ids mixed with text pieces.
PromptPieces = list[int | str]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class ExtraChunk(_Body):
    """One piece of extra context (llama-vscode's ring buffer): a file or a snippet of one."""

    text: str
    filename: str = "tmp"


class GenerationFields(_Body):
    """The fields every completion endpoint shares (sampling, stopping, caching, output)."""

    n_predict: int | None = Field(
        None,
        ge=-1,
        validation_alias=AliasChoices("n_predict", "max_completion_tokens", "max_tokens"),
        description="Tokens to generate; -1 until a stop rule; 0 only fills the cache.",
    )
    n_cmpl: int | None = Field(
        None,
        ge=1,
        validation_alias=AliasChoices("n_cmpl", "n"),
        description="Number of completions of the same prompt; more than 1 answers an array.",
    )
    id_slot: int | None = Field(None, ge=-1, description="Pin a slot; -1 picks the best one.")
    stream: bool | None = None
    cache_prompt: bool | None = None
    n_indent: int | None = Field(None, ge=0, description="Minimum indentation of new lines.")
    t_max_predict_ms: int | None = Field(
        None, ge=-1, description="After a newline, stop once generation ran this long."
    )
    t_max_prompt_ms: int | None = Field(None, description="Accepted and ignored (as llama-server).")
    stop: list[str] | str | None = None
    response_fields: list[str] | None = Field(
        None, description="Only these paths, flattened (e.g. timings/prompt_n)."
    )
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    temperature: float | None = None
    samplers: list[str] | str | None = None
    seed: int | None = None
    speculative_n_max: int | None = Field(None, ge=0, alias="speculative.n_max")
    speculative_n_min: int | None = Field(None, ge=0, alias="speculative.n_min")
    speculative_p_min: float | None = Field(None, ge=0.0, le=1.0, alias="speculative.p_min")
    model: Any = Field(None, description="Accepted and ignored: one model pair is served.")
    lora: Any = Field(None, description="Accepted and ignored.")


class InfillRequest(GenerationFields):
    """``POST /infill``: llama-vscode's and llama.vim's fill-in-the-middle request."""

    input_prefix: str | PromptPieces
    input_suffix: str | PromptPieces
    input_extra: list[ExtraChunk] | None = None
    prompt: str | None = Field(None, description="Text typed on the cursor line before the cursor.")


class CompletionRequest(GenerationFields):
    """``POST /completion``: llama-server's native API."""

    prompt: str | PromptPieces

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, value: str | PromptPieces) -> str | PromptPieces:
        if isinstance(value, list) and not value:
            raise ValueError("prompt is an empty list")
        return value


class OpenAICompletionRequest(GenerationFields):
    """``POST /v1/completions``; a ``suffix`` turns it into fill-in-the-middle."""

    prompt: str | PromptPieces
    suffix: str | None = None
    echo: bool | None = None
    logprobs: Any = None


class TokenizeRequest(_Body):
    content: str | PromptPieces = ""
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(_Body):
    tokens: list[int] = Field(default_factory=list)
