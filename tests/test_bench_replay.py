"""`localspec bench replay`: request shapes, abort behaviour, reports, and a real short replay.

The traffic is checked field by field against what llama-vscode sends; the driver runs against
a loopback stub that answers after a delay chosen per request and records whether the client
waited or closed the connection (an abort), so abort behaviour is observed on the wire.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from localspec.bench import anchor, editor, report
from localspec.bench.background import TURN_GAP_S
from localspec.bench.driver import (
    ColdCheck,
    ColdMode,
    Outcome,
    Target,
    answers_consistent,
    cold_body,
    divergence,
    replay,
    run_burst,
)
from localspec.bench.replay import build_parser as replay_parser
from localspec.bench.replay import main as replay_main
from localspec.bench.replay import own_n_cmpl, server_specs
from localspec.bench.stats import percentile

KEYSTROKE_FIELDS = {
    "id_slot", "input_prefix", "input_suffix", "input_extra", "prompt", "n_predict", "n_cmpl",
    "top_k", "top_p", "seed", "stream", "samplers", "cache_prompt", "t_max_prompt_ms",
    "t_max_predict_ms",
}  # fmt: skip


def _write_code(root: Path, n_files: int = 4, n_lines: int = 400) -> Path:
    """Source files whose every line says where it is, so windows can be checked exactly."""
    root.mkdir(parents=True, exist_ok=True)
    for f in range(n_files):
        lines = []
        for i in range(n_lines):
            indent = "    " * (i % 3)
            lines.append(f"{indent}value_{f}_{i} = compute({i}, name='f{f}')")
        (root / f"mod{f}.py").write_text("\n".join(lines) + "\n")
    return root


@pytest.fixture(scope="module")
def code_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_code(tmp_path_factory.mktemp("code"))


@pytest.fixture(scope="module")
def sources(code_dir: Path) -> list[editor.SourceFile]:
    return editor.load_sources(code_dir)


# --- the traffic ----------------------------------------------------------------------------


def test_keystroke_bodies_match_llama_vscode(sources: list[editor.SourceFile]) -> None:
    settings = editor.TrafficSettings(locations=6, max_keys=12)
    schedule = editor.build_schedule(settings, sources)
    by_path = {s.path: s.lines for s in sources}
    assert len(schedule.bursts) == 6
    for burst in schedule.bursts:
        lines = by_path[burst.filename]
        y = burst.line_no
        indent = len(burst.line) - len(burst.line.lstrip(" "))
        # one request on arrival, then one per typed character
        assert len(burst.keys) == min(12, len(burst.line.rstrip()) - indent) + 1
        assert [k.kind for k in burst.keys][-1] == "final"
        for k, key in enumerate(burst.keys):
            body = key.body
            assert set(body) == KEYSTROKE_FIELDS | ({"n_indent"} if indent else set())
            assert body["input_prefix"] == "\n".join(lines[max(0, y - 256) : y]) + "\n"
            # retyping: nothing of the line is right of the cursor yet
            assert body["input_suffix"] == "\n" + "\n".join(lines[y + 1 : y + 65]) + "\n"
            typed = burst.line[: indent + k]
            assert body["prompt"] == ("" if typed.strip() == "" else typed)
            if indent:
                assert body["n_indent"] == indent
            assert body["n_predict"] == 128 and body["n_cmpl"] == 3  # llama-vscode asks for three
            assert body["top_k"] == 40 and body["top_p"] == 0.99 and body["seed"] == 42
            assert body["samplers"] == ["top_k", "top_p", "infill"]
            assert body["cache_prompt"] is True and body["stream"] is False
            assert body["t_max_prompt_ms"] == 500 and body["t_max_predict_ms"] == 500
            assert body["id_slot"] == 0
            assert body["input_extra"] == burst.keys[0].body["input_extra"]
        waits = [k.wait_s for k in burst.keys[:-1] if k.kind == "type"]
        assert all(0.08 <= w <= 0.15 for w in waits)
        assert all(1.0 <= k.wait_s <= 2.5 for k in burst.keys if k.kind == "pause")


def test_prefix_window_is_256_lines_deep_in_a_file(tmp_path: Path) -> None:
    srcs = editor.load_sources(_write_code(tmp_path / "c", n_files=2, n_lines=900))
    settings = editor.TrafficSettings(locations=12, max_keys=2)
    deep = [b for b in editor.build_schedule(settings, srcs).bursts if b.line_no >= 300]
    assert deep, "some location lies past line 300"
    body = deep[0].keys[0].body
    assert body["input_prefix"].count("\n") == 256
    assert body["input_suffix"].count("\n") == 1 + min(64, 900 - deep[0].line_no)


def test_ring_chunks_and_warmups(sources: list[editor.SourceFile]) -> None:
    settings = editor.TrafficSettings(locations=10, max_keys=3)
    schedule = editor.build_schedule(settings, sources)
    # the session starts with a ring filled from other places, sent as one warm-up
    setup = schedule.setup
    assert setup["n_predict"] == 0 and setup["samplers"] == [] and setup["t_max_predict_ms"] == 1
    assert setup["input_prefix"] == setup["input_suffix"] == setup["prompt"] == ""
    assert 1 <= len(setup["input_extra"]) <= 16
    n_warmups = 0
    previous = setup["input_extra"]
    for burst in schedule.bursts:
        assert len(burst.warmups) <= int(burst.idle_s) + 1  # one per idle second at most
        for warm in burst.warmups:
            n_warmups += 1
            assert set(warm) == KEYSTROKE_FIELDS
            assert warm["n_predict"] == 0 and warm["samplers"] == []
            assert warm["t_max_predict_ms"] == 1
            assert warm["input_prefix"] == warm["input_suffix"] == warm["prompt"] == ""
            # each warm-up follows exactly one chunk entering the ring (oldest evicted if full)
            assert warm["input_extra"][-1] not in previous
            assert warm["input_extra"][:-1] == [c for c in previous if c in warm["input_extra"]]
            previous = warm["input_extra"]
        extra = burst.keys[0].body["input_extra"]
        assert extra == previous
        assert len(extra) <= 16
        for chunk in extra:
            assert set(chunk) == {"text", "time", "filename"}
            assert chunk["text"].endswith("\n") and 3 <= chunk["text"].count("\n") <= 32
            assert Path(chunk["filename"]).is_absolute()
    assert n_warmups > 0


def test_schedule_is_seeded(sources: list[editor.SourceFile]) -> None:
    a = editor.build_schedule(editor.TrafficSettings(locations=4), sources)
    b = editor.build_schedule(editor.TrafficSettings(locations=4), sources)
    c = editor.build_schedule(editor.TrafficSettings(locations=4, seed=7), sources)
    assert a.bursts == b.bursts
    assert a.bursts != c.bursts
    greedy = editor.build_schedule(editor.TrafficSettings(locations=1, greedy=True), sources)
    assert greedy.bursts[0].keys[0].body["top_k"] == 1


def test_ring_evicts_near_duplicates_and_oldest() -> None:
    import random

    ring = editor.Ring(editor.TrafficSettings(ring_n_chunks=2, ring_chunk_lines=4))
    rng = random.Random(0)
    src = editor.SourceFile("/a.py", [f"line {i}" for i in range(20)])
    ring.pick(rng, src, 0, 4, 1)
    ring.pick(rng, src, 0, 4, 2)  # the same four lines: not queued twice
    assert len(ring.queued) == 1
    ring.update()
    ring.pick(rng, src, 8, 12, 3)
    ring.pick(rng, src, 12, 16, 4)
    assert ring.update() and ring.update() and not ring.update()
    assert [c.lines[0] for c in ring.chunks] == ["line 8", "line 12"]  # oldest evicted


def test_bad_settings_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="locations"):
        editor.TrafficSettings(locations=0).check()
    with pytest.raises(ValueError, match="interval_s"):
        editor.TrafficSettings(interval_s=(0.2, 0.1)).check()
    with pytest.raises(ValueError, match="not found"):
        editor.load_sources(tmp_path / "missing")
    with pytest.raises(ValueError, match="at least two"):
        editor.load_sources(_write_code(tmp_path / "one", n_files=1))


# --- the driver, against a stub that sees aborts on the wire ---------------------------------


def _candidate(text: str, prob: float) -> dict[str, Any]:
    return {"id": 0, "token": text, "bytes": list(text.encode()), "logprob": math.log(prob)}


def _report(content: str) -> list[dict[str, Any]]:
    """The stub's n_probs report: "different" (a cold answer that disagrees) parts from the
    warm "<...>" on a near tie (0.5 vs 0.4, warm took the runner-up "<"); any other answer
    is one confident token (0.9 vs 0.05)."""
    if content == "different":
        return [
            {**_candidate("diff", 0.5), "top_logprobs": [_candidate("diff", 0.5),
                                                         _candidate("<", 0.4)]},
            {**_candidate("erent", 0.9), "top_logprobs": [_candidate("erent", 0.9),
                                                          _candidate("x", 0.05)]},
        ]  # fmt: skip
    return [{**_candidate(content, 0.9), "top_logprobs": [_candidate(content, 0.9),
                                                          _candidate("?", 0.05)]}]  # fmt: skip


class Stub:
    """An HTTP/1.1 /infill server on loopback: answers after ``delay(body)`` seconds, or
    records an abort when the client closes the connection first."""

    def __init__(self, delay: Any) -> None:
        self.delay = delay
        self.log: list[tuple[str, dict[str, Any]]] = []  # ("answered" | "aborted", body)
        self.answered_at: list[float] = []  # time.monotonic() of each answer
        self.metered_at: list[float] = []  # ... and of each GET /metrics
        self.work = 0  # prompt "tokens" received, aborted requests included (GET /metrics)
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._handle, "127.0.0.1", 0)
        )
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                if lines[0].startswith("GET /metrics"):
                    self.metered_at.append(time.monotonic())
                    text = "# TYPE llamacpp:prompt_tokens_total counter\n"
                    text += f"llamacpp:prompt_tokens_total {self.work}\n"
                    writer.write(
                        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n"
                        + f"Content-Length: {len(text)}\r\n\r\n{text}".encode()
                    )
                    await writer.drain()
                    continue
                length = next(
                    int(h.split(":")[1]) for h in lines if h.lower().startswith("content-length")
                )
                body = json.loads(await reader.readexactly(length))
                self.work += len(body["prompt"]) + 1
                try:  # a closed connection reads EOF before the delay is over
                    got = await asyncio.wait_for(reader.read(1), self.delay(body))
                except asyncio.TimeoutError:
                    got = None
                if got == b"":
                    self.log.append(("aborted", body))
                    return
                self.log.append(("answered", body))
                self.answered_at.append(time.monotonic())
                answer = {
                    "content": f"<{body['prompt']}>",
                    "stop_type": "limit",
                    "tokens_cached": 10,
                    "timings": {
                        "prompt_n": len(body["prompt"]) + 1,
                        "cache_n": 9,
                        "prompt_ms": 1.0,
                        "predicted_n": 4,
                        "predicted_ms": 2.0,
                        "draft_n": 4,
                        "draft_n_accepted": 3,
                    },
                }
                if body.get("cache_prompt") is False and body["prompt"].endswith("2"):
                    answer["content"] = "different"  # the cold cache disagrees here
                if body.get("n_probs"):
                    answer["completion_probabilities"] = _report(answer["content"])
                data = json.dumps(answer).encode()
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    b"Server-Timing: engine;dur=1.5, app;dur=0.2\r\n"
                    + f"Content-Length: {len(data)}\r\n\r\n".encode()
                    + data
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            return
        finally:
            writer.close()

    def __enter__(self) -> Stub:
        self._thread.start()
        self._ready.wait(5)
        return self

    async def _shutdown(self) -> None:
        self._server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def __exit__(self, *_: object) -> None:
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _slow_on(chars: str) -> Any:
    """A delay rule: 3 s (far past any typing interval) when the prompt ends in ``chars``."""

    def delay(body: dict[str, Any]) -> float:
        if body["n_predict"] == 0:
            return 0.05
        prompt = body["prompt"]
        return 3.0 if prompt and prompt[-1] in chars and body["cache_prompt"] else 0.0

    return delay


def _burst(keys: list[tuple[str, float, editor.KeyKind]], warmups: int = 1) -> editor.Burst:
    base = {"n_predict": 128, "cache_prompt": True}
    return editor.Burst(
        index=0,
        filename="/x.py",
        line_no=0,
        line="",
        idle_s=0.2,
        warmups=tuple({"prompt": "", "n_predict": 0} for _ in range(warmups)),
        keys=tuple(editor.Keystroke({**base, "prompt": p}, w, kind) for p, w, kind in keys),
    )


# between keystrokes of these tests: a request is aborted once the next key is due, so the
# stub's instant answers must come back within it, on a loaded machine too (a stalled answer
# waits 3 s, far longer)
KEY_S = 0.5


def test_slow_requests_are_aborted_on_the_wire() -> None:
    burst = _burst(
        [("a", KEY_S, "type"), ("ab", KEY_S, "type"), ("abc", KEY_S, "type"),
         ("abcd", 5.0, "final")]
    )  # fmt: skip
    with Stub(_slow_on("b")) as stub:

        async def go() -> list[Outcome]:
            target = Target("stub", stub.url)
            try:
                return await run_burst(target, burst)
            finally:
                await target.aclose()

        outcomes = asyncio.run(go())
    keys = [o for o in outcomes if o.key >= 0]
    assert [o.status for o in keys] == ["ok", "aborted", "ok", "ok"]
    assert [o.kind for o in outcomes if o.key < 0] == ["warmup"]
    # the stub saw the abort: the client closed that connection before the answer
    assert ("aborted", burst.keys[1].body) in stub.log
    assert [s for s, b in stub.log if b.get("n_predict") == 0] == ["answered"]
    ok = keys[0]
    assert ok.content == "<a>" and ok.prompt_n == 2 and ok.cache_n == 9
    assert ok.draft_n == 4 and ok.draft_n_accepted == 3
    assert ok.server_timing == {"engine": 1.5, "app": 0.2}


def two_locations() -> editor.Schedule:
    """A short schedule in three generated files: 2 locations, 3 keys each, no pauses."""
    settings = editor.TrafficSettings(
        locations=2, max_keys=3, pause_prob=0.0, interval_s=(KEY_S, KEY_S)
    )
    src = [
        editor.SourceFile(f"/m{i}.py", [f"x{i}_{j} = {j}  # filler" for j in range(120)])
        for i in range(3)
    ]
    return editor.build_schedule(settings, src)


def replay_on(
    make: Callable[[], list[Target]], schedule: editor.Schedule, cold: ColdMode
) -> list[Outcome]:
    """Replay ``schedule`` on the targets ``make`` builds (inside the event loop, where their
    HTTP clients live), closing them after."""

    async def go() -> list[Outcome]:
        targets = make()
        try:
            return await replay(targets, schedule, cold=cold)
        finally:
            for t in targets:
                await t.aclose()

    return asyncio.run(go())


def test_interleaved_replay_with_cold_checks() -> None:
    schedule = two_locations()
    with Stub(_slow_on("")) as a, Stub(_slow_on("")) as b:
        outcomes = replay_on(lambda: [Target("A", a.url), Target("B", b.url)], schedule, "all")
        log_a, log_b = list(a.log), list(b.log)
    # both servers saw the same requests in the same order (setup, warm-ups, keys, cold)
    assert [body for _, body in log_a] == [body for _, body in log_b]
    n_keys = sum(len(bu.keys) for bu in schedule.bursts)
    keyed = [o for o in outcomes if o.key >= 0 and o.kind != "warmup"]
    assert len(keyed) == 2 * n_keys and all(o.status == "ok" for o in keyed)
    colds = [body for _, body in log_a if body.get("cache_prompt") is False]
    assert len(colds) == n_keys and all(body["n_probs"] == 2 for body in colds)
    summaries = report.summarize(outcomes, ["A", "B"])
    for s in summaries:
        assert s.sent == n_keys and s.completed == n_keys and s.aborted == 0
        assert s.cold_checked == n_keys
        n_differ = sum(1 for o in keyed if o.server == s.server and o.cold and not o.cold.identical)
        assert s.cold_identical == pytest.approx(1 - n_differ / n_keys)
        # every disagreement parts on the stub's near tie, the runner-up taken
        assert n_differ > 0 and s.cold_parted == n_differ
        assert s.parted_margin_p50 == s.parted_margin_max == pytest.approx(0.1)
        assert s.parted_runner_up == 1.0
        assert s.cold_margin_p50 == pytest.approx(0.85)
        assert s.acceptance == pytest.approx(0.75)
    assert summaries[1].agree_with_first == 1.0
    assert summaries[1].cold_agree_with_first == 1.0  # same stub, same cold answers
    # all prompt work: the servers' own counters around each location (keys and warm-ups,
    # not the setup fill nor the cold re-evaluations after the location)
    typed = [b for bu in schedule.bursts for b in (*bu.warmups, *(k.body for k in bu.keys))]
    want = sum(len(b["prompt"]) + 1 for b in typed) / n_keys
    assert [s.prompt_all_per_key for s in summaries] == [pytest.approx(want)] * 2
    meters = [o for o in outcomes if o.kind == "meter"]
    assert len(meters) == 2 * len(schedule.bursts)


def test_each_servers_turn_begins_after_an_idle_gap() -> None:
    """localspec's thread rule reads the last fraction of a second of other processes' CPU as
    load: a turn that began the instant the other server's ended would run on fewer threads."""
    with Stub(_slow_on("")) as a, Stub(_slow_on("")) as b:
        replay_on(lambda: [Target("A", a.url), Target("B", b.url)], two_locations(), "final")
    answered = sorted(a.answered_at + b.answered_at)
    turns = a.metered_at[::2] + b.metered_at[::2]  # each turn reads the metrics first
    assert len(turns) == 2 * len(two_locations().bursts)
    for start in turns:
        last = max(t for t in answered if t < start)  # (the setup fills come first)
        assert start - last >= TURN_GAP_S


