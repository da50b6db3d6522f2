"""`localspec up` serving chat as users run it: real subprocesses, real models, real HTTP.

With local files (``--chat-target``) and through the plan: a profile catalog whose completion
pair is a base model and whose instruct pair fits beside it, both pulled from an IT-locked
mirror, both loaded, each request to its model.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from localspec import cli
from localspec.commands import common, up
from tests.test_cli import (  # noqa: F401 (the env fixture)
    INFILL,
    SMOL_REPO,
    _free_port,
    _system,
    env,
    localspec,
    smol_entry,
)

ASK = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}


def _chat_catalog(directory: Path, fim_file: str, chat_file: str) -> None:
    """SmolLM2 twice: with FIM ids as the completion model, as shipped (its chat template)
    as the instruct model; an n-gram pair each."""
    directory.mkdir(parents=True, exist_ok=True)
    entries = smol_entry("smol", fim_file) + smol_entry("smol-chat", chat_file, '["chat"]')
    (directory / "smol.toml").write_text(entries)


def test_up_serves_the_chat_pair_the_plan_chose(
    env: dict[str, str],  # noqa: F811
    smollm_fim_q4: Path,
    smollm_q4: Path,
) -> None:
    from tests.hubserver import LocalHub

    models_dir = Path(env["XDG_CONFIG_HOME"]) / "localspec" / "models"
    _chat_catalog(models_dir, smollm_fim_q4.name, smollm_q4.name)
    port = _free_port()
    with LocalHub() as hub:
        hub.add_file(SMOL_REPO, smollm_fim_q4.name, smollm_fim_q4)
        hub.add_file(SMOL_REPO, smollm_q4.name, smollm_q4)
        (_system(env) / "10-it.toml").write_text(
            f'locked = ["hub.endpoint", "models.allowed"]\n'
            f'[hub]\nendpoint = "{hub.url}"\n[models]\nallowed = ["smol*"]\n'
        )
        plan = localspec(env, "plan", "--json", "--ctx-size", "512")
        assert plan.returncode == 0, plan.stderr
        chat = json.loads(plan.stdout)["chat"]
        assert chat["mode"] == "separate" and chat["plan"]["pair_id"] == "smol-chat+ngram"
        upped = localspec(env, "up", "--detach", "--port", str(port), "--ctx-size", "512")
        try:
            assert upped.returncode == 0, upped.stderr + upped.stdout
            base = f"http://127.0.0.1:{port}"
            listed = httpx.get(f"{base}/v1/models").json()["data"]
            assert [m["id"] for m in listed] == ["smol+ngram", "smol-chat+ngram"]
            answer = httpx.post(f"{base}/v1/chat/completions", json=ASK, timeout=60)
            assert answer.status_code == 200, answer.text
            assert answer.json()["model"] == "smol-chat+ngram"
            infill = httpx.post(f"{base}/infill", json=INFILL, timeout=60)
            assert infill.status_code == 200 and infill.json()["model"] == "smol+ngram"
            log = localspec(env, "logs", "-n", "200").stdout
            assert "chat:     separate:" in log  # the plan, with both pairs, before loading
            status = localspec(env, "status", "--port", str(port))
            assert "chat         smol-chat+ngram" in status.stdout, status.stdout
        finally:
            assert localspec(env, "down", "--port", str(port)).returncode == 0


def test_up_with_a_local_chat_model_and_with_chat_off(
    env: dict[str, str],  # noqa: F811
    smollm_fim_q4: Path,
    smollm_q4: Path,
) -> None:
    port = _free_port()
    args = ["up", "--detach", "--port", str(port), "--ctx-size", "512"]
    files = ["--target", str(smollm_fim_q4), "--chat-target", str(smollm_q4)]
    upped = localspec(env, *args, *files)
    try:
        assert upped.returncode == 0, upped.stderr + upped.stdout
        base = f"http://127.0.0.1:{port}"
        models = httpx.get(f"{base}/v1/models").json()["models"]
        assert [m["capabilities"] for m in models] == [
            ["completion", "infill"],
            ["completion", "chat"],
        ]
        answer = httpx.post(f"{base}/v1/chat/completions", json=ASK, timeout=60)
        assert answer.status_code == 200 and answer.json()["model"] == smollm_q4.name
    finally:
        assert localspec(env, "down", "--port", str(port)).returncode == 0
    # models.chat = off: the chat model is not loaded, and chat says which setting did it
    args = cli.build_parser().parse_args(["up", *files, "--set", "models.chat=off"])
    settings = common.load_settings(args, quiet=True).settings
    served = up._local_models(args, settings)
    assert served.chat is None and served.chat_refusal == up.CHAT_OFF
    assert "models.chat = off" in up._server_settings(settings, None, served).chat_refusal
    usage = localspec(env, "up", "--chat-target", str(smollm_q4))
    assert usage.returncode == 2 and "--chat-target needs --target" in usage.stderr


def test_completions_and_chat_at_once_keep_the_daemon_up(
    env: dict[str, str],  # noqa: F811
    smollm_f16: Path,
    smollm_fim_q4: Path,
    smollm_q4: Path,
) -> None:
    """Chat and completions at once, each pair on its worker: the workers share the engine
    thread and the daemon answers every request. (The chat daemon crash this guards against
    came from the two models loading on two threads at once, about one daemon in ten, so this
    run catches it only sometimes; test_two_workers_share_one_engine_thread checks the order
    of the loads itself: server/worker.py EngineThread.)"""
    import random
    import threading

    port = _free_port()
    files = ["--target", str(smollm_f16), "--draft", str(smollm_fim_q4), "--threads", "2"]
    files += ["--chat-target", str(smollm_q4), "--slots", "1"]
    upped = localspec(env, "up", "--detach", "--port", str(port), "--ctx-size", "1024", *files)
    base = f"http://127.0.0.1:{port}"
    rng = random.Random(7)
    statuses: list[int | str] = []

    def send(path: str, bodies: list[dict[str, object]]) -> None:
        with httpx.Client(base_url=base, timeout=60) as client:
            for body in bodies:
                try:
                    statuses.append(client.post(path, json=body).status_code)
                except httpx.HTTPError as exc:  # the daemon went down
                    statuses.append(repr(exc))
                    return

    completions = [
        {"prompt": "def f(x):\n    return x" * rng.randint(1, 20), "n_predict": rng.randint(1, 24)}
        for _ in range(60)
    ]
    chats = [{**ASK, "model": smollm_q4.name, "max_tokens": rng.randint(1, 12)} for _ in range(60)]
    try:
        assert upped.returncode == 0, upped.stderr + upped.stdout
        clients = [
            threading.Thread(target=send, args=("/completion", completions)),
            threading.Thread(target=send, args=("/v1/chat/completions", chats)),
        ]
        for t in clients:
            t.start()
        for t in clients:
            t.join()
        assert statuses == [200] * 120
    finally:
        assert localspec(env, "down", "--port", str(port)).returncode == 0
