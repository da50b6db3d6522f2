"""Login services: start the daemon when the user logs in, without root.

One template per OS under ``launcher/templates`` (a systemd user unit, a launchd LaunchAgent, a
Task Scheduler logon task). Rendering is pure (:func:`render`); :func:`install`,
:func:`uninstall` and :func:`status` write the file for the current user and drive the OS tool
(``systemctl --user``, ``launchctl``, ``schtasks``) only when it exists, so the files can be
rendered and installed for any OS into a temporary home in tests.
"""

from __future__ import annotations

import getpass
import os
import plistlib
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from string import Template
from typing import Literal
from xml.sax.saxutils import escape

from localspec import paths
from localspec.resources import data_dir

OsName = Literal["linux", "macos", "windows"]
OS_NAMES: tuple[OsName, ...] = ("linux", "macos", "windows")
UNIT_NAME = "localspec.service"
LAUNCHD_LABEL = "org.localspec.daemon"
TASK_NAME = "localspec"
TEMPLATES: dict[OsName, str] = {
    "linux": "localspec.service",
    "macos": f"{LAUNCHD_LABEL}.plist",
    "windows": "localspec-task.xml",
}


class ServiceError(RuntimeError):
    """A service file that did not render, validate or install; the message says why."""


def current_os() -> OsName:
    if sys.platform == "darwin":
        return "macos"
    if sys.platform.startswith("win"):
        return "windows"
    return "linux"


def home() -> Path:
    return Path(os.environ.get("HOME") or os.environ.get("USERPROFILE") or Path.home())


def service_path(os_name: OsName) -> Path:
    """Where the service file goes for the current user."""
    if os_name == "linux":
        config = os.environ.get("XDG_CONFIG_HOME") or str(home() / ".config")
        return Path(config) / "systemd" / "user" / UNIT_NAME
    if os_name == "macos":
        return home() / "Library" / "LaunchAgents" / f"{LAUNCHD_LABEL}.plist"
    if current_os() == "windows":
        return paths.user_data_dir() / "localspec-task.xml"
    return home() / "AppData" / "Local" / "localspec" / "localspec-task.xml"


def log_path() -> Path:
    return paths.state_dir() / "localspec.log"


def daemon_command(os_name: OsName, python: str | None = None) -> list[str]:
    """The command a login service runs: this Python, foreground ``up``, logging to a file."""
    python = python or sys.executable
    if os_name == "windows":  # pythonw: no console window at every logon
        candidate = Path(python).with_name("pythonw.exe")
        if candidate.name != Path(python).name and candidate.exists():
            python = str(candidate)
    return [python, "-m", "localspec", "up", "--log-file", str(log_path())]


# --- rendering -------------------------------------------------------------------------------


def _systemd_quote(arg: str) -> str:
    """One ExecStart word: systemd expands % specifiers and $ variables, and splits on spaces."""
    arg = arg.replace("%", "%%").replace("$", "$$")
    if any(c in arg for c in " \t\"'\\;"):
        return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return arg


def _windows_args(args: Sequence[str]) -> str:
    return subprocess.list2cmdline(list(args))


def render(os_name: OsName, command: Sequence[str] | None = None) -> str:
    """The service file's text for ``os_name``."""
    command = list(command or daemon_command(os_name))
    template = Template(
        (data_dir("launcher") / "templates" / TEMPLATES[os_name]).read_text("utf-8")
    )
    if os_name == "linux":
        return template.substitute(
            exec_start=" ".join(_systemd_quote(a) for a in command),
            unit_path=service_path("linux"),
        )
    if os_name == "macos":
        program_arguments = "\n".join(f"    <string>{escape(a)}</string>" for a in command)
        return template.substitute(
            label=LAUNCHD_LABEL,
            program_arguments=program_arguments,
            stdio_log=escape(str(paths.state_dir() / "launchd.log")),
        )
    user = os.environ.get("USERNAME") or getpass.getuser()
    domain = os.environ.get("USERDOMAIN")
    return template.substitute(
        task_name=TASK_NAME,
        user_id=escape(f"{domain}\\{user}" if domain else user),
        command=escape(command[0]),
        arguments=escape(_windows_args(command[1:])),
        working_dir=escape(str(home())),
    )


def encode(os_name: OsName, text: str) -> bytes:
    """Bytes as the OS tool wants them: Task Scheduler reads UTF-16 with a BOM."""
    return text.encode("utf-16") if os_name == "windows" else text.encode("utf-8")


