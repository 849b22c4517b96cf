"""`common/` is the bottom layer: it imports neither a framework's code (frameworks/) nor the
tools (benchmarks/), by an import statement or by name (importlib.import_module), and its modules
import each other without a circle (TYPE_CHECKING imports and imports inside functions count).
A trainer passes what is framework-specific as a value (its profiler class to `Run`)."""

from __future__ import annotations

import ast
from pathlib import Path

COMMON = Path(__file__).resolve().parents[2] / "common"
UPPER = ("frameworks", "benchmarks")


def imports_of(path: Path) -> set[str]:
    """The modules `path` imports anywhere: import statements, and the constant names given to
    importlib.import_module / __import__."""
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module)
            modules |= {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                modules.add(node.args[0].value)
    return modules


def test_common_imports_no_framework_code_and_no_tool() -> None:
    for path in sorted(COMMON.glob("*.py")):
        upward = {m for m in imports_of(path) if m.split(".")[0] in UPPER}
        assert not upward, f"common/{path.name} reaches up into {sorted(upward)}"


def test_common_modules_import_each_other_without_a_circle() -> None:
    names = {p.stem for p in COMMON.glob("*.py")}
    graph = {
        p.stem: {m.split(".")[1] for m in imports_of(p) if m.startswith("common.")} & names
        for p in COMMON.glob("*.py")
    }
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            raise AssertionError("import circle in common/: " + " -> ".join(path + [node]))
        if node in done:
            return
        for nxt in sorted(graph[node] - {node}):
            visit(nxt, path + [node])
        done.add(node)

    for node in sorted(graph):
        visit(node, [])
