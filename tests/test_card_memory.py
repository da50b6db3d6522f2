"""Devices from llama.cpp itself, and memory as planned: the planner's arithmetic held against
what llama.cpp logs it allocated, per device, on real fixture models; a load that runs out of
memory re-planned by ``up`` (a real allocation failure: a context no address space holds)."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from localspec.commands.lifecycle import render_status
from localspec.engine import Engine, EngineSettings, ModelSettings, OutOfMemoryError, memory
from localspec.engine import devices as ggml_devices
from localspec.engine.alloc import Allocations
from localspec.hardware import probe_build
from tests.test_cli import INFILL, _free_port, env, localspec  # noqa: F401 (the env fixture)


def test_llama_cpp_lists_its_devices_and_backends() -> None:
    found = ggml_devices.devices()
    cpu = [d for d in found if d.type == "cpu"]
    assert cpu and cpu[0].backend == "CPU" and cpu[0].buffer_type == "CPU"
    assert all(0 < d.free_bytes <= d.total_bytes for d in found), found
    assert "CPU" in ggml_devices.backends()
    assert probe_build(found).backends == ggml_devices.backends()
    assert all(d.offloads == (d.type in ("gpu", "igpu")) for d in found)


def test_allocation_log_lines_are_read_per_device() -> None:
    rec = Allocations()
    for line in (
        "load_tensors:      Vulkan0 model buffer size =   256.60 MiB",
        "load_tensors:   CPU_Mapped model buffer size =    54.00 MiB",
        "llama_kv_cache:    Vulkan0 KV buffer size =    22.50 MiB",
        "llama_context:    Vulkan0 compute buffer size =    98.25 MiB",
        "llama_context: Vulkan_Host compute buffer size =     3.01 MiB",
        "llama_context: Vulkan_Host  output buffer size =     0.94 MiB",
        "ggml_vulkan: Device memory allocation of size 123 failed.",
    ):
        rec.feed(line)
    got = rec.by_device({"Vulkan0": "Vulkan0"})
    mib = 2**20
    assert got["Vulkan0"] == {
        "model": round(256.60 * mib),
        "kv": round(22.50 * mib),
        "compute": round(98.25 * mib),
    }
    assert got["host"]["model"] == 54 * mib
    assert got["host"]["compute"] == round(3.01 * mib) + round(0.94 * mib)
    assert len(rec.failures) == 1


def _engine_settings(target: Path, draft: Path | None, n_ctx: int, n_slots: int) -> EngineSettings:
    return EngineSettings(
        target=ModelSettings(str(target), n_ctx=n_ctx, n_threads=1),
        draft=ModelSettings(str(draft), n_ctx=n_ctx, n_threads=1) if draft else None,
        n_slots=n_slots,
    )


@pytest.mark.parametrize(
    ("target", "draft", "n_ctx", "n_slots"),
    [
        ("smollm_fim_f16", "smollm_fim_q4", 1024, 1),
        ("smollm_fim_f16", None, 4096, 2),
        ("qwen_target", "qwen_draft", 2048, 1),
    ],
)
def test_allocated_is_within_10_percent_of_the_plan_on_the_cpu(
    target: str, draft: str | None, n_ctx: int, n_slots: int, request: pytest.FixtureRequest
) -> None:
    t = request.getfixturevalue(target)
    d = request.getfixturevalue(draft) if draft else None
    with Engine.load(_engine_settings(t, d, n_ctx, n_slots)) as engine:
        rows = memory.report(engine)
        info = memory.props(engine)
    assert [r["device"] for r in rows] == ["host"]  # a CPU build: one device
    (row,) = rows
    for kind in ("model", "kv", "compute"):
        planned, real = row["planned"][kind], row["allocated"][kind]
        assert real > 0, (kind, row)
        assert abs(planned - real) <= 0.10 * real, (kind, planned, real)
    assert memory.within(rows)
    text = render_status({"url": "http://x", "health": "ready", "props": {"llama_cpp": info}})
    assert "llama.cpp    CPU" in text and "host (RAM)" in text
    assert "of plan" in text


def test_a_gpu_memory_cap_only_binds_offload_devices(smollm_fim_q4: Path) -> None:
    every_layer = ModelSettings(str(smollm_fim_q4), n_gpu_layers=-1, n_ctx=512, n_threads=1)
    capped = EngineSettings(every_layer, n_slots=1, gpu_memory_cap=1)
    if ggml_devices.offload_devices():  # a GPU build: one byte holds nothing
        with pytest.raises(OutOfMemoryError, match=r"over the .* cap"):
            Engine.load(capped)
    else:  # the CPU build: the cap is on GPU memory, the host is not capped
        with Engine.load(capped) as engine:
            assert memory.report(engine)[0]["allocated"]["model"] > 0


def _limited_address_space() -> None:
    # an allocation past this fails whatever the kernel's overcommit policy, so a context
    # too large for any machine fails at once instead of being touched page by page
    resource.setrlimit(resource.RLIMIT_AS, (16 * 2**30, 16 * 2**30))


def test_up_replans_when_llama_cpp_runs_out_of_memory(
    env: dict[str, str],  # noqa: F811
    smollm_fim_f16: Path,
    smollm_fim_q4: Path,
) -> None:
    port = _free_port()
    # 2M tokens of SmolLM2's KV are ~46 GB: llama.cpp's buffer allocation fails for real
    args = ["up", "--detach", "--port", str(port), "--ctx-size", "2000000"]
    args += ["--target", str(smollm_fim_f16), "--draft", str(smollm_fim_q4)]
    upped = subprocess.run(
        [sys.executable, "-m", "localspec", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=_limited_address_space,
    )
    try:
        assert upped.returncode == 0, upped.stderr + upped.stdout
        log = localspec(env, "logs", "-n", "200").stdout
        assert "ran out of memory" in log, log
        assert "re-planned with context 2000000 -> 8192 tokens" in log, log
        base = f"http://127.0.0.1:{port}"
        props = httpx.get(f"{base}/props", timeout=30).json()
        assert props["n_ctx"] == 8192
        (row,) = props["llama_cpp"]["memory"]
        assert abs(row["ratio"] - 1.0) <= 0.10, row
        answer = httpx.post(f"{base}/infill", json=INFILL, timeout=120)
        assert answer.status_code == 200, answer.text
        status = localspec(env, "status", "--port", str(port))
        assert "planned / allocated" in status.stdout, status.stdout
        shown = localspec(env, "status", "--port", str(port), "--json")
        assert json.loads(shown.stdout)["props"]["llama_cpp"]["memory"] == [row]
    finally:
        assert localspec(env, "down", "--port", str(port)).returncode == 0
