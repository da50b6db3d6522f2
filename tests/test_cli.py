"""The `localspec` command as users run it: real subprocesses, a temporary HOME and XDG dirs,
a real llama.cpp model serving real HTTP over loopback."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from localspec import cli
from localspec.settings import SettingsError
from tests.ops_support import http_server

INFILL = {"input_prefix": "def add(a, b):\n    return ", "input_suffix": "\n", "n_predict": 4}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """A clean environment: no LOCALSPEC_*/HF_*/XDG_* of the machine, a home of our own."""
    home = tmp_path / "home"
    home.mkdir()
    clean = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("LOCALSPEC_", "XDG_", "HF_")) or k == "LOCALSPEC_FIXTURE_CACHE"
    }
    clean.update(
        HOME=str(home),
        XDG_CONFIG_HOME=str(home / ".config"),
        XDG_STATE_HOME=str(home / ".local/state"),
        XDG_DATA_HOME=str(home / ".local/share"),
        XDG_CACHE_HOME=str(home / ".cache"),
        LOCALSPEC_SYSTEM_CONFIG_DIR=str(tmp_path / "system"),
        LOCALSPEC_LIMITS_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    return clean


def _system(env: dict[str, str]) -> Path:
    path = Path(env["LOCALSPEC_SYSTEM_CONFIG_DIR"])
    path.mkdir(exist_ok=True)
    return path


def _user_config(env: dict[str, str]) -> Path:
    path = Path(env["XDG_CONFIG_HOME"]) / "localspec" / "config.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _state(env: dict[str, str]) -> Path:
    return Path(env["XDG_STATE_HOME"]) / "localspec"


def localspec(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "localspec", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _wait_ready(port: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the daemon exited before it was ready"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError("not ready in time")


def test_up_serves_infill_reports_already_running_and_stops_on_sigterm(
    env: dict[str, str], smollm_fim_q4: Path, tmp_path: Path
) -> None:
    port = _free_port()
    out = (tmp_path / "up.out").open("w+")
    model = str(smollm_fim_q4)
    args = ["up", "--target", model, "--draft", model, "--port", str(port), "--ctx-size", "512"]
    args.append("--log-requests")
    proc = subprocess.Popen(
        [sys.executable, "-m", "localspec", *args],
        env=env,
        stdout=out,
        stderr=subprocess.STDOUT,
    )
    try:
        _wait_ready(port, proc)
        answer = httpx.post(f"http://127.0.0.1:{port}/infill", json=INFILL, timeout=60)
        assert answer.status_code == 200, answer.text
        assert isinstance(answer.json()["content"], str)
        pid_file = _state(env) / f"localspec-{port}.pid"
        assert json.loads(pid_file.read_text())["pid"] == proc.pid

        again = localspec(env, "up", "--port", str(port), "--target", str(smollm_fim_q4))
        assert again.returncode == 0, again.stderr
        assert f"already running at http://localhost:{port} (pid {proc.pid})" in again.stdout

        status = localspec(env, "status", "--port", str(port))
        assert status.returncode == 0, status.stderr
        assert "ready" in status.stdout and str(smollm_fim_q4) in status.stdout
        assert f"draft        {smollm_fim_q4}" in status.stdout
        assert "1 served" in status.stdout
        report = json.loads(localspec(env, "status", "--port", str(port), "--json").stdout)
        assert report["pid"] == proc.pid and report["metrics"]["requests"] == 1
        assert report["metrics"]["prompt_tokens_evaluated"] > 0
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    out.seek(0)
    log = out.read()
    assert code == 0, log
    assert f"serving at http://localhost:{port}" in log
    assert "POST /infill 200" in log  # log.requests: one line per request, no prompt text
    assert "def add" not in log
    assert not pid_file.exists()


# `up` as it runs when another `up` binds the port between its probe and its bind (two
# started at once: a login service and a terminal): the first probe is made to miss
_LOSE_THE_RACE = """
import sys
from localspec import cli, daemon
real, calls = daemon.probe_port, []
def probe(*args, **kwargs):
    calls.append(args)
    return daemon.PortOwner("free") if len(calls) == 1 else real(*args, **kwargs)
