"""Session fixtures: the fixture models every test shares (built once, cached on disk)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixtures.models import STANDARD


def _model_fixture(name: str):
    @pytest.fixture(scope="session", name=name)
    def _fixture() -> Path:
        return STANDARD[name]()

    return _fixture


for _name in STANDARD:
    globals()[_name] = _model_fixture(_name)


@pytest.fixture(autouse=True)
def _results_elsewhere(tmp_path_factory: pytest.TempPathFactory, monkeypatch) -> Path:
    """Benchmarks run by tests write their result files to a temporary directory, never into
    the checkout's bench/results (the project's record of real runs)."""
    results = tmp_path_factory.mktemp("results")
    monkeypatch.setenv("BENCH_RESULTS_DIR", str(results))
    return results


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``vulkan`` need a Vulkan build of llama.cpp: they run only when the marker
    expression names them (``-m vulkan``, .ci/run's second step), not in the CPU suite."""
    if "vulkan" in (config.option.markexpr or ""):
        return
    kept = [item for item in items if item.get_closest_marker("vulkan") is None]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in kept])
        items[:] = kept
