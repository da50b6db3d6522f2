"""Speculation you can see: each request's language and its drafts' acceptance by position,
over real HTTP on loopback, with the real engine on the follow pair (a draft the target
rejects at known places: after every multiple of 3, ``tests/fixtures/models.py``)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from localspec.commands import lifecycle
from localspec.engine.acceptance import MAX_POSITION, Acceptance
from localspec.language import LanguageBook, code_in_chat, from_filename, guess, label
from localspec.server import ServerSettings, create_app, logs
from tests.fixtures.models import follow_chain, scripted_chat_gguf
from tests.ops_support import wait_until
from tests.spec_support import follow_drafting
from tests.test_server_http import Live, engine_settings, start, stop

PY = (
    "import os\n\n\ndef main(argv):\n    for name in argv:\n        print(os.path.basename(name))\n"
)
C = '#include <stdio.h>\n\nint main(int argc, char **argv) {\n    printf("%d\\n", argc);\n'
SH = '#!/bin/sh\nset -e\nfor f in *.txt; do\n  echo "$f"\ndone\n'
JS = "const fs = require('fs');\nfunction f(a) {\n  return a.map((b) => b * 2);\n}\n"
N_MAX = 6


# ---------------------------------------------------------------- pure parts


def test_guess_reads_the_labelled_languages_and_calls_prose_other() -> None:
    assert guess(PY) == "python"
    assert guess(C) == "c"
    assert guess(SH) == "shell"
    assert guess(JS) == "javascript"
    assert guess("Dear team, the meeting moves to Friday afternoon.\n") == "other"
    assert guess("   \n") == "other"


def test_client_names_and_file_names_map_to_the_bounded_labels() -> None:
    assert label("Python") == "python" and label("shellscript") == "shell"
    assert label("typescriptreact") == "typescript" and label("cobol") == "other"
    assert label(None) is None and label("") is None
    assert from_filename("/src/a/main.c") == "c" and from_filename("x.tsx") == "typescript"
    assert from_filename("run.sh") == "shell" and from_filename("notes.xyz123") == "other"
    assert from_filename("tmp") is None  # llama-vscode's placeholder name
    assert code_in_chat(["fix this:\n```py\nx = 1\n```\n", "thanks"]) == ("python", "x = 1\n")
    assert code_in_chat(["just words"]) == (None, "just words")


def test_a_slot_keeps_its_guess_while_the_codes_head_stays() -> None:
    book = LanguageBook()
    try:
        first = book.resolve(3, given=None, code=PY, key_text="head")
        assert first.result(timeout=30) == "python"
        again = book.resolve(3, given=None, code=C, key_text="head")  # same head: remembered
        assert again.done() and again.result() == "python"
        moved = book.resolve(3, given=None, code=C, key_text="other head")
        assert moved.result(timeout=30) == "c"
        told = book.resolve(3, given="go", code=C)
        assert told.done() and told.result() == "go"
        assert book.resolve(4, given=None, code="", fallback="rust").result(timeout=30) == "rust"
    finally:
        book.close()


def test_acceptance_by_position_counts_each_judged_token_once() -> None:
    acc = Acceptance()
    acc.add(5, 2)  # positions 1, 2 accepted, 3 rejected, 4-5 never judged
    acc.add(1, 1)
    acc.add(3, 0)
    acc.add(12, 12)  # positions past MAX_POSITION share its bucket
    assert acc.drafts == 4 and acc.drafted == 21 and acc.accepted == 15
    assert acc.reached[:4] == [4, 2, 2, 1] and acc.accepted_at[:4] == [3, 2, 1, 1]
    assert acc.reached[MAX_POSITION - 1] == 12 - (MAX_POSITION - 1)
    assert acc.rejected_at[:3] == [1, 0, 1]


# ---------------------------------------------------------------- over HTTP


@pytest.fixture(scope="module")
def follow(qwen_follow: Path, qwen_follow_draft: Path) -> Iterator[Live]:
    engine = follow_drafting(qwen_follow, qwen_follow_draft, N_MAX)
    live = start(create_app(ServerSettings(port=0), engine))
    yield live
    stop(live)


def _metric(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def _complete(c: httpx.Client, **body: Any) -> dict[str, Any]:
    r = c.post("/completion", json={"n_predict": 20, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_drafts_are_counted_by_language_and_position(
    follow: Live, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=logs.REQUESTS)
    prompt = [1000, 1001, 1002]
    with follow.client() as c:
        before = c.get("/metrics").text
        answer = _complete(c, prompt=prompt, language="Python")
        # exact: the target's own chain, whatever was drafted
        assert answer["tokens"] == follow_chain(prompt[-1], 20)
        assert answer["language"] == "python"
        t = answer["timings"]
        per_pos = t["draft_n_accepted_per_pos"]
        # the draft goes wrong after each multiple of 3: two tokens of each draft are
        # accepted, the third rejected; never a rejection at positions 1 or 2
        assert t["draft_n"] > t["draft_n_accepted"] > 0
        assert sum(per_pos) == t["draft_n_accepted"]
        assert per_pos[0] == per_pos[1] == t["draft_n_verif_steps"] > 0
        assert per_pos[2:] == [0] * (MAX_POSITION - 2)

        _complete(c, prompt="int x = 0;\n" + C, filename="/src/prog.c")
        _complete(c, prompt=SH)  # no word from the client: guessed
        wait_until(lambda: sum(follow.service.spec.requests.values()) >= 3)
        text = c.get("/metrics").text

    reached = _metric(text, "localspec_draft_position_reached_total")
    accepted = _metric(text, "localspec_draft_position_accepted_total")
    py = (("language", "python"),)
    assert not _metric(before, "localspec_draft_position_reached_total")
    assert reached[(*py, ("position", "3"))] == per_pos[0] > 0  # every draft reached 3 ...
    assert accepted.get((*py, ("position", "3")), 0) == 0  # ... and failed there
    assert accepted[(*py, ("position", "1"))] == per_pos[0]
    assert (*py, ("position", "4")) not in reached
    requests = _metric(text, "localspec_language_requests_total")
    assert requests == {(("language", "c"),): 1, (("language", "python"),): 1,
                        (("language", "shell"),): 1}  # fmt: skip
    drafted = _metric(text, "localspec_language_draft_tokens_total")
    assert drafted[py] == t["draft_n"]

    lines = [r for r in caplog.records if r.name == logs.REQUESTS and "/completion" in r.message]
    fields = lines[0].fields  # type: ignore[attr-defined]
    assert fields["language"] == "python"
    assert fields["rejected_at"] == f"3:{per_pos[0]}"


@pytest.fixture(scope="module")
def scripted() -> Iterator[Live]:
    live = start(create_app(ServerSettings(port=0), engine_settings(scripted_chat_gguf())))
    yield live
    stop(live)


def test_chat_language_is_the_fenced_codes(scripted: Live) -> None:
    with scripted.client() as c:
        r = c.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "why?\n```rust\nfn main() {}\n```"}],
                "max_tokens": 4,
            },
        )
        assert r.status_code == 200, r.text
        wait_until(lambda: scripted.service.spec.requests.get("rust", 0) == 1)
        text = c.get("/metrics").text
    assert _metric(text, "localspec_language_requests_total") == {(("language", "rust"),): 1}


def test_stats_data_and_status_table_show_acceptance_by_language(follow: Live) -> None:
    with follow.client() as c:
        _complete(c, prompt=[2000, 2001, 2002], language="go")
        wait_until(lambda: follow.service.spec.requests.get("go", 0) >= 1)
        page = c.get("/stats")
        data = c.get("/stats/data").json()
        later = c.get("/stats/data", params={"since": data["recent"][-1]["t"]}).json()
        bad = c.get("/stats/data", params={"since": "yesterday"})
    assert page.status_code == 200 and "<canvas" in page.text and "src=" not in page.text
    go = data["languages"]["go"]
    assert go["requests"] >= 1 and go["drafted"] > go["accepted"] > 0
    by_pos = {p["position"]: p for p in go["positions"]}
    assert by_pos["1"]["accepted"] == by_pos["1"]["reached"] > 0  # never cut at position 1
    assert by_pos["3"]["reached"] > 0 and by_pos["3"]["accepted"] == 0
    assert data["latency_ms"]["p95"] >= data["latency_ms"]["p50"] > 0
    assert data["recent"][-1]["language"] == "go" and later["recent"] == []
    assert data["machine"]["cores"] >= 1
    assert bad.status_code == 400 and "error" in bad.json()

    report = lifecycle.gather_status("127.0.0.1", follow.port, None)
    text = lifecycle.render_status(report)
    row = next(line for line in text.splitlines() if line.strip().startswith("go "))
    cells = row.split()
    # language, requests, drafted, accepted share, mean run, then @1 .. @8
    assert cells[5] == "100%" and cells[7] == "0%" and cells[8] == "-", row