daemon.probe_port = probe
sys.exit(cli.main(sys.argv[1:]))
"""


def test_an_up_that_loses_the_start_race_reports_the_winner_and_keeps_its_pid_file(
    env: dict[str, str], smollm_fim_q4: Path, tmp_path: Path
) -> None:
    port = _free_port()
    args = ["up", "--target", str(smollm_fim_q4), "--port", str(port), "--ctx-size", "512"]
    out = (tmp_path / "up.out").open("w+")
    winner = subprocess.Popen(
        [sys.executable, "-m", "localspec", *args], env=env, stdout=out, stderr=subprocess.STDOUT
    )
    try:
        _wait_ready(port, winner)
        pid_file = _state(env) / f"localspec-{port}.pid"
        loser = subprocess.run(
            [sys.executable, "-c", _LOSE_THE_RACE, *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert loser.returncode == 0, loser.stderr
        assert f"already running at http://localhost:{port} (pid {winner.pid})" in loser.stdout
        assert json.loads(pid_file.read_text())["pid"] == winner.pid
        down = localspec(env, "down", "--port", str(port))
        assert down.returncode == 0, down.stderr
        assert winner.wait(60) == 0
    finally:
        if winner.poll() is None:
            winner.kill()


def test_detach_status_logs_down_with_a_locked_port(
    env: dict[str, str], smollm_fim_q4: Path
) -> None:
    port, attempted = _free_port(), _free_port()
    profile = _system(env) / "50-it.toml"
    profile.write_text(f'locked = ["server.port"]\n[server]\nport = {port}\n')
    up = localspec(
        env,
        "up",
        "--detach",
        "--port",
        str(attempted),
        "--target",
        str(smollm_fim_q4),
        "--ctx-size",
        "512",
    )
    try:
        assert up.returncode == 0, up.stderr
        assert f"flag --port tried to set {attempted}, but system profile {profile}" in up.stderr
        assert f"localspec is running at http://localhost:{port}" in up.stdout
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200

        status = localspec(env, "status", "--json")
        assert status.returncode == 0
        report = json.loads(status.stdout)
        assert report["health"] == "ready" and report["localspec"] is True
        assert report["props"]["model_path"] == str(smollm_fim_q4)

        logs = localspec(env, "logs", "-n", "20")
        assert logs.returncode == 0 and "serving at" in logs.stdout
    finally:
        down = localspec(env, "down")
    assert down.returncode == 0, down.stderr
    assert f"localspec on port {port} stopped" in down.stdout
    # the log says why the daemon went away, and that it finished stopping
    tail = localspec(env, "logs", "-n", "5").stdout
    assert "stopping on SIGTERM" in tail and tail.rstrip().endswith("stopped"), tail
    assert localspec(env, "status").returncode == 3
    again = localspec(env, "down")
    assert again.returncode == 3 and "no localspec daemon" in again.stdout


def test_a_detached_start_shows_its_own_log_lines_and_keeps_its_log_file(
    env: dict[str, str], smollm_fim_q4: Path, tmp_path: Path
) -> None:
    port = _free_port()
    shared = _state(env) / "localspec.log"
    shared.parent.mkdir(parents=True)
    shared.write_text("[ok] loading old.gguf: serving at http://localhost:1\nERROR old run\n")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"<html>a login page, not a model</html>")
    failed = localspec(env, "up", "--detach", "--port", str(port), "--target", str(bad))
    assert failed.returncode == 1 and "not a GGUF file" in failed.stderr
    assert "old" not in failed.stderr  # this start's lines only, not an earlier run's
    mine = tmp_path / "mine.log"
    args = ["up", "--detach", "--port", str(port), "--target", str(smollm_fim_q4)]
    up = localspec(env, *args, "--ctx-size", "512", "--log-file", str(mine))
    try:
        assert up.returncode == 0, up.stderr
        assert f"logs: {mine}" in up.stdout and "serving at" in mine.read_text()
    finally:
        assert localspec(env, "down", "--port", str(port)).returncode == 0
    # a setting that cannot work is the command line's error, before a daemon is spawned
    draftless = localspec(env, *args, "--spec-mode", "draft")
    assert draftless.returncode == 2 and "no draft model is given" in draftless.stderr
    assert "starting localspec" not in draftless.stderr


def test_port_held_by_another_program_is_named(env: dict[str, str], smollm_fim_q4: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        result = localspec(env, "up", "--port", str(port), "--target", str(smollm_fim_q4))
    assert result.returncode == 4
    assert f"port {port} is held by" in result.stderr
    assert f"(pid {os.getpid()})" in result.stderr  # psutil names the holder


def test_status_and_down_leave_a_llama_server_on_the_port_alone(
    env: dict[str, str], tmp_path: Path
) -> None:
    """llama-vscode's port often has llama-server on it: status is not fooled, and a stale
    pid file whose pid now belongs to another program never gets it killed."""
    llama_server = b'{"status":"ok","model_path":"/models/qwen.gguf"}'
    # a daemon that died without cleaning up; its pid reused by `localspec logs -f`
    reused = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", "localspec", "logs", "-f"]
    )
    try:
        with http_server(llama_server, headers={"Server": "llama.cpp"}) as port:
            pid_file = _state(env) / f"localspec-{port}.pid"
            pid_file.parent.mkdir(parents=True)
            pid_file.write_text(json.dumps({"pid": reused.pid, "host": "localhost", "port": port,
                                            "started": time.time() - 3600}))  # fmt: skip
            status = localspec(env, "status", "--port", str(port))
            assert status.returncode == 3, status.stdout
            assert f"localspec is not running: port {port} is held by" in status.stdout
            down = localspec(env, "down", "--port", str(port))
            assert down.returncode == 3 and "no localspec daemon" in down.stdout
            assert reused.poll() is None  # never signalled
            assert not pid_file.exists()  # the stale file is gone
    finally:
        reused.kill()


def test_bad_profiles_stop_up_with_named_errors(env: dict[str, str], smollm_fim_q4: Path) -> None:
    profile = _system(env) / "10-corp.toml"
    profile.write_text('locked = ["hub.endpiont"]\n[server]\nprot = 8012\n')
    user = _user_config(env)
    user.write_text("[speculative]\nn_max = 'many'\n")
    result = localspec(env, "up", "--target", str(smollm_fim_q4))
    assert result.returncode == 2
    assert f"system profile {profile}: 'locked' names unknown key 'hub.endpiont'" in result.stderr
    assert "(did you mean 'hub.endpoint'?)" in result.stderr
    assert f"system profile {profile}: unknown key 'server.prot'" in result.stderr
    assert (
        f"user config {user}: speculative.n_max: Input should be a valid integer" in result.stderr
    )
    validate = localspec(env, "profile", "validate", str(profile))
    assert validate.returncode == 2 and "server.prot" in validate.stderr
    profile.write_text('locked = ["hub.endpoint"]\n[hub]\nendpoint = "https://m.example"\n')
    validate = localspec(env, "profile", "validate", str(profile))
    assert validate.returncode == 0 and "locks hub.endpoint" in validate.stdout


def test_security_rules_refuse_to_start(
    env: dict[str, str], smollm_fim_q4: Path, tmp_path: Path
) -> None:
    target = ["--target", str(smollm_fim_q4), "--port", str(_free_port())]
    result = localspec(env, "up", "--host", "0.0.0.0", *target)
    assert result.returncode == 2 and "reachable from other machines" in result.stderr
    if os.name == "posix":
        key = tmp_path / "key"
        key.write_text("sk-test-key\n")
        key.chmod(0o644)
        result = localspec(env, "up", "--host", "0.0.0.0", "--api-key-file", str(key), *target)
        assert result.returncode == 2 and f"chmod 600 {key}" in result.stderr
        assert "sk-test-key" not in result.stderr + result.stdout


def test_models_allowed_restricts_local_files(env: dict[str, str], smollm_fim_q4: Path) -> None:
    (_system(env) / "p.toml").write_text(
        'locked = ["models.allowed"]\n[models]\nallowed = ["qwen2.5-coder-*"]\n'
    )
    result = localspec(env, "up", "--target", str(smollm_fim_q4), "--port", str(_free_port()))
    assert result.returncode == 1
    assert "is not in models.allowed (qwen2.5-coder-*)" in result.stderr


def test_profile_explain_names_every_origin_and_hides_the_key(env: dict[str, str]) -> None:
    profile = _system(env) / "10-corp.toml"
    profile.write_text(
        'locked = ["server.host"]\n[hub]\nendpoint = "https://mirror.corp.example"\n'
    )
    user = _user_config(env)
    user.write_text(
        '[server]\nhost = "0.0.0.0"\napi_key = "sk-hidden-123"\n[log]\nlevel = "debug"\n'
    )
    env = {**env, "LOCALSPEC_SPECULATIVE_N_MAX": "8"}
    result = localspec(env, "profile", "explain", "--port", "9123")
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: line for line in result.stdout.splitlines() if line and line[0] != " "}
    assert rows["hub.endpoint"].endswith(f"system profile {profile}")
    assert rows["log.level"].endswith(f"user config {user}")
    assert rows["speculative.n_max"].endswith("env LOCALSPEC_SPECULATIVE_N_MAX")
    assert rows["server.port"].endswith("flag --port")
    assert "localhost" in rows["server.host"] and rows["server.host"].endswith("[locked]")
    assert f"set (from user config {user})" in rows["server.api_key"]
    assert "tried to set 0.0.0.0" in result.stdout
    shown = (
        localspec(env, "profile", "show").stdout
        + localspec(env, "profile", "explain", "--json").stdout
    )
    assert "sk-hidden-123" not in result.stdout + shown
    assert 'api_key = "<secret>"' in shown


def _parsers(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _parsers(child, (*path, name))


def test_every_command_has_help_with_examples() -> None:
    commands = list(_parsers(cli.build_parser()))
    assert len(commands) >= 20  # every command and sub-action
    for path, parser in commands:
        assert "examples:" in (parser.epilog or ""), f"`localspec {' '.join(path)} --help`"
    assert "examples:" in localspec_help(["up"])


def localspec_help(command: list[str]) -> str:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        cli.main([*command, "--help"])
    return out.getvalue()


def test_help_lists_exit_codes_where_a_command_ends_with_more_than_success(
    monkeypatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("LOCALSPEC_STATE_DIR", str(tmp_path))
    helps = {path: parser.format_help() for path, parser in _parsers(cli.build_parser())}
    for path in [("up",), ("down",), ("status",), ("pull",), ("profile",), ("service",)]:
        assert helps[path].rstrip().endswith("4  the port is held by another program (up)"), path
    for path in [("logs",), ("models",), ("plan",), ("bench",), ("profile", "show")]:
        assert "exit codes:" not in helps[path], path
    # an action shows its group's examples; the logs description names the file of this run
    assert "localspec profile validate corp.toml" in helps[("profile", "keys")]
    assert f"login service ({tmp_path / 'localspec.log'})." in helps[("logs",)]


def test_top_level_help_documents_exit_codes(capsys) -> None:
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    assert "exit codes:" in out and "4  the port is held by another program" in out


def test_bench_passes_the_remaining_arguments_through(monkeypatch) -> None:
    seen: list[list[str]] = []
    fake = types.ModuleType("localspec.bench.replay")
    fake.main = lambda argv: seen.append(argv) or 0  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "localspec.bench.replay", fake)
    assert cli.main(["bench", "replay", "--file", "x.py", "--requests", "3"]) == 0
    assert seen == [["--file", "x.py", "--requests", "3"]]


SMOL_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF"


def smol_entry(model_id: str, filename: str, capabilities: str = '["fim"]') -> str:
    """A catalog entry for SmolLM2 in ``filename`` and its n-gram pair ``<id>+ngram``."""
    return f"""
