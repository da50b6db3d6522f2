"""Engine errors: each message names the file or the mismatch so the user knows what to fix."""

from __future__ import annotations


class EngineError(RuntimeError):
    """Base class: anything the engine refuses or fails to do."""


class ModelLoadError(EngineError):
    """A GGUF file is missing, truncated, not GGUF, or llama.cpp refused it."""


class PairMismatchError(EngineError):
    """The draft model cannot speculate for the target (vocabularies differ)."""


class DecodeError(EngineError):
    """llama_decode failed (out of KV cells, invalid batch)."""


class PromptTooLongError(EngineError, ValueError):
    """The prompt does not fit the slot's context (the caller should have truncated it)."""
