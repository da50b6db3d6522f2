"""The daemon over real HTTP on loopback, with the real engine on the fixture models.

One server per module (model loads are the slow part): ``qwen`` is the tiny Qwen-vocabulary
pair (real FIM ids, real tokenizer, random weights: fast, nonsense text) behind an API key;
``smollm`` is SmolLM2-135M as shipped, a trained model without FIM tokens (501 on /infill,
sensible text for stop rules).
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import llama_cpp
import pytest
import uvicorn

from localspec.engine.types import EngineSettings, ModelSettings, SpecSettings
from localspec.server import ServerSettings, create_app, logs
from localspec.server.run import bind_sockets
from localspec.server.state import Service
from tests.ops_support import wait_until
from tests.steer import held_generation, held_prefill

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
FIM_PRE, FIM_SUF, FIM_MID, FIM_REP, FIM_SEP = 151659, 151661, 151660, 151663, 151664
N_CTX, N_BATCH = 4096, 1024


@dataclass
class Live:
    url: str
    port: int
    server: uvicorn.Server
    thread: threading.Thread
    service: Service

    def client(self, **kw: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=120, **kw)


def start(app: Any) -> Live:
    sockets = bind_sockets("127.0.0.1", 0)
    port = sockets[0].getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": sockets}, daemon=True)
    thread.start()
    live = Live(f"http://127.0.0.1:{port}", port, server, thread, app.state.service)
    with live.client() as c:
        for _ in range(600):
            try:
                if c.get("/health").status_code == 200:
                    return live
            except httpx.TransportError:
                pass
            time.sleep(0.1)
    raise RuntimeError(f"server did not become ready: {live.service.worker.error}")


def stop(live: Live) -> None:
    live.server.should_exit = True
    live.thread.join(60)


def engine_settings(path: Path, draft: Path | None = None, n_slots: int = 2) -> EngineSettings:
    def model(p: Path) -> ModelSettings:
        return ModelSettings(
            path=str(p), n_ctx=N_CTX, n_batch=N_BATCH, n_ubatch=N_BATCH, n_threads=2,
            n_threads_batch=2,
        )  # fmt: skip

    return EngineSettings(
        target=model(path),
        draft=model(draft) if draft is not None else None,
        n_slots=n_slots,
        spec=SpecSettings(mode="auto" if draft is not None else "ngram"),
    )


@pytest.fixture(scope="module")
def qwen(qwen_target: Path, qwen_target_f16: Path) -> Iterator[Live]:
    settings = ServerSettings(port=0, api_key=KEY, queue_limit=1)
    live = start(create_app(settings, engine_settings(qwen_target, qwen_target_f16)))
    yield live
    stop(live)


@pytest.fixture(scope="module")
def smollm(smollm_q4: Path) -> Iterator[Live]:
    live = start(create_app(ServerSettings(port=0), engine_settings(smollm_q4, n_slots=1)))
    yield live
    stop(live)


@pytest.fixture(scope="module")
def qwen_vocab(qwen_target: Path) -> llama_cpp.Llama:
    return llama_cpp.Llama(str(qwen_target), vocab_only=True, verbose=False)


@pytest.fixture
def qc(qwen: Live) -> Iterator[httpx.Client]:
    with qwen.client(headers=AUTH) as c:
        yield c


# ---------------------------------------------------------------- the llama-vscode sequence


def ring_chunks(n: int = 16, module: Any = None) -> list[dict[str, Any]]:
    """llama-vscode's ring buffer: chunks of real code (the stdlib: json.decoder unless
    ``module`` says otherwise) with file names."""
    import inspect
    import json.decoder

    source = inspect.getsource(module or json.decoder).splitlines(keepends=True)
    return [
        {"text": "".join(source[i * 8 : i * 8 + 8]), "time": 1724000000 + i,
         "filename": f"/work/proj/mod{i}.py"}
        for i in range(n)
    ]  # fmt: skip


def vscode_request(prompt: str, **over: Any) -> dict[str, Any]:
    body = {
        "id_slot": 0,
        "input_prefix": "import os\n\n\ndef main(argv):\n",
        "input_suffix": "\n    return 0\n",
        "input_extra": ring_chunks(),
        "prompt": prompt,
        "n_predict": 16,
        "n_cmpl": 1,
        "top_k": 40,
        "top_p": 0.99,
        "stream": False,
        "samplers": ["top_k", "top_p", "infill"],
        "cache_prompt": True,
        "t_max_prompt_ms": 500,
        "t_max_predict_ms": 500,
        "model": "qwen2.5-coder",
    }
    body.update(over)
    return body


def test_llama_vscode_request_sequence(qwen: Live, qc: httpx.Client) -> None:
    # 1. warm-up: empty prefix/suffix/prompt, all ring chunks, n_predict 0
    warm = qc.post(
        "/infill",
        json=vscode_request("", input_prefix="", input_suffix="", n_predict=0, samplers=[],
                            t_max_predict_ms=1),
    )  # fmt: skip
    assert warm.status_code == 200, warm.text
    w = warm.json()
    assert (w["content"], w["tokens_predicted"], w["stop"]) == ("", 0, True)
    assert isinstance(w["generation_settings"], dict) and w["generation_settings"]["n_ctx"] == N_CTX
    assert w["tokens_evaluated"] > 16 * 40  # the ring chunks were evaluated into the cache
    assert b'"content":"' in warm.content  # compact JSON: llama.vim's regex depends on it

    # 2. a FIM request with n_cmpl 3: an array of three, the ring chunks come from the cache
    first = qc.post("/infill", json=vscode_request("    args = ", n_cmpl=3))
    assert first.status_code == 200, first.text
    arr = first.json()
    assert isinstance(arr, list) and [c["index"] for c in arr] == [0, 1, 2]
    for c in arr:
        assert isinstance(c["content"], str) and isinstance(c["generation_settings"], dict)
        assert c["tokens_predicted"] <= 16 and c["id_slot"] == 0
    assert arr[0]["timings"]["cache_n"] > w["tokens_evaluated"] // 2  # warm-up reused
    assert arr[0]["timings"]["prompt_n"] < 64
    assert all(c["timings"]["prompt_n"] <= 1 for c in arr[1:])  # same prompt: cached

    # 3. the same request after one more typed character: only the tail is evaluated
    typed = qc.post("/infill", json=vscode_request("    args = p"))
    assert typed.status_code == 200
    t = typed.json()
    assert t["timings"]["prompt_n"] < 32 < t["timings"]["cache_n"]
    assert t["tokens_evaluated"] == t["timings"]["prompt_n"] + t["timings"]["cache_n"]

    # 4. an aborted request (the editor closes the connection), then a new one
    body = vscode_request("    args = pa", n_predict=3000, samplers=["top_k"], top_k=1,
                          t_max_predict_ms=0)  # fmt: skip
    aborted = abort_mid_generation(qwen, "/infill", body)
    assert aborted < 1500  # the slot stopped early: far fewer tokens than it had room for
    after = qc.post("/infill", json=vscode_request("    args = par"))
    assert after.status_code == 200
    a = after.json()
    assert a["timings"]["cache_n"] > w["tokens_evaluated"] // 2 and a["timings"]["prompt_n"] < 64

    # 5. the "future" request llama-vscode sends after showing a suggestion
    future = qc.post("/infill", json=vscode_request("    args = par" + a["content"]))
    assert future.status_code == 200 and "content" in future.json()
    assert future.json()["timings"]["cache_n"] > w["tokens_evaluated"] // 2


def test_two_editors_that_both_pin_slot_0_keep_their_own_caches(qwen: Live) -> None:
    """llama-vscode and llama.vim both send ``id_slot: 0``. With two slots, each editor's
    requests go to the slot that holds its context, so neither evicts the other's and every
    keystroke after the first evaluates only its own few tokens (llama-server, which follows
    the pin, evaluates each editor's whole prompt again after the other's request)."""
    import json.encoder

    rings = {"vscode": ring_chunks(8), "vim": ring_chunks(8, json.encoder)}
    slots: dict[str, set[int]] = {"vscode": set(), "vim": set()}
    with qwen.client(headers=AUTH) as c:
        for typed in ("    a", "    ar", "    arg"):
            for editor, ring in rings.items():
                r = c.post("/infill", json=vscode_request(typed, input_extra=ring, n_predict=2))
                assert r.status_code == 200, r.text
                answer = r.json()
                slots[editor].add(answer["id_slot"])
                if typed != "    a":  # after each editor's first request: its cache is there
                    assert answer["timings"]["prompt_n"] <= 4, (editor, answer["timings"])
                    assert answer["timings"]["cache_n"] > 400
    assert len(slots["vscode"]) == len(slots["vim"]) == 1 and slots["vscode"] != slots["vim"]


class Editors:
    """Several editors' /infill requests to one daemon, each sent from the test thread or its
    own (``send`` is a thread target); ``results`` holds each answer by name."""

    def __init__(self, live: Live) -> None:
        self.live = live
        self.results: dict[str, httpx.Response] = {}

    def send(self, name: str, body: dict[str, Any]) -> None:
        with self.live.client(headers=AUTH) as c:
            self.results[name] = c.post("/infill", json=body)

    def settle(self, rings: dict[str, list[dict[str, Any]]]) -> dict[str, int]:
        """Each editor's first request, with its ring: the slot each one's context is on."""
        for name, ring in rings.items():
            self.send(name, vscode_request("    x", input_extra=ring, n_predict=1))
        return {name: self.results[name].json()["id_slot"] for name in rings}

    def behind_running(self, name: str, body: dict[str, Any], long_body: dict[str, Any]) -> None:
        """Send ``body`` while ``long_body`` generates (held there): it must queue for that
        busy slot (the other slot stays idle) and run once the long request is stopped."""
        worker = self.live.service.worker
        with held_generation(worker.engine) as hold:
            running = threading.Thread(target=self.send, args=("running", long_body))
            running.start()
            hold.wait_reached()
            waiting = threading.Thread(target=self.send, args=(name, body))
            waiting.start()
            wait_until(lambda: worker.queued == 1)
            assert len(worker.running_jobs()) == 1
            worker.cancel_running()
            running.join()
            hold.release.set()
            waiting.join()


def test_a_keystroke_waits_for_the_slot_that_holds_its_editor(qwen: Live) -> None:
    """The editor's previous request still runs on its slot (its cancel not seen yet, or the
    "future" request): the next keystroke waits for that slot rather than evaluating its
    whole prompt on the idle one; and a keystroke stops the editor's warm-up running there."""
    import json.encoder

    worker, ring = qwen.service.worker, ring_chunks(8, json.encoder)
    editor = Editors(qwen)
    send, results = editor.send, editor.results
    home_slot = editor.settle({"home": ring})["home"]
    other = 1 - home_slot  # what the requests pin from now on: the pin is only a hint
    keystroke = vscode_request("    xyz", input_extra=ring, id_slot=other, n_predict=1)
    long_body = vscode_request("    xy", input_extra=ring, id_slot=other, n_predict=3000, top_k=1,
                               samplers=["top_k"], t_max_predict_ms=0)  # fmt: skip
    editor.behind_running("key", keystroke, long_body)
    answer = results["key"].json()
    assert answer["id_slot"] == home_slot and answer["timings"]["prompt_n"] <= 4

    grown = [*ring, {"text": "def more():\n    return 1\n" * 40, "filename": "/p/more.py"}]
    warmup = vscode_request("", input_prefix="", input_suffix="", input_extra=grown,
                            id_slot=other, n_predict=0, samplers=[],
                            t_max_predict_ms=1)  # fmt: skip
    with held_prefill(worker.engine) as hold:
        warming = threading.Thread(target=send, args=("warm-up", warmup))
        warming.start()
        hold.wait_reached()
        key = threading.Thread(target=send, args=("key", keystroke))
        key.start()
        warming.join(60)
        assert not warming.is_alive()  # it ended inside the hold: the keystroke stopped it
        key.join()
    assert results["warm-up"].json()["id_slot"] == home_slot
    assert results["key"].json()["id_slot"] == home_slot