[models.{model_id}]
family = "smollm2"
role = "target"
params_b = 0.135
capabilities = {capabilities}
tokenizer = {{ family = "smollm2" }}
[models.{model_id}.arch]
n_layer = 30
n_embd = 576
n_head = 9
n_head_kv = 3
head_dim = 64
n_vocab = 49152
n_ctx_train = 8192
tied_embeddings = true
[models.{model_id}.quants.Q4_1]
repo = "{SMOL_REPO}"
files = [{{ filename = "{filename}" }}]

[pairs."{model_id}+ngram"]
target = "{model_id}"
"""


def _smol_catalog(directory: Path, filename: str) -> None:
    """A catalog profile with one real model (SmolLM2 with FIM ids) and an n-gram pair."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "smol.toml").write_text(smol_entry("smol", filename))


def test_up_plans_pulls_from_the_locked_mirror_and_serves(
    env: dict[str, str], smollm_fim_q4: Path
) -> None:
    """`up` without --target: probe → plan → pull (from the IT-locked hub) → serve."""
    from tests.hubserver import LocalHub

    _smol_catalog(Path(env["XDG_CONFIG_HOME"]) / "localspec" / "models", smollm_fim_q4.name)
    port = _free_port()
    with LocalHub() as hub:
        hub.add_file(SMOL_REPO, smollm_fim_q4.name, smollm_fim_q4)
        (_system(env) / "10-it.toml").write_text(
            f'locked = ["hub.endpoint", "models.allowed"]\n'
            f'[hub]\nendpoint = "{hub.url}"\n[models]\nallowed = ["smol*"]\n'
        )
        env = {**env, "HF_ENDPOINT": "http://127.0.0.1:9", "LOCALSPEC_MODELS_PAIR": "smol+ngram"}
        up = localspec(env, "up", "--detach", "--port", str(port), "--ctx-size", "512")
        try:
            assert up.returncode == 0, up.stderr + up.stdout
            assert "env HF_ENDPOINT tried to set http://127.0.0.1:9" in up.stderr
            status = json.loads(localspec(env, "status", "--port", str(port), "--json").stdout)
            served = Path(status["props"]["model_path"])
            assert served.name == smollm_fim_q4.name
            assert served.read_bytes() == smollm_fim_q4.read_bytes()
            assert any(r.method == "GET" for r in hub.requests)
            log = localspec(env, "logs", "-n", "200").stdout
            assert "pair:     smol+ngram" in log  # the plan is shown before loading
            assert "HTTP Request:" not in log  # the download's client keeps its lines to itself
            answer = httpx.post(f"http://127.0.0.1:{port}/infill", json=INFILL, timeout=60)
            assert answer.status_code == 200, answer.text
        finally:
            assert localspec(env, "down", "--port", str(port)).returncode == 0
        hub.reset_counts()
        models = localspec(env, "models")
        assert models.returncode == 0
        assert any(
            ln.split()[:2] == ["smol", "Q4_1"] and ln.endswith("verified")
            for ln in models.stdout.splitlines()
        )
        again = localspec(env, "pull", "smol")
        assert again.returncode == 0, again.stderr
        assert again.stdout.strip() == str(served)
        assert hub.requests == []  # verified files cost no network request
        refused = localspec(env, "pull", "qwen2.5-coder-0.5b")
        assert refused.returncode == 2 and "not in models.allowed" in refused.stderr


