"""Import rules: the trainer's light service modules pull in neither FastAPI nor Celery."""

from __future__ import annotations

import subprocess
import sys

import pytest

LIGHT = ["service.records", "service.tables", "service.db", "service.config", "service.buffer",
         "service.inference", "envs.task"]


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
    """Every state change of those tables is a named method of service.buffer.Buffer: no other
    module of the service or the trainer INSERTs, UPDATEs or DELETEs them itself."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    offenders = []
    for path in [*(root / "service").rglob("*.py"), *(root / "trainer").rglob("*.py")]:
        if path.name == "buffer.py" and path.parent.name == "service":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("update", "insert", "delete") and node.args
                    and isinstance(node.args[0], ast.Name) and node.args[0].id in STATE_TABLES):
                offenders.append(f"{path.relative_to(root)}:{node.lineno} {node.func.attr}({node.args[0].id})")
    assert offenders == []
