"""The team backends' pure parts: settings and their security rules, the stable slot, the FIM
prompt as text, the OpenAI request body, stop rules on an upstream's stream, error shapes."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from localspec import settings as st
from localspec.catalog import load_catalog
from localspec.engine.vocab import FimTokens
from localspec.server.prompts import Extra, infill_prompt
from localspec.server.requests import InfillRequest, task_params
from localspec.server.upstream.answer import upstream_error, upstream_message
from localspec.server.upstream.config import UpstreamSettings
from localspec.server.upstream.fim_text import CHARS_PER_TOKEN, infill_text
from localspec.server.upstream.identity import stable_slot, workstation
from localspec.server.upstream.openai_request import completion_body, sampling_fields
from localspec.server.upstream.openai_stream import Collector
from localspec.server.upstream.relay import pinned_slot, prepare

CATALOG = load_catalog()
FIM = CATALOG.model("qwen2.5-coder-7b").tokenizer.fim_text
assert FIM is not None


def _load(tmp_path: Path, *, system: str = "", user: str = "", env: dict[str, str] | None = None):
    system_dir = tmp_path / "system"
    system_dir.mkdir(exist_ok=True)
    if system:
        (system_dir / "50-it.toml").write_text(system)
    user_file = tmp_path / "config.toml"
    if user:
        user_file.write_text(user)
    return st.load(environ=env or {}, system_dir=system_dir, user_file=user_file)


# ------------------------------------------------------------------ settings


def test_an_it_profile_locks_the_backend_and_explain_masks_the_key(tmp_path: Path) -> None:
    profile = (
        'locked = ["backend"]\n[backend]\nkind = "llama-server"\n'
        'url = "https://llm.corp.example:8443"\napi_key = "sk-team-secret"\n'
        "fallback_ms = 1500\n"
    )
    resolved = _load(
        tmp_path,
        system=profile,
        user='[backend]\nkind = "local"\n',
        env={"LOCALSPEC_BACKEND_URL": "https://elsewhere.example"},
    )
    backend = resolved.settings.backend
    assert (backend.kind, backend.url, backend.fallback_ms) == (
        "llama-server",
        "https://llm.corp.example:8443",
        1500.0,
    )
    assert {v.key for v in resolved.violations} == {"backend.kind", "backend.url"}
    rows = {r.key: r for r in st.explain(resolved)}
    assert rows["backend.api_key"].value.startswith("set (from system profile")
    assert rows["backend.kind"].locked_by is not None
    assert "backend.fallback" in rows and "backend.ca_bundle" in rows
    shown = repr(st.explain(resolved)) + repr(st.to_toml_dict(resolved.settings))
    shown += " ".join(str(v) for v in resolved.violations)
    assert "sk-team-secret" not in shown


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[backend]\nkind = "openai"\n', "needs backend.url"),
        ('[backend]\nurl = "ftp://x"\n', "http:// or https://"),
        ('[backend]\nurl = "https://bob:pw@llm.corp"\n', "must not carry credentials"),
        ('[backend]\nfallback = "maybe"\n', "backend.fallback"),
    ],
)
def test_bad_backend_settings_name_the_key(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(st.SettingsError, match=message):
        _load(tmp_path, user=text)


def test_plain_http_to_another_host_is_refused_unless_allowed(tmp_path: Path) -> None:
    text = '[backend]\nkind = "llama-server"\nurl = "http://10.1.2.3:8012"\n'
    with pytest.raises(st.SettingsError, match=r"unencrypted.*allow_insecure_http"):
        st.check_backend(_load(tmp_path, user=text).settings)
    allowed = _load(tmp_path, user=text + "allow_insecure_http = true\n")
    assert st.check_backend(allowed.settings) is None
    for url in ("http://127.0.0.1:8013", "http://localhost:8013", "http://[::1]:8013"):
        loop = _load(tmp_path, user=f'[backend]\nkind = "llama-server"\nurl = "{url}"\n')
        assert st.check_backend(loop.settings) is None
    https = _load(
        tmp_path, user='[backend]\nkind = "openai"\nurl = "https://10.1.2.3"\nmodel = "m"\n'
    )
    assert st.check_backend(https.settings) is None


def test_the_key_file_is_permission_checked_and_read(tmp_path: Path) -> None:
    key = tmp_path / "upstream.key"
    key.write_text("sk-from-file\n")
    os.chmod(key, 0o644)
    text = f'[backend]\nkind = "llama-server"\nurl = "https://x.example"\napi_key_file = "{key}"\n'
    if os.name == "posix":
        with pytest.raises(st.SettingsError, match="chmod 600"):
            st.check_backend(_load(tmp_path, user=text).settings)
    os.chmod(key, 0o600)
    assert st.check_backend(_load(tmp_path, user=text).settings) == "sk-from-file"
    both = text + 'api_key = "sk-inline"\n'
    with pytest.raises(st.SettingsError, match="not both"):
        st.check_backend(_load(tmp_path, user=both).settings)
    missing = (
        '[backend]\nkind = "openai"\nurl = "https://x.example"\nmodel = "m"\n'
        'ca_bundle = "/nope.pem"\n'
    )
    with pytest.raises(st.SettingsError, match="ca_bundle"):
        st.check_backend(_load(tmp_path, user=missing).settings)


def test_the_key_never_shows_in_the_upstream_settings_repr() -> None:
    cfg = UpstreamSettings(kind="llama-server", url="https://x", api_key="sk-hidden")
    assert "sk-hidden" not in repr(cfg)


# ------------------------------------------------------------------ identity


def test_the_stable_slot_is_stable_in_range_and_spread() -> None:
    me = workstation()
    assert ":" in me and stable_slot(8, me) == stable_slot(8, me)
    slots = [stable_slot(8, f"machine-{i}:dev") for i in range(400)]
    assert set(slots) == set(range(8))
    assert max(slots.count(s) for s in range(8)) < 400 / 8 * 1.6  # no slot takes them all
    cfg = UpstreamSettings(kind="llama-server", url="http://127.0.0.1:1")
    assert pinned_slot(cfg, None, me) == -1  # slot count unknown: the upstream picks
    assert pinned_slot(cfg, 8, me) == stable_slot(8, me)
    pinned = UpstreamSettings(kind="llama-server", url="http://127.0.0.1:1", slot=5)
    assert pinned_slot(pinned, 8, me) == 5


def test_prepare_sets_slot_and_model_and_keeps_a_bad_body() -> None:
    raw, stream, n = prepare(
        b'{"id_slot":0,"prompt":"x","model":"","stream":true}', slot=3, model="m"
    )
    assert json.loads(raw) == {"id_slot": 3, "prompt": "x", "model": "m", "stream": True}
    assert stream is True and n == 1
    assert prepare(b'{"prompt":"x"}', slot=None, model=None) == (b'{"prompt":"x"}', False, 1)
    assert prepare(b"not json", slot=1, model=None) == (b"not json", False, 1)
    assert prepare(b'{"n_cmpl":3}', slot=None, model=None).n_choices == 3
    assert prepare(b'{"n":2,"stream":true}', slot=None, model=None).n_choices == 2
    editors = b'{"model":"editor-name","prompt":"x"}'
    assert json.loads(prepare(editors, slot=None, model=None, replace_model=True).content) == {
        "prompt": "x"
    }
    assert prepare(editors, slot=None, model=None).content == editors  # /tokenize and such


# ------------------------------------------------------------------ the FIM prompt as text


def test_the_text_layout_is_local_servings_layout() -> None:
    """The same pieces through fim.infill_prompt with one id per character: the text prompt
    is the token layout with each FIM token's text in its place."""
    extra = [Extra("import os\n", "/p/a.py"), Extra("x = 1\n", "/p/b.py")]
    text = infill_text(
        FIM,
        input_prefix="def f(x):\n",
        input_suffix="\n    return y\n",
        input_extra=extra,
        prompt="    y = ",
        n_ctx=8192,
    )
    assert text == (
        "<|repo_name|>myproject\n<|file_sep|>/p/a.py\nimport os\n<|file_sep|>/p/b.py\nx = 1\n"
        "<|file_sep|>filename\n<|fim_prefix|>def f(x):\n<|fim_suffix|>\n    return y\n"
        "<|fim_middle|>    y = "
    )
    # the order and blocks come from infill_prompt itself: the same call on token ids agrees
    ids = FimTokens(pre=-1, suf=-2, mid=-3, rep=-4, sep=-5)
    names = {-1: FIM.pre, -2: FIM.suf, -3: FIM.mid, -4: FIM.rep, -5: FIM.sep}
    layout = infill_prompt(
        tokenize=lambda s: [ord(c) for c in s],
        fim=ids,
        input_prefix="def f(x):\n",
        input_suffix="\n    return y\n",
        input_extra=extra,
        prompt_tokens=[ord(c) for c in "    y = "],
        window=4096,
        n_ctx=40000,
        infill_layout="typed-in-middle",
    )
    assert text == "".join(names[t] if t < 0 else chr(t) for t in layout.tokens)


