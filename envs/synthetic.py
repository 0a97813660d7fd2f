"""Synthetic SWE-bench records with realistic field sizes, for load tests and benchmarks.

Sizes follow SWE-bench's shape: statements of a few KB, patches of 1-10 KB, PASS_TO_PASS
lists from none to hundreds of test ids, lists shipped as JSON-encoded strings.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

_WORDS = ("the value when index array returns raises error should instead default config "
          "parser empty list none key missing wrong off by one boundary unicode path file "
          "timeout handler request response cache thread lock").split()


def _prose(rng: random.Random, n_chars: int) -> str:
    out, size = [], 0
    while size < n_chars:
        word = rng.choice(_WORDS)
        out.append(word)
        size += len(word) + 1
    return " ".join(out)


def _diff(rng: random.Random, path: str, n_chars: int) -> str:
    lines = [f"diff --git a/{path} b/{path}", f"--- a/{path}", f"+++ b/{path}",
             f"@@ -{rng.randint(1, 900)},7 +{rng.randint(1, 900)},9 @@ def f():"]
    size = sum(map(len, lines))
    while size < n_chars:
        line = rng.choice(" +-") + "    " + _prose(rng, rng.randint(20, 70))
        lines.append(line)
        size += len(line) + 1
    return "\n".join(lines) + "\n"


def _size(rng: random.Random, median: int, cap: int) -> int:
    return min(cap, max(200, int(rng.lognormvariate(0, 0.8) * median)))


def synthetic_task(i: int, seed: int = 0, repo: str | None = None) -> dict:
    rng = random.Random(seed * 1_000_003 + i)
    repo = repo or f"org{i % 12}/project{i % 12}"
    module = f"src/{repo.split('/')[1]}/mod{i % 50}.py"
    tests = f"tests/test_mod{i % 50}.py"
    f2p = [f"{tests}::test_case_{i}_{k}" for k in range(rng.randint(1, 4))]
    p2p = [f"{tests}::test_keep_{k}[param-{k}]" for k in range(int(rng.expovariate(1 / 40)))]
    return {
        "instance_id": f"{repo.replace('/', '__')}-{i}",
        "repo": repo,
        "base_commit": f"{rng.getrandbits(160):040x}",
        "problem_statement": _prose(rng, _size(rng, 1800, 40_000)),
        "hints_text": _prose(rng, _size(rng, 400, 10_000)) if rng.random() < 0.5 else "",
        "patch": _diff(rng, module, _size(rng, 1600, 30_000)),
        "test_patch": _diff(rng, tests, _size(rng, 2500, 30_000)),
        "FAIL_TO_PASS": json.dumps(f2p),
        "PASS_TO_PASS": json.dumps(p2p),
        "version": f"{rng.randint(0, 5)}.{rng.randint(0, 9)}",
        "environment_setup_commit": f"{rng.getrandbits(160):040x}",
        "created_at": f"2023-0{rng.randint(1, 9)}-1{rng.randint(0, 9)}T12:34:56Z",
    }


def synthetic_suite(n: int, seed: int = 0) -> Iterator[dict]:
    for i in range(n):
        yield synthetic_task(i, seed)
