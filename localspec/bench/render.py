"""Render the current results table of each benchmark into docs/benchmarks.md.

The doc marks where each benchmark's table goes (``<!-- results:NAME -->`` ...
``<!-- /results:NAME -->``); between the markers this writes the table of the newest result
file under ``results/NAME/`` (harness.py writes them), with the file, date, commit and command
it came from. Tables are never edited by hand: a test renders them again and compares, so the
doc always says what the newest data says.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from localspec.bench import harness

MARKER = re.compile(r"(<!-- results:([a-z0-9_-]+) -->\n)(.*?)(<!-- /results:\2 -->)", re.DOTALL)


def _when(doc: dict[str, Any]) -> str:
    """The run's date; for runs recorded only in prose, the date their text was committed."""
    date = str(doc.get("date", "unknown"))
    if date != "unknown":
        return date
    return str(doc.get("recorded", {}).get("date", ""))


def newest(results: Path, benchmark: str) -> tuple[Path, dict[str, Any]] | None:
    """The newest result file of ``benchmark`` that carries a table."""
    found = []
    for path in sorted((results / benchmark).glob("*.json")):
        doc = json.loads(path.read_text())
        if doc.get("table"):
            found.append((_when(doc), path.name, path, doc))
    if not found:
        return None
    _, _, path, doc = max(found, key=lambda f: (f[0], f[1]))
    return path, doc


def _cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def table_markdown(table: dict[str, Any]) -> str:
    """A result file's table: columns and rows as a Markdown table, or printed text as-is."""
    if "columns" in table:
        lines = ["| " + " | ".join(_cell(c) for c in table["columns"]) + " |"]
        lines.append("|" + "---|" * len(table["columns"]))
        lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in table["rows"]]
        return "\n".join(lines)
    return "```text\n" + table["text"] + "\n```"


def section(results: Path, benchmark: str, root: Path | None) -> str:
    """What goes between one benchmark's markers."""
    found = newest(results, benchmark)
    if found is None:
        earlier = any((results / benchmark).glob("*.json"))
        where = f" (written-up runs: `bench/results/{benchmark}/`)" if earlier else ""
        return f"_No current table yet: run `localspec bench {benchmark}`{where}._\n"
    path, doc = found
    shown = path.relative_to(root).as_posix() if root and path.is_relative_to(root) else path.name
    commit = str(doc.get("commit", "unknown"))
    date = str(doc.get("date", "unknown"))
    if date == "unknown" and doc.get("recorded", {}).get("date"):
        date = f"unknown (written up {doc['recorded']['date'][:10]})"
    facts = [f"`{shown}`", f"date {date}", f"commit {commit[:12]}"]
    machine = doc.get("machine")
    if isinstance(machine, dict):  # a run's facts, or the sentence a written-up run gave
        machine = machine.get("cpu") or machine.get("text") or machine.get("platform")
    if machine and machine != "unknown":
        said = " ".join(str(machine).split()).rstrip(".")
        said = re.sub(r"^(?:- )?(?:Build )?[Mm]achine(?: for these runs)?: ", "", said)
        facts.append(f"machine: {said if len(said) <= 160 else said[:159] + '…'}")
    said = "From " + ", ".join(facts)
    parts = [said if said.endswith("…") else said + "."]
    if doc.get("command", "unknown") != "unknown":
        parts.append(f"Command: `{doc['command']}`.")
    title = doc.get("table", {}).get("title")
    if title:
        parts.append(f"**{title}**")
    return "\n".join(parts) + "\n\n" + table_markdown(doc["table"]) + "\n"


def render(text: str, results: Path, root: Path | None = None) -> str:
    """``text`` with every marked table rendered again from ``results``."""

    def fill(m: re.Match[str]) -> str:
        return m.group(1) + section(results, m.group(2), root) + m.group(4)

    return MARKER.sub(fill, text)


def main(argv: Sequence[str] | None = None) -> int:
    root = harness.source_checkout()
    p = argparse.ArgumentParser(prog="localspec bench render", description=__doc__)
    p.add_argument(
        "--doc",
        type=Path,
        default=root / "docs" / "benchmarks.md" if root else None,
        help="the Markdown file to render into (default: the checkout's docs/benchmarks.md)",
    )
    p.add_argument("--results", type=Path, default=None, help="default: the results directory")
    p.add_argument("--check", action="store_true", help="only say whether the doc is current")
    args = p.parse_args(argv)
    if args.doc is None or not args.doc.is_file():
        print(f"error: no document to render into: {args.doc}", file=sys.stderr)
        return 2
    results = args.results or harness.results_dir()
    text = args.doc.read_text()
    out = render(text, results, root)
    if args.check:
        if out != text:
            print(f"{args.doc} is out of date: run `localspec bench render`", file=sys.stderr)
            return 1
        print(f"{args.doc} is current")
        return 0
    if out != text:
        args.doc.write_text(out)
        print(f"rendered {args.doc}")
    else:
        print(f"{args.doc} was already current")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
