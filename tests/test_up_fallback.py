"""`up` falls back to a more frugal plan when a planned pair fails to load."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

from localspec.catalog import load_catalog
from localspec.commands.up import Served, _fallback
from localspec.hardware import load_hardware_profile
from localspec.plan import PlanSettings, make_plan
from localspec.settings_to import plan_engine_settings


def test_planned_load_failure_retries_smaller_until_nothing_is_left() -> None:
    plan = make_plan(load_catalog(), load_hardware_profile("rtx4090-24gb"), PlanSettings())
    paths = (Path("/models/target.gguf"), Path("/models/draft.gguf"))
    served = Served(plan_engine_settings(plan, *paths), plan.pair_id, plan, paths)
    seen = [(served.engine.target.n_ctx, served.engine.target.n_gpu_layers)]
    while (nxt := _fallback(served)) is not None:
        assert nxt.alias == served.alias and nxt.paths == paths
        seen.append((nxt.engine.target.n_ctx, nxt.engine.target.n_gpu_layers))
        served = nxt
    assert len(seen) >= 3, seen
    # Each step gives something up: context first (not below 4096), then GPU layers.
    for (ctx_a, ngl_a), (ctx_b, ngl_b) in pairwise(seen):
        assert (ctx_b < ctx_a and ngl_b == ngl_a) or (ctx_b == ctx_a and ngl_b < ngl_a)
        assert ctx_b >= 4096
    assert seen[-1][1] == 0


def test_local_files_are_not_second_guessed() -> None:
    plan = make_plan(load_catalog(), load_hardware_profile("cpu-32gb"), PlanSettings())
    served = Served(plan_engine_settings(plan, Path("/t.gguf")), "t.gguf")
    assert _fallback(served) is None
