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
