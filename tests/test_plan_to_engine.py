"""A plan's multi-GPU layout reaches llama.cpp's model parameters."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

from localspec.catalog import load_catalog
from localspec.engine.llama import gpu_split
from localspec.hardware import load_hardware_profile
from localspec.plan import PlanSettings, make_plan
from localspec.settings_to import plan_engine_settings


def test_two_gpu_plan_splits_the_target_and_pins_the_draft() -> None:
    plan = make_plan(load_catalog(), load_hardware_profile("2xh100-80gb"), PlanSettings())
    assert plan.tensor_split is not None and len(plan.tensor_split) == 2
    settings = plan_engine_settings(plan, "/m/target.gguf", "/m/draft.gguf")
    assert settings.target.tensor_split == plan.tensor_split
    assert settings.draft is not None
    gpu = plan.draft_gpu or 0
    assert settings.draft.main_gpu == gpu
    assert settings.draft.tensor_split == tuple(float(i == gpu) for i in range(2))


def test_single_gpu_plan_leaves_the_split_to_llama_cpp() -> None:
    plan = make_plan(load_catalog(), load_hardware_profile("rtx4090-24gb"), PlanSettings())
    settings = plan_engine_settings(plan, "/m/target.gguf", "/m/draft.gguf")
    assert not settings.target.tensor_split
    assert settings.draft is None or not settings.draft.tensor_split


def test_gpu_split_fills_every_device_slot() -> None:
    arr = gpu_split((0.25, 0.75), 16)
    assert arr is not None and len(arr) == 16
    assert list(arr)[:3] == [0.25, 0.75, 0.0]
    assert ctypes.sizeof(arr) == 16 * ctypes.sizeof(ctypes.c_float)
    assert gpu_split(None, 16) is None
    with pytest.raises(ValueError, match="supports 1"):
        gpu_split((0.5, 0.5), 1)
    with pytest.raises(ValueError, match="non-negative"):
        gpu_split((-1.0, 2.0), 4)


@pytest.mark.parametrize("n_slots", [1, 3])
def test_the_plan_counts_the_kv_cells_the_engine_allocates(
    qwen_target: Path, qwen_draft: Path, n_slots: int
) -> None:
    """Each model's context holds every slot's context and the extra completions' room; the
    plan's memory is computed on the same number of cells, for the target and the draft."""
    from localspec.engine import Engine, EngineSettings, ModelSettings
    from localspec.planning.memory import kv_cells
    from localspec.planning.types import Layout

    def ms(path: Path) -> ModelSettings:
        return ModelSettings(str(path), n_ctx=1024, n_batch=256, n_ubatch=256, n_threads=1)

    settings = EngineSettings(target=ms(qwen_target), draft=ms(qwen_draft), n_slots=n_slots)
    with Engine.load(settings) as engine:
        assert engine.pair.dctx is not None
        cells = kv_cells(Layout(1024, n_slots, "f16", 256, 0, (), 0))
        assert engine.pair.tctx.n_ctx_total == engine.pair.dctx.n_ctx_total == cells
        assert cells > 1024 * n_slots  # (room for the extra completions, not the slots alone)
