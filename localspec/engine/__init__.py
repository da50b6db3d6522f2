"""localspec's engine: the only code that touches llama-cpp-python's low-level API."""

from localspec.engine.api import ServedEngine
from localspec.engine.engine import Engine
from localspec.engine.errors import (
    DecodeError,
    EngineError,
    ModelLoadError,
    OutOfMemoryError,
    PairMismatchError,
    PromptTooLongError,
)
from localspec.engine.slot import Task
from localspec.engine.types import (
    Cancel,
    DraftStats,
    EngineSettings,
    GenerationRequest,
    GenerationResult,
    IndexedTokenCallback,
    ModelSettings,
    SamplingParams,
    SpecSettings,
    TokenCallback,
    TokenEvent,
)
from localspec.engine.vocab import FimTokens

__all__ = [
    "Cancel",
    "DecodeError",
    "DraftStats",
    "Engine",
    "EngineError",
    "EngineSettings",
    "FimTokens",
    "GenerationRequest",
    "GenerationResult",
    "IndexedTokenCallback",
    "ModelLoadError",
    "ModelSettings",
    "OutOfMemoryError",
    "PairMismatchError",
    "PromptTooLongError",
    "SamplingParams",
    "ServedEngine",
    "SpecSettings",
    "Task",
    "TokenCallback",
    "TokenEvent",
]