def test_the_text_layout_keeps_budgets_and_drops_sentinels() -> None:
    prefix = "".join(f"line {i}\n" for i in range(2000))  # far more than 3/4 of a batch
    text = infill_text(
        FIM, input_prefix=prefix, input_suffix="", input_extra=(), prompt="", n_ctx=4096
    )
    kept = text.split("<|fim_prefix|>")[1].split("<|fim_suffix|>")[0]
    assert prefix.endswith(kept) and len(kept) == int(1024 * CHARS_PER_TOKEN) // 4 * 3
    ring = infill_text(
        FIM,
        input_prefix="",
        input_suffix="",
        input_extra=[Extra("a\ufdd0b\n", "x.py")],
        prompt="",
        n_ctx=4096,
        ring_only=True,
    )
    assert ring == "<|repo_name|>myproject\n<|file_sep|>x.py\nab\n<|file_sep|>filename\n"


# ------------------------------------------------------------------ the OpenAI request


def _params(**body: Any) -> Any:
    request = InfillRequest.model_validate({"input_prefix": "", "input_suffix": "", **body})
    return task_params(request, n_ctx=4096, n_cmpl_max=8)


def test_the_samplers_map_to_openai_fields() -> None:
    editor = _params(
        top_k=40, top_p=0.99, samplers=["top_k", "top_p", "infill"], n_cmpl=3, n_predict=128
    )
    assert sampling_fields(editor) == {"temperature": 1.0, "top_p": 0.99, "top_k": 40, "min_p": 0.0}
    vim = _params(min_p=0.1, temperature=0.1, samplers=["min_p", "temperature"], seed=7)
    assert sampling_fields(vim) == {
        "temperature": 0.1,
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.1,
        "seed": 7,
    }
    penalised = _params(presence_penalty=0.5, frequency_penalty=0.2, repeat_penalty=1.1,
                        ignore_eos=True, samplers=["penalties", "temperature"])  # fmt: skip
    fields = sampling_fields(penalised)
    assert (fields["presence_penalty"], fields["frequency_penalty"]) == (0.5, 0.2)
    assert fields["repetition_penalty"] == 1.1 and fields["ignore_eos"] is True
    unchained = _params(presence_penalty=0.5, samplers=["temperature"])  # not in the chain
    assert "presence_penalty" not in sampling_fields(unchained)
    body = completion_body(prompt="P", params=editor, model="m", end=FIM.end)
    assert body["n"] == 3 and body["stream"] is True and body["prompt"] == "P"
    assert body["model"] == "m" and "<|file_sep|>" in body["stop"] and body["max_tokens"] == 128
    warmup = completion_body(prompt="P", params=_params(n_predict=0), model=None, end=())
    assert warmup["max_tokens"] == 1 and "model" not in warmup and "stop" not in warmup


