"""What chat needs of a loaded model: its chat template, the text of its BOS/EOS tokens and the
tool-call format its template teaches. Read once per engine, on the thread that loaded it,
before the engine serves (the template is a string in the GGUF header; the token texts come
from the vocabulary, which only one thread at a time may touch)."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from localspec.chat import ChatTemplate, TemplateError, ToolCallFormat, tool_call_format
from localspec.engine.api import ServedEngine
from localspec.planning.gguf_header import read_gguf_header

log = logging.getLogger("localspec.server")

TEMPLATE_KEY = "tokenizer.chat_template"


@dataclass(frozen=True)
class ChatModel:
    """A served model as chat sees it; ``template`` None: the GGUF carries no chat template
    (a base or FIM-only model), so this model answers no chat."""

    template: ChatTemplate | None
    tool_format: ToolCallFormat | None = None
    problem: str = ""  # why the template is unusable, when the GGUF has one that is broken

    @property
    def serves_chat(self) -> bool:
        return self.template is not None


NO_CHAT = ChatModel(None)
_known: weakref.WeakKeyDictionary[ServedEngine, ChatModel] = weakref.WeakKeyDictionary()


def _token_text(vocab: Any, token: int | None) -> str:
    if token is None or token < 0:
        return ""
    return vocab.piece(token, special=True).decode("utf-8", "replace")


def read_chat_model(engine: ServedEngine) -> ChatModel:
    """The engine's chat side, from its GGUF header and vocabulary (worker thread)."""
    path = engine.model_path
    source = read_gguf_header(path).metadata.get(TEMPLATE_KEY)
    if not isinstance(source, str) or not source.strip():
        return NO_CHAT
    vocab = engine.vocab
    try:
        template = ChatTemplate(
            source,
            bos_token=_token_text(vocab, vocab.bos),
            eos_token=_token_text(vocab, vocab.eos),
            add_bos=bool(vocab.add_bos),
        )
    except TemplateError as exc:
        log.warning("%s: chat disabled: %s", path, exc)
        return ChatModel(None, problem=str(exc))
    return ChatModel(template, tool_call_format(source))


def chat_model(engine: ServedEngine) -> ChatModel:
    """The engine's chat side (read at load; ``NO_CHAT`` for an engine nobody read)."""
    try:
        return _known.get(engine, NO_CHAT)
    except TypeError:  # an engine that cannot be weakly referenced (a test's stand-in)
        return NO_CHAT


def reading_chat_model(load: Callable[[], ServedEngine]) -> Callable[[], ServedEngine]:
    """``load`` that also reads the loaded engine's chat side (on the thread that loads it,
    before the daemon reports ready)."""

    def load_and_read() -> ServedEngine:
        engine = load()
        try:
            _known[engine] = read_chat_model(engine)
        except Exception as exc:  # a model without a readable header still completes
            log.warning("could not read the chat template: %s: %s", type(exc).__name__, exc)
        return engine

    return load_and_read
