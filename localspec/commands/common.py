"""What every command shares: its texts and parser, exit codes, settings flags, error printing,
progress display."""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

from localspec import settings as st

# Exit codes (documented in `localspec --help` and docs/cli.md).
EXIT_OK = 0  # done; also "already running" for `up`
EXIT_FAILURE = 1  # a runtime failure: the server died, a download failed, a timeout
EXIT_USAGE = 2  # bad command line, bad settings or profile, refused by a security rule
EXIT_NOT_RUNNING = 3  # `status`/`down`: no localspec daemon answers on the port
EXIT_PORT_BUSY = 4  # `up`: another program holds the port

EXIT_CODES_HELP = """\
exit codes:
  0  success (for `up`: also "a localspec daemon is already running")
  1  runtime failure (server died, download failed, timed out)
  2  bad command line, settings or profile, or refused by a security rule
  3  no localspec daemon is running (status, down)
  4  the port is held by another program (up)
"""

Handler = Callable[[argparse.Namespace], int]


class Formatter(argparse.RawDescriptionHelpFormatter):
    """Keep the examples in epilogs as written."""


@dataclass(frozen=True)
class Command:
    """A command's (or an action's) texts, declared at the top of its module: its name, the
    one-line help, the description and examples ``--help`` shows, and whether the exit codes
    follow the examples (where the command can end with more than success)."""

    name: str
    help: str
    epilog: str
    description: str | None = None
    exit_codes: bool = False

    def action(self, name: str, help: str) -> Command:
        """An action of this command group (``profile show``): its own help, the group's
        examples."""
        return Command(name, help, self.epilog)


def add_command(
    sub: argparse._SubParsersAction,
    command: Command,
    func: Handler | None = None,
    **fill: object,
) -> argparse.ArgumentParser:
    """A command's parser: its examples kept as written, the exit codes after them where the
    command asks for them, and its handler. ``fill`` completes the description where it names a
    value known only when the parser is built (``{log_file}``)."""
    description = command.description
    if fill and description is not None:
        description = description.format(**fill)
    epilog = command.epilog
    p = sub.add_parser(
        command.name,
        help=command.help,
        description=description,
        epilog=f"{epilog}\n{EXIT_CODES_HELP}" if command.exit_codes else epilog,
        formatter_class=Formatter,
    )
    if func is not None:
        p.set_defaults(func=func)
    return p


def add_actions(parser: argparse.ArgumentParser, dest: str) -> argparse._SubParsersAction:
    """The actions of a command group (``profile show``, ``service install``): one is required."""
    return parser.add_subparsers(dest=dest, metavar="ACTION", required=True)


# --- settings flags --------------------------------------------------------------------------


@dataclass(frozen=True)
class SettingFlag:
    flag: str
    key: str
    type: Callable[[str], Any] | None
    help: str
    metavar: str | None = None
    choices: tuple[str, ...] | None = None

    @property
    def dest(self) -> str:
        return "setting:" + self.key


ADDRESS_FLAGS = (
    SettingFlag("--host", "server.host", str, "address to bind / connect to", "ADDR"),
    SettingFlag("--port", "server.port", int, "TCP port (default 8012)", "PORT"),
)
SERVE_FLAGS = (
    SettingFlag("--api-key-file", "server.api_key_file", str, "file holding the API key", "FILE"),
    SettingFlag("--slots", "server.slots", int, "parallel slots (separate KV caches)", "N"),
    SettingFlag("--pair", "models.pair", str, "catalog pair to serve", "NAME"),
    SettingFlag("--chat-pair", "models.chat_pair", str, "catalog instruct pair for chat", "NAME"),
    SettingFlag("--ctx-size", "limits.context", int, "context tokens per slot", "N"),
    SettingFlag("--gpu-memory-gb", "limits.gpu_memory_gb", float, "GPU memory cap", "GB"),
    SettingFlag("--threads", "limits.threads", int, "CPU threads for llama.cpp", "N"),
    SettingFlag(
        "--spec-mode",
        "speculative.mode",
        str,
        "drafter to use",
        None,
        ("off", "draft", "ngram", "hybrid", "auto"),
    ),
    SettingFlag("--draft-max", "speculative.n_max", int, "most tokens drafted per step", "N"),
    SettingFlag("--draft-min", "speculative.n_min", int, "skip drafts shorter than this", "N"),
    SettingFlag("--draft-p-min", "speculative.p_min", float, "min draft token probability", "P"),
    SettingFlag(
        "--spec-pipeline",
        "speculative.pipeline",
        str,
        "the draft model on its own thread (default auto)",
        None,
        ("auto", "on", "off"),
    ),
    SettingFlag("--cache-reuse", "cache.reuse_chunk", int, "min KV-shift chunk; 0: off", "N"),
    SettingFlag(
        "--cache-exact-ms", "cache.exact_ms", float, "extra ms per request for exact KV", "MS"
    ),
    SettingFlag(
        "--infill-layout",
        "cache.infill_layout",
        str,
        "where /infill puts the typed cursor line",
        None,
        ("typed-in-middle", "llama-server"),
    ),
    SettingFlag("--infill-window", "cache.infill_window", int, "/infill prefix+suffix tokens", "N"),
    SettingFlag(
        "--jump-policy",
        "cache.jump_policy",
        str,
        "a cold /infill past t_max_prompt_ms: wait, or answer from what fits",
        None,
        ("wait", "budget"),
    ),
    SettingFlag(
        "--ring-attention",
        "cache.ring_attention",
        str,
        "how /infill's ring chunks attend (default blocks)",
        None,
        ("causal", "blocks"),
    ),
    SettingFlag(
        "--slot-save-path", "server.slot_save_path", str, "directory of saved slots", "DIR"
    ),
    SettingFlag("--spm-infill", "server.spm_infill", bool, "/infill: suffix block before prefix"),
    SettingFlag("--offline", "hub.offline", bool, "never use the network"),
    SettingFlag(
        "--log-level", "log.level", str, "log level", None, ("debug", "info", "warning", "error")
    ),
    SettingFlag("--log-format", "log.format", str, "log line format", None, ("text", "json")),
    SettingFlag("--log-requests", "log.requests", bool, "one log line per request"),
)


