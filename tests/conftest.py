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
