"""What every benchmark shares besides its argument parser (command.py) and the servers it
starts (anchor.py): the machine's facts, and the result file each run leaves behind.

A result file is one JSON document per run, under the results directory, holding what a
reader needs to trust or repeat it: the machine, the git commit, the command line, the date,
the table the run printed and the figures behind it. docs/benchmarks.md's tables are rendered
from these files (``localspec bench render``), so the docs cannot drift from the data.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# not LOCALSPEC_*: the settings refuse unknown variables with that prefix, and a benchmark
# passes its environment to the daemons it starts
RESULTS_ENV = "BENCH_RESULTS_DIR"
SCHEMA = 1
_SOURCE_ROOT = Path(__file__).resolve().parents[2]


def source_checkout() -> Path | None:
    """The git checkout this package runs from, or None when it is installed from a wheel."""
    root = _SOURCE_ROOT
    return root if (root / "pyproject.toml").is_file() and (root / ".git").exists() else None


def results_dir() -> Path:
    """``$BENCH_RESULTS_DIR``, else the checkout's ``bench/results`` (kept in git, the
    project's record), else ``bench-results`` in the user's data directory."""
    if os.environ.get(RESULTS_ENV):
        return Path(os.environ[RESULTS_ENV]).expanduser()
    root = source_checkout()
    if root is not None:
        return root / "bench" / "results"
    from localspec.paths import user_data_dir

    return user_data_dir() / "bench-results"


def git_commit() -> str:
    """The checkout's commit (``+dirty`` with uncommitted changes), or ``unknown``."""
    root = source_checkout()
    if root is None:
        return "unknown"
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True, text=True, check=True, timeout=10,
        ).stdout.strip()  # fmt: skip
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, check=True, timeout=10,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head}+dirty" if dirty else head


def machine() -> dict[str, Any]:
    """The facts that decide a benchmark's figures: CPU, cores, memory, OS, Python."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
    }
    try:
        import psutil

        info["physical_cores"] = psutil.cpu_count(logical=False)
        info["memory_gb"] = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:  # pragma: no cover
        pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return info


def command_line(benchmark: str, argv: Sequence[str] | None) -> str:
    """The command that repeats this run (the arguments as the benchmark received them)."""
    args = list(sys.argv[1:] if argv is None else argv)
    return shlex.join(["localspec", "bench", benchmark, *args])


def write_json(path: Path, doc: Any) -> None:
    """``--json FILE``: the figures alone, as the benchmark always wrote them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print(f"wrote {path}", file=sys.stderr)


def record(
    benchmark: str,
    argv: Sequence[str] | None,
    table: str,
    figures: Any,
    *,
    json_path: Path | str | None = None,
) -> Path:
    """Write this run's result file (and ``--json``'s copy of the figures); returns its path."""
    if json_path:
        write_json(Path(json_path), figures)
    now = datetime.datetime.now(datetime.timezone.utc)
    commit = git_commit()
    doc = {
        "schema": SCHEMA,
        "benchmark": benchmark,
        "date": now.isoformat(timespec="seconds"),
        "commit": commit,
        "command": command_line(benchmark, argv),
        "machine": machine(),
        "table": {"text": table.rstrip("\n")},
        "figures": figures,
    }
    stamp = now.strftime("%Y-%m-%dT%H%M%SZ")
    out = results_dir() / benchmark / f"{stamp}-{commit[:7]}.json"
    n = 1
    while out.exists():  # two runs in one second
        n += 1
        out = out.with_name(f"{stamp}-{commit[:7]}-{n}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print(f"result: {out}", file=sys.stderr)
    return out
