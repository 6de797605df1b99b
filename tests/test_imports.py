"""Package structure: no module of ``moe_ep`` imports one that imports it back (also not lazily inside a function),
and ``import moe_ep`` needs neither CuPy nor nvshmem4py."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "moe_ep"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(mod: str, is_pkg: bool, level: int, target: str | None) -> str:
    """The absolute name of ``from <level dots><target> import ...`` inside ``mod``."""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def import_graph() -> dict[str, set[str]]:
    """module -> the moe_ep modules it imports anywhere in its body (``from pkg import name`` counts as importing
    ``pkg.name`` when that is a module, else ``pkg``).

    Example: moe_ep/layer.py's ``from .transport import dispatch`` gives the edge moe_ep.layer -> moe_ep.transport.
    """
    files = {_module_name(p): p for p in PKG.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                src = _resolve(mod, is_pkg, node.level, node.module) if node.level else (node.module or "")
                subs = [f"{src}.{a.name}" for a in node.names if f"{src}.{a.name}" in files]
                targets = subs or [src]
            for t in targets:
                if t in files and t != mod:
                    graph[mod].add(t)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n) :] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_cycle():
    graph = import_graph()
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph))}"


def test_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_import_without_gpu_packages():
    code = (
        "import sys; sys.modules['cupy'] = None; sys.modules['nvshmem'] = None\n"
        "import moe_ep, moe_ep.transport.nvshmem.buffer, moe_ep.experts.sm90.mlp, moe_ep.mxfp8.cuda\nprint('ok')"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