def add_settings_flags(
    parser: argparse.ArgumentParser, *, serve: bool = False, address: bool = True
) -> None:
    group = parser.add_argument_group(
        "settings", "override config files and environment (see `localspec profile explain`)"
    )
    for spec in (ADDRESS_FLAGS if address else ()) + (SERVE_FLAGS if serve else ()):
        if spec.type is bool:
            group.add_argument(
                spec.flag, dest=spec.dest, action=argparse.BooleanOptionalAction, help=spec.help
            )
            continue
        group.add_argument(
            spec.flag,
            dest=spec.dest,
            type=spec.type,
            metavar=spec.metavar,
            choices=spec.choices,
            help=spec.help,
        )
    group.add_argument(
        "--set",
        dest="settings_set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set any settings key, e.g. --set server.queue_limit=32 (repeatable)",
    )


def flag_values(args: argparse.Namespace) -> tuple[dict[str, tuple[Any, str]], list[str]]:
    flags, problems = st.parse_set_options(getattr(args, "settings_set", []))
    for spec in ADDRESS_FLAGS + SERVE_FLAGS:
        value = getattr(args, spec.dest, None)
        if value is not None:
            flags[spec.key] = (value, spec.flag)
    return flags, problems


def flag_argv(args: argparse.Namespace) -> list[str]:
    """The settings flags given, as argv again (to hand to a detached child)."""
    argv: list[str] = []
    for spec in ADDRESS_FLAGS + SERVE_FLAGS:
        value = getattr(args, spec.dest, None)
        if isinstance(value, bool):
            argv.append(spec.flag if value else "--no-" + spec.flag.removeprefix("--"))
        elif value is not None:
            argv += [spec.flag, str(value)]
    for item in getattr(args, "settings_set", []):
        argv += ["--set", item]
    return argv


def load_settings(args: argparse.Namespace, *, quiet: bool = False) -> st.ResolvedSettings:
    """All layers plus this command's flags; lock attempts are reported, never fatal."""
    flags, problems = flag_values(args)
    if problems:
        raise st.SettingsError(problems)
    resolved = st.load(flags=flags)
    if not quiet:
        for violation in resolved.violations:
            warn(f"locked: {violation}")
    return resolved


# --- output ----------------------------------------------------------------------------------


def error(message: str) -> None:
    print(f"localspec: error: {message}", file=sys.stderr)


def warn(message: str) -> None:
    print(f"localspec: {message}", file=sys.stderr)


def settings_error(exc: st.SettingsError) -> int:
    error("invalid settings:" if len(exc.problems) > 1 else exc.problems[0])
    if len(exc.problems) > 1:
        for problem in exc.problems:
            print(f"  - {problem}", file=sys.stderr)
    return EXIT_USAGE


def print_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")


class Progress:
    """A one-line spinner with elapsed time on a terminal; plain start/end lines otherwise
    (logs and pipes get no control characters)."""

    FRAMES = "|/-\\"

    def __init__(self, message: str, stream: TextIO | None = None) -> None:
        self.message = message
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def __enter__(self) -> Progress:
        self.started = time.monotonic()
        if self.tty:
            self._thread = threading.Thread(target=self._spin, daemon=True)
            self._thread.start()
        else:
            self._write(f"{self.message} ...\n")
        return self

    def __exit__(self, exc_type: type | None, *_: object) -> None:
        if not self.finished:
            self.finish("failed" if exc_type else "done", ok=exc_type is None)

    @property
    def finished(self) -> bool:
        return self._stop.is_set()

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def update(self, message: str) -> None:
        with self._lock:
            self.message = message

    def finish(self, result: str, *, ok: bool = True) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        mark = "ok" if ok else "!!"
        clear = "\r\033[K" if self.tty else ""
        self._write(f"{clear}[{mark}] {self.message}: {result} ({self.elapsed:.1f} s)\n")

    def _spin(self) -> None:
        for frame in itertools.cycle(self.FRAMES):
            if self._stop.wait(0.1):
                return
            with self._lock:
                line = f"\r\033[K{frame} {self.message} {self.elapsed:.0f} s"
            self._write(line)

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()
