"""A workstation's stable upstream slot: the same developer on the same machine always lands on
the same llama-server slot, so that slot's KV cache (the ring of files the editor keeps
sending) survives the other developers' traffic on a shared server with many slots.

The slot is ``sha256(machine id + ":" + user name) mod n_slots``: no state to keep, the same
after a restart. The machine id is the OS's own (``/etc/machine-id`` on Linux, the
IOPlatformUUID on macOS, ``MachineGuid`` on Windows), else the network card's address and the
host name. Two developers may share a slot (with 8 slots and 20 developers that is certain);
pin ``backend.slot`` per machine where it matters.
"""

from __future__ import annotations

import getpass
import hashlib
import os
import platform
import socket
import subprocess
import uuid
from pathlib import Path

_LINUX_IDS = (Path("/etc/machine-id"), Path("/var/lib/dbus/machine-id"))


def machine_id() -> str:
    for path in _LINUX_IDS:
        try:
            text = path.read_text(encoding="ascii").strip()
        except (OSError, UnicodeDecodeError):
            continue
        if text:
            return text
    system = platform.system()
    if system == "Darwin":
        try:
            out = subprocess.run(
                ["ioreg", "-rd1", "-c", "IOPlatformExpertDevice"],
                capture_output=True,
                text=True,
                timeout=5,
            ).stdout
        except (OSError, subprocess.SubprocessError):
            out = ""
        for line in out.splitlines():
            if "IOPlatformUUID" in line:
                return line.split("=", 1)[-1].strip().strip('"')
    if system == "Windows":
        try:
            import winreg  # type: ignore[import-not-found,unused-ignore]

            key = winreg.OpenKey(  # type: ignore[attr-defined,unused-ignore]
                winreg.HKEY_LOCAL_MACHINE,  # type: ignore[attr-defined,unused-ignore]
                r"SOFTWARE\Microsoft\Cryptography",
            )
            return str(winreg.QueryValueEx(key, "MachineGuid")[0])  # type: ignore[attr-defined,unused-ignore]
        except OSError:
            pass
    return f"{uuid.getnode():012x}-{socket.gethostname()}"


def user_name() -> str:
    try:
        return getpass.getuser()
    except (OSError, KeyError):  # no login name (a container without a passwd entry)
        return str(os.getuid()) if hasattr(os, "getuid") else "user"


def workstation() -> str:
    """This machine and user, as the slot hash's input."""
    return f"{machine_id()}:{user_name()}"


def stable_slot(n_slots: int, identity: str) -> int:
    """The slot for ``identity`` among ``n_slots`` (the same on every run and every machine)."""
    if n_slots < 1:
        raise ValueError(f"n_slots must be at least 1, got {n_slots}")
    digest = hashlib.sha256(identity.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % n_slots
