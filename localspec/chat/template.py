"""A model's own chat template (GGUF ``tokenizer.chat_template``), rendered as Hugging Face
renders it: jinja2 with ``trim_blocks``/``lstrip_blocks``, ``loopcontrols``, a ``tojson`` that
writes plain JSON, ``raise_exception`` and ``strftime_now``, in jinja2's immutable sandbox (the
template comes with a downloaded file: it may compute, never reach Python's internals).
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_TEMPLATE_CHARS = 1 << 20  # a GGUF's template is a few KB; refuse anything absurd


class TemplateError(ValueError):
    """The template failed for these messages (its own ``raise_exception``, or a template
    bug): the request's fault or the model file's, never the daemon's."""


def _tojson(
    value: Any,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
    ensure_ascii: bool = False,
) -> str:
    """Hugging Face's ``tojson`` (jinja2's own HTML-escapes ``<``, ``>``, ``&`` and ``'``,
    which would put ``\\u003c`` into the prompt where the model was trained on ``<``)."""
    return json.dumps(
        value, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=ensure_ascii
    )


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _environment() -> jinja2.Environment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[loopcontrols],
        undefined=jinja2.Undefined,
        autoescape=False,
        keep_trailing_newline=False,
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _environment()


@dataclass(frozen=True)
class TemplateCaps:
    """What a template does with the request's parts (read from its source, as llama.cpp's
    ``chat_template_caps``): clients use it to decide what to send."""

    supports_tools: bool
    supports_tool_calls: bool
    supports_system_role: bool

    def to_json(self) -> dict[str, bool]:
        return {
            "supports_tools": self.supports_tools,
            "supports_tool_calls": self.supports_tool_calls,
            "supports_system_role": self.supports_system_role,
        }


@dataclass
class ChatTemplate:
    """One model's chat template, compiled once; ``render`` turns messages into prompt text."""

    source: str
    bos_token: str = ""
    eos_token: str = ""
    add_bos: bool = False  # the tokenizer adds BOS itself: a leading bos_token is dropped
    _compiled: jinja2.Template | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if len(self.source) > MAX_TEMPLATE_CHARS:
            raise TemplateError(f"chat template of {len(self.source)} characters: too long")
        try:
            self._compiled = _ENV.from_string(self.source)
        except jinja2.TemplateError as exc:
            raise TemplateError(f"the model's chat template does not compile: {exc}") from None

    @property
    def caps(self) -> TemplateCaps:
        src = self.source
        return TemplateCaps(
            supports_tools="tools" in src,
            supports_tool_calls="tool_calls" in src,
            # templates that refuse a system message say so with raise_exception
            supports_system_role="system" in src,
        )

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text. ``extra``: ``chat_template_kwargs`` (cannot replace ``messages``)."""
        assert self._compiled is not None
        variables: dict[str, Any] = dict(extra or {})
        variables.update(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )
        if tools:
            variables["tools"] = list(tools)
        try:
            text = self._compiled.render(**variables)
        except TemplateError:
            raise
        except jinja2.exceptions.SecurityError as exc:
            raise TemplateError(f"the chat template tried something unsafe: {exc}") from None
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError) as exc:
            raise TemplateError(
                f"the model's chat template failed on these messages: {type(exc).__name__}: {exc}"
            ) from None
        except RecursionError:
            raise TemplateError("the model's chat template recursed too deeply") from None
        if self.add_bos and self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token) :]  # the tokenizer adds it (llama.cpp does the same)
        return text
