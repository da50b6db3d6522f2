"""/infill's prefix/suffix window is a setting (``cache.infill_window``), not the engine's
batch size: an engine planned with a small batch still sees the editors' recommended window
(llama-server ``-b 1024``: 768 prefix and 256 suffix tokens), over real HTTP on a real model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import llama_cpp
import pytest

from localspec.engine.types import EngineSettings, ModelSettings, SpecSettings
from localspec.server.app import create_app
from localspec.server.options import ServerSettings
from tests.test_server_http import start, stop

N_CTX = 4096
FIM_PRE, FIM_SUF, FIM_MID = 151659, 151661, 151660


def engine_settings(path: Path, n_batch: int) -> EngineSettings:
    model = ModelSettings(
        path=str(path), n_ctx=N_CTX, n_batch=n_batch, n_ubatch=n_batch, n_threads=2,
        n_threads_batch=2,
    )  # fmt: skip
    return EngineSettings(target=model, n_slots=1, spec=SpecSettings(mode="ngram"))


def laid_out(qwen_target: Path, settings: ServerSettings, n_batch: int) -> tuple[Any, list[int]]:
    """(/props, the slot's tokens) after one /infill with a long prefix and suffix."""
    live = start(create_app(settings, engine_settings(qwen_target, n_batch)))
    try:
        with live.client() as c:
            props = c.get("/props").json()
            body = {
                "input_prefix": "".join(f"value_{i} = {i}\n" for i in range(600)),
                "input_suffix": "".join(f"print(value_{i})\n" for i in range(400)),
                "input_extra": [],
                "prompt": "",
                "n_predict": 0,
            }
            r = c.post("/infill", json=body)
            assert r.status_code == 200, r.text
            return props, live.service.worker.slots[r.json()["id_slot"]].tokens
    finally:
        stop(live)


def blocks(tokens: list[int]) -> tuple[int, int]:
    """(prefix tokens, suffix tokens) of a typed-in-middle layout."""
    pre, suf, mid = tokens.index(FIM_PRE), tokens.index(FIM_SUF), tokens.index(FIM_MID)
    return suf - pre - 1, mid - suf - 1


def test_the_window_is_the_presets_whatever_the_batch(qwen_target: Path) -> None:
    vocab = llama_cpp.Llama(str(qwen_target), vocab_only=True, verbose=False)
    prefix = "".join(f"value_{i} = {i}\n" for i in range(600))
    assert len(vocab.tokenize(prefix.encode(), add_bos=False)) > 768  # the budget binds
    # a CPU plan's batch: the prompt still keeps 768 prefix tokens, as llama-server -b 1024
    props, tokens = laid_out(qwen_target, ServerSettings(port=0), n_batch=256)
    assert (props["n_batch"], props["infill_window"]) == (256, 1024)
    assert blocks(tokens) == (768, 254)  # the suffix's quarter less FIM_SUF and FIM_MID
    # the setting, not the batch, moves it
    props, tokens = laid_out(qwen_target, ServerSettings(port=0, infill_window=512), 1024)
    assert props["infill_window"] == 512
    assert blocks(tokens) == (384, 126)


@pytest.mark.parametrize("asked", [[], ["--infill-window", "2048"]])
def test_plan_shows_the_window(asked: list[str], tmp_path: Path) -> None:
    env = {"HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "cfg"), "PATH": "/usr/bin"}
    want = int(asked[1]) if asked else 1024
    run = [sys.executable, "-m", "localspec", "plan", "--hardware", "cpu-32gb", *asked]
    text = subprocess.run(run, env=env, capture_output=True, text=True, check=True).stdout
    assert f"infill window: {want} tokens ({want * 3 // 4} prefix, {want // 4} suffix" in text
    as_json = subprocess.run([*run, "--json"], env=env, capture_output=True, text=True, check=True)
    data = json.loads(as_json.stdout)
    assert data["infill_window"] == want and data["n_batch"] != want


def test_the_openai_backend_takes_the_same_window() -> None:
    from localspec.catalog import FimText
    from localspec.server.upstream.fim_text import infill_text

    fim = FimText(pre="<P>", suf="<S>", mid="<M>", rep=None, sep=None)
    kw: dict[str, Any] = dict(
        input_prefix="a" * 20000, input_suffix="b" * 20000, input_extra=[], prompt="", n_ctx=8192
    )
    narrow, wide = infill_text(fim, window=512, **kw), infill_text(fim, window=1024, **kw)
    assert wide.count("a") == 2 * narrow.count("a") and wide.count("b") > narrow.count("b")
