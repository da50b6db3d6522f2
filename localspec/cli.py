"""The ``localspec`` command line: a parser per command group (``localspec.commands``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from localspec import __version__
from localspec.commands import bench, common, lifecycle, models, profile, service, spec, up
from localspec.settings import SettingsError

EPILOG = f"""\
examples:
  localspec up                      plan, fetch and serve at http://localhost:8012
  localspec up --detach             the same in the background; `localspec down` stops it
  localspec up --target 7b.gguf --draft 0.5b.gguf   serve local files
  localspec status                  what is loaded, requests, acceptance, cache reuse
  localspec plan --json             what `up` would run on this machine, and why
  localspec profile explain         every setting and where it came from
  localspec service install         start at login (systemd user unit, LaunchAgent, logon task)

Every command has --help with examples.

{common.EXIT_CODES_HELP}"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="localspec",
        description="Fast local code completion for llama-vscode and llama.vim.",
        epilog=EPILOG,
        formatter_class=common.Formatter,
    )
    parser.add_argument("--version", action="version", version=f"localspec {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in (up, lifecycle, models, profile, service, spec, bench):
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return common.EXIT_OK
    try:
        return int(args.func(args))
    except SettingsError as exc:  # bad settings: every problem named, whichever command met them
        return common.settings_error(exc)
    except KeyboardInterrupt:
        print("localspec: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `localspec logs | head`
        return common.EXIT_OK
