"""Turn the measured sections of an old docs/benchmarks.md into result files (run once).

Until commit caff486 the benchmark results lived as dated prose in docs/benchmarks.md. This
writes one result file per measured section under bench/results/NAME/, keeping the section's
text verbatim (``notes``) and every Markdown table as columns and rows (``tables``), with the
date, commits, commands and machine the text states ("unknown" where it states none) and the
commit that documented it (``recorded``, from git blame). Rerun to check the files:

    python scripts/split-bench-history.py caff486 --out /tmp/history && diff -r ...
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
from pathlib import Path

DOC = "docs/benchmarks.md"
FIRST_MEASURED = "## Speculative decoding (`localspec bench speculative`)"

# each measured section's benchmark (by the start of its heading); default: the one its
# commands name most often
BENCHMARK = {
    "## Speculative decoding": "speculative",
    "### Machine, models, conditions": "replay",
    "## Round 2": "replay",
    "### A busy machine": "speculative",
    "### Many sequences in one step": "steps",
    "### Before and after the clean-up": "replay",
    "### Prefill pieces of one size": "throughput",
    "### Prompt pieces of 64 under load": "throughput",
    "### Flash attention on the default model's shape": "speculative",
    "### The suite on another CPU": "suite",
    "### The same goals on an AMD EPYC machine": "throughput",
    "### The Zen 4 box again": "throughput",
    "### The Zen 4 box, a later session": "throughput",
    "### Replay, r19-r20": "kvcompact",
    "### Replay, r25-r27": "replay",
}
# the table rendered as a benchmark's current one (heading start -> table index, title); the
# newest of each benchmark's sections that measured it in its standard form
PRIMARY = {
    "### Replay, a1 and r34-r35": (
        1,
        "r34: the final code on the reference schedule (seed 42), localspec vs llama-server",
    ),
    "## Speculative decoding": (0, "every mode against target-only, two runs"),
    "### Many sequences in one step": (0, "a decode step's time by sequences in the step"),
    "### Instruction edits": (0, "instruction edits, localspec vs llama-server modes"),
    "### One and four clients, current code": (
        0,
        "one and four clients, localspec vs llama-server (ratios)",
    ),
    "### Replay, r19-r20": (0, "KV compaction after a file switch, off vs on"),
}
# a table that belongs to another benchmark than its section: (heading start, index, benchmark,
# title)
EXTRA = [
    ("### Replay, r25-r27", 2, "ringquality",
     "what the ring's attention costs the model's predictions (nats per token)"),
]  # fmt: skip

COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,12}\b")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
RUN = re.compile(r"\b([ra]\d+)(?:-r?(\d+))?\b")
MACHINE = re.compile(
    r"[^.\n]*(?:\bMachine(?: for these runs)?:|Build machine:|machine type|\d vCPUs (?:of|\())"
    r"(?:[^.\n]|\n(?!\s*\n)|\.(?=\w))*?(?:\.(?!\w)|(?=\n\s*\n))"
)


def git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout


def cells(line: str) -> list[str]:
    inner = line.strip()[1:-1] if line.strip().endswith("|") else line.strip()[1:]
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", inner)]


def tables(lines: list[str]) -> list[dict]:
    out, i = [], 0
    while i < len(lines):
        if (
            lines[i].startswith("|")
            and i + 1 < len(lines)
            and re.match(r"^\|[\s:|-]+\|?$", lines[i + 1])
        ):
            j = i + 2
            while j < len(lines) and lines[j].startswith("|"):
                j += 1
            k = i - 1
            while k >= 0 and not lines[k].strip():
                k -= 1
            start = k
            while start > 0 and lines[start - 1].strip() and not lines[start - 1].startswith("|"):
                start -= 1
            caption = " ".join(x.strip() for x in lines[start : k + 1]) if k >= 0 else ""
            out.append({"caption": caption, "columns": cells(lines[i]),
                        "rows": [cells(x) for x in lines[i + 2 : j]]})  # fmt: skip
            i = j
        else:
            i += 1
    return out


def commands(text: str) -> list[str]:
    blocks = re.findall(r"```[a-z]*\n(.*?)```", text, re.DOTALL)
    found = [b.strip() for b in blocks if "bench" in b]
    spans = re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", text, flags=re.DOTALL))
    found += [
        " ".join(c.split()) for c in spans
        if c.startswith(("localspec bench", "bench ", "python -m localspec.bench"))
    ]  # fmt: skip
    return list(dict.fromkeys(found))


def runs(heading: str) -> list[str]:
    out = []
    for m in RUN.finditer(heading):
        if m.group(2) and m.group(1).startswith("r"):
            out += [f"r{n}" for n in range(int(m.group(1)[1:]), int(m.group(2)) + 1)]
        else:
            out.append(m.group(1))
    return out


def slug(heading: str) -> str:
    words = re.sub(r"[^a-z0-9]+", "-", heading.lstrip("#").lower()).strip("-")
    return words[:48].rstrip("-")


def pick(table: dict, title: str) -> dict:
    return {"title": title, "columns": table["columns"], "rows": table["rows"]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("commit", help="the commit whose docs/benchmarks.md to split")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    p.add_argument("--doc", default=DOC, help="another doc's measured sections")
    p.add_argument("--first", default=FIRST_MEASURED, help="the first measured heading")
    p.add_argument("--until", default=None, help="the heading after the last measured one")
    p.add_argument("--bench", default=None, help="the benchmark of every section")
    p.add_argument("--prefix", default="history", help="the files' name prefix")
    args = p.parse_args()
    lines = git("show", f"{args.commit}:{args.doc}").split("\n")
    begin = lines.index(args.first) + 1
    stop = lines.index(args.until) if args.until else len(lines)
    heads = [i for i in range(begin - 1, stop) if lines[i].startswith("##")] + [stop]
    heads = heads[:-1] if heads[-1] == len(lines) else heads
    machine_said: dict | str = "unknown"
    round_date = "unknown"
    for n, start in enumerate(heads[:-1] if args.until else heads):
        end = heads[n + 1] if n + 1 < len(heads) else len(lines)
        heading = lines[start]
        body = lines[start:end]
        text = "\n".join(body).strip() + "\n"
        if heading.startswith("## "):
            found = DATE.search(heading)
            round_date = found.group(0) if found else "unknown"
        if len(text.split()) < 20:  # a heading over subsections
            continue
        named = re.findall(r"(?:localspec bench|bench) (\w+)", text)
        bench = args.bench or next((b for k, b in BENCHMARK.items() if heading.startswith(k)), None)
        if bench is None:
            counts = {b: named.count(b) for b in set(named) if b in KNOWN}
            bench = max(counts, key=lambda b: (counts[b], b)) if counts else "replay"
        said = MACHINE.search(text)
        if said:
            machine_said = {"text": " ".join(said.group(0).split()), "stated_in": heading}
        date = DATE.search(heading) or DATE.search(text)
        commits = list(dict.fromkeys(COMMIT.findall(text)))
        in_heading = COMMIT.findall(heading)
        blame = git("blame", "--porcelain", "-L", f"{start + 1},{start + 1}", args.commit, "--",
                    args.doc).split("\n")  # fmt: skip
        when = next(x.split()[1] for x in blame if x.startswith("author-time "))
        recorded_date = subprocess.run(
            ["date", "-u", "-d", f"@{when}", "+%Y-%m-%dT%H:%M:%S+00:00"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        found_tables = tables(body)
        cmds = commands(text)
        doc = {
            "schema": 1,
            "benchmark": bench,
            "title": heading.lstrip("#").strip(),
            "runs": runs(heading),
            "date": date.group(0) if date else round_date,
            "commit": (in_heading or commits or ["unknown"])[0],
            "commits_mentioned": commits,
            "command": cmds[0] if cmds else "unknown",
            "commands": cmds,
            "machine": machine_said,
            "recorded": {
                "in": args.doc,
                "at": args.commit,
                "section": heading.lstrip("#").strip(),
                "commit": blame[0].split()[0][:12],
                "date": recorded_date,
            },
        }
        primary = next((v for k, v in PRIMARY.items() if heading.startswith(k)), None)
        if primary is not None:
            doc["table"] = pick(found_tables[primary[0]], primary[1])
        doc["tables"] = found_tables
        doc["notes"] = text
        name = f"{args.prefix}-{n:02d}-{slug(heading)}.json"
        out = args.out / bench / name
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
        for key, index, other, title in EXTRA:
            if heading.startswith(key):
                extra = {k: v for k, v in doc.items() if k not in ("tables", "notes", "table")}
                extra["benchmark"] = other
                extra["table"] = pick(found_tables[index], title)
                extra["tables"] = [found_tables[index]]
                extra["notes"] = f"One table of {bench}/{name}, which holds the section's text."
                path = args.out / other / name
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(extra, indent=1, ensure_ascii=False) + "\n")


KNOWN = {"replay", "speculative", "edit", "throughput", "steps", "load", "overhead",
         "kvcompact", "ringquality"}  # fmt: skip

if __name__ == "__main__":
    main()
