"""Instruction edits of real functions: the corpus ``localspec bench edit`` sends.

Functions of the Python standard library on this machine (the same modules the other
benchmarks read), each with one instruction of four kinds that an editor user gives: rename,
add type hints, add a docstring, convert a loop. The answer mostly repeats the code it was
given, which is where drafting from the prompt pays. The request is llama-vscode's "edit with
AI" request (its system message; the instruction and the original code in its wording).
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

KINDS = ("rename", "type-hints", "docstring", "convert-loop")
MIN_LINES, MAX_LINES = 8, 40  # long enough to be worth a chat request, short enough for CPUs
SYSTEM = "You are an expert coder."
PROMPT = (
    "Modify the following original code according to the instructions. Output only the "
    "modified code. No explanations.\n\ninstructions:\n{instruction}\n\noriginal code:\n"
    "{code}\n\nmodified code:"
)


@dataclass(frozen=True)
class EditTask:
    kind: str
    where: str  # module:function
    instruction: str
    code: str

    def messages(self) -> list[dict[str, str]]:
        """llama-vscode's "edit with AI" request for this function."""
        user = PROMPT.format(instruction=self.instruction, code=self.code)
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def _instruction(kind: str, fn: ast.FunctionDef) -> str | None:
    if kind == "rename":
        return f"Rename the function `{fn.name}` to `{fn.name}_v2`. Keep everything else as it is."
    if kind == "type-hints":
        return "Add type hints to the parameters and the return value. Change nothing else."
    if kind == "docstring":
        return "Add a one-line docstring that says what the function does. Change nothing else."
    has_for = any(isinstance(node, ast.For) for node in ast.walk(fn))
    if not has_for:
        return None
    return "Convert the first `for` loop into a `while` loop. Keep everything else as it is."


def _functions(path: Path) -> Iterator[tuple[ast.FunctionDef, str]]:
    try:
        source = path.read_text(encoding="utf-8", errors="replace")
        tree = ast.parse(source)
    except (OSError, SyntaxError, ValueError):
        return
    lines = source.splitlines()
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef) or node.end_lineno is None:
            continue
        start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        n = node.end_lineno - start + 1
        if MIN_LINES <= n <= MAX_LINES:
            yield node, textwrap.dedent("\n".join(lines[start - 1 : node.end_lineno])) + "\n"


def edit_tasks(n: int, files: Sequence[Path]) -> list[EditTask]:
    """``n`` tasks, the four kinds in turn, each on the next function (taken from the files in
    turn) that allows the kind: deterministic for a machine's standard library."""
    pools = [list(_functions(path)) for path in files]
    order = [
        (path, *entry)
        for depth in range(max((len(p) for p in pools), default=0))
        for path, pool in zip(files, pools, strict=True)
        if depth < len(pool)
        for entry in (pool[depth],)
    ]
    out: list[EditTask] = []
    used: set[int] = set()
    while len(out) < n:
        kind = KINDS[len(out) % len(KINDS)]
        for i, (path, fn, code) in enumerate(order):
            instruction = _instruction(kind, fn) if i not in used else None
            if instruction is not None:
                used.add(i)
                out.append(EditTask(kind, f"{path.stem}:{fn.name}", instruction, code))
                break
        else:
            break  # no function left for this kind
    return out
