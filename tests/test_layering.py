"""The architecture's rules, read from the code: which part may import which (lazy imports
count), no import cycles, no private names across modules, one writer of the state tables, and
the trainer's service modules pull in neither FastAPI nor Celery."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = ("sandboxes", "envs", "service", "trainer")
SHARED = ("service.config", "service.log")
ENTRY = ("service.cli", "service.embedded", "service.app", "service.rl", "service.demo", "service.trackers")
PARTS = {  # part -> the parts it may import (itself included)
    "sandboxes": {"sandboxes"},
    "envs": {"envs", "sandboxes"},
    "shared": {"shared"},
    "store": {"store", "shared", "envs"},
    "fleet": {"fleet", "store", "shared"},
    "worker": {"worker", "store", "fleet", "shared", "envs", "sandboxes"},
    "control": {"control", "worker", "store", "fleet", "shared", "envs", "sandboxes"},
    "api": {"api", "control", "worker", "store", "fleet", "shared", "envs", "sandboxes"},
    "ui": {"ui", "api", "control", "store", "shared"},
    "entry": {"entry", "api", "ui", "control", "worker", "fleet", "store", "shared", "envs", "sandboxes"},
    "trainer": {"trainer", "store", "fleet.client", "shared"},
}
LIGHT = ["service.store.records", "service.store.tables", "service.store.db", "service.store.buffer",
         "service.config", "service.fleet.client", "envs.task"]


def _modules() -> dict[str, Path]:
    out = {}
    for top in OURS:
        for path in (ROOT / top).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


MODULES = _modules()


def _imports(module: str) -> list[tuple[str, list[str], int]]:
    """(imported module, names taken from it, line) for every import of ours, lazy ones included."""
    out = []
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names if a.name.split(".")[0] in OURS]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] in OURS:
            subs = [a.name for a in node.names if f"{node.module}.{a.name}" in MODULES]
            out += [(f"{node.module}.{s}", [], node.lineno) for s in subs]
            names = [a.name for a in node.names if a.name not in subs]
            if names:
                out.append((node.module, names, node.lineno))
    return out


def part(module: str) -> str:
    if module in SHARED:
        return "shared"
    if module in ENTRY:
        return "entry"
    top, _, rest = module.partition(".")
    if top != "service":
        return top
    return rest.split(".")[0] or "entry"


def _allowed(importer: str, imported: str) -> bool:
    allowed = PARTS[part(importer)]
    return part(imported) in allowed or any(imported == f"service.{a}" or imported.startswith(f"service.{a}.")
                                            for a in allowed if "." in a)


def test_every_module_belongs_to_a_part():
    assert {m: part(m) for m in MODULES if part(m) not in PARTS} == {}


def test_parts_import_only_downward():
    """store at the bottom; the service never imports the trainer; the trainer only the store and
    the fleet client; api and ui never import each other's way back."""
    bad = [f"{m}:{line} imports {imp}" for m in MODULES for imp, _, line in _imports(m)
           if imp in MODULES and not _allowed(m, imp)]
    assert bad == []


def test_no_import_cycles():
    graph = {m: {imp for imp, _, _ in _imports(m) if imp in MODULES and imp != m} for m in MODULES}
    cycles, index, low, stack, on_stack = [], {}, {}, [], set()

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                cycles.append(sorted(component))

    for m in graph:
        if m not in index:
            visit(m)
    assert cycles == []


def test_no_module_imports_another_modules_private_names():
    bad = [f"{m}:{line} takes {imp}.{n}" for m in MODULES for imp, names, line in _imports(m)
           for n in names if n.startswith("_") and imp != m]
    assert bad == []


@pytest.mark.parametrize("module", LIGHT)
def test_light_module_imports_no_web_or_queue_framework(module):
    code = (f"import sys, {module}; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('fastapi', 'celery', 'starlette', 'kombu')); "
            "print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"{module} imports {out.stdout.strip()}"


def test_sandboxes_import_nothing_of_ours():
    code = ("import sys, pkgutil, importlib, sandboxes; "
            "[importlib.import_module('sandboxes.' + m.name) for m in pkgutil.iter_modules(sandboxes.__path__)]; "
            "print(','.join(sorted(m for m in sys.modules if m.split('.')[0] in ('service', 'envs', 'trainer'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


STATE_TABLES = ("Episode", "Turn", "Group", "Run", "Policy")


def test_only_the_store_writes_episodes_groups_runs_and_policies():
    """Every state change of those tables is a named method of service.store.buffer.Buffer: no other
    module of the service or the trainer INSERTs, UPDATEs or DELETEs them itself."""
    offenders = []
    for path in [*(ROOT / "service").rglob("*.py"), *(ROOT / "trainer").rglob("*.py")]:
        if path == ROOT / "service" / "store" / "buffer.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("update", "insert", "delete") and node.args
                    and isinstance(node.args[0], ast.Name) and node.args[0].id in STATE_TABLES):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.func.attr}({node.args[0].id})")
    assert offenders == []
