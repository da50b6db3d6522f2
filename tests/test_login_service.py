"""Login services: render and validate all three, install/uninstall into a temporary home."""

from __future__ import annotations

import os
import plistlib
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from localspec import login_service

TASK_NS = "{http://schemas.microsoft.com/windows/2004/02/mit/task}"


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("USERPROFILE", str(home))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    monkeypatch.setenv("LOCALSPEC_STATE_DIR", str(home / "state dir"))  # a space, on purpose
    monkeypatch.setenv("LOCALSPEC_DATA_DIR", str(home / "data"))
    return home


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOCALSPEC_", "XDG_"))}
    env.update(HOME=str(home), LOCALSPEC_STATE_DIR=str(home / "state"), **extra)
    return env


def test_systemd_unit_runs_this_python_and_passes_systemd_analyze(home: Path) -> None:
    text = login_service.render("linux")
    exec_line = next(ln for ln in text.splitlines() if ln.startswith("ExecStart="))
    # the state dir has a space: the log path must be one quoted word
    assert exec_line.startswith(f'ExecStart={sys.executable} -m localspec up --log-file "')
    assert "state dir/localspec.log" in exec_line
    check = login_service.validate("linux", login_service.encode("linux", text))
    assert check.ok, check.messages
    if shutil.which("systemd-analyze"):
        assert check.how == "systemd-analyze verify"


def test_systemd_validation_catches_a_broken_unit() -> None:
    bad = login_service.render("linux").replace("Restart=on-failure", "Restrat=on-failure")
    check = login_service.validate("linux", bad.encode())
    assert not check.ok
    broken = login_service.render("linux").replace("[Install]", "")
    assert not login_service._parse_ini_unit(broken).ok


def test_launchd_plist_parses_with_program_arguments(home: Path) -> None:
    data = login_service.encode(
        "macos", login_service.render("macos", ["/opt/py & co/python", "-m", "localspec", "up"])
    )
    plist = plistlib.loads(data)
    assert plist["Label"] == login_service.LAUNCHD_LABEL
    assert plist["ProgramArguments"] == ["/opt/py & co/python", "-m", "localspec", "up"]
    assert plist["RunAtLoad"] is True
    assert plist["KeepAlive"] == {"SuccessfulExit": False}
    assert login_service.validate("macos", data).ok
    assert not login_service.validate("macos", data.replace(b"</dict>\n</plist>", b"")).ok


def test_windows_task_is_utf16_xml_with_a_logon_trigger(home: Path, monkeypatch) -> None:
    monkeypatch.setenv("USERNAME", "dev")
    monkeypatch.setenv("USERDOMAIN", "CORP")
    command = [
        r"C:\Program Files\Python311\pythonw.exe",
        "-m",
        "localspec",
        "up",
        "--log-file",
        r"C:\a b\l.log",
    ]
    data = login_service.encode("windows", login_service.render("windows", command))
    assert data[:2] in (b"\xff\xfe", b"\xfe\xff")  # schtasks wants the BOM
    root = ET.fromstring(data)
    assert root.find(f"{TASK_NS}Triggers/{TASK_NS}LogonTrigger/{TASK_NS}UserId").text == r"CORP\dev"
    exec_ = root.find(f"{TASK_NS}Actions/{TASK_NS}Exec")
    assert exec_.find(f"{TASK_NS}Command").text == command[0]
    assert exec_.find(f"{TASK_NS}Arguments").text == r'-m localspec up --log-file "C:\a b\l.log"'
    assert (
        root.find(f"{TASK_NS}Principals/{TASK_NS}Principal/{TASK_NS}RunLevel").text
        == "LeastPrivilege"
    )
    assert login_service.validate("windows", data).ok


@pytest.mark.parametrize("os_name", login_service.OS_NAMES)
def test_install_and_uninstall_in_a_temp_home(home: Path, os_name: str) -> None:
    outcome = login_service.install(os_name, start=False)
    path = login_service.service_path(os_name)
    assert outcome.ok and outcome.path == path and path.is_file()
    assert str(home) in str(path)
    assert login_service.validate(os_name, path.read_bytes()).ok
    assert login_service.status(os_name).installed
    login_service.uninstall(os_name)
    assert not path.exists()
    assert not login_service.status(os_name).installed


def test_systemd_install_respects_xdg_config_home(home: Path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home / "cfg"))
    assert (
        login_service.service_path("linux")
        == home / "cfg" / "systemd" / "user" / "localspec.service"
    )


@pytest.mark.skipif(login_service.current_os() != "linux", reason="drives systemctl on Linux")
def test_install_enables_with_systemctl_user_and_reports_failure(
    home: Path, tmp_path: Path
) -> None:
    """A stand-in systemctl on PATH records its arguments; real `localspec` subprocesses."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls.txt"
    fake = bin_dir / "systemctl"
    fake.write_text(
        f'#!/bin/sh\necho "$@" >> "{calls}"\n'
        'case "$*" in *is-enabled*) echo enabled;; *is-active*) echo active;; esac\n'
        'if [ "$FAIL_ENABLE" = 1 ] && [ "$2" = enable ]; then echo "no user bus" >&2; exit 1; fi\n'
        'if [ -n "$FAIL_ENABLE" ] && [ "$2" = enable ]; then echo "$FAIL_ENABLE" >&2; exit 1; fi\n'
    )
    fake.chmod(0o755)
    env = _env(home, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    run = lambda *args, **kw: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "localspec", "service", *args],
        env={**env, **kw},
        capture_output=True,
        text=True,
        timeout=60,
    )
    result = run("install")
    assert result.returncode == 0, result.stderr
    assert calls.read_text().splitlines() == [
        "--user daemon-reload",
        "--user enable --now localspec.service",
    ]
    status = run("status")
    assert "installed" in status.stdout and "enabled: enabled   active: active" in status.stdout
    result = run("uninstall")
    assert result.returncode == 0
    assert "--user disable --now localspec.service" in calls.read_text()
    assert not (home / ".config/systemd/user/localspec.service").exists()
    failed = run("install", FAIL_ENABLE="1")
    assert failed.returncode == 1
    assert "no user bus" in failed.stdout and "enable it by hand" in failed.stdout
    # systemctl's own words in an ssh session or a container: say what the user can do
    nobus = run("install", FAIL_ENABLE="Failed to connect to bus: No medium found")
    assert nobus.returncode == 1
    assert "there is no systemd user session here" in nobus.stdout
    assert "loginctl enable-linger" in nobus.stdout


def test_cli_dry_run_renders_every_os_without_writing(home: Path) -> None:
    for os_name, marker in (("linux", "ExecStart="), ("macos", "<plist"), ("windows", "<Task")):
        result = subprocess.run(
            [sys.executable, "-m", "localspec", "service", "install", "--os", os_name, "--dry-run"],
            env=_env(home),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        assert marker in result.stdout
        assert "checked with" in result.stderr
    assert not any(home.rglob("localspec.service")) and not any(home.rglob("*.plist"))


def test_install_refuses_settings_the_service_would_fail_on(home: Path) -> None:
    config = home / "config"
    config.mkdir()
    (config / "config.toml").write_text("[server]\nprot = 8012\n")
    env = _env(home, LOCALSPEC_CONFIG_DIR=str(config), LOCALSPEC_SYSTEM_CONFIG_DIR=str(home / "s"))
    for dry in ([], ["--dry-run"]):
        result = subprocess.run(
            [sys.executable, "-m", "localspec", "service", "install", "--os", "linux", *dry],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 2 and "unknown key 'server.prot'" in result.stderr
    assert not any(home.rglob("localspec.service"))