@pytest.mark.skipif(os.name != "posix", reason="file modes and SIGINT are POSIX")
def test_inline_key_in_a_readable_file_warns_and_missing_model_fails(
    env: dict[str, str], tmp_path: Path
) -> None:
    user = _user_config(env)
    user.write_text('[server]\napi_key = "sk-inline-999"\n')
    user.chmod(0o644)
    missing = tmp_path / "nope.gguf"
    result = localspec(env, "up", "--target", str(missing), "--port", str(_free_port()))
    assert result.returncode == 1
    assert f"server.api_key is written in {user}, which other users can read" in result.stderr
    assert f"model file not found: {missing}" in result.stderr
    assert "sk-inline-999" not in result.stderr + result.stdout


@contextlib.contextmanager
def _following(env: dict[str, str]) -> Iterator[Callable[[], str]]:
    """`localspec logs -f -n 1` running: its next output line on each call; after the block
    it gets Ctrl-C and must exit 0."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "localspec", "logs", "-f", "-n", "1"],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        # Ctrl-C as in a terminal: a suite started in the background (nohup, `cmd &` in a
        # script) hands its children SIGINT ignored, and Python then never raises on it
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )

    def line() -> str:
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready, "no output from `localspec logs -f`"
        return proc.stdout.readline()

    try:
        yield line
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        proc.kill()  # whatever happened, no follower is left running
        proc.wait()


@pytest.mark.skipif(os.name != "posix", reason="SIGINT delivery")
def test_logs_follow_prints_new_lines_and_stops_on_ctrl_c(env: dict[str, str]) -> None:
    log = _state(env) / "localspec.log"
    log.parent.mkdir(parents=True)
    log.write_text("old 1\nold 2\n")
    with _following(env) as line:
        assert line() == "old 2\n"
        with log.open("a") as fh:
            fh.write("new 1\n")
        assert line() == "new 1\n"


@pytest.mark.skipif(os.name != "posix", reason="SIGINT delivery")
def test_logs_follow_waits_for_a_log_not_written_yet(env: dict[str, str]) -> None:
    assert localspec(env, "logs", "-n", "-2").returncode == 2
    log = _state(env) / "localspec.log"
    with _following(env) as line:
        assert line().startswith(f"no log yet at {log}")
        log.parent.mkdir(parents=True)
        (log.parent / "tmp").write_text("first\n")
        (log.parent / "tmp").rename(log)  # whole, as the daemon's first lines would be seen
        assert line() == "first\n"


def test_catalog_refresh_pins_sizes_and_sha256_from_the_hub(
    env: dict[str, str], tmp_path: Path
) -> None:
    import hashlib

    from tests.hubserver import LocalHub

    data = b"GGUF" + bytes(range(256)) * 40
    catalog_dir = tmp_path / "catalog"
    _smol_catalog(catalog_dir, "smol.gguf")
    with LocalHub() as hub:
        hub.add_file(SMOL_REPO, "smol.gguf", data)
        endpoint = ["--set", f"hub.endpoint={hub.url}"]
        dry = localspec(env, "catalog", "refresh", str(catalog_dir), "--dry-run", *endpoint)
        assert dry.returncode == 0, dry.stderr
        assert "files.smol.gguf.sha256" in dry.stdout and "dry run" in dry.stdout
        assert "sha256" not in (catalog_dir / "smol.toml").read_text()
        done = localspec(env, "catalog", "refresh", str(catalog_dir), "--json", *endpoint)
        assert done.returncode == 0, done.stderr
    keys = {change["key"] for change in json.loads(done.stdout)}
    assert {"files.smol.gguf.size", "files.smol.gguf.sha256"} <= keys
    text = (catalog_dir / "smol.toml").read_text()
    assert hashlib.sha256(data).hexdigest() in text and str(len(data)) in text
    offline = localspec(env, "catalog", "refresh", str(catalog_dir), "--set", "hub.offline=true")
    assert offline.returncode == 2 and "hub.offline" in offline.stderr


def test_status_report_renders_pair_memory_requests_and_acceptance() -> None:
    from localspec.commands.lifecycle import metric_totals, render_status, summarise

    metrics = """\