@dataclass
class Validation:
    ok: bool
    how: str  # which check ran
    messages: list[str] = field(default_factory=list)


def validate(os_name: OsName, data: bytes) -> Validation:
    """Check a rendered file with the OS tool where it exists, else by parsing it."""
    if os_name == "linux":
        analyze = shutil.which("systemd-analyze")
        with tempfile.TemporaryDirectory() as tmp:
            unit = Path(tmp) / UNIT_NAME
            unit.write_bytes(data)
            if analyze:
                proc = subprocess.run(
                    [analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60
                )
                lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
                # systemd-analyze only warns about unknown keys; treat any remark about our
                # own file as a failure so a typo in the template cannot slip through.
                bad = proc.returncode != 0 or any(UNIT_NAME in ln for ln in lines)
                return Validation(not bad, "systemd-analyze verify", lines)
            return _parse_ini_unit(data.decode("utf-8"))
    if os_name == "macos":
        try:
            plist = plistlib.loads(data)
        except Exception as exc:  # plistlib raises ExpatError, ValueError, InvalidFileException
            return Validation(False, "plistlib", [f"not a valid plist: {exc}"])
        missing = [k for k in ("Label", "ProgramArguments", "RunAtLoad") if k not in plist]
        return Validation(not missing, "plistlib", [f"missing {k}" for k in missing])
    try:
        root = ET.fromstring(data)
    except ET.ParseError as exc:
        return Validation(False, "xml.etree", [f"not valid XML: {exc}"])
    ns = "{http://schemas.microsoft.com/windows/2004/02/mit/task}"
    required = ["Triggers/LogonTrigger", "Actions/Exec/Command", "Principals/Principal"]
    missing = [
        p for p in required if root.find("/".join(ns + part for part in p.split("/"))) is None
    ]
    return Validation(not missing, "xml.etree", [f"missing {p}" for p in missing])


def _parse_ini_unit(text: str) -> Validation:
    sections: set[str] = set()
    problems = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            sections.add(line[1:-1])
        elif "=" not in line:
            problems.append(f"line {number}: expected Key=Value")
    problems += [f"missing [{s}]" for s in ("Unit", "Service", "Install") if s not in sections]
    return Validation(not problems, "unit file parse", problems)


# --- install / uninstall / status ------------------------------------------------------------

Runner = Callable[[Sequence[str]], subprocess.CompletedProcess]


def _run(args: Sequence[str]) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=120)


@dataclass
class Outcome:
    path: Path
    lines: list[str] = field(default_factory=list)  # what was done, for the user
    ok: bool = True


def _tool(os_name: OsName) -> str | None:
    """The OS's service tool, only on that OS (never drive systemctl for a macOS file)."""
    if os_name != current_os():
        return None
    return shutil.which(
        {"linux": "systemctl", "macos": "launchctl", "windows": "schtasks"}[os_name]
    )


def _step(outcome: Outcome, run: Runner, args: Sequence[str], *, required: bool) -> bool:
    proc = run(args)
    shown = " ".join(args)
    if proc.returncode == 0:
        outcome.lines.append(f"ran: {shown}")
        return True
    detail = (proc.stderr or proc.stdout or "").strip().splitlines()
    outcome.lines.append(f"failed: {shown}: {detail[-1] if detail else f'exit {proc.returncode}'}")
    if required:
        outcome.ok = False
    return False


