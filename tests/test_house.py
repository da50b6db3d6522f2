"""The package's structure, read from its source with ``ast``: no module reaches into another
object's ``_`` members, the modules import each other in no loop (imports under
``TYPE_CHECKING`` included: a loop a type checker follows is one a reader follows too), and the
tests' engine stand-in offers what the server calls of an engine (``ServedEngine``)."""

from __future__ import annotations

import ast
import inspect
import types
import typing
from pathlib import Path

from localspec.engine.api import ServedEngine
from tests.fake_engine import StepEngine

PACKAGE = Path(__file__).resolve().parent.parent / "localspec"

# ``x._name`` allowed where x is not self or cls, each for its reason
PRIVATE_ALLOWED = {
    "_SubParsersAction": "argparse's sub-command type has no public name",
    "_fields_": "ctypes structures declare their fields under this name",
}


def _sources() -> list[tuple[str, Path, ast.Module]]:
    """(module name, path, tree) of every module of the package."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out.append((".".join(parts), path, ast.parse(path.read_text(encoding="utf-8"))))
    return out


def private_reaches(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, expression) of each ``x._name`` whose x is not ``self`` or ``cls``."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        name = node.attr
        if not name.startswith("_") or name.startswith("__") or name in PRIVATE_ALLOWED:
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        found.append((node.lineno, ast.unparse(node)))
    return found


def import_graph(sources: list[tuple[str, Path, ast.Module]]) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (at any depth of the file)."""
    names = {name for name, _, _ in sources}
    graph: dict[str, set[str]] = {}
    for name, path, tree in sources:
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name in names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*up, *([node.module] if node.module else [])])
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    if full in names:
                        deps.add(full)  # a module of the package, imported from it
                    elif base in names:
                        deps.add(base)
        deps.discard(name)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_reaches_into_another_objects_private_members() -> None:
    bad = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {expr}"
        for _, path, tree in _sources()
        for line, expr in private_reaches(tree)
    ]
    assert bad == []


def test_the_private_member_check_sees_what_it_forbids() -> None:
    tree = ast.parse("self._a\ncls._b\nengine._tctx\nobj.x._y\nargparse._SubParsersAction\n")
    assert private_reaches(tree) == [(3, "engine._tctx"), (4, "obj.x._y")]


def test_no_import_cycles_even_under_type_checking() -> None:
    assert cycles(import_graph(_sources())) == []


def test_the_cycle_check_sees_a_cycle_behind_type_checking() -> None:
    src = {
        "pkg.a": "from pkg.b import B\n",
        "pkg.b": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n",
        "pkg.c": "from .a import A\n",
    }
    sources = [
        (name, Path(name.replace(".", "/") + ".py"), ast.parse(s)) for name, s in src.items()
    ]
    sources.append(("pkg", Path("pkg/__init__.py"), ast.parse("")))
    assert cycles(import_graph(sources)) == [["pkg.a", "pkg.b"]]


def _simple_type(hint: object) -> tuple[type, ...] | None:
    """The builtin types a value of ``hint`` may have, or None for a class to leave alone
    (the stand-in's vocabulary is a fake, not llama.cpp's)."""
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        parts = [_simple_type(a) for a in args]
        if any(p is None for p in parts):
            return None
        return tuple(t for p in parts if p is not None for t in p)
    if hint is type(None):
        return (type(None),)
    if typing.get_origin(hint) is tuple:
        return (tuple,)
    if hint in (int, str, bool, float):
        return (hint,)  # type: ignore[return-value]
    return None


def assert_serves(engine: object) -> None:
    """``engine`` has every member of ServedEngine, with the same call signatures (names and
    kinds of parameters) and values of the declared builtin types."""
    for name, hint in typing.get_type_hints(ServedEngine).items():
        assert hasattr(engine, name), name
        allowed = _simple_type(hint)
        if allowed is not None:
            assert isinstance(getattr(engine, name), allowed), (name, getattr(engine, name))
    for name, member in vars(ServedEngine).items():
        if name.startswith("_"):
            continue
        if isinstance(member, property):
            assert hasattr(engine, name), name
            allowed = _simple_type(typing.get_type_hints(member.fget).get("return"))
            if allowed is not None:
                assert isinstance(getattr(engine, name), allowed), name
        elif inspect.isfunction(member):
            mine = inspect.signature(getattr(engine, name))
            want = inspect.signature(member.__get__(engine))
            shape = [(p.name, p.kind) for p in want.parameters.values()]
            assert [(p.name, p.kind) for p in mine.parameters.values()] == shape, name


def test_the_tests_stand_in_engine_serves_as_an_engine() -> None:
    assert_serves(StepEngine())


def test_the_interface_check_catches_a_missing_or_different_member() -> None:
    class NoClose(StepEngine):
        close = None  # type: ignore[assignment]

    class OtherStep(StepEngine):
        def step(self, n: int = 1) -> bool:  # type: ignore[override]
            return False

    for bad in (NoClose(), OtherStep()):
        try:
            assert_serves(bad)
        except (AssertionError, TypeError):
            continue
        raise AssertionError(f"{type(bad).__name__} passed")
