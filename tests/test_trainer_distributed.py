"""torchtitan's FSDP2, and FSDP2 + expert parallelism, over two gloo processes on CPU give the
same loss, gradients and post-step loss as one process on the same batch, with our model
construction (trainer.model) and our loss (trainer.loss); see tests/trainer_harness.py.

The comparisons are made in a form whose result does not depend on the CPU's instruction set:
the experts compute in float32 (`expert_dtype`), not in torchtitan's bfloat16 (whose rounding
differs between AVX2, AVX-512 and AMX kernels, and between batch compositions), and both sides
run in their own process with one thread. What can still differ is said at each assertion.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from service.fleet.tiny_model import TinyModelSpec, init_tiny

from tests.conftest import require_torchtitan  # noqa: E402

require_torchtitan()

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
EXPERT_PARAMS = ("w1_EFD", "w2_EDF", "w3_EFD")
U32 = 2.0**-24  # float32 unit roundoff
EXPERT_TOKENS = 2 * 64  # fixed_batch: every token of both documents may reach one expert
# AdamW's first update is lr * g / (|g| + eps): its derivative in g is at most lr / eps, so an eps
# far above the rounding noise of the gradients keeps that noise from flipping whole lr-sized
# steps (with eps = 1e-8, an element whose gradient is ~0 moves by +-lr on a rounding).
ADAM_EPS = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {"dense": init_tiny(root / "dense"),
            "moe": init_tiny(root / "moe", TinyModelSpec(moe=True))}


def step(model: Path, out: Path, *, nproc: int = 1, ep: int = 1) -> dict:
    """tests/trainer_harness.py's step with float32 experts: one process, or torchrun over nproc."""
    launch = ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--standalone"] if nproc > 1 else []
    cmd = [sys.executable, *launch, "-m", "tests.trainer_harness", "--model", str(model), "--ep", str(ep),
           "--out", str(out), "--expert-dtype", "float32", "--adam-eps", str(ADAM_EPS)]
    proc = subprocess.run(cmd, cwd=REPO, env=os.environ | {"OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def reference(tiny, tmp_path_factory) -> dict[str, dict]:
    """The single-process step (no process group, no parallelism) for each tiny model."""
    root = tmp_path_factory.mktemp("reference")
    return {kind: step(path, root / f"{kind}.json") for kind, path in tiny.items()}


@pytest.mark.parametrize("kind", ["moe", "dense"])
def test_fsdp_matches_one_process(tiny, reference, kind, tmp_path):
    ref = reference[kind]
    got = step(tiny[kind], tmp_path / "fsdp.json", nproc=2)
    layouts = set(got["layout"].values())
    assert layouts == {"['fsdp']: [Shard(dim=0)]"}, layouts
    # Without EP each rank runs exactly the one-process computation of its document (same shapes,
    # same kernels, float32 throughout), and FSDP's reduce-scatter adds the two ranks' gradients,
    # as one process accumulates its two backward passes: a + b == b + a, so nothing may differ.
    assert got["loss_before"] == ref["loss_before"]
    assert got["grad_norms"] == ref["grad_norms"]
    assert got["loss_after"] == ref["loss_after"]


def test_fsdp_ep_matches_one_process(tiny, reference, tmp_path):
    ref = reference["moe"]
    got = step(tiny["moe"], tmp_path / "ep.json", nproc=2, ep=2)
    experts = {k for k in got["grad_norms"] if k.endswith(EXPERT_PARAMS)}
    assert experts, got["grad_norms"]
    assert all(got["layout"][k].startswith("['efsdp', 'ep']") for k in experts), got["layout"]
    # Under EP an expert's rank receives both ranks' tokens and runs one grouped matmul over them,
    # where one process runs each document alone: the forward is computed token by token either
    # way, but each expert weight's gradient is a sum over up to EXPERT_TOKENS tokens taken in
    # another order. Reordering a float32 sum of n terms moves it by at most (n - 1) u sum|x|;
    # gradients upstream inherit that through the experts' inputs. Bounded relative to the norms:
    bound = (EXPERT_TOKENS - 1) * U32
    assert got["loss_before"] == pytest.approx(ref["loss_before"], rel=bound)
    assert got["grad_norms"] == pytest.approx(ref["grad_norms"], rel=bound)
    # AdamW's update moves by at most lr / ADAM_EPS times the gradients' change (1e-3 / 1e-4 of
    # at most bound * |g|), so the loss after the step stays within the same order.
    assert got["loss_after"] == pytest.approx(ref["loss_after"], rel=bound)
    # Measured on AVX2, AVX-512 and AMX: losses identical, gradient norms within 1.7e-7.
