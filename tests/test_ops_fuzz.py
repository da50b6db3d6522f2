"""Fuzzing: schemathesis draws bodies from the daemon's own OpenAPI schema (valid ones and
deliberately invalid ones) for every route, a bounded number per route, against the real
daemon on loopback. Not one answer may be a 5xx, and the daemon must still serve afterwards."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode

from localspec.engine.types import EngineSettings, ModelSettings
from localspec.server import ServerSettings, create_app
from tests.ops_support import Live, engine_settings, start, stop

N_CTX = 128  # bounds the longest generation a drawn n_predict can ask for
EXAMPLES = 12  # per route and mode

SETTINGS = ServerSettings(port=0, n_cmpl_max=2, request_timeout_s=30)
# the schema does not depend on the model: build it from an app that never loads one
SCHEMA = schemathesis.openapi.from_dict(
    create_app(SETTINGS, EngineSettings(target=ModelSettings(path="unused.gguf"))).openapi()
)
SCHEMA.config.generation.update(
    modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
    max_examples=EXAMPLES,
    deterministic=True,
)


@pytest.fixture(scope="module")
def live(qwen_scripted_chat: Path) -> Iterator[Live]:
    # Qwen's vocabulary with FIM ids and a chat template: every route serves, chat included
    server = start(SETTINGS, engine_settings(qwen_scripted_chat, n_ctx=N_CTX, n_batch=64))
    yield server
    stop(server)


@SCHEMA.parametrize()
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)
def test_no_drawn_request_gets_a_5xx(case: schemathesis.Case, live: Live) -> None:
    response = case.call(base_url=live.url, timeout=60)
    assert response.status_code < 500, (case.path, case.body, response.text[:500])
    if response.status_code >= 400:  # every refusal in llama-server's error format
        error = response.json()["error"]
        assert error["code"] == response.status_code and error["message"] and error["type"]


def test_still_serving_after_the_fuzzing(live: Live) -> None:
    with live.client() as c:
        r = c.post("/infill", json={"input_prefix": "def f(", "input_suffix": ")", "n_predict": 2})
        assert r.status_code == 200
        slots = c.get("/slots").json()
        assert not any(s["is_processing"] for s in slots)
