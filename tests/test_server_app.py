"""The app before and without a model: loading answers, a failed load, CORS (no engine runs)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx

from localspec.engine.types import EngineSettings, ModelSettings
from localspec.server import ServerSettings, create_app


def _get(app: object, method: str, path: str, **kw: object) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.request(method, path, **kw)  # type: ignore[arg-type]

    return asyncio.run(go())


def test_every_route_answers_503_while_loading_and_cors_still_works(tmp_path: Path) -> None:
    settings = ServerSettings(cors_origins=("http://localhost:3000",))
    app = create_app(settings, EngineSettings(target=ModelSettings(path=str(tmp_path / "m.gguf"))))
    # the lifespan has not started the worker: the daemon is still "loading"
    for path in ("/health", "/props", "/slots"):
        r = _get(app, "GET", path, headers={"Origin": "http://localhost:3000"})
        assert r.status_code == 503
        assert r.json() == {"error": {"code": 503, "message": "Loading model",
                                      "type": "unavailable_error"}}  # fmt: skip
        assert r.headers["access-control-allow-origin"] == "http://localhost:3000"
        assert r.headers["server"].startswith("localspec/")  # a loading localspec is ours
    preflight = _get(
        app, "OPTIONS", "/infill",
        headers={"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST"},
    )  # fmt: skip
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "http://localhost:3000"


def test_a_failed_load_is_reported_on_every_route(tmp_path: Path) -> None:
    missing = tmp_path / "missing.gguf"
    failures: list[BaseException] = []
    app = create_app(
        ServerSettings(),
        EngineSettings(target=ModelSettings(path=str(missing))),
        on_failure=failures.append,
    )
    worker = app.state.service.worker
    worker.start()
    deadline = time.monotonic() + 60
    while worker.state == "loading" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert worker.state == "failed" and failures
    r = _get(app, "GET", "/health")
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "server_error"
    assert "missing.gguf" in r.json()["error"]["message"]


def test_openapi_schema_documents_the_infill_body(tmp_path: Path) -> None:
    app = create_app(ServerSettings(), EngineSettings(target=ModelSettings(path="x.gguf")))
    schema = app.openapi()  # type: ignore[attr-defined]
    infill = schema["components"]["schemas"]["InfillRequest"]["properties"]
    assert {"input_prefix", "input_suffix", "input_extra", "n_indent", "speculative.n_max"} <= set(
        infill
    )
