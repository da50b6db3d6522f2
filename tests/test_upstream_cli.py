"""``localspec up`` with an IT profile that points the workstation at a team server: real
subprocesses, a temporary HOME, a second localspec daemon as the team server."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.test_cli import INFILL, _free_port, _system, _user_config, _wait_ready, env, localspec
from tests.upstream_support import daemon

__all__ = ["env"]  # the fixture, imported for these tests

SECRET = "sk-team-upstream-7f3a"


@dataclass
class Up:
    """A ``localspec up`` subprocess; ``code`` and ``log`` are set once it has stopped."""

    port: int
    code: int | None = None
    log: str = ""


@contextlib.contextmanager
def running_up(env: dict[str, str], tmp_path: Path, *args: str) -> Iterator[Up]:
    """``localspec up`` on a free port, ready when entered, stopped with SIGTERM on exit."""
    up = Up(_free_port())
    with (tmp_path / "up.out").open("w+") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "localspec", "up", "--port", str(up.port), *args],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        try:
            _wait_ready(up.port, proc)
            yield up
        finally:
            proc.send_signal(signal.SIGTERM)
            up.code = proc.wait(60)
            out.seek(0)
            up.log = out.read()


def test_an_it_profile_points_up_at_the_team_server(
    env: dict[str, str], qwen_target: Path, tmp_path: Path
) -> None:
    with daemon(tmp_path, model=str(qwen_target), api_key=SECRET, n_slots=4) as team:
        key = tmp_path / "upstream.key"
        key.write_text(SECRET + "\n")
        key.chmod(0o600)
        profile = _system(env) / "50-team.toml"
        profile.write_text(
            'locked = ["backend"]\n[backend]\nkind = "llama-server"\n'
            f'url = "{team.url}"\napi_key_file = "{key}"\nfallback = "none"\n'
        )
        _user_config(env).write_text('[backend]\nkind = "local"\n')  # locked: ignored
        with running_up(env, tmp_path, "--log-requests") as up:
            port = up.port
            url = f"http://127.0.0.1:{port}"
            answer = httpx.post(f"{url}/infill", json=INFILL, timeout=60)
            assert answer.status_code == 200, answer.text
            assert answer.json()["model"] == qwen_target.name  # the team server's model

            status = localspec(env, "status", "--port", str(port))
            assert status.returncode == 0, status.stderr
            assert f"backend      llama-server {team.url}: up, slot " in status.stdout
            assert "of 4" in status.stdout and "answering    upstream" in status.stdout
            assert "fallback     none" in status.stdout
            assert "completions  1 by the upstream, 0 by the local model" in status.stdout
            report = json.loads(localspec(env, "status", "--port", str(port), "--json").stdout)
            assert report["props"]["backend"]["status"] == "up"

            explain = localspec(env, "profile", "explain")
            lines = explain.stdout.splitlines()
            rows = {line.split()[0]: line for line in lines if line and line[0] != " "}
            assert rows["backend.kind"].split()[1] == "llama-server"
            assert rows["backend.kind"].endswith("[locked]")
            assert str(key) in rows["backend.api_key_file"]
            assert "tried to set local" in explain.stdout
        log = up.log
        assert up.code == 0, log
        assert "connecting to the llama-server upstream" in log and "serving at" in log
        assert "POST /infill 200 ok" in log and "backend=upstream" in log
        shown = log + status.stdout + explain.stdout + json.dumps(report)
        assert SECRET not in shown
        assert SECRET not in Path(team.log_file or "").read_text()


def test_up_refuses_plain_http_to_another_host(env: dict[str, str]) -> None:
    _user_config(env).write_text(
        '[backend]\nkind = "llama-server"\nurl = "http://10.9.9.9:8012"\nfallback = "none"\n'
    )
    result = localspec(env, "up", "--port", str(_free_port()))
    assert result.returncode == 2
    assert "plain http to 10.9.9.9" in result.stderr
    assert "backend.allow_insecure_http" in result.stderr


def test_up_needs_a_catalog_model_for_the_openai_kind(env: dict[str, str]) -> None:
    _user_config(env).write_text(
        '[backend]\nkind = "openai"\nurl = "http://127.0.0.1:9"\nmodel = "llama3"\n'
        'fallback = "none"\n'
    )
    result = localspec(env, "up", "--port", str(_free_port()))
    assert result.returncode == 1
    assert "backend.model = 'llama3' names no catalog model with FIM tokens" in result.stderr


@pytest.mark.skipif(os.name != "posix", reason="signals and file modes as on POSIX")
def test_up_with_an_unreachable_team_server_and_no_fallback_says_why(
    env: dict[str, str], tmp_path: Path
) -> None:
    dead = f"http://127.0.0.1:{_free_port()}"
    _user_config(env).write_text(
        f'[backend]\nkind = "llama-server"\nurl = "{dead}"\nfallback = "none"\n'
    )
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "localspec", "up", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except httpx.TransportError:
                time.sleep(0.2)
        assert health.status_code == 503
        assert f"the upstream {dead} is down" in health.json()["error"]["message"]
        status = localspec(env, "status", "--port", str(port))
        assert "loading" in status.stdout  # answering, but not ready (nothing can serve)
        assert f"  why          the upstream {dead} is down" in status.stdout
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


@pytest.mark.parametrize(
    "local_rule",
    ["[hub]\noffline = true\n", '[models]\nallowed = ["no-such-model-*"]\n'],
    ids=["offline-nothing-downloaded", "profile-forbids-every-local-model"],
)
def test_up_serves_through_the_team_server_when_no_local_model_can_stand_in(
    local_rule: str, env: dict[str, str], qwen_target: Path, tmp_path: Path
) -> None:
    """B2: backend.fallback = local (the default), but no local model can be had (nothing
    downloaded and the hub is off limits, or the profile allows none): ``up`` still serves
    through the team server, and says there is no local fallback and why."""
    with daemon(tmp_path, model=str(qwen_target), n_slots=4) as team:
        _system(env).joinpath("50-team.toml").write_text(
            f'{local_rule}[backend]\nkind = "llama-server"\nurl = "{team.url}"\n'
        )
        with running_up(env, tmp_path) as up:
            answer = httpx.post(f"http://127.0.0.1:{up.port}/infill", json=INFILL, timeout=60)
            assert answer.status_code == 200, answer.text
            assert answer.headers["x-localspec-backend"] == "upstream"
            status = localspec(env, "status", "--port", str(up.port))
            assert "answering    upstream" in status.stdout
            assert "  fallback     none (no local model: " in status.stdout, status.stdout
        assert up.code == 0, up.log
        assert "no local model to stand in for the upstream" in up.log, up.log


def test_validate_and_service_install_refuse_the_backend_up_refuses(
    env: dict[str, str], tmp_path: Path
) -> None:
    """B3: a backend ``up`` refuses (plain http to another host) is refused, with the same
    message, by ``profile validate`` (a file, and the effective settings) and by ``service
    install`` (which would install a unit that fails at every login)."""
    profile = '[backend]\nkind = "llama-server"\nurl = "http://10.9.9.9:8012"\nfallback = "none"\n'
    corp = tmp_path / "corp.toml"
    corp.write_text(profile)
    _user_config(env).write_text(profile)
    up = localspec(env, "up", "--port", str(_free_port()))
    assert up.returncode == 2 and "plain http to 10.9.9.9" in up.stderr
    said = next(line for line in up.stderr.splitlines() if "plain http" in line)
    for args in (
        ("profile", "validate", str(corp)),
        ("profile", "validate"),
        ("service", "install", "--dry-run"),
    ):
        result = localspec(env, *args)
        assert result.returncode == 2, (args, result.stdout, result.stderr)
        assert said in result.stderr.splitlines(), (args, result.stderr)
