"""The `localspec` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from localspec import __version__

EPILOG = """\
examples:
  localspec up                      plan, fetch and serve at http://localhost:8012
  localspec --version
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="localspec",
        description="Fast local code completion for llama-vscode and llama.vim.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"localspec {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("up", help="plan, fetch and serve the completion endpoint")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    print(f"localspec {args.command}: not available in this build yet", file=sys.stderr)
    return 2