def install(
    os_name: OsName | None = None,
    *,
    start: bool = True,
    command: Sequence[str] | None = None,
    run: Runner = _run,
) -> Outcome:
    """Render, validate and write the service file; enable and start it where the tool exists."""
    os_name = os_name or current_os()
    data = encode(os_name, render(os_name, command))
    check = validate(os_name, data)
    if not check.ok:
        raise ServiceError(
            f"rendered {os_name} service file failed {check.how}: " + "; ".join(check.messages)
        )
    path = service_path(os_name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    outcome = Outcome(path, [f"wrote {path} (checked with {check.how})"])
    tool = _tool(os_name)
    if tool is None:
        outcome.lines.append(
            f"{'this is not ' + os_name if os_name != current_os() else 'no service tool found'}: "
            "the file takes effect at the next login"
        )
        return outcome
    if not start:
        outcome.lines.append("not enabled (--no-start): " + " ".join(_enable_hint(os_name, path)))
        return outcome
    if os_name == "linux":
        _step(outcome, run, [tool, "--user", "daemon-reload"], required=True)
        _step(outcome, run, [tool, "--user", "enable", "--now", UNIT_NAME], required=True)
    elif os_name == "macos":
        domain = f"gui/{os.getuid()}"
        _step(outcome, run, [tool, "bootout", f"{domain}/{LAUNCHD_LABEL}"], required=False)
        _step(outcome, run, [tool, "bootstrap", domain, str(path)], required=True)
    else:
        _step(
            outcome,
            run,
            [tool, "/Create", "/TN", TASK_NAME, "/XML", str(path), "/F"],
            required=True,
        )
        _step(outcome, run, [tool, "/Run", "/TN", TASK_NAME], required=False)
    if not outcome.ok:
        no_bus = any("connect to bus" in line.lower() for line in outcome.lines)
        outcome.lines.append(
            "the file is installed; "
            + (
                # ssh, a container, a root shell: no systemd user session to talk to
                "there is no systemd user session here: log in to a desktop session, or run "
                "`loginctl enable-linger $USER` and log in again, then: "
                if no_bus
                else "enable it by hand: "
            )
            + " ".join(_enable_hint(os_name, path))
        )
    return outcome


def _enable_hint(os_name: OsName, path: Path) -> list[str]:
    if os_name == "linux":
        return ["systemctl", "--user", "enable", "--now", UNIT_NAME]
    if os_name == "macos":
        return ["launchctl", "bootstrap", "gui/$(id -u)", str(path)]
    return ["schtasks", "/Create", "/TN", TASK_NAME, "/XML", str(path)]


def uninstall(os_name: OsName | None = None, *, run: Runner = _run) -> Outcome:
    """Stop and disable the service where the tool exists, then remove the file."""
    os_name = os_name or current_os()
    path = service_path(os_name)
    outcome = Outcome(path)
    tool = _tool(os_name)
    if tool is not None:
        if os_name == "linux":
            _step(outcome, run, [tool, "--user", "disable", "--now", UNIT_NAME], required=False)
        elif os_name == "macos":
            _step(
                outcome,
                run,
                [tool, "bootout", f"gui/{os.getuid()}/{LAUNCHD_LABEL}"],
                required=False,
            )
        else:
            _step(outcome, run, [tool, "/Delete", "/TN", TASK_NAME, "/F"], required=False)
    if path.exists():
        path.unlink()
        outcome.lines.append(f"removed {path}")
    else:
        outcome.lines.append(f"nothing to remove: {path} does not exist")
    if tool is not None and os_name == "linux":
        _step(outcome, run, [tool, "--user", "daemon-reload"], required=False)
    return outcome


@dataclass
class ServiceStatus:
    os_name: OsName
    path: Path
    installed: bool
    enabled: str | None = None  # the tool's word ("enabled", "disabled"), None without a tool
    active: str | None = None

    def as_dict(self) -> dict[str, object]:
        return {
            "os": self.os_name,
            "path": str(self.path),
            "installed": self.installed,
            "enabled": self.enabled,
            "active": self.active,
        }


def status(os_name: OsName | None = None, *, run: Runner = _run) -> ServiceStatus:
    os_name = os_name or current_os()
    path = service_path(os_name)
    result = ServiceStatus(os_name, path, path.exists())
    tool = _tool(os_name)
    if tool is None or not result.installed:
        return result
    if os_name == "linux":
        result.enabled = run([tool, "--user", "is-enabled", UNIT_NAME]).stdout.strip() or "unknown"
        result.active = run([tool, "--user", "is-active", UNIT_NAME]).stdout.strip() or "unknown"
    elif os_name == "macos":
        proc = run([tool, "print", f"gui/{os.getuid()}/{LAUNCHD_LABEL}"])
        result.enabled = "loaded" if proc.returncode == 0 else "not loaded"
        state = [
            ln.split("=", 1)[1].strip()
            for ln in proc.stdout.splitlines()
            if ln.strip().startswith("state =")
        ]
        result.active = state[0] if state else None
    else:
        proc = run([tool, "/Query", "/TN", TASK_NAME, "/FO", "LIST"])
        result.enabled = "registered" if proc.returncode == 0 else "not registered"
        state = [
            ln.split(":", 1)[1].strip()
            for ln in proc.stdout.splitlines()
            if ln.startswith("Status:")
        ]
        result.active = state[0] if state else None
    return result