def test_cold_checks_go_to_the_oracle_and_leave_the_measured_cache_alone() -> None:
    schedule = two_locations()
    with Stub(_slow_on("")) as measured, Stub(_slow_on("")) as twin:
        outcomes = replay_on(
            lambda: [Target("A", measured.url, oracle=Target("A.cold", twin.url))], schedule, "all"
        )
        seen, checked = list(measured.log), list(twin.log)
    n_keys = sum(len(bu.keys) for bu in schedule.bursts)
    assert not [b for _, b in seen if b.get("cache_prompt") is False]
    assert len(seen) == 1 + sum(len(bu.keys) + len(bu.warmups) for bu in schedule.bursts)
    assert [b["cache_prompt"] for _, b in checked] == [False] * n_keys
    # no clock, and the length the answer had (the stub's answers stop by limit at 4 tokens)
    assert {(b["t_max_predict_ms"], b["n_predict"]) for _, b in checked} == {(0, 4)}
    colds = [o.cold for o in outcomes if o.cold is not None]
    assert len(colds) == n_keys and all(o.server == "A" for o in outcomes)
    # the twin's answers decide: it disagrees on prompts ending in "2", as the stub does
    assert {c.content for c in colds if not c.identical} == {"different"}


def test_a_cold_check_has_no_clock_and_the_length_a_limit_gave_the_answer() -> None:
    body = {"prompt": "x", "n_predict": 128, "t_max_predict_ms": 500, "n_indent": 4}

    def answer(stop_type: str, predicted_n: int | None) -> Outcome:
        return _outcome("A", 0, 1.0, stop_type=stop_type, predicted_n=predicted_n)

    timed = cold_body(body, answer("limit", 37))  # the deadline (or n_indent) ended it
    assert timed == {
        **body,
        "cache_prompt": False,
        "n_probs": 2,
        "t_max_predict_ms": 0,
        "n_predict": 37,
        "n_cmpl": 1,  # only the first completion is compared: it has the body's seed
    }
    ended = cold_body(body, answer("eos", 12))  # the model ended it: the cold one may go on
    assert ended["n_predict"] == 128 and ended["t_max_predict_ms"] == 0
    assert cold_body(body, answer("limit", None))["n_predict"] == 128
    assert body["t_max_predict_ms"] == 500  # the replayed body itself is untouched