def test_a_keystroke_takes_over_its_editors_first_warm_up(qwen: Live) -> None:
    """A third editor's first warm-up fills the least recent slot; its first keystroke comes
    while that runs. The keystroke stops the warm-up and goes on from where it got, on that
    slot: it does not evaluate the whole prompt on the other slot, evicting the editor whose
    context is there (seen in the two-editor replay: a 3 800-token prompt evaluated again)."""
    import json.encoder
    import textwrap

    worker = qwen.service.worker
    rings = {"a": ring_chunks(8), "b": ring_chunks(8, json.encoder)}
    editors = Editors(qwen)
    send, results = editors.send, editors.results
    slot_b = editors.settle(rings)["b"]  # editors a and b each on a slot of their own
    ring_c = ring_chunks(8, textwrap)
    warmup = vscode_request("", input_prefix="", input_suffix="", input_extra=ring_c,
                            n_predict=0, samplers=[], t_max_predict_ms=1)  # fmt: skip
    keystroke = vscode_request("    x", input_extra=ring_c, n_predict=1)
    with held_prefill(worker.engine) as hold:
        warming = threading.Thread(target=send, args=("warm-up", warmup))
        warming.start()
        hold.wait_reached()  # its first piece is in the slot (a's, the least recent)
        key = threading.Thread(target=send, args=("key", keystroke))
        key.start()
        warming.join(60)
        assert not warming.is_alive()  # it ended inside the hold: the keystroke stopped it
        hold.release.set()  # (the keystroke's own prompt takes several steps)
        key.join()
    slot_c = results["warm-up"].json()["id_slot"]
    answer = results["key"].json()
    assert slot_c != slot_b and answer["id_slot"] == slot_c
    assert answer["timings"]["cache_n"] > 0  # it went on from the warm-up's first piece
    with qwen.client(headers=AUTH) as c:  # b's context is still in its slot
        b = c.post("/infill", json=vscode_request("    xy", input_extra=rings["b"], n_predict=1))
    assert b.json()["id_slot"] == slot_b and b.json()["timings"]["prompt_n"] <= 4