# ------------------------------------------------------------------ the stream


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _run(pieces: list[str], finish: str | None = "stop", **body: Any) -> tuple[Collector, str]:
    clock = Clock()
    c = Collector(_params(**body), end=FIM.end, clock=clock, t_sent=0.0)
    streamed = ""
    for piece in pieces:
        clock.now += 0.1
        for _, text in c.feed({"choices": [{"index": 0, "text": piece}]}):
            streamed += text
        if c.done:
            return c, streamed
    for _, text in c.feed({"choices": [{"index": 0, "text": "", "finish_reason": finish}]}):
        streamed += text
    return c, streamed


def test_n_indent_cuts_the_first_line_below_the_indent() -> None:
    c, streamed = _run(["a = 1\n", "    b = 2\n", "c", " = 3\n", "never"], n_indent=4)
    assert c.done and c.choices[0].text == "a = 1\n    b = 2\n"
    assert c.choices[0].stop_type == "limit"
    # as llama-server (and the engine): the rule sees a line's indentation one piece late,
    # so the streamed pieces may hold that piece; the final answer is cut
    assert streamed.startswith(c.choices[0].text) and "never" not in streamed
    assert c.finals(model="m", stream=False)[0]["content"] == "a = 1\n    b = 2\n"


def test_a_stop_word_ends_it_and_is_reported() -> None:
    c, streamed = _run(["foo", "(x)", " END", " more"], stop=["END"])
    assert streamed == "foo(x) " and c.choices[0].stop_type == "word"
    assert c.choices[0].stopping_word == "END"