def test_a_twin_is_the_same_server_on_another_port() -> None:
    serve = anchor.ServeSettings(target=Path("t.gguf"), draft=Path("d.gguf"))
    for spec in (
        anchor.localspec_spec(serve, port=1),
        anchor.llama_server_spec(Path("llama-server"), serve, "draft", port=1),
    ):
        twin = anchor.twin(spec)
        assert twin.name == spec.name + ".cold" and twin.port != spec.port
        at = spec.argv.index("--port")
        assert twin.argv[at + 1] == str(twin.port)
        assert (
            twin.argv[: at + 1] + twin.argv[at + 2 :] == spec.argv[: at + 1] + spec.argv[at + 2 :]
        )


# --- reports --------------------------------------------------------------------------------


def test_percentile_matches_numpy_linear() -> None:
    import numpy as np

    values = [5.0, 1.0, 9.0, 3.0, 7.0, 2.0]
    for q in (0, 10, 50, 95, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([], 50) is None


def test_consistency_rule() -> None:
    assert answers_consistent("abc", "eos", "abc", "eos")
    assert answers_consistent("ab", "limit", "abcd", "eos")  # cut early by the time budget
    assert answers_consistent("abcd", "eos", "ab", "limit")
    assert not answers_consistent("ab", "eos", "abcd", "eos")
    assert not answers_consistent("ax", "limit", "abcd", "eos")


def test_divergence_finds_where_an_answer_leaves_the_cold_tokens() -> None:
    def entry(text: str, *alts: tuple[str, float], p: float = 0.6) -> dict[str, Any]:
        top = [_candidate(text, p), *(_candidate(t, q) for t, q in alts)]
        return {**_candidate(text, p), "top_logprobs": top}

    cold = [entry("def"), entry(" f", (" g", 0.3)), entry("(x)", ("(y)", 0.2), p=0.7)]
    assert divergence("def f(x)", cold) is None  # the same path
    assert divergence("def f", cold) is None  # cut shorter
    assert divergence("def f(", cold) is None  # cut inside a token
    assert divergence("def f(x) + more", cold) is None  # the cold answer was cut shorter
    assert divergence("def g()", cold) == (pytest.approx(0.3), True)  # the runner-up
    assert divergence("def f[x]", cold) == (pytest.approx(0.5), False)  # a third choice
    ended = [entry("a"), entry("", ("b", 0.35), p=0.4)]  # the cold answer ends (EOG)
    assert divergence("ab", ended) == (pytest.approx(0.05), True)
    assert divergence("zz", [{**_candidate("a", 0.9), "top_logprobs": []}]) is None


def _outcome(server: str, key: int, ms: float, status: str = "ok", **kw: Any) -> Outcome:
    return Outcome(server, 0, key, kw.pop("kind", "type"), status, ms, **kw)  # type: ignore[arg-type]


def test_summary_pairs_latency_and_ratios() -> None:
    outcomes = [
        _outcome("fast", 0, 10, prompt_n=2, predicted_ms=4.0),
        _outcome("fast", 1, 20, prompt_n=4, predicted_ms=4.0),
        _outcome(
            "fast",
            2,
            30,
            kind="final",
            prompt_n=6,
            predicted_ms=28.0,
            content="x",
            cold=ColdCheck(
                "ok",
                50,
                "x",
                identical=True,
                consistent=True,
                probabilities=[
                    {
                        **_candidate("x", 0.7),
                        "top_logprobs": [_candidate("x", 0.7), _candidate("z", 0.2)],
                    }
                ],
            ),
        ),
        _outcome("slow", 0, 100, prompt_n=10),
        _outcome("slow", 1, 150, "aborted"),
        _outcome(
            "slow",
            2,
            300,
            kind="final",
            prompt_n=30,
            content="y",
            cold=ColdCheck("ok", 50, "z", identical=False, consistent=False),
        ),
    ]
    fast, slow = report.summarize(outcomes, ["fast", "slow"])
    fast_cold = outcomes[2].cold
    assert (fast.completed, slow.completed, slow.aborted) == (3, 2, 1)
    assert fast.p50_ms == 20 and slow.p50_ms == 200
    assert fast.paired_p50_ms == 20  # keys 0 and 2 only: key 1 was aborted on "slow"
    assert slow.paired_p50_ms == 200
    assert fast.prompt_n_mean == 4 and slow.prompt_n_mean == 20
    assert fast.before_gen_p50_ms == 6  # latency minus generation: 6, 16 and 2 ms
    assert slow.before_gen_p50_ms is None  # no generation times reported
    assert fast.cold_identical == 1.0 and slow.cold_identical == 0.0
    assert slow.agree_with_first == 0.0
    assert fast.cold_agree_with_first is None  # the first server is the reference
    assert slow.cold_agree_with_first == 0.0  # "z" (slow's cold) vs "x" (fast's cold)
    assert slow.cold_vs_first_margin_p50 == slow.cold_vs_first_margin_max == pytest.approx(0.5)
    same_cold = [o if o.server == "fast" else replace(o, cold=fast_cold) for o in outcomes]
    assert report.summarize(same_cold, ["fast", "slow"])[1].cold_agree_with_first == 1.0
    rel = report.ratios([fast, slow])["slow"]
    assert rel["paired_p50_ms"] == pytest.approx(0.1) and rel["prompt_n_mean"] == 0.2
    text = report.table([fast, slow])
    assert "latency p50 ms" in text and "identical to cold cache" in text and "vs slow" in text
    anchor_like = replace(slow, server="llama-server/plain")
    assert report.best_anchor([fast, anchor_like]) is anchor_like


def test_plot_draws_both_panels(tmp_path: Path) -> None:
    outcomes = [_outcome("a", k, 10.0 * (k + 1), prompt_n=k) for k in range(5)]
    outcomes += [_outcome("b", k, 30.0 * (k + 1), prompt_n=5 * k + 1) for k in range(5)]
    path = tmp_path / "plot" / "replay.png"
    report.plot(outcomes, ["a", "b"], path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- the command ----------------------------------------------------------------------------


def test_a_twin_replays_the_same_keystrokes_with_its_own_n_cmpl() -> None:
    """``--also-n-cmpl``: the twin gets every body the first server gets, n_cmpl replaced,
    and the two compare keystroke by keystroke."""
    schedule = two_locations()
    with Stub(_slow_on("")) as a, Stub(_slow_on("")) as b:
        outcomes = replay_on(
            lambda: [Target("A", a.url), Target("A/n_cmpl1", b.url, overrides={"n_cmpl": 1})],
            schedule,
            "none",
        )
        log_a, log_b = list(a.log), list(b.log)
    keys = [body for _, body in log_a if body.get("n_predict")]
    assert keys and all(body["n_cmpl"] == 3 for body in keys)  # llama-vscode's default
    assert [{**body, "n_cmpl": 1} for _, body in log_a] == [body for _, body in log_b]
    got = own_n_cmpl(outcomes, "A", "A/n_cmpl1", 3, 1)
    n_keys = sum(len(bu.keys) for bu in schedule.bursts)
    assert got["paired_n"] == n_keys and got["twin_n_cmpl"] == 1
    mine, twins = got["paired_p50_ms_each"]
    assert mine == report.summarize(outcomes, ["A"])[0].p50_ms  # every key completed by both
    assert got["paired_p50_ms"] == pytest.approx(mine / twins)


def test_also_n_cmpl_starts_a_second_localspec(tmp_path: Path) -> None:
    target = tmp_path / "t.gguf"
    target.write_bytes(b"GGUF")
    args = replay_parser().parse_args(["--target", str(target), "--also-n-cmpl", "1"])
    first, twin = server_specs(args)
    assert (first.name, twin.name) == ("localspec", "localspec/n_cmpl1")
    assert first.port != twin.port
    port_at = first.argv.index("--port") + 1
    assert twin.argv[:port_at] == first.argv[:port_at]
    assert twin.argv[port_at + 1 :] == first.argv[port_at + 1 :]
    args = replay_parser().parse_args(["--url", "http://x", "--also-n-cmpl", "1"])
    with pytest.raises(ValueError, match="--also-n-cmpl"):
        server_specs(args)
    args = replay_parser().parse_args(["--target", str(target), "--also-pinned"])
    first, pinned = server_specs(args)
    assert pinned.name == "localspec/pinned" and first.port != pinned.port
    assert pinned.argv[-2:] == ["--set", "server.slot_choice=pinned"]
    assert "server.slot_choice=pinned" not in first.argv


def test_also_jump_policy_starts_a_localspec_with_the_other_policy(tmp_path: Path) -> None:
    target = tmp_path / "t.gguf"
    target.write_bytes(b"GGUF")
    argv = ["--target", str(target), "--jump-policy", "wait", "--also-jump-policy", "budget"]
    first, other = server_specs(replay_parser().parse_args(argv))
    assert (first.name, other.name) == ("localspec", "localspec/jump-budget")
    assert first.argv[-2:] == ["--jump-policy", "wait"] and first.port != other.port
    assert other.argv[-2:] == ["--jump-policy", "budget"] and "wait" not in other.argv


def test_budget_answers_are_counted_and_compared_with_the_first_servers() -> None:
    outcomes = [
        _outcome("wait", 0, 900, content="a"),
        _outcome("wait", 1, 800, content="b"),
        _outcome("wait", 2, 50, content="c"),
        replace(_outcome("budget", 0, 300, content="a"), budget=True),
        replace(_outcome("budget", 1, 300, content="x"), budget=True),
        _outcome("budget", 2, 40, content="c"),
    ]
    wait, budget = report.summarize(outcomes, ["wait", "budget"])
    assert (wait.budget, wait.budget_share, wait.budget_equal_first) == (0, None, None)
    assert budget.budget == 2 and budget.budget_share == pytest.approx(2 / 3)
    assert budget.budget_compared == 2 and budget.budget_equal_first == 0.5
    text = report.table([wait, budget])
    assert "budget answers (nearest lines)" in text and "= first's answer" in text
    assert "identical to cold cache" not in text  # (no cold checks: the row is left out)


def test_cli_against_a_url_writes_json(code_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    with Stub(_slow_on("e")) as stub:
        code = replay_main(
            [
                "--url",
                stub.url,
                "--code",
                str(code_dir),
                "--locations",
                "2",
                "--max-keys",
                "6",
                "--json",
                str(out),
                "--quiet",
            ]
        )
    assert code == 0
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "replay" and doc["traffic"]["locations"] == 2
    (summary,) = doc["summaries"]
    assert summary["sent"] == summary["completed"] + summary["aborted"]
    assert summary["cold_checked"] == 2  # the last keystroke of each line
    assert {r["kind"] for r in doc["requests"]} >= {"setup", "type", "final"}


def test_cli_refuses_missing_inputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert replay_main(["--code", str(_write_code(tmp_path / "c"))]) == 2
    assert "--target" in capsys.readouterr().err
    assert replay_main(["--target", str(tmp_path / "nope.gguf"), "--code", str(tmp_path)]) == 2
    assert "not found" in capsys.readouterr().err


@pytest.fixture()
def no_llama_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("LLAMA_SERVER_BIN", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    yield


@pytest.mark.usefixtures("no_llama_server")
def test_vs_llama_server_needs_a_binary(
    qwen_target: Path, code_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "--url",
        "http://127.0.0.1:9",
        "--target",
        str(qwen_target),
        "--code",
        str(code_dir),
        "--vs-llama-server",
        "plain",
    ]
    assert replay_main(argv) == 2
    assert "LLAMA_SERVER_BIN" in capsys.readouterr().err


# --- a real replay: localspec's daemon on a fixture model -------------------------------------


def test_short_real_replay_against_localspec(
    qwen_target: Path, code_dir: Path, tmp_path: Path
) -> None:
    """The whole path: start `localspec up` on a free port, type a few keys, check one answer
    against a cold cache, write JSON."""
    out = tmp_path / "real.json"
    argv = ["--target", str(qwen_target), "--code", str(code_dir), "--ctx", "2048",
            "--threads", "1", "--locations", "1", "--max-keys", "2", "--greedy",
            "--json", str(out), "--log-dir", str(tmp_path / "logs"), "--quiet"]  # fmt: skip
    assert replay_main(argv) == 0
    doc = json.loads(out.read_text())
    (summary,) = doc["summaries"]
    assert summary["server"] == "localspec" and summary["errors"] == 0
    assert summary["sent"] == 3 and summary["completed"] >= 1  # the last key waits its answer
    assert summary["cold_checked"] == 1
    (final,) = [r for r in doc["requests"] if r["kind"] == "final"]
    assert final["status"] == "ok" and final["prompt_n"] > 0
    # the ring warmed up by the setup request is reused, not evaluated again
    assert final["cache_n"] > 0 and final["cold"]["prompt_n"] > final["prompt_n"]
    setup = next(r for r in doc["requests"] if r["kind"] == "setup")
    assert setup["status"] == "ok" and setup["prompt_n"] > 0
    assert doc["servers"][0]["argv"][1:4] == ["-m", "localspec", "up"]
    # the cold check ran on a twin: the measured daemon's log shows only the replay's requests
    assert doc["cold_on"] == {"localspec": "localspec.cold"}
    assert [s["name"] for s in doc["servers"]] == ["localspec", "localspec.cold"]
    logs = {p.name.rsplit("-", 1)[0]: p.read_text() for p in (tmp_path / "logs").glob("*.log")}
    sent = [r for r in doc["requests"] if r["kind"] != "meter"]  # setup, warm-ups, keys
    assert logs["localspec"].count("POST /infill") == len(sent) == 2 + summary["sent"]
    assert logs["localspec.cold"].count("POST /infill") == 1  # the one cold check


def test_llama_server_modes_take_a_flash_attention_off_variant() -> None:
    serve = anchor.ServeSettings(target=Path("t.gguf"), draft=Path("d.gguf"))
    plain = anchor.llama_server_spec(Path("llama-server"), serve, "plain", port=1)
    assert plain.name == "llama-server/plain" and "--flash-attn" not in plain.argv
    off = anchor.llama_server_spec(Path("llama-server"), serve, "draft+fa-off", port=1)
    assert off.name == "llama-server/draft+fa-off"
    assert off.argv[off.argv.index("--flash-attn") + 1] == "off" and "-md" in off.argv
    with pytest.raises(ValueError, match=r"\+fa-on"):
        anchor.llama_server_spec(Path("llama-server"), serve, "plain+fa-on", port=1)


def test_replay_sets_localspecs_flash_attention_only_when_asked(tmp_path: Path) -> None:
    target = tmp_path / "t.gguf"
    target.write_bytes(b"GGUF")
    for extra, want in (([], None), (["--flash-attn", "on"], "on")):
        args = replay_parser().parse_args(["--target", str(target), *extra])
        (spec,) = server_specs(args)
        got = spec.argv[spec.argv.index("--flash-attn") + 1] if want else None
        assert got == want and ("--flash-attn" in spec.argv) == (want is not None)


def test_localspec_takes_the_exact_kv_budget_only_when_given() -> None:
    serve = anchor.ServeSettings(target=Path("t.gguf"))
    assert "--cache-exact-ms" not in anchor.localspec_spec(serve, port=1).argv
    argv = anchor.localspec_spec(replace(serve, cache_exact_ms=0.0), port=1).argv
    assert argv[argv.index("--cache-exact-ms") + 1] == "0.0"
    assert "--ring-attention" not in argv
    argv = anchor.localspec_spec(replace(serve, ring_attention="blocks"), port=1).argv
    assert argv[argv.index("--ring-attention") + 1] == "blocks"


def test_clients_have_their_own_schedule_slot_and_burst_numbers(
    sources: list[editor.SourceFile],
) -> None:
    from localspec.bench.replay import CLIENT_STRIDE, client_schedule

    traffic = editor.TrafficSettings(locations=2, max_keys=3, n_cmpl=2)
    a, b = (client_schedule(traffic, sources, i, 2) for i in range(2))
    assert {k.body["id_slot"] for burst in a.bursts for k in burst.keys} == {0}
    assert {k.body["id_slot"] for burst in b.bursts for k in burst.keys} == {1}
    assert all(k.body["n_cmpl"] == 2 for burst in a.bursts for k in burst.keys)
    assert [x.index for x in b.bursts] == [CLIENT_STRIDE + x.index for x in a.bursts]
    same = client_schedule(traffic, sources, 1, 2, same_slot=True)  # as real editors send
    assert {k.body["id_slot"] for burst in same.bursts for k in burst.keys} == {0}
    assert (a.bursts[0].filename, a.bursts[0].line_no) != (
        b.bursts[0].filename,
        b.bursts[0].line_no,
    )


def test_two_clients_beside_a_busy_process_against_localspec(
    qwen_target: Path, code_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "clients.json"
    argv = ["--target", str(qwen_target), "--code", str(code_dir), "--ctx", "2048",
            "--threads", "1", "--locations", "1", "--max-keys", "2", "--greedy",
            "--clients", "2", "--n-cmpl", "2", "--background", "1", "--cold", "none",
            "--json", str(out), "--log-dir", str(tmp_path / "logs"), "--quiet"]  # fmt: skip
    assert replay_main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["clients"] == 2 and doc["background"] == 1
    (summary,) = doc["summaries"]
    assert summary["errors"] == 0 and summary["sent"] == 2 * 3
    finals = [r for r in doc["requests"] if r["kind"] == "final"]
    assert len(finals) == 2 and all(len(r["cmpl_predicted"]) == 2 for r in finals)
    log = next((tmp_path / "logs").glob("localspec-*.log")).read_text()
    assert "slot=0" in log and "slot=1" in log  # each client on its own slot
