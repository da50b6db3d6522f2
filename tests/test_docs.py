"""The docs stay short enough to read, and their benchmark tables say what the result files say."""

from __future__ import annotations

from pathlib import Path

from localspec.bench import render

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
BUDGETS = {"README.md": 1_200, "docs/benchmarks.md": 4_000}
DOCS_BUDGET = 25_000


def words(path: Path) -> int:
    """Words as ``wc -w`` counts them: runs of non-whitespace."""
    return len(path.read_text(encoding="utf-8").split())


def test_word_budgets() -> None:
    over = {name: words(ROOT / name) for name, most in BUDGETS.items() if words(ROOT / name) > most}
    assert not over, f"over budget ({BUDGETS}): {over}"
    total = sum(words(p) for p in DOCS.glob("*.md"))
    assert total <= DOCS_BUDGET, f"docs/*.md hold {total} words, the budget is {DOCS_BUDGET}"


def test_benchmark_tables_are_rendered_from_the_result_files() -> None:
    doc = (DOCS / "benchmarks.md").read_text(encoding="utf-8")
    markers = render.MARKER.findall(doc)
    assert {m[1] for m in markers} >= {"replay", "speculative", "throughput", "edit", "steps"}
    assert render.render(doc, ROOT / "bench" / "results", ROOT) == doc, (
        "docs/benchmarks.md differs from the result files: run `localspec bench render`"
    )


def test_readme_opens_with_the_two_commands() -> None:
    head = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()[:6]
    assert any(line.startswith("./launcher/localspec up ") for line in head)
    assert any(line.startswith("./launcher/test ") for line in head)


def test_doc_links_point_at_files() -> None:
    """Every docs/NAME.md a doc names exists (the docs were merged and renamed over time)."""
    import re

    named = set()
    for path in [ROOT / "README.md", *DOCS.glob("*.md")]:
        named |= set(re.findall(r"docs/([a-z0-9_-]+\.md)", path.read_text(encoding="utf-8")))
    missing = sorted(n for n in named if not (DOCS / n).is_file())
    assert not missing, missing