def test_an_end_token_the_upstream_rendered_is_eos() -> None:
    c, streamed = _run(["x = 1\n", "<|file_sep|>", "other.py"])
    assert streamed == "x = 1\n" and c.choices[0].stop_type == "eos"
    assert c.choices[0].stopping_word == ""


def test_t_max_predict_ms_stops_at_the_first_newline_past_the_deadline() -> None:
    # 100 ms apart; the first piece starts the clock: "b" at 100 ms, its newline at 200 ms
    pieces = ["a\n", "b", "\n", "c", "\n", "d"]
    c, streamed = _run(pieces, t_max_predict_ms=150)
    assert streamed == "a\nb\n" == c.choices[0].text and c.choices[0].stop_type == "limit"
    c, streamed = _run(pieces, t_max_predict_ms=250)
    assert streamed == "a\nb\nc\n" and c.choices[0].stop_type == "limit"


def test_the_upstreams_finish_reason_and_usage_make_the_answer() -> None:
    c, _ = _run(["hello", " world"], finish="length")
    c.feed({"choices": [], "usage": {"prompt_tokens": 50, "completion_tokens": 2,
                                     "prompt_tokens_details": {"cached_tokens": 45}}})  # fmt: skip
    final = c.finals(model="m", stream=False)[0]
    assert final["content"] == "hello world" and final["stop_type"] == "limit"
    t = final["timings"]
    assert (t["prompt_n"], t["cache_n"], t["predicted_n"]) == (5, 45, 2)
    assert t["prompt_ms"] == pytest.approx(100.0) and t["predicted_ms"] == pytest.approx(100.0)
    assert final["tokens_predicted"] == 2 and final["tokens_evaluated"] == 50
    assert isinstance(final["generation_settings"], dict)


def test_several_choices_each_stop_on_their_own() -> None:
    c = Collector(_params(n_cmpl=2, stop=["!"]), clock=Clock(), t_sent=0.0)
    c.feed({"choices": [{"index": 0, "text": "a!"}, {"index": 1, "text": "b"}]})
    assert c.choices[0].done and not c.done
    c.feed({"choices": [{"index": 1, "text": "c", "finish_reason": "stop"}]})
    assert c.done and [ch.text for ch in c.choices.values()] == ["a", "bc"]
    finals = c.finals(model="m", stream=False)
    assert [f["index"] for f in finals] == [0, 1]


def test_a_warm_up_wants_no_text() -> None:
    c, streamed = _run(["ignored"], n_predict=0)
    assert c.done and streamed == "" and c.finals(model="m", stream=False)[0]["content"] == ""


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b'{"error":{"code":400,"message":"bad","type":"invalid_request_error"}}', "bad"),
        (b'{"object":"error","message":"too long","type":"BadRequestError","code":400}',
         "too long"),
        (b'{"error":"model not found"}', "model not found"),
        (b"plain text failure", "plain text failure"),
    ],
)  # fmt: skip
def test_upstream_error_messages_are_found(raw: bytes, message: str) -> None:
    assert upstream_message(raw) == message


def test_a_401_says_whose_key_it_refused() -> None:
    cfg = UpstreamSettings(kind="openai", url="https://llm", api_key="k", fim=FIM)
    answer = upstream_error(401, b'{"error":{"message":"Invalid API Key"}}', cfg)
    body = json.loads(answer.body)
    assert answer.status == 401 and body["error"]["type"] == "authentication_error"
    assert "refuses localspec's key (backend.api_key_file)" in body["error"]["message"]
    assert "Invalid API Key" in body["error"]["message"]
    other = json.loads(upstream_error(404, b'{"message":"no such model"}', cfg).body)
    assert other["error"] == {
        "code": 404,
        "message": "upstream https://llm: no such model",
        "type": "not_found_error",
    }


def test_catalog_names_map_to_models() -> None:
    assert CATALOG.match_model("Qwen/Qwen2.5-Coder-7B").id == "qwen2.5-coder-7b"  # type: ignore[union-attr]
    assert CATALOG.match_model("qwen2.5-coder:1.5b-base").id == "qwen2.5-coder-1.5b"  # type: ignore[union-attr]
    assert CATALOG.match_model("Qwen/Qwen3-Coder-30B-A3B-Instruct-FP8").id == "qwen3-coder-30b-a3b"  # type: ignore[union-attr]
    assert CATALOG.match_model("llama3") is None
    assert CATALOG.match_model("qwen2.5-coder-7bx") is None
