"""Steering speculation: rejected drafts recorded (opt-in) and exported, and relaxed
acceptance (opt-in, labelled not bit-identical), over real HTTP on the follow pair, whose
draft the target rejects after every multiple of 3 (``tests/fixtures/models.py``)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from localspec import cli, rejections, settings_to
from localspec.engine.types import EngineSettings, ModelSettings, SpecSettings
from localspec.server import ServerSettings, create_app
from localspec.settings import Settings
from tests.fixtures.models import follow_chain, follow_next
from tests.ops_support import wait_until
from tests.test_server_http import Live, start, stop

PROMPT = [1000, 1001, 1002]
N = 20


def _engine(target: Path, draft: Path, **spec: Any) -> EngineSettings:
    def model(p: Path) -> ModelSettings:
        return ModelSettings(path=str(p), n_ctx=2048, n_batch=512, n_ubatch=512, n_threads=2)

    return EngineSettings(
        target=model(target),
        draft=model(draft),
        n_slots=1,
        spec=SpecSettings(mode="draft", n_max=6, p_min=0.0, pipeline=False, **spec),
    )


@pytest.fixture
def serve(qwen_follow: Path, qwen_follow_draft: Path) -> Iterator[Any]:
    lives: list[Live] = []

    def run(server: ServerSettings | None = None, **spec: Any) -> Live:
        app = create_app(
            server or ServerSettings(port=0), _engine(qwen_follow, qwen_follow_draft, **spec)
        )
        lives.append(start(app))
        return lives[-1]

    yield run
    for live in lives:
        stop(live)


def _complete(c: httpx.Client, **body: Any) -> dict[str, Any]:
    r = c.post("/completion", json={"prompt": PROMPT, "n_predict": N, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_rejected_drafts_are_recorded_locally_and_exported(
    serve: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "data" / rejections.FILE_NAME
    live = serve(ServerSettings(port=0, rejections_path=str(path)), record_rejections=True)
    with live.client() as c:
        answer = _complete(c, language="c")
    assert answer["tokens"] == follow_chain(PROMPT[-1], N)  # recording changes nothing
    steps = answer["timings"]["draft_n_verif_steps"]
    wait_until(lambda: path.exists() and len(list(rejections.read(path))) == steps)
    assert path.stat().st_mode & 0o077 == 0  # the user's code: owner-only
    records = list(rejections.read(path))
    for r in records:
        # cut at position 3: two accepted, then the target's own token where they differ
        assert r["accepted"] == 2 and r["language"] == "c" and r["source"] == "draft"
        assert r["draft_tokens"][:2] == r["target_tokens"][:2]
        last = r["context_tokens"][-1]
        assert r["target_tokens"] == follow_chain(last, 3)
        assert r["draft_tokens"][:3] == follow_chain(last, 3, miss=3)
        assert r["context_tokens"][:3] == PROMPT
    assert records[0]["draft"] and records[0]["target"] and records[0]["context_tail"]

    out = tmp_path / "export.jsonl"
    assert cli.main(["spec", "export", "--file", str(path), "--out", str(out)]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines == records
    assert cli.main(["spec", "export", "--file", str(path), "--language", "go"]) == 0
    assert capsys.readouterr().out == ""


def test_recording_is_off_by_default_and_the_file_is_capped(tmp_path: Path) -> None:
    assert settings_to.server_settings(Settings(), api_key=None).rejections_path is None
    on = Settings.model_validate({"speculative": {"record_rejections": True}})
    path = settings_to.server_settings(on, api_key=None).rejections_path
    assert path == str(rejections.default_path())
    f = rejections.RejectionFile(tmp_path / "r.jsonl", max_bytes=4000)
    for i in range(100):
        f.append([{"i": i, "pad": "x" * 50}])
    sizes = [p.stat().st_size for p in (f.path, f.older)]
    assert sum(sizes) <= 4000 and min(sizes) > 0
    kept = [r["i"] for r in rejections.read(f.path)]
    assert kept == list(range(100 - len(kept), 100))  # the newest, oldest first


def test_default_serving_records_nothing(serve: Any) -> None:
    live = serve()
    with live.client() as c:
        answer = _complete(c)
        props = c.get("/props").json()
    assert live.service.spec.rejections is None
    assert answer["generation_settings"]["speculative.accept"] == "exact"
    assert answer["generation_settings"]["speculative.bit_identical"] is True
    assert props["speculative"]["accept"] == "exact"
    assert "draft_n_relaxed" not in answer["timings"]


def test_relaxed_acceptance_is_opt_in_and_labelled(serve: Any) -> None:
    # a floor the follow pair's wrong tokens never reach: the same output as exact
    strict = serve(accept="topk", accept_top_k=3, accept_p_min=0.1)
    with strict.client() as c:
        answer = _complete(c)
    assert answer["tokens"] == follow_chain(PROMPT[-1], N)
    assert "draft_n_relaxed" not in answer["timings"]
    stop(strict)

    # every drafted token taken: the output is the draft's chain, and says it is not exact
    loose = serve(accept="topk", accept_top_k=200_000, accept_p_min=0.0)
    with loose.client() as c:
        answer = _complete(c)
        props = c.get("/props").json()
    first = follow_next(PROMPT[-1])  # drawn from the prompt, before any draft
    assert answer["tokens"] == [first, *follow_chain(first, N - 1, miss=3)]
    assert answer["tokens"] != follow_chain(PROMPT[-1], N)
    t = answer["timings"]
    assert t["draft_n_relaxed"] > 0 and t["draft_n_accepted"] == t["draft_n"]
    settings = answer["generation_settings"]
    assert settings["speculative.accept"] == "topk"
    assert settings["speculative.bit_identical"] is False
    assert props["speculative"]["bit_identical"] is False
    assert props["speculative"]["accept_top_k"] == 200_000


def test_relaxed_acceptance_settings_reach_the_engine() -> None:
    s = Settings.model_validate(
        {"speculative": {"accept": "topk", "accept_top_k": 5, "accept_p_min": 0.2}}
    )
    base = EngineSettings(target=ModelSettings(path="x.gguf"))
    spec = settings_to.with_speculation_extras(base, s).spec
    assert (spec.accept, spec.accept_top_k, spec.accept_p_min) == ("topk", 5, 0.2)
    assert dataclasses.replace(base).spec.accept == "exact"