def test_a_warm_up_after_a_ring_change_waits_for_its_editors_busy_slot(qwen: Live) -> None:
    """Editor a's ring moved on by a chunk (the oldest left the front) while its previous
    keystroke still runs: the warm-up shares no prefix with a's slot but all its chunks, and
    waits for that slot rather than evict editor b's context from the idle one."""
    import json.encoder
    import textwrap

    rings = {"a": ring_chunks(9), "b": ring_chunks(8, json.encoder)}
    editors = Editors(qwen)
    results = editors.results
    slots = editors.settle({"a": rings["a"][:8], "b": rings["b"]})  # a slot each
    slot_a, slot_b = slots["a"], slots["b"]
    assert slot_a != slot_b
    long_body = vscode_request("    xy", input_extra=rings["a"][:8], n_predict=3000, top_k=1,
                               samplers=["top_k"], t_max_predict_ms=0)  # fmt: skip
    moved = [*rings["a"][1:], *ring_chunks(1, textwrap)]  # a's ring, one chunk on
    warmup = vscode_request("", input_prefix="", input_suffix="", input_extra=moved,
                            n_predict=0, samplers=[], t_max_predict_ms=1)  # fmt: skip
    editors.behind_running("warm-up", warmup, long_body)
    assert results["warm-up"].json()["id_slot"] == slot_a
    with qwen.client(headers=AUTH) as c:  # b's context is still in its slot
        b = c.post("/infill", json=vscode_request("    xy", input_extra=rings["b"], n_predict=1))
    assert b.json()["id_slot"] == slot_b and b.json()["timings"]["prompt_n"] <= 4


def test_one_editors_keystroke_leaves_the_other_editors_warm_up_running(qwen: Live) -> None:
    """Both editors send the same id_slot: with slot choice it names no editor, so editor
    b's keystroke does not stop editor a's warm-up running on the slot that id names (under
    llama-server's rule it would: the pin is the slot)."""
    import json.encoder
    import textwrap

    worker, editors = qwen.service.worker, Editors(qwen)
    rings = {"a": ring_chunks(8), "b": ring_chunks(8, json.encoder)}
    slots = editors.settle(rings)
    pin = slots["a"]  # the id both send; a's new ring goes to a's slot, the least recent
    warmup = vscode_request("", input_prefix="", input_suffix="",
                            input_extra=ring_chunks(8, textwrap), id_slot=pin, n_predict=0,
                            samplers=[], t_max_predict_ms=1)  # fmt: skip
    keystroke = vscode_request("    xy", input_extra=rings["b"], id_slot=pin, n_predict=1)
    with held_prefill(worker.engine) as hold:
        warming = threading.Thread(target=editors.send, args=("warm-up", warmup))
        warming.start()
        hold.wait_reached()
        key = threading.Thread(target=editors.send, args=("key", keystroke))
        key.start()
        wait_until(lambda: len(worker.running_jobs()) == 2)  # b's keystroke runs on b's slot
        assert not any(job.cancel.is_set() for job in worker.running_jobs())
        hold.release.set()
        warming.join()
        key.join()
    assert editors.results["key"].json()["id_slot"] == slots["b"]
    warmed = editors.results["warm-up"].json()
    assert warmed["id_slot"] == pin and warmed["timings"]["prompt_n"] > 256  # all of it


def abort_mid_generation(live: Live, path: str, body: dict[str, Any]) -> int:
    """Send a request on a raw socket, close it once generation runs; return tokens generated.

    The generation waits after its third token until it is cancelled: the client leaves
    mid-generation on any machine (a fast one could otherwise finish the answer first)."""
    worker = live.service.worker
    done_before, cancelled_before = worker.n_done, worker.n_cancelled
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {KEY}\r\nContent-Length: {len(payload)}\r\n\r\n"
    ).encode()
    with (
        held_generation(worker.engine, after=3) as hold,
        socket.create_connection(("127.0.0.1", live.port)) as sock,
    ):
        sock.sendall(head + payload)
        hold.wait_reached()  # it has generated a little
        sock.close()
        # the job ended cancelled (counted just after its slot is freed) ...
        wait_until(lambda: worker.n_cancelled == cancelled_before + 1)
    assert worker.n_done > done_before and not worker.busy  # ... and the engine is free again
    slot = next(s for s in worker.slots if s.n_requests and s.last_used == max(
        x.last_used for x in worker.slots))  # fmt: skip
    prompt_len = slot.last_prompt_n + slot.last_cache_n
    return len(slot.tokens) - prompt_len


def test_streaming_client_that_leaves_frees_the_slot(qwen: Live) -> None:
    body = vscode_request("x", n_predict=3000, stream=True, input_extra=[], id_slot=1,
                          samplers=["top_k"], top_k=1, t_max_predict_ms=0)  # fmt: skip
    assert abort_mid_generation(qwen, "/infill", body) < 1500


