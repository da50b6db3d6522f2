"""The follow pair served with fixed-length drafts, for the speculation tests over HTTP."""

from __future__ import annotations

from pathlib import Path

from localspec.engine.types import EngineSettings, ModelSettings, SpecSettings


def follow_drafting(target: Path, draft: Path, n_max: int) -> EngineSettings:
    """Every step drafts ``n_max`` tokens on the engine's own thread (no pipelined draft,
    whose offers follow its timing), so rejections fall where the follow rule puts them."""

    def model(p: Path) -> ModelSettings:
        return ModelSettings(path=str(p), n_ctx=2048, n_batch=512, n_ubatch=512, n_threads=2)

    return EngineSettings(
        target=model(target),
        draft=model(draft),
        n_slots=2,
        spec=SpecSettings(mode="draft", n_max=n_max, p_min=0.0, pipeline=False),
    )