# TYPE localspec_requests counter
localspec_requests_total{endpoint="infill",outcome="ok"} 7
localspec_requests_total{endpoint="completion",outcome="ok"} 3
# TYPE localspec_prompt_tokens_evaluated counter
localspec_prompt_tokens_evaluated_total 250
# TYPE localspec_prompt_tokens_cached counter
localspec_prompt_tokens_cached_total 750
# TYPE localspec_draft_tokens counter
localspec_draft_tokens_total{source="draft"} 80
localspec_draft_tokens_total{source="ngram"} 20
# TYPE localspec_draft_tokens_accepted counter
localspec_draft_tokens_accepted_total{source="draft"} 60
localspec_draft_tokens_accepted_total{source="ngram"} 5
"""
    summary = summarise(metric_totals(metrics))
    assert summary["requests"] == 10
    assert summary["reuse_ratio"] == 0.75 and summary["acceptance_rate"] == 0.65
    report = {
        "url": "http://localhost:8012",
        "health": "ready",
        "pid": 42,
        "uptime_s": 3725,
        "rss_bytes": 512 * 1024 * 1024,
        "gpu_memory": [{"name": "NVIDIA H200", "used_bytes": 9 * 1024**3}],
        "props": {
            "model_alias": "qwen2.5-coder-7b+0.5b",
            "model_path": "/m/qwen2.5-coder-7b-q8_0.gguf",
            "draft_model_path": "/m/qwen2.5-coder-0.5b-q8_0.gguf",
            "n_ctx": 16384,
        },
        "slots": {"total": 2, "busy": 1},
        "metrics": summary,
    }
    text = render_status(report)
    for expected in (
        "pid 42, up 1h 2m 5s, 536.87 MB resident",
        "pair         qwen2.5-coder-7b+0.5b",
        "draft        /m/qwen2.5-coder-0.5b-q8_0.gguf",
        "memory       NVIDIA H200: 9.66 GB",
        "10 served",
        "750 tokens reused, 250 evaluated (75% reused)",
        "65 of 100 drafted tokens (65%)",
        "1 busy of 2",
    ):
        assert expected in text, (expected, text)


def test_pull_a_hub_file_reference_with_a_token_file(env: dict[str, str], tmp_path: Path) -> None:
    from tests.hubserver import LocalHub

    data = b"GGUF" + bytes(5000)
    token = tmp_path / "hf-token"
    token.write_text("hf_secret_token\n")
    ref = "acme/Tiny-GGUF/tiny.gguf"
    with LocalHub() as hub:
        hub.add_file("acme/Tiny-GGUF", "tiny.gguf", data)
        options = ["--set", f"hub.endpoint={hub.url}", "--set", f"hub.token_file={token}"]
        if os.name == "posix":
            token.chmod(0o644)
            refused = localspec(env, "pull", ref, *options)
            assert refused.returncode == 2 and f"chmod 600 {token}" in refused.stderr
            assert hub.requests == []
            token.chmod(0o600)
        result = localspec(env, "pull", ref, *options)
        assert result.returncode == 0, result.stderr
        assert Path(result.stdout.strip()).read_bytes() == data
        assert {r.authorization for r in hub.requests} == {"Bearer hf_secret_token"}
        assert "hf_secret_token" not in result.stdout + result.stderr


@pytest.mark.parametrize(
    ("argv", "infill_layout", "ring_attention"),
    [([], "typed-in-middle", "blocks"),
     (["--infill-layout", "llama-server"], "llama-server", "blocks"),
     (["--infill-layout", "typed-in-middle"], "typed-in-middle", "blocks"),
     (["--ring-attention", "causal"], "typed-in-middle", "causal")],
)  # fmt: skip
def test_infill_layout_and_ring_attention_flags_reach_the_server(
    argv: list[str],
    infill_layout: str,
    ring_attention: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    from localspec.commands import common, up

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    args = cli.build_parser().parse_args(["up", *argv])
    settings = common.load_settings(args, quiet=True).settings
    served = up.Served(types.SimpleNamespace(n_slots=1), "m.gguf")
    server = up._server_settings(settings, None, served)
    assert (server.infill_layout, server.ring_attention) == (infill_layout, ring_attention)


def test_server_limits_and_spm_reach_the_server(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from localspec.commands import common, up

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    served = up.Served(types.SimpleNamespace(n_slots=1), "m.gguf")

    def server_for(*argv: str) -> Any:
        args = cli.build_parser().parse_args(["up", *argv])
        return up._server_settings(common.load_settings(args, quiet=True).settings, None, served)

    default = server_for()
    assert (default.spm_infill, default.n_cmpl_max, default.max_body_bytes) == (
        False,
        16,
        8 * 1024 * 1024,
    )
    changed = server_for(
        "--spm-infill", "--set", "server.n_cmpl_max=4", "--set", "server.max_body_bytes=4096"
    )
    assert (changed.spm_infill, changed.n_cmpl_max, changed.max_body_bytes) == (True, 4, 4096)
    with pytest.raises(SettingsError, match="max_body_bytes"):
        server_for("--set", "server.max_body_bytes=10")
    assert (default.body_timeout_s, default.max_connections) == (30.0, 256)
    limits = server_for("--set", "server.body_timeout_s=5", "--set", "server.max_connections=8")
    assert (limits.body_timeout_s, limits.max_connections) == (5.0, 8)


@pytest.mark.parametrize(
    ("argv", "flash_attn"),
    [([], None), (["--flash-attn", "on"], True), (["--flash-attn", "off"], False)],
)
def test_flash_attn_flag_reaches_both_local_models(
    argv: list[str], flash_attn: bool | None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """None leaves the choice to the engine (off on this CPU build, see test_engine_load)."""
    from localspec.commands import common, up

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    target, draft = tmp_path / "t.gguf", tmp_path / "d.gguf"
    target.write_bytes(b"GGUF")
    draft.write_bytes(b"GGUF")
    args = cli.build_parser().parse_args(
        ["up", "--target", str(target), "--draft", str(draft), *argv]
    )
    settings = common.load_settings(args, quiet=True).settings
    engine = up._local_models(args, settings).engine
    assert engine.target.flash_attn is flash_attn and engine.draft.flash_attn is flash_attn