# ---------------------------------------------------------------- FIM layout on Qwen's tokenizer


ROOM = 256  # ServerSettings.infill_room (at most n_ctx / 4)


@pytest.fixture
def server_layout(qwen: Live) -> Iterator[None]:
    """llama-server's own /infill layout: the typed cursor line ends the prefix."""
    svc = qwen.service
    original = svc.settings
    svc.settings = replace(original, infill_layout="llama-server")
    try:
        yield
    finally:
        svc.settings = original


@pytest.mark.parametrize("n_prefix_lines", [40, 400])
def test_fim_layout_is_what_the_slot_evaluates(
    qwen: Live, qc: httpx.Client, qwen_vocab: Any, n_prefix_lines: int, server_layout: None
) -> None:
    """llama-server's layout, token for token, as run with ``-n 128`` (the editors' n_predict,
    ``ServerSettings.infill_room`` = 2 x 128), with the prefix budget partly and fully used."""

    def tok(text: str) -> list[int]:
        return qwen_vocab.tokenize(text.encode(), add_bos=False, special=False)

    prefix = "x = '<|fim_prefix|>'\n" + "".join(f"value_{i} = {i}\n" for i in range(n_prefix_lines))
    suffix = "".join(f"print(value_{i})\n" for i in range(200))
    chunk = "".join(f"def helper_{i}():\n    return {i}\n" for i in range(400))
    extra = [{"text": chunk, "filename": "/p/helpers.py"}, {"text": "tail = 1\n"}]
    prompt = "    y = <|fim_pad|>"  # the cursor line is tokenized with special tokens on
    body = {"id_slot": 1, "input_prefix": prefix, "input_suffix": suffix, "input_extra": extra,
            "prompt": prompt, "n_predict": 0}  # fmt: skip
    r = qc.post("/infill", json=body)
    assert r.status_code == 200, r.text

    p_tok = qwen_vocab.tokenize(prompt.encode(), add_bos=False, special=True)
    assert p_tok[-1] == 151662  # <|fim_pad|> in the prompt is the special token
    full_extra = [
        FIM_REP, *tok("myproject\n"),
        FIM_SEP, *tok("/p/helpers.py\n"), *tok(chunk),
        FIM_SEP, *tok("tmp\n"), *tok("tail = 1\n"),  # missing filename: "tmp"
        FIM_SEP, *tok("filename\n"),
    ]  # fmt: skip
    n_extra = N_CTX - N_BATCH - ROOM  # llama-server's budget: n_ctx - n_batch - 2 * n_predict
    n_prefix = min(len(tok(prefix)), 3 * (N_BATCH // 4))
    n_suffix = N_BATCH // 4 - (2 + len(p_tok))
    assert len(full_extra) > n_extra and len(tok(suffix)) > n_suffix
    fim_block = [
        FIM_PRE, *tok(prefix)[-n_prefix:], *p_tok,
        FIM_SUF, *tok(suffix)[:n_suffix],
        FIM_MID,
    ]  # fmt: skip
    want = [*full_extra[-n_extra:], *fim_block]
    if n_prefix_lines == 400:  # every budget full
        assert len(tok(prefix)) > n_prefix and len(want) == N_CTX - ROOM + 1
    got = qwen.service.worker.slots[r.json()["id_slot"]].tokens
    assert got == want
    assert got.count(FIM_PRE) == 1  # the literal "<|fim_prefix|>" in the code stayed text
    assert r.json()["tokens_evaluated"] == len(want)


def test_default_layout_types_behind_fim_mid(qwen: Live, qc: httpx.Client, qwen_vocab: Any) -> None:
    """The daemon's default: the cursor line follows FIM_MID and the suffix keeps its whole
    budget, so each keystroke evaluates only the line's changed tokens, not the suffix block."""

    def tok(text: str, special: bool = False) -> list[int]:
        return qwen_vocab.tokenize(text.encode(), add_bos=False, special=special)

    prefix = "".join(f"value_{i} = {i}\n" for i in range(40))
    suffix = "".join(f"print(value_{i})\n" for i in range(200))
    line = "    total = value_1 + value_2"
    base = {"id_slot": 1, "input_prefix": prefix, "input_suffix": suffix, "input_extra": [],
            "n_predict": 0}  # fmt: skip
    n_suffix = N_BATCH // 4 - 2
    head = [FIM_REP, *tok("myproject\n"), FIM_SEP, *tok("filename\n"), FIM_PRE, *tok(prefix),
            FIM_SUF, *tok(suffix)[:n_suffix], FIM_MID]  # fmt: skip
    r = qc.post("/infill", json={**base, "prompt": ""})
    assert r.status_code == 200 and qwen.service.worker.slots[r.json()["id_slot"]].tokens == head
    evaluated = []
    for n in range(4, len(line) + 1, 4):
        r = qc.post("/infill", json={**base, "prompt": line[:n]})
        assert r.status_code == 200, r.text
        want = [*head, *tok(line[:n], special=True)]
        assert qwen.service.worker.slots[r.json()["id_slot"]].tokens == want
        evaluated.append(r.json()["timings"]["prompt_n"])
    # the suffix block (~250 tokens) is never evaluated again: only the line's tail
    assert max(evaluated) <= len(tok(line, special=True)) + 1, evaluated


def test_ring_warmup_keeps_the_cursor_context_behind_the_ring(
    qwen: Live, qc: httpx.Client, qwen_vocab: Any
) -> None:
    """The editors' warm-up (n_predict 0, empty prefix/suffix/prompt, the ring in input_extra)
    caches the ring alone; with the ring already cached the slot keeps the cursor's prefix and
    suffix, so the next keystroke evaluates only its typed tokens."""
    ring = [{"text": "".join(f"def helper_{i}():\n    return {i}\n" for i in range(30)),
             "filename": "/p/helpers.py"}]  # fmt: skip
    key = {"id_slot": 1, "input_extra": ring, "n_predict": 0,
           "input_prefix": "".join(f"v{i} = {i}\n" for i in range(30)),
           "input_suffix": "".join(f"print(v{i})\n" for i in range(30))}  # fmt: skip
    warmup = {"id_slot": 1, "input_extra": ring, "n_predict": 0, "input_prefix": "",
              "input_suffix": "", "prompt": ""}  # fmt: skip
    # evaluated cold: the slot's KV is exact whatever it held, so the warm-up has no shifted
    # KV to repair (whether a repair fits its budget turns on this machine's measured speed)
    cold_key = {**key, "prompt": "    total =", "cache_prompt": False}
    r = qc.post("/infill", json=cold_key)
    assert r.status_code == 200
    slot = qwen.service.worker.slots[r.json()["id_slot"]]
    held = list(slot.tokens)
    r = qc.post("/infill", json=warmup)
    assert r.status_code == 200 and r.json()["timings"]["prompt_n"] == 0
    assert r.json()["id_slot"] == slot.id  # the slot that holds the ring
    assert slot.tokens == held  # nothing dropped
    head = held[: held.index(FIM_PRE)]
    assert r.json()["tokens_evaluated"] == len(head)  # the prompt: the ring alone
    r = qc.post("/infill", json={**key, "prompt": "    total = v1"})
    assert r.json()["timings"]["prompt_n"] <= 3
    # a new chunk: evaluated, and the cursor's context moves behind it (a KV shift, or
    # evaluated again where the exact-KV budget affords it), not dropped
    changed = [*ring, {"text": "x = 1\n", "filename": "/p/x.py"}]
    before = list(slot.tokens)
    r = qc.post("/infill", json={**warmup, "input_extra": changed})
    assert r.status_code == 200 and r.json()["timings"]["prompt_n"] > 0
    assert slot.tokens[slot.tokens.index(FIM_PRE) :] == before[before.index(FIM_PRE) :]
    r = qc.post("/infill", json={**key, "input_extra": changed, "prompt": "    total = v1"})
    assert r.json()["timings"]["prompt_n"] <= 3


def test_ring_warmup_in_llama_server_layout_drops_the_cursor_context(
    qwen: Live, qc: httpx.Client, server_layout: None
) -> None:
    """llama-server's own layout evaluates ``[FIM_PRE][FIM_SUF][FIM_MID]`` after the ring."""
    key = {"id_slot": 1, "n_predict": 0, "input_prefix": "a = 1\n", "input_suffix": "b\n",
           "prompt": "c"}  # fmt: skip
    assert qc.post("/infill", json=key).status_code == 200
    warmup = {"id_slot": 1, "n_predict": 0, "input_prefix": "", "input_suffix": "", "prompt": ""}
    r = qc.post("/infill", json=warmup)
    assert r.status_code == 200
    assert qwen.service.worker.slots[r.json()["id_slot"]].tokens[-3:] == [FIM_PRE, FIM_SUF, FIM_MID]


def test_empty_extra_layout(qwen: Live, qc: httpx.Client, qwen_vocab: Any) -> None:
    def tok(text: str) -> list[int]:
        return qwen_vocab.tokenize(text.encode(), add_bos=False, special=False)

    r = qc.post("/infill", json={"id_slot": 1, "input_prefix": "a = 1\n", "input_suffix": "b\n",
                                 "n_predict": 0})  # fmt: skip
    assert r.status_code == 200
    want = [FIM_REP, *tok("myproject\n"), FIM_SEP, *tok("filename\n"), FIM_PRE, *tok("a = 1\n"),
            FIM_SUF, *tok("b\n"), FIM_MID]  # fmt: skip
    assert qwen.service.worker.slots[r.json()["id_slot"]].tokens == want


# ---------------------------------------------------------------- fields, stream, errors


def test_response_fields_are_flat_paths(qc: httpx.Client) -> None:
    fields = ["content", "timings/prompt_n", "generation_settings/n_ctx", "missing/x"]
    r = qc.post("/infill", json={"input_prefix": "a", "input_suffix": "b", "n_predict": 2,
                                 "response_fields": fields})  # fmt: skip
    assert r.status_code == 200
    body = r.json()
    assert set(body) == {"content", "timings/prompt_n", "generation_settings/n_ctx"}
    assert body["generation_settings/n_ctx"] == N_CTX
    empty = qc.post("/infill", json={"input_prefix": "a", "input_suffix": "b", "n_predict": 1,
                                     "response_fields": [""]})  # fmt: skip
    assert empty.json() == {}


def test_server_timing_splits_engine_from_overhead(qc: httpx.Client) -> None:
    r = qc.post("/infill", json={"input_prefix": "a", "input_suffix": "b", "n_predict": 2})
    parts = dict(p.strip().split(";dur=") for p in r.headers["server-timing"].split(","))
    assert set(parts) == {
        "parse",
        "queue",
        "prep",
        "engine",
        "post",
        "wake",
        "render",
        "app",
        "total",
    }
    assert float(parts["engine"]) > 0 and float(parts["total"]) >= float(parts["engine"])


def test_auth_and_health(qwen: Live) -> None:
    with qwen.client() as c:
        assert c.get("/health").json() == {"status": "ok"}  # public
        assert c.head("/health").status_code == 200  # as monitors probe it
        assert c.get("/").status_code == 200  # the chat page: an iframe sends no key
        r = c.post("/infill", json={"input_prefix": "", "input_suffix": ""})
        assert r.status_code == 401
        assert r.json() == {"error": {"code": 401, "message": "Invalid API Key",
                                      "type": "authentication_error"}}  # fmt: skip
        wrong = c.get("/props", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        assert c.get("/props", headers={"X-Api-Key": KEY}).status_code == 200


def test_bad_requests_answer_400_in_llama_server_format(qc: httpx.Client) -> None:
    cases = [
        b"{not json",
        json.dumps({"input_prefix": "a"}).encode(),  # input_suffix missing
        json.dumps({"input_prefix": "a", "input_suffix": "b", "n_predict": -5}).encode(),
        json.dumps({"input_prefix": "a", "input_suffix": "b", "input_extra": "x"}).encode(),
        json.dumps({"input_prefix": "a", "input_suffix": "b", "prompt": [1, 2]}).encode(),
    ]
    for raw in cases:
        r = qc.post("/infill", content=raw, headers={"Content-Type": "application/json"})
        assert r.status_code == 400, (raw, r.text)
        err = r.json()["error"]
        assert err["code"] == 400 and err["type"] == "invalid_request_error" and err["message"]
    # a prompt longer than the context is cut by llama-server's (older) truncation rule
    too_long = qc.post("/completion", json={"prompt": list(range(N_CTX + 10)), "n_predict": 1})
    assert too_long.status_code == 200
    assert too_long.json()["truncated"] is True
    assert too_long.json()["tokens_evaluated"] < N_CTX
    bad_id = qc.post("/completion", json={"prompt": [10**9], "n_predict": 1})
    assert bad_id.status_code == 400
    # texts without ids are several prompts to llama-server: refused, not joined into one
    for route in ("/completion", "/v1/completions"):
        several = qc.post(route, json={"prompt": ["def f", "def g"], "max_tokens": 1})
        assert several.status_code == 400 and "one prompt per request" in several.text
    mixed = qc.post("/completion", json={"prompt": ["def ", 69, "()"], "n_predict": 1})
    assert mixed.status_code == 200  # ids and text: one prompt
    assert qc.get("/nope").json()["error"]["type"] == "not_found_error"
    # the daemon survived all of that
    ok = qc.post("/infill", json={"input_prefix": "a", "input_suffix": "b", "n_predict": 1})
    assert ok.status_code == 200


def test_full_queue_answers_503_with_retry_after(qwen: Live) -> None:
    """queue_limit is 1: one running on each of the two slots, one queued, the fourth is
    turned away. (The long generations wait after their first token until cancelled: they
    run on any machine.)"""
    long_body = {"prompt": "go", "n_predict": 3000, "top_k": 1, "id_slot": -1}
    worker = qwen.service.worker
    results: list[httpx.Response] = []

    def send() -> None:
        with qwen.client(headers=AUTH) as c:
            results.append(c.post("/completion", json=long_body))

    with held_generation(worker.engine):
        runners = [threading.Thread(target=send) for _ in range(3)]
        for n, runner in enumerate(runners[:2], start=1):
            runner.start()
            wait_until(lambda n=n: len(worker.running_jobs()) == n)  # both slots decode at once
        runners[2].start()
        wait_until(lambda: worker.queued == 1)
        with qwen.client(headers=AUTH) as c:
            r = c.post("/completion", json={"prompt": "x", "n_predict": 1})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "unavailable_error"
        worker.cancel_running()  # let the long ones end quickly
        wait_until(lambda: worker.busy and worker.queued == 0)
        worker.cancel_running()
        for runner in runners:
            runner.join()
    assert [x.status_code for x in results] == [200, 200, 200]


def test_a_newer_request_for_a_slot_replaces_its_queued_warmup(qwen: Live) -> None:
    """A queued warm-up is a background cache fill: the completion that comes after it for
    the slot takes its place (that a queued completion is never dropped is in
    tests/test_ops_units.py, whose worker queues more than this one)."""
    worker = qwen.service.worker
    results: dict[str, httpx.Response] = {}

    def send(name: str, body: dict[str, Any]) -> None:
        with qwen.client(headers=AUTH) as c:
            results[name] = c.post("/infill", json=body)

    base = {"input_prefix": "a", "input_suffix": "b", "id_slot": 0}
    long_body = {**base, "n_predict": 3000, "top_k": 1}  # two, on both slots: the others queue
    with held_generation(worker.engine) as hold:  # they run until cancelled, on any machine
        running = threading.Thread(target=send, args=("running", long_body))
        running.start()
        hold.wait_reached()
        also = threading.Thread(target=send, args=("also running", long_body))
        also.start()
        wait_until(lambda: len(worker.running_jobs()) == 2)
        old = threading.Thread(target=send, args=("old", {**base, "n_predict": 0}))
        old.start()
        wait_until(lambda: worker.queued == 1)
        new = threading.Thread(target=send, args=("new", {**base, "n_predict": 4, "prompt": "c"}))
        new.start()
        old.join()  # superseded at once, while the long request still runs
        assert worker.busy and "running" not in results
        worker.cancel_running()
        running.join()
        also.join()
        hold.release.set()
        new.join()
    assert results["old"].status_code == 503 and "superseded" in results["old"].text
    assert results["new"].status_code == 200


def test_props_models_slots_metrics(qwen: Live, qc: httpx.Client, qwen_target: Path) -> None:
    props = qc.get("/props").json()
    assert props["default_generation_settings"]["n_ctx"] == N_CTX
    assert props["model_path"] == str(qwen_target) and props["total_slots"] == 2
    assert props["draft_model_path"] and props["speculative"]["n_max"] == 16
    assert props["speculative"]["ring_attention"] == "blocks"  # the default
    assert props["speculative"]["pipeline"] == "auto"  # the default: the engine decides
    models = qc.get("/v1/models").json()
    assert models["data"][0]["id"] == qwen_target.name
    slots = qc.get("/slots").json()
    assert [s["id"] for s in slots] == [0, 1] and slots[0]["n_ctx"] == N_CTX
    assert qc.post("/infill", json={"input_prefix": "a", "input_suffix": "b", "n_predict": 1,
                                    "cache_prompt": False}).status_code == 200  # fmt: skip
    metrics = qc.get("/metrics")
    assert metrics.status_code == 200 and "localspec_prompt_tokens_cached_total" in metrics.text
    holes, compactions = qwen.service.worker.engine.kv_holes
    assert f"localspec_kv_holes {float(holes)}" in metrics.text
    assert f"localspec_kv_compactions_total {float(compactions)}" in metrics.text
    from localspec.bench.driver import prompt_tokens_metric  # what the replay bench reads

    engine_work = prompt_tokens_metric(metrics.text)
    assert engine_work is not None and engine_work >= qwen.service.worker.n_prompt_evaluated > 0
    assert "localspec_requests_cancelled_total" in metrics.text


def test_tokenize_detokenize(qc: httpx.Client) -> None:
    toks = qc.post("/tokenize", json={"content": "<|fim_prefix|>def"}).json()["tokens"]
    assert toks[0] == FIM_PRE  # parse_special defaults to true
    plain = qc.post("/tokenize", json={"content": "<|fim_prefix|>", "parse_special": False})
    assert FIM_PRE not in plain.json()["tokens"]
    pieces = qc.post("/tokenize", json={"content": "def f", "with_pieces": True}).json()
    assert "".join(p["piece"] for p in pieces["tokens"]) == "def f"
    text = qc.post("/detokenize", json={"tokens": toks[1:]}).json()["content"]
    assert text == "def"
    # control tokens render as text, as in llama-server (the same ids tokenize back)
    assert qc.post("/detokenize", json={"tokens": toks}).json()["content"] == "<|fim_prefix|>def"
    special = qc.post("/tokenize", json={"content": "<|fim_prefix|>", "with_pieces": True})
    assert special.json()["tokens"] == [{"id": FIM_PRE, "piece": "<|fim_prefix|>"}]
    # a character split over tokens: each part's bytes, never a replacement character
    split = qc.post("/tokenize", json={"content": "\u2e3b x", "with_pieces": True}).json()
    pieces = [p["piece"] for p in split["tokens"]]
    raw = b"".join(bytes(p) if isinstance(p, list) else p.encode() for p in pieces)
    assert raw == "\u2e3b x".encode() and isinstance(pieces[0], list)
    # a JSON body whatever the Content-Type says, as llama-server (curl -d sends a form type)
    for ctype in ("application/x-www-form-urlencoded", "text/plain"):
        r = qc.post("/tokenize", content=b'{"content":"def"}', headers={"Content-Type": ctype})
        assert r.status_code == 200 and r.json()["tokens"] == toks[1:]


def test_openai_completions_with_suffix_is_fim(qwen: Live, qc: httpx.Client) -> None:
    r = qc.post("/v1/completions", json={"prompt": "def f():\n", "suffix": "\n", "max_tokens": 3,
                                         "n": 2})  # fmt: skip
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and len(body["choices"]) == 2
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    last = max(qwen.service.worker.slots, key=lambda s: s.last_used)
    assert FIM_PRE in last.tokens and FIM_MID in last.tokens
    stream = qc.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "stream": True})
    lines = [x for x in stream.text.split("\n\n") if x]
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2][6:])
    assert last["choices"][0]["finish_reason"] is not None
    # as llama-server's: an OpenAI client reads the usage from the last chunk
    n_text = sum(1 for x in lines[:-2] if json.loads(x[6:])["choices"][0]["text"])
    assert last["usage"]["completion_tokens"] == last["timings"]["predicted_n"] >= n_text
    usage = last["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


# ---------------------------------------------------------------- a trained model: stop rules


# These tests compare answers to the same prompt: each is evaluated cold (the same batches), so
# they are the same computation on any CPU. With the prompt cached, a repeat would evaluate its
# last token alone, whose logits round differently from the batch's: a near tie of the trained
# model could then part the answers.
COLD = {"top_k": 1, "cache_prompt": False}


def _complete(c: httpx.Client, prompt: str, **kw: Any) -> dict[str, Any]:
    r = c.post("/completion", json={"prompt": prompt, "n_predict": 40, **COLD, **kw})
    assert r.status_code == 200, r.text
    return r.json()


CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n"


def cut_by_indent(text: str, n_indent: int) -> str:
    """llama-server's n_indent rule on a finished text (lines after the first newline)."""
    nl = text.find("\n")
    while nl >= 0:
        pos = nl + 1
        while pos < len(text) and text[pos] in " \t":
            pos += 1
        if pos < len(text) and pos - (nl + 1) < n_indent:
            return text[:pos]
        nl = text.find("\n", nl + 1)
    return text


def test_model_without_fim_answers_501(smollm: Live) -> None:
    with smollm.client() as c:
        r = c.post("/infill", json={"input_prefix": "a", "input_suffix": "b"})
        assert r.status_code == 501
        err = r.json()["error"]
        assert err["type"] == "not_supported_error"
        assert err["message"].startswith("Infill is not supported by this model")


def test_stop_strings_n_indent_and_time_limit(smollm: Live) -> None:
    with smollm.client() as c:
        free = _complete(c, CODE)
        text = free["content"]
        assert "\n" in text.strip("\n"), text  # the premise: several lines of code

        word = text.strip().split()[1]
        stopped = _complete(c, CODE, stop=[word])
        assert stopped["stop_type"] == "word" and stopped["stopping_word"] == word
        assert stopped["content"] == text[: text.index(word)]

        indented = _complete(c, CODE, n_indent=4)
        assert indented["stop_type"] == "limit", indented
        assert indented["content"] == cut_by_indent(text, 4)

        timed = _complete(c, CODE, t_max_predict_ms=1)
        assert timed["stop_type"] == "limit"
        assert "\n" in timed["content"] and text.startswith(timed["content"])
        assert len(timed["content"]) < len(text)


def test_streaming_matches_the_plain_answer(smollm: Live) -> None:
    with smollm.client() as c:
        plain = _complete(c, CODE, n_predict=12)
        with c.stream("POST", "/completion", json={"prompt": CODE, "n_predict": 12, **COLD,
                                                   "stream": True}) as r:  # fmt: skip
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert all(not e["stop"] for e in events[:-1]) and events[-1]["stop"] is True
    assert "".join(e["content"] for e in events[:-1]) == plain["content"]
    assert events[-1]["content"] == "" and events[-1]["timings"]["predicted_n"] == 12


def test_n_probs_reports_each_tokens_candidates(smollm: Live) -> None:
    """llama-server's pre-sampling n_probs: per generated token its log-probability and the
    likeliest tokens; the answer itself is the one given without n_probs."""
    import math

    with smollm.client() as c:
        plain = _complete(c, CODE, n_predict=12)
        probed = _complete(c, CODE, n_predict=12, n_probs=3)
        body = {"prompt": CODE, "n_predict": 12, "n_probs": 3, "stream": True, **COLD}
        with c.stream("POST", "/completion", json=body) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
        refused = [
            c.post("/completion", json={"prompt": CODE, "n_probs": 2, "post_sampling_probs": True}),
            c.post("/completion", json={"prompt": CODE, "n_probs": 100_000}),
        ]
    assert probed["content"] == plain["content"] and "completion_probabilities" not in plain
    assert probed["generation_settings"]["n_probs"] == 3
    report = probed["completion_probabilities"]
    assert [e["id"] for e in report] == probed["tokens"] and len(report) == 12
    assert b"".join(bytes(e["bytes"]) for e in report).decode() == probed["content"]
    for entry in report:
        top = entry["top_logprobs"]
        assert len(top) == 3 and top[0]["logprob"] >= top[1]["logprob"] >= top[2]["logprob"]
        assert sum(math.exp(t["logprob"]) for t in top) <= 1.0 + 1e-6
        assert entry["id"] == top[0]["id"]  # greedy: the likeliest token
        assert entry["logprob"] == pytest.approx(top[0]["logprob"])
        assert all(t["token"] == bytes(t["bytes"]).decode("utf-8", "ignore") for t in top)
    streamed = [e for e in events if not e["stop"]]
    assert [e["completion_probabilities"] for e in streamed] == [[entry] for entry in report]
    assert "completion_probabilities" not in events[-1]  # sent with the pieces already
    for r in refused:
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "post_sampling_probs" in refused[0].json()["error"]["message"]


def test_request_timeout_cancels_and_answers_503(qwen: Live, qc: httpx.Client) -> None:
    svc = qwen.service
    original = svc.settings
    svc.settings = replace(original, request_timeout_s=0.3)
    try:
        # the generation waits after its first token until cancelled: it outlasts the
        # timeout on any machine
        with held_generation(svc.worker.engine):
            r = qc.post("/completion", json={"prompt": "go", "n_predict": 3000, "top_k": 1})
    finally:
        svc.settings = original
    assert r.status_code == 503 and "timed out" in r.json()["error"]["message"]
    wait_until(lambda: not svc.worker.busy)  # the engine was told to stop, and did
    assert qc.post("/completion", json={"prompt": "go", "n_predict": 2}).status_code == 200


def test_streaming_several_completions_tags_each_with_its_index(qc: httpx.Client) -> None:
    body = {"input_prefix": "a", "input_suffix": "b", "n_predict": 3, "n_cmpl": 2,
            "stream": True, "input_extra": []}  # fmt: skip
    with qc.stream("POST", "/infill", json=body) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    finals = [e for e in events if e["stop"]]
    assert sorted(e["index"] for e in finals) == [0, 1]
    for index in (0, 1):
        parts = [e for e in events if not e["stop"] and e["index"] == index]
        assert len(parts) == next(f for f in finals if f["index"] == index)["tokens_predicted"]


def _metric(qc: httpx.Client, name: str) -> float:
    """An unlabelled series' value (it must be there)."""
    text = qc.get("/metrics").text
    return float(next(x for x in text.splitlines() if x.startswith(name + " ")).split()[-1])


def test_agreeing_completions_are_counted_in_the_request_log(
    qc: httpx.Client, caplog: pytest.LogCaptureFixture
) -> None:
    """Greedy completions always agree: the second and third draw at the first's rows. The
    prompt is evaluated once for the three, and the log line and /metrics count it once."""
    caplog.set_level(logging.INFO, logger=logs.REQUESTS)
    evaluated0 = _metric(qc, "localspec_prompt_tokens_evaluated_total")
    cached0 = _metric(qc, "localspec_prompt_tokens_cached_total")
    body = {"input_prefix": "def f(x):\n", "input_suffix": "\n", "n_predict": 6, "n_cmpl": 3,
            "top_k": 1, "input_extra": [], "cache_prompt": False}  # fmt: skip
    answers = qc.post("/infill", json=body).json()
    assert len({a["content"] for a in answers}) == 1
    n = answers[0]["tokens_predicted"]
    line = next(r for r in caplog.records if r.name == logs.REQUESTS and "/infill" in r.message)
    fields: dict[str, Any] = line.fields  # type: ignore[attr-defined]
    assert fields["followed"] == 2 * (n - 1)
    n_prompt = answers[0]["tokens_evaluated"]
    assert fields["n_prompt"] == n_prompt
    assert fields["evaluated"] + fields["reused"] == n_prompt  # not three prompts' worth
    assert fields["evaluated"] == answers[0]["timings"]["prompt_n"] > 0
    assert fields["prompt_ms"] == pytest.approx(answers[0]["timings"]["prompt_ms"], abs=0.01)
    assert fields["prompt_ms"] + fields["gen_ms"] <= fields["total_ms"]
    assert fields["predicted"] == sum(a["tokens_predicted"] for a in answers)
    evaluated = _metric(qc, "localspec_prompt_tokens_evaluated_total") - evaluated0
    assert evaluated == fields["evaluated"]
    assert _metric(qc, "localspec_prompt_tokens_cached_total") - cached0 == fields["reused"]


@pytest.mark.parametrize("blocks", [False, True])
def test_ring_blocks_move_a_rotated_ring_exactly(
    qwen: Live, qc: httpx.Client, blocks: bool
) -> None:
    """The ring loses its oldest chunk: evaluated causally, the moved chunks' KV is shifted
    (approximate, counted); as blocks it is moved exactly and the answer is the cold one's."""
    svc = qwen.service
    original = svc.settings
    svc.settings = replace(original, ring_attention="blocks" if blocks else "causal")
    engine = svc.worker.engine
    engine_settings = engine.settings
    # on this tiny model re-evaluating the ring costs less than the exact budget: shift instead
    engine.settings = replace(engine_settings, exact_ms=0.0)
    try:
        ring = ring_chunks(8)
        key = vscode_request("    argv = ", id_slot=1, top_k=1, samplers=["top_k"], n_predict=8)
        assert qc.post("/infill", json={**key, "input_extra": ring[:6]}).status_code == 200
        before = _metric(qc, "localspec_answers_on_shifted_kv_total")
        rotated = {**key, "input_extra": ring[1:7]}
        warm = qc.post("/infill", json=rotated).json()
        moved = _metric(qc, "localspec_answers_on_shifted_kv_total") - before
        cold = qc.post("/infill", json={**rotated, "cache_prompt": False, "n_probs": 2}).json()
        n_prompt = cold["timings"]["prompt_n"]
        assert 0 < warm["timings"]["prompt_n"] < n_prompt / 2  # the moved chunks were reused
        assert moved == (0 if blocks else 1)
        props = qc.get("/props").json()
        assert props["speculative"]["ring_attention"] == ("blocks" if blocks else "causal")
        if blocks:
            # moved blocks differ from a cold evaluation by K's rotation rounding (~2e-3 in the
            # logits, test_engine_blocks): no choice of the cold answer is that close a call,
            # so the answers are the same on any CPU
            top = [e["top_logprobs"] for e in cold["completion_probabilities"]]
            assert min(t[0]["logprob"] - t[1]["logprob"] for t in top) > 0.05, top
            assert warm["content"] == cold["content"]
    finally:
        svc.settings = original
        engine.settings = engine_settings
