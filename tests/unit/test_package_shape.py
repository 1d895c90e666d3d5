"""The package's shape, checked from its source: no import circle, no oversized module, no capability probes.

These are the rules docs/design.md states; a test holds them so the next change cannot quietly undo
them. The import graph counts every `import` and `from ... import` in art_nb, those under
`if TYPE_CHECKING:` and inside functions included: a type-only circle is still a circle a reader has
to untangle.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "art_nb"
MAX_LINES = 450


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph() -> dict[str, set[str]]:
    """module -> the art_nb modules it imports (a `from pkg import name` of a submodule counts as that submodule)."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, path, node)
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
            for target in targets:
                if target in modules and target != name:
                    graph[name].add(target)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle, or None. A package importing its own submodules (`__init__` re-exports) is not one."""
    edges = {m: {t for t in targets if not t.startswith(m + ".")} for m, targets in graph.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for start in sorted(edges):
        if start not in state:
            found = visit(start)
            if found:
                return found
    return None


def test_the_import_graph_has_no_circle() -> None:
    graph = import_graph()
    assert "art_nb.model" in graph and graph["art_nb.model"], "the graph builder found no imports: it is broken"
    cycle = _cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_planted_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert _cycle(graph) == ["a", "b", "c", "a"]
    assert _cycle({"p": {"p.x"}, "p.x": set()}) is None  # a package re-exporting its submodule is not one


def test_the_model_handle_imports_no_backend_and_the_protocol_no_model() -> None:
    graph = import_graph()
    assert not {m for m in graph["art_nb.model"] if m.startswith("art_nb.backends.") and m != "art_nb.backend"}
    assert "art_nb.model" not in graph["art_nb.backend"]
    assert "art_nb.store" not in graph["art_nb.model"]


# docs/design.md's layers, by module prefix (the longest prefix wins).
LAYERS = {
    "art_nb._version": 0, "art_nb.types": 0, "art_nb.config": 0, "art_nb.events": 0, "art_nb.secrets": 0,
    "art_nb.trajectories": 0, "art_nb.store": 0, "art_nb.records": 0, "art_nb.gather": 0, "art_nb.grpo": 0,
    "art_nb.messages": 0, "art_nb.utils": 0, "art_nb.dev": 0, "art_nb.porting": 0, "art_nb.trajectories": 0,
    "art_nb.capture": 0, "art_nb.scopes": 0,
    "art_nb.sft_config": 0,
    "art_nb.backend": 1, "art_nb.model": 1, "art_nb.reporting": 1,
    "art_nb.local.engines": 2, "art_nb.local.trainers": 2, "art_nb.local.server": 2, "art_nb.local.server.toolcalls": 2, "art_nb.web": 2,
    "art_nb.local.plan.memory": 2, "art_nb.local.plan.versions": 2, "art_nb.local.plan.base_models": 2, "art_nb.local.plan.threads": 2, "art_nb.local.plan.compat": 2, "art_nb.local.plan.choices": 2,
    "art_nb.local.s3": 2,
    "art_nb.backends": 3,
    "art_nb": 4, "art_nb.local": 4, "art_nb.notebook": 4, "art_nb.envs": 4, "art_nb.local.export": 4, "art_nb.local.gguf": 4, "art_nb.datasets_io": 4, "art_nb.demo": 4,
    "art_nb.cli": 4, "art_nb.serverless": 4, "art_nb.rewards": 4, "art_nb.mcp": 4, "art_nb.langgraph": 4,
}


def layer(module: str) -> int:
    prefix = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS[prefix]


def test_imports_point_down_the_layers() -> None:
    graph = import_graph()
    upward = sorted(f"{m} ({layer(m)}) -> {t} ({layer(t)})" for m, targets in graph.items() for t in targets
                    if layer(t) > layer(m) and not t.startswith(m + ".") and not m.endswith("__init__"))
    assert not upward, "imports that point up the layers of docs/design.md: " + "; ".join(upward)


def test_no_module_is_over_the_size_limit() -> None:
    sizes = {name: len(path.read_text().splitlines()) for name, path in _modules().items()}
    too_big = {name: n for name, n in sizes.items() if n > MAX_LINES}
    assert not too_big, f"split these by job (limit {MAX_LINES} lines): {too_big}"


def _probes(source: str) -> list[tuple[int, str]]:
    """hasattr(...) and getattr(obj, name, default) calls: asking an object what it can do.

    A probe of a third-party object is allowed when its line, or a comment line right above it,
    says `# third-party: <why>`."""
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
            continue
        probe = node.func.id == "hasattr" or (node.func.id == "getattr" and len(node.args) == 3)
        marked = "# third-party:" in lines[node.lineno - 1] or (
            node.lineno > 1 and lines[node.lineno - 2].strip().startswith("# third-party:"))
        if probe and not marked:
            found.append((node.lineno, lines[node.lineno - 1].strip()))
    return found


def test_no_capability_probes_on_our_own_objects() -> None:
    """Protocols declare what callers use. A probe of a third-party object says why on its line."""
    found = {f"{path.relative_to(PACKAGE.parent)}:{line}": text
             for path in PACKAGE.rglob("*.py") for line, text in _probes(path.read_text())}
    assert not found, f"declare these in a protocol, or mark a third-party probe '# third-party: why': {found}"


def test_the_probe_finder_sees_probes() -> None:
    assert len(_probes("hasattr(x, 'a')\ngetattr(x, 'a', None)\ngetattr(x, 'a')\n")) == 2
    assert _probes("getattr(torch, 'x', None)  # third-party: old torch\n") == []
