"""The foundation: the package installs, ships its data, and the launcher bootstraps it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import localspec
from localspec.resources import data_dir

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def test_console_script_and_module_agree() -> None:
    script = subprocess.run(
        [str(BIN / "localspec"), "--version"], capture_output=True, text=True, check=True
    )
    module = subprocess.run(
        [sys.executable, "-m", "localspec", "--version"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert script.stdout.strip() == module.stdout.strip() == f"localspec {localspec.__version__}"
    helptext = subprocess.run(
        [sys.executable, "-m", "localspec", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "examples:" in helptext and "up" in helptext


def test_data_dirs_found_from_source_tree() -> None:
    assert (data_dir("launcher") / "localspec").is_file()
    assert data_dir("models").is_dir()


def test_wheel_ships_models_and_launcher(tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("localspec-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "localspec/_data/launcher/localspec" in names
    assert "localspec/_data/launcher/bootstrap.sh" in names
    shipped_models = {n for n in names if n.startswith("localspec/_data/models/")}
    expected = {
        f"localspec/_data/models/{p.relative_to(ROOT / 'models').as_posix()}"
        for p in (ROOT / "models").rglob("*")
        if p.is_file()
    }
    assert expected and expected <= shipped_models


def _tool_dir(tmp_path: Path, tools: list[str]) -> Path:
    """A PATH holding only the named tools: what a machine without Python looks like."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool in tools:
        found = shutil.which(tool)
        assert found, tool
        (bindir / tool).symlink_to(found)
    return bindir


def test_launcher_without_python_says_so(tmp_path: Path) -> None:
    bindir = _tool_dir(tmp_path, ["sh", "dirname", "cat", "cksum", "cut", "grep", "uname"])
    env = {"PATH": str(bindir), "HOME": str(tmp_path), "LOCALSPEC_VENV": str(tmp_path / "venv")}
    result = _launch(env)
    assert result.returncode == 1
    assert "Python 3.10 or newer is required" in result.stderr


def _launch(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["sh", str(ROOT / "launcher" / "localspec"), "--version"],
        env=env,
        capture_output=True,
        text=True,
    )


def test_launcher_bootstraps_once_then_starts_at_once(tmp_path: Path) -> None:
    """First run creates the venv and installs (from the cached llama.cpp wheel); the second
    run installs nothing."""
    env = {
        **os.environ,
        "LOCALSPEC_VENV": str(tmp_path / "venv"),
        "LOCALSPEC_PYTHON": sys.executable,
    }
    env.pop("VIRTUAL_ENV", None)
    first = _launch(env)
    assert first.returncode == 0, first.stderr
    assert "creating the virtual environment" in first.stderr
    assert first.stdout.strip() == f"localspec {localspec.__version__}"
    second = _launch(env)
    assert second.returncode == 0
    assert "installing" not in second.stderr and "creating" not in second.stderr
    assert second.stdout.strip() == first.stdout.strip()
    # localspec changed (stamp gone) and no wheel is cached: llama.cpp is installed already,
    # so it is reinstalled from nothing and never rebuilt.
    (tmp_path / "venv" / ".localspec-installed").unlink()
    env["LOCALSPEC_WHEELHOUSE"] = str(tmp_path / "empty-wheelhouse")
    third = _launch(env)
    assert third.returncode == 0, third.stderr
    assert "installing localspec" in third.stderr
    assert "building llama.cpp" not in third.stderr and "llama-cpp-python" not in third.stderr
