"""Imports point down the layers: read every module of the package with `ast` (imports inside functions
too), fold modules into units (a subpackage of engine/, a module of engine/, or a top package), and fail on
an import from a lower layer to a higher one, on any circle between units, on a unit no layer names, and
on Prefect imported under engine/ or tideflow_kernels/."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "tideflow_kernels", "drills", "tasks", "flows")

# Bottom to top. A unit may import units of its own layer or below; within a layer, no circles.
LAYERS: list[tuple[str, ...]] = [
    ("tideflow_kernels", "engine", "engine.runtime", "engine.telemetry", "engine.weights", "engine.transfer"),
    # ^ the package root, its host runtime (processes, threads, devices, paths, errors, the HTTP client),
    #   telemetry (metrics), weights in object stores, KV transfer
    ("engine.model", "engine.encoder"),  # the model (and its tokenizer) and the vision encoder
    ("engine.kvtier",),  # KV blocks below the device pool: host memory, disk, a shared store
    ("engine.core",),  # the engine core: scheduler, KV blocks, model runner, sampler, PD handoff, the engine loop
    ("engine.offline", "engine.api"),  # a model without a server (default checkpoint, reference loop, model
    #                                    commands); the HTTP kit every server shares
    ("engine.server", "engine.parallel"),  # one member: its HTTP front and `serve`, DEP ranks
    ("engine.router",),  # the gateway
    ("engine.group", "engine.canary"),  # groups of members; canary verbs
    ("engine.scaling",),  # warm pool and autoscaler over groups
    ("engine.capacity",),  # capacity planning: role profiles (a plan will write the autoscaler's floors)
    ("engine.control",),  # the controller that owns the fleet
    ("engine.main",),  # the engine's commands
    ("drills",),  # load and fault drills against a running fleet (above the engine: they drive it from outside)
    ("tasks",),  # Prefect tasks
    ("flows",),  # Prefect flows and the tideflow command
]
RANK = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}


def unit_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] not in PACKAGES:
        return None
    if parts[0] != "engine" or len(parts) == 1:
        return parts[0]
    return ".".join(parts[:2])


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """Modules a file imports, anywhere in it (relative imports resolved against its package)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # `from engine import intraop`
    return found


def unit_graph() -> tuple[dict[str, set[str]], dict[tuple[str, str], str], dict[str, set[str]]]:
    """unit -> units it imports; (from, to) -> one file that makes the edge; file -> top-level packages
    it imports (for the Prefect rule)."""
    edges: dict[str, set[str]] = {}
    witness: dict[tuple[str, str], str] = {}
    tops: dict[str, set[str]] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            src = unit_of(module_name(path))
            found = imports_of(path)
            tops[str(path.relative_to(ROOT))] = {name.split(".")[0] for name in found}
            for name in found:
                dst = unit_of(name)
                if dst is None or dst == src or (name.startswith("engine.") and not _exists(name)):
                    continue
                edges.setdefault(src, set()).add(dst)
                witness.setdefault((src, dst), str(path.relative_to(ROOT)))
            edges.setdefault(src, set())
    return edges, witness, tops


def _exists(module: str) -> bool:
    """`from engine.runtime import intraop` adds 'engine.runtime.intraop' (a module) and `from engine.x import Name`
    adds 'engine.x.Name' (not one): only names that are files or packages count."""
    rel = Path(*module.split("."))
    return (ROOT / rel).with_suffix(".py").exists() or (ROOT / rel / "__init__.py").exists()


def upward(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((a, b) for a, targets in edges.items() for b in targets if RANK[b] > RANK[a])


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one unit (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


@pytest.fixture(scope="module")
def graph():
    return unit_graph()


def test_every_unit_has_a_layer(graph):
    edges, _, _ = graph
    assert sorted(u for u in edges if u not in RANK) == [], "name the new unit's layer in LAYERS"
    assert sorted(u for u in RANK if u not in edges) == [], "LAYERS names a unit that no longer exists"


def test_imports_point_down(graph):
    edges, witness, _ = graph
    found = [f"{a} -> {b} ({witness[(a, b)]})" for a, b in upward(edges)]
    assert found == [], "imports from a lower layer to a higher one"


def test_no_circles_between_units(graph):
    edges, _, _ = graph
    assert circles(edges) == []


def test_the_engine_and_kernels_never_import_prefect(graph):
    _, _, tops = graph
    offenders = sorted(f for f, names in tops.items() if f.split("/")[0] in ("engine", "tideflow_kernels") and "prefect" in names)
    assert offenders == []


def test_the_checks_catch_what_they_look_for():
    """The checkers on a made-up graph: an upward edge and a circle are both reported."""
    made_up = {"engine.model": {"engine.server"}, "engine.server": {"engine.core"},
               "engine.core": {"engine.model"}}
    assert ("engine.model", "engine.server") in upward(made_up)
    assert circles(made_up) == [["engine.core", "engine.model", "engine.server"]]


def test_no_flow_module_shadows_a_package():
    """Prefect loads a deployment's entrypoint as a script, with flows/ first on sys.path: a flows/<name>.py named
    like a top-level package (flows/drills.py beside drills/) takes its place, and the flow's own `import drills.x`
    fails in every deployment run, while in-process imports (flows.drills) work."""
    flow_modules = {p.stem for p in (ROOT / "flows").glob("*.py")}
    assert sorted(flow_modules & set(PACKAGES)) == []


SCRIPT_FOLDERS = ("benchmarks", "harness", "scripts")  # run as files, so no test imports them by themselves


def unresolved_imports(path: Path) -> list[str]:
    """The project names `path` imports (`from engine.x import y`, `import engine.x`) that do not exist."""
    import importlib

    missing = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [(node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [(alias.name, None) for alias in node.names]
        else:
            continue
        for module, name in names:
            if module.split(".")[0] not in PACKAGES:
                continue
            try:
                found = importlib.import_module(module)
            except ImportError:
                missing.append(module)
                continue
            if name is not None and not hasattr(found, name):
                try:
                    importlib.import_module(f"{module}.{name}")
                except ImportError:
                    missing.append(f"{module}.{name}")
    return missing


def test_benchmarks_and_scripts_import_what_exists():
    """A module moved between rooms breaks the scripts that import it by its old name, and nothing else notices
    until someone runs the benchmark (three did, after engine/intraop.py moved to engine/runtime/)."""
    broken = {str(p.relative_to(ROOT)): found for folder in SCRIPT_FOLDERS for p in sorted((ROOT / folder).glob("*.py"))
              if (found := unresolved_imports(p))}
    assert broken == {}


def test_the_import_check_sees_a_moved_module(tmp_path):
    script = tmp_path / "old.py"
    script.write_text("from engine import intraop\nimport engine.no_such_room\nfrom engine.runtime import intraop\n")
    assert unresolved_imports(script) == ["engine.intraop", "engine.no_such_room"]
