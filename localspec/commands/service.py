"""``localspec service install|uninstall|status``: start the daemon at login (no root)."""

from __future__ import annotations

import argparse
import sys

from localspec import daemon, login_service
from localspec import settings as st
from localspec.commands import common as c

SERVICE = c.Command(
    "service",
    "install, remove or inspect the login service",
    description="Start localspec when you log in: a per-user service, no root needed.",
    exit_codes=True,
    epilog="""\
examples:
  localspec service install              systemd user unit / LaunchAgent / logon task, started now
  localspec service install --no-start   write and check the file only
  localspec service install --os macos --dry-run   print the launchd plist for this Python
  localspec service status
  localspec service uninstall

files:
  Linux    ~/.config/systemd/user/localspec.service   (systemctl --user)
  macOS    ~/Library/LaunchAgents/org.localspec.daemon.plist   (launchctl)
  Windows  %LOCALAPPDATA%\\localspec\\localspec-task.xml   (schtasks task "localspec")
The service runs `python -m localspec up --log-file <state dir>/localspec.log`
with the settings of your config.toml and the system profiles.
""",
)


def register(sub: argparse._SubParsersAction) -> None:
    actions = c.add_actions(c.add_command(sub, SERVICE), "service_command")
    for name, helptext, func in (
        ("install", "render, check, install and start the service", run_install),
        ("uninstall", "stop the service and remove its file", run_uninstall),
        ("status", "is the service installed, enabled, running", run_status),
    ):
        q = c.add_command(actions, SERVICE.action(name, helptext), func)
        q.add_argument(
            "--os",
            dest="os_name",
            choices=login_service.OS_NAMES,
            default=login_service.current_os(),
            help="target OS (default: this one)",
        )
        if name == "install":
            q.add_argument("--dry-run", action="store_true", help="print the file, change nothing")
            q.add_argument("--no-start", action="store_true", help="do not enable or start it")
        if name == "status":
            q.add_argument("--json", action="store_true", help="print JSON")


def run_install(args: argparse.Namespace) -> int:
    # the service runs `localspec up` at every login: settings it would refuse are said now,
    # not in a unit that fails and restarts every few seconds (a SettingsError: exit 2)
    st.check_backend(c.load_settings(args, quiet=True).settings)  # `up`'s backend rules
    try:
        if args.dry_run:
            text = login_service.render(args.os_name)
            check = login_service.validate(args.os_name, login_service.encode(args.os_name, text))
            sys.stdout.write(text)
            if not check.ok:
                c.error(f"{check.how} rejects it: {'; '.join(check.messages)}")
                return c.EXIT_FAILURE
            print(
                f"# checked with {check.how}; "
                f"would be written to {login_service.service_path(args.os_name)}",
                file=sys.stderr,
            )
            return c.EXIT_OK
        outcome = login_service.install(args.os_name, start=not args.no_start)
    except login_service.ServiceError as exc:
        c.error(str(exc))
        return c.EXIT_FAILURE
    for line in outcome.lines:
        print(line)
    return c.EXIT_OK if outcome.ok else c.EXIT_FAILURE


def run_uninstall(args: argparse.Namespace) -> int:
    outcome = login_service.uninstall(args.os_name)
    for line in outcome.lines:
        print(line)
    return c.EXIT_OK


def run_status(args: argparse.Namespace) -> int:
    result = login_service.status(args.os_name)
    if args.json:
        c.print_json(result.as_dict())
        return c.EXIT_OK
    state = "installed" if result.installed else "not installed"
    print(f"login service ({result.os_name}): {state}  {result.path}")
    if result.enabled is not None:
        print(f"  enabled: {result.enabled}   active: {result.active}")
    pid_files = sorted(daemon.pid_file(0).parent.glob("localspec-*.pid"))
    for path in pid_files:
        port = path.stem.removeprefix("localspec-")
        if port.isdigit() and (info := daemon.read_pid_file(int(port))):
            print(f"  daemon: pid {info.pid} on port {info.port}")
    return c.EXIT_OK
