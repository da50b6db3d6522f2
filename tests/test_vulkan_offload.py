"""The offload path for real: llama.cpp built for Vulkan, run on a Vulkan device (on a CPU-only
machine Mesa's lavapipe, with GGML_VK_VISIBLE_DEVICES=0). Layers, KV and the draft on the
device; the plan against llama.cpp's own allocation; speculation's answers against the
target's. Sized for lavapipe: ~50 s compiling pipelines at the first evaluation, then a few
tokens/s. Run by .ci/run's Vulkan step (``-m vulkan``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from localspec.engine import devices as ggml_devices
from tests.test_cli import _free_port, env, localspec  # noqa: F401 (the env fixture)

pytestmark = pytest.mark.vulkan

NO_DEVICE = (
    "llama.cpp sees no Vulkan device: build it with CMAKE_ARGS=-DGGML_VULKAN=on, and on a "
    "machine whose only Vulkan device is lavapipe (a CPU-type device llama.cpp skips) set "
    "GGML_VK_VISIBLE_DEVICES=0"
)


def test_llama_cpp_sees_a_vulkan_device_with_its_memory() -> None:
    assert "Vulkan" in ggml_devices.backends()
    devices = ggml_devices.offload_devices()
    assert devices, NO_DEVICE
    vk = devices[0]
    assert vk.backend == "Vulkan" and vk.name == "Vulkan0" and vk.buffer_type == "Vulkan0"
    assert 0 < vk.free_bytes <= vk.total_bytes


def test_plan_up_and_status_with_the_pair_on_the_device(
    env: dict[str, str],  # noqa: F811
    smollm_fim_f16: Path,
    smollm_fim_q4: Path,
    tmp_path: Path,
) -> None:
    out = tmp_path / "offload.json"
    args = ["bench", "offload", "--target", str(smollm_fim_f16), "--draft", str(smollm_fim_q4)]
    args += ["--prompts", "2", "--n-predict", "6", "--json", str(out)]
    done = subprocess.run(
        [sys.executable, "-m", "localspec", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    plan = result["plan"]
    # `localspec plan`: the build's backends, the device llama.cpp sees, every layer on it
    assert "Vulkan" in plan["backends"], plan
    assert any(d.startswith("Vulkan0: ") for d in plan["llama_devices"]), plan
    assert plan["memory"][0]["device"].startswith("vulkan:0 ")
    assert plan["target_ngl"] == plan["target_layers"]
    # what llama.cpp allocated on the device and on the host, within 10 % of the plan's rule
    rows = {r["device"]: r for r in result["memory"]}
    assert set(rows) == {"Vulkan0", "host"}, rows
    for kind in ("model", "kv", "compute"):
        assert rows["Vulkan0"]["allocated"][kind] > 0, rows["Vulkan0"]
    for row in rows.values():
        assert abs(row["ratio"] - 1.0) <= 0.10, row
    # speculation with the draft on the device changed no greedy answer; the bench runs the
    # draft model on every step and without its own thread (speculative.pipeline off), so
    # the draft offers tokens whatever the timing
    assert result["speculative"]["mode"] == "draft", result["speculative"]
    assert result["speculative"]["pipeline"] == "off", result["speculative"]
    assert result["all_equal"], result["answers"]
    assert all(a["speculative"]["tokens"] > 0 for a in result["answers"])
    assert result["drafted"] > 0, result["answers"]
    # every drafted token was verified and its acceptance counted: by draft position in each
    # answer's timings, and in /metrics (the target-only answers drafted nothing)
    for answer in result["answers"]:
        spec = answer["speculative"]
        assert 0 <= spec["draft_n_accepted"] <= spec["draft_n"], spec
        assert sum(spec["draft_n_accepted_per_pos"]) == spec["draft_n_accepted"], spec
        assert (spec["draft_n_verif_steps"] > 0) == (spec["draft_n"] > 0), spec
        assert answer["target_only"]["draft_n"] == 0, answer
    metrics = result["metrics"]
    assert metrics["draft_tokens"] == result["drafted"], metrics
    assert metrics["draft_tokens_accepted"] == result["accepted"], metrics
    assert "Vulkan0" in result["status_text"] and "of plan" in result["status_text"]


def test_up_over_the_memory_cap_replans_with_fewer_layers(
    env: dict[str, str],  # noqa: F811
    smollm_fim_f16: Path,
) -> None:
    # every layer of the F16 file takes ~380 MiB of the device at this context; a 0.25 GB
    # card cannot hold them: the load fails for memory and `up` re-plans with fewer layers
    port = _free_port()
    args = ["up", "--detach", "--port", str(port), "--ctx-size", "1024"]
    args += ["--target", str(smollm_fim_f16), "--gpu-memory-gb", "0.25"]
    upped = localspec(env, *args, timeout=600)
    try:
        assert upped.returncode == 0, upped.stderr + upped.stdout
        log = localspec(env, "logs", "-n", "300").stdout
        assert "ran out of memory: re-planned with GPU layers 31 -> " in log, log
        props = httpx.get(f"http://127.0.0.1:{port}/props", timeout=30).json()
        rows = {r["device"]: r for r in props["llama_cpp"]["memory"]}
        device = rows["Vulkan0"]
        assert 0 < device["allocated"]["total"] <= 0.25e9, device
        assert abs(device["ratio"] - 1.0) <= 0.10, device
    finally:
        assert localspec(env, "down", "--port", str(port)).returncode == 0
