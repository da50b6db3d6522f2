"""The host-memory cache of slot contexts, over real HTTP on a real target+draft pair: two
editors taking turns on one slot each get their context back from RAM instead of evaluating
it again, with the answer a cold evaluation gives; and the cache's LRU bound."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from localspec.commands.lifecycle import metric_totals, render_status, summarise
from localspec.engine.hostcache import HostCache
from localspec.engine.slotstate import SeqSnapshot, SlotSnapshot
from localspec.engine.types import SpecSettings
from localspec.server.app import create_app
from localspec.server.logs import REQUESTS
from localspec.server.options import ServerSettings
from tests.test_server_http import Live, engine_settings, start, stop
from tests.test_server_slot_actions import context_restores

EDITOR_A = "".join(f"def alpha_{i}(x):\n    return x * {i}\n\n" for i in range(40))
EDITOR_B = "".join(f"class Beta{i}:\n    size = {i}\n\n" for i in range(50))
MORE = "def omega(x):\n    return"
ASK = {"n_predict": 10, "top_k": 1, "samplers": ["top_k"], "n_probs": 2, "id_slot": 0}


def serve(target: Path, draft: Path, host_cache_bytes: int) -> Live:
    pair = replace(
        engine_settings(target, draft, n_slots=1),
        spec=SpecSettings(mode="draft"),
        host_cache_bytes=host_cache_bytes,
    )
    return start(create_app(ServerSettings(port=0), pair))


@pytest.fixture(scope="module")
def cached(qwen_target: Path, qwen_draft: Path) -> Iterator[Live]:
    live = serve(qwen_target, qwen_draft, 256 << 20)
    yield live
    stop(live)


def complete(c: httpx.Client, prompt: str, **kw: Any) -> dict[str, Any]:
    r = c.post("/completion", json={"prompt": prompt, **ASK, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def turns(live: Live) -> tuple[dict[str, Any], dict[str, Any]]:
    """Editor A fills the slot, editor B takes it, editor A comes back with a few more
    tokens: (A's first answer, A's answer on its return)."""
    with live.client() as c:
        first = complete(c, EDITOR_A)
        other = complete(c, EDITOR_B)
        assert other["timings"]["prompt_n"] > 300  # B's context replaced A's in the slot
        back = complete(c, EDITOR_A + MORE)
    return first, back


def test_an_editor_coming_back_restores_its_context(
    cached: Live, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=REQUESTS)
    first, back = turns(cached)
    n_a = first["timings"]["prompt_n"]
    assert n_a > 300
    # only the new tokens were evaluated (and what of A's answer the prompt did not repeat)
    assert back["timings"]["prompt_n"] < 20 and back["tokens_cached"] >= n_a
    cache = cached.service.worker.engine.host_cache
    assert cache.hits >= 1 and cache.restored_tokens >= n_a and len(cache) >= 1
    hits, stashed = cache.hits, cache.stashed
    with cached.client() as c:
        cold = complete(c, EDITOR_A + MORE, cache_prompt=False)
    # a cold request restores nothing (it evaluates afresh) but keeps the context it drops
    assert (cache.hits, cache.stashed) == (hits, stashed + 1)
    top = [e["top_logprobs"] for e in cold["completion_probabilities"]]
    assert min(t[0]["logprob"] - t[1]["logprob"] for t in top) > 0.05, top  # no near tie
    assert back["content"] == cold["content"]
    # the request log, /metrics and `localspec status` say what the cache did
    lines = [r.getMessage() for r in caplog.records if r.name == REQUESTS]
    assert any(f"restored={cache.restored_tokens} " in m for m in lines)  # the one restore
    assert any("stashed=" in m for m in lines)
    with cached.client() as c:
        text = c.get("/metrics").text
    totals = metric_totals(text)
    assert totals["localspec_host_cache_restores_total"] == cache.hits >= 1
    assert totals["localspec_host_cache_restored_tokens_total"] >= n_a
    assert totals["localspec_host_cache_bytes"] == cache.n_bytes > 0
    with cached.client() as c:  # the same restores among every source's
        by_source = context_restores(c)
    assert by_source["host_cache"] == (
        cache.hits,
        cache.restored_tokens,
        pytest.approx(cache.restore_ms / 1e3),
    )
    assert by_source["slot_file"] == by_source["restart"] == (0, 0, 0)
    status = render_status({"url": cached.url, "health": "ok", "metrics": summarise(totals)})
    assert f"{cache.hits} restores ({cache.restored_tokens} tokens" in status


def test_without_the_cache_the_context_is_evaluated_again(
    qwen_target: Path, qwen_draft: Path
) -> None:
    live = serve(qwen_target, qwen_draft, 0)
    try:
        first, back = turns(live)
        assert back["timings"]["prompt_n"] >= first["timings"]["prompt_n"]
        assert live.service.worker.engine.host_cache is None
    finally:
        stop(live)


def snap(tokens: list[int], n_bytes: int) -> SlotSnapshot:
    data = np.zeros(n_bytes, dtype=np.uint8)
    return SlotSnapshot(SeqSnapshot(data, {"tokens": tokens}), None)


def test_the_cache_keeps_its_bound_least_recently_used_first() -> None:
    cache = HostCache(max_bytes=3000)
    assert cache.stash(snap([1, 2, 3], 1000)) and cache.stash(snap([4, 5], 1000))
    # a longer context holding an entry's tokens replaces it
    assert cache.stash(snap([1, 2, 3, 9], 1000)) and len(cache) == 2
    assert cache.holds([1, 2, 3]) and not cache.holds([1, 2, 4])
    assert cache.stash(snap([7], 1000)) and cache.stash(snap([8], 1000))  # [4, 5] the oldest
    assert not cache.holds([4, 5]) and cache.holds([1, 2, 3, 9])
    assert cache.n_bytes == 3000 and cache.evicted == 1
    cache.entries.move_to_end(next(iter(cache.entries)))  # a restore: [1, 2, 3, 9] is newest
    assert cache.stash(snap([10], 1000))
    assert not cache.holds([7]) and cache.holds([1, 2, 3, 9]) and cache.evicted == 2
    assert not cache.stash(snap([6], 4000))  # larger than the whole cache: not kept
    assert cache.n_bytes <= cache.max_bytes
