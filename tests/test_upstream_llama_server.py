"""Both backend kinds against llama.cpp's own llama-server (the real team server): slow, and
only where ``LLAMA_SERVER_BIN`` names a binary (scripts/build-llama-server.sh builds one)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from localspec.bench.anchor import ManagedServer, ServeSettings, llama_server_spec
from localspec.server.upstream.identity import stable_slot, workstation
from tests.upstream_support import daemon, props, sse_objects, upstream_config, wait_for

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not os.environ.get("LLAMA_SERVER_BIN"),
        reason="LLAMA_SERVER_BIN is not set: no llama.cpp llama-server binary to test against "
        "(build one with scripts/build-llama-server.sh)",
    ),
]

FIM_BODY = {
    "input_prefix": "def add(a, b):\n",
    "input_suffix": "\n\nprint(add(1, 2))\n",
    "input_extra": [{"text": "import os\n", "filename": "/p/util.py"}],
    "prompt": "    return ",
    "n_predict": 16,
    "top_k": 1,
    "samplers": ["top_k"],
}


@pytest.fixture(scope="module")
def llama_server(qwen_target: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary = Path(os.environ["LLAMA_SERVER_BIN"])
    spec = llama_server_spec(binary, ServeSettings(target=qwen_target, ctx=8192), "plain")
    spec.argv[spec.argv.index("-np") + 1] = "4"
    spec.argv += ["--slots", "-kvu"]
    server = ManagedServer(spec, tmp_path_factory.mktemp("llama-server"))
    server.start()
    try:
        server.wait_ready(300)
        yield spec.url
    finally:
        server.stop()


def test_llama_server_kind_against_llama_server(llama_server: str, tmp_path: Path) -> None:
    with daemon(tmp_path, upstream=upstream_config(llama_server)) as proxy:
        slot = stable_slot(4, workstation())
        r = httpx.post(proxy.url + "/infill", json=FIM_BODY, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["id_slot"] == slot and "timings" in r.json()
        streamed = httpx.post(proxy.url + "/infill", json={**FIM_BODY, "stream": True}, timeout=120)
        events = sse_objects(streamed.text)
        assert events and events[-1]["stop"] is True
        p = props(proxy.url)
        assert p["total_slots"] == 4 and p["backend"]["id_slot"] == slot
        tok = httpx.post(proxy.url + "/tokenize", json={"content": "def f"}).json()
        assert tok["tokens"]
        # the editor leaves: llama-server's slot stops processing
        long = {"prompt": "def f():\n", "n_predict": 100000, "stream": True}
        with httpx.stream("POST", proxy.url + "/completion", json=long, timeout=60) as s:
            next(s.iter_raw())

        def idle() -> bool:
            return not any(s["is_processing"] for s in httpx.get(llama_server + "/slots").json())

        assert wait_for(idle, 10, "llama-server's slot stops") < 5


def test_openai_kind_against_llama_servers_v1_completions(
    llama_server: str, tmp_path: Path
) -> None:
    with daemon(tmp_path, upstream=upstream_config(llama_server, kind="openai")) as proxy:
        r = httpx.post(proxy.url + "/infill", json=FIM_BODY, timeout=120)
        assert r.status_code == 200, r.text
        answer = r.json()
        assert isinstance(answer["content"], str) and answer["timings"]["predicted_n"] >= 1
        assert answer["prompt"].endswith("<|fim_middle|>    return ")
        assert props(proxy.url)["backend"]["kind"] == "openai"
