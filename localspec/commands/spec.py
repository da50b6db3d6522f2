"""``localspec spec export``: the rejected drafts recorded on this machine, as JSONL."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from localspec import rejections
from localspec.commands import common as c

SPEC = c.Command(
    "spec",
    "speculative decoding's records on this machine",
    description="Rejected drafts, recorded when speculative.record_rejections is true.",
    exit_codes=True,
    epilog="""\
examples:
  localspec spec export                       every recorded rejection, JSONL on stdout
  localspec spec export --out rej.jsonl       into a file
  localspec spec export --language python     only Python's

each line: context_tail, draft, target (texts), context_tokens, draft_tokens, target_tokens
(the pair's token ids), accepted (draft tokens taken before the first rejected one), language,
source, t. Recording is off by default; nothing is ever sent anywhere.
""",
)


def register(sub: argparse._SubParsersAction) -> None:
    actions = c.add_actions(c.add_command(sub, SPEC), "spec_command")
    export = SPEC.action("export", "write the rejected drafts as JSONL")
    q = c.add_command(actions, export, run_export)
    q.add_argument("--out", type=Path, help="write here (default: stdout)")
    q.add_argument("--language", help="only this language's (python, c, shell, ...)")
    q.add_argument(
        "--file", type=Path, default=None, help="the recorded file (default: the data dir's)"
    )


def run_export(args: argparse.Namespace) -> int:
    path = args.file or rejections.default_path()
    if not path.exists() and not path.with_name(path.name + ".1").exists():
        c.error(
            f"no rejected drafts recorded at {path} "
            "(set speculative.record_rejections = true and serve some requests)"
        )
        return c.EXIT_FAILURE
    if args.out is None:
        n = rejections.export(path, sys.stdout, language=args.language)
    else:
        with args.out.open("w", encoding="utf-8") as out:
            n = rejections.export(path, out, language=args.language)
        print(f"{n} rejected drafts written to {args.out}", file=sys.stderr)
    return c.EXIT_OK
