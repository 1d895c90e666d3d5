"""The package's shape, checked from its source: no import circle, no oversized module, no capability probes.

These are the rules docs/design.md states (its layer and wing tables are read from there); a test holds them so the next change cannot quietly undo
them. The import graph counts every `import` and `from ... import` in art_nb, those under
`if TYPE_CHECKING:` and inside functions included: a type-only circle is still a circle a reader has
to untangle.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
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
    assert not {m for m in graph["art_nb.model"] if m.split(".")[1] in {"local", "remote", "serverless"}}
    assert "art_nb.model" not in graph["art_nb.backend"]
    assert "art_nb.store" not in graph["art_nb.model"]


DESIGN = PACKAGE.parent / "docs" / "design.md"


def _table(marker: str) -> list[list[str]]:
    """The rows of the markdown table that follows `<!-- {marker}: ... -->` in docs/design.md, cells split."""
    lines = DESIGN.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"<!-- {marker}:"))
    rows = []
    for line in lines[start + 3:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def _rooms_in(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def layer_table() -> dict[str, int]:
    """Room (`x.py`, `x/`, `x/y.py`, relative to art_nb/) -> layer number, from design.md's layer table."""
    return {room: int(row[0].split()[0]) for row in _table("layers") for room in _rooms_in(row[1])}


def wing_rules() -> list[tuple[str, str, list[str], list[str]]]:
    """(from, into, only from, only into) rows from design.md's wing table; an empty list: nobody/nothing."""
    return [(_rooms_in(r[0])[0], _rooms_in(r[1])[0], _rooms_in(r[2]), _rooms_in(r[3])) for r in _table("wings")]


def _path_of(module: str) -> str:
    """art_nb.local.plan.choices -> 'local/plan/choices.py'; a package -> its folder, 'local/plan/'; art_nb -> '__init__.py'."""
    path = _modules()[module].relative_to(PACKAGE).as_posix()
    return path[: -len("__init__.py")] if path.endswith("/__init__.py") else path


def _covers(room: str, path: str) -> bool:
    return path == room or (room.endswith("/") and path.startswith(room))


def room_of(path: str, rooms: Iterable[str]) -> str | None:
    """The most specific room that holds a module's path."""
    return max((r for r in rooms if _covers(r, path)), key=len, default=None)


def shape_violations(graph: dict[str, set[str]], paths: dict[str, str], layers: dict[str, int],
                     wings: list[tuple[str, str, list[str], list[str]]]) -> list[str]:
    """Every import that breaks the layer table or the wing table; a module no room covers is one too.

    A package's `__init__` re-exporting its own submodules is exempt from the layer rule (it points down into
    itself), as it is from the circle rule."""
    found = [f"{paths[m]}: in no room of docs/design.md's layer table" for m in graph if room_of(paths[m], layers) is None]
    for m, targets in graph.items():
        source = paths[m]
        for t in sorted(targets):
            target = paths[t]
            if t.startswith(m + ".") or room_of(source, layers) is None or room_of(target, layers) is None:
                continue
            src_layer, dst_layer = layers[room_of(source, layers)], layers[room_of(target, layers)]
            if dst_layer > src_layer:
                found.append(f"{source} (layer {src_layer}) imports {target} (layer {dst_layer}): up the layers")
            for wing_from, wing_into, only_from, only_into in wings:
                if _covers(wing_from, source) and _covers(wing_into, target):
                    allowed = any(_covers(r, source) for r in only_from) and any(_covers(r, target) for r in only_into)
                    if not allowed:
                        found.append(f"{source} imports {target}: {wing_from} -> {wing_into} is not in the wing table")
    return found


def folder_graph(graph: dict[str, set[str]], paths: dict[str, str]) -> dict[str, set[str]]:
    """The import graph between rooms as the tree draws them: a folder is one room, a top-level module its own."""
    def folder(module: str) -> str:
        path = paths[module]
        if path.endswith("/"):  # a package: its __init__ is in its folder
            return path
        return path.rsplit("/", 1)[0] + "/" if "/" in path else path

    rooms: dict[str, set[str]] = {folder(m): set() for m in graph}
    for m, targets in graph.items():
        for t in targets:
            if t.startswith(m + ".") and paths[m].endswith("/"):
                continue  # a package re-exporting what is inside it
            if folder(m) != folder(t):
                rooms[folder(m)].add(folder(t))
    return rooms


def _package_shape() -> tuple[dict[str, set[str]], dict[str, str]]:
    graph = import_graph()
    return graph, {m: _path_of(m) for m in graph}


def test_imports_keep_the_layers_and_the_wings_of_docs_design() -> None:
    graph, paths = _package_shape()
    layers = layer_table()
    assert len(layers) > 20 and len(wing_rules()) >= 5, "design.md's tables were not found"
    found = shape_violations(graph, paths, layers, wing_rules())
    assert not found, "imports against docs/design.md's tables:\n" + "\n".join(found)


def test_no_folder_level_circle() -> None:
    graph, paths = _package_shape()
    rooms = folder_graph(graph, paths)
    assert "local/engines/hf/" in rooms and "local/plan/" in rooms["local/engines/hf/"]
    cycle = _cycle(rooms)
    assert cycle is None, "folders that import each other: " + " -> ".join(cycle)


def test_the_checks_see_a_planted_upward_import_a_wing_crossing_and_a_folder_circle() -> None:
    graph, paths = _package_shape()
    layers, wings = layer_table(), wing_rules()
    upward = {**graph, "art_nb.store": graph["art_nb.store"] | {"art_nb.model"}}
    assert any("store.py (layer 0) imports model.py (layer 1)" in v for v in shape_violations(upward, paths, layers, wings))
    crossing = {**graph, "art_nb.remote.client": graph["art_nb.remote.client"] | {"art_nb.local.runtime"}}
    assert any("remote/client.py imports local/runtime.py" in v for v in shape_violations(crossing, paths, layers, wings))
    into_engines = {**graph, "art_nb.notebook.viewer": graph["art_nb.notebook.viewer"] | {"art_nb.local.engines.base"}}
    assert any("notebook/viewer.py imports local/engines/base.py" in v
               for v in shape_violations(into_engines, paths, layers, wings))
    homeless = {**paths, "art_nb.store": "attic/store.py"}
    assert any("in no room" in v for v in shape_violations(graph, homeless, layers, wings))
    circle = {**graph, "art_nb.local.plan.choices": graph["art_nb.local.plan.choices"] | {"art_nb.local.trainers.base"}}
    assert _cycle(folder_graph(circle, paths)) is not None
    assert _cycle(folder_graph(graph, paths)) is None


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
