"""Engine errors: each message names the file or the mismatch so the user knows what to fix."""

from __future__ import annotations


class EngineError(RuntimeError):
    """Base class: anything the engine refuses or fails to do."""


class ModelLoadError(EngineError):
    """A GGUF file is missing, truncated, not GGUF, or llama.cpp refused it."""


class OutOfMemoryError(ModelLoadError):
    """llama.cpp could not allocate a buffer on a device (or went over the device memory cap):
    a smaller layout may load (``up`` re-plans)."""


class PairMismatchError(EngineError):
    """The draft model cannot speculate for the target (vocabularies differ)."""


class DecodeError(EngineError):
    """llama_decode failed (out of KV cells, invalid batch)."""


class PromptTooLongError(EngineError, ValueError):
    """The prompt does not fit the slot's context (the caller should have truncated it)."""
