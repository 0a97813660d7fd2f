"""torchtitan's FSDP2, and FSDP2 + expert parallelism, over two gloo processes on CPU give the
same loss, gradients and post-step loss as one process on the same batch, with our model
construction (trainer.model) and our loss (trainer.loss); see trainer/distributed.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from service.tiny_model import TinyModelSpec, init_tiny

from tests.conftest import require_torchtitan  # noqa: E402

require_torchtitan()

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
EXPERT_PARAMS = ("w1_EFD", "w2_EDF", "w3_EFD")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {"dense": init_tiny(root / "dense"),
            "moe": init_tiny(root / "moe", TinyModelSpec(moe=True))}


@pytest.fixture(scope="module")
def reference(tiny) -> dict[str, dict]:
    """The single-process step (no process group, no parallelism) for each tiny model."""
    from trainer.distributed import run_step

    return {kind: run_step(path) for kind, path in tiny.items()}


def torchrun(model: Path, out: Path, *, ep: int = 1) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
           "-m", "trainer.distributed", "--model", str(model), "--ep", str(ep), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=os.environ | {"OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("kind", ["moe", "dense"])
def test_fsdp_matches_one_process(tiny, reference, kind, tmp_path):
    ref = reference[kind]
    got = torchrun(tiny[kind], tmp_path / "fsdp.json")
    layouts = set(got["layout"].values())
    assert layouts == {"['fsdp']: [Shard(dim=0)]"}, layouts
    # Without EP every matmul sees the same tokens as in one process (bf16 experts included) and
    # FSDP sums the ranks' float32 gradients: identical up to float32 summation order.
    assert got["loss_before"] == pytest.approx(ref["loss_before"], rel=1e-5)
    assert got["loss_after"] == pytest.approx(ref["loss_after"], rel=1e-5)
    assert got["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-5)


def test_fsdp_ep_matches_one_process(tiny, reference, tmp_path):
    ref = reference["moe"]
    got = torchrun(tiny["moe"], tmp_path / "ep.json", ep=2)
    experts = {k for k in got["grad_norms"] if k.endswith(EXPERT_PARAMS)}
    assert experts, got["grad_norms"]
    assert all(got["layout"][k].startswith("['efsdp', 'ep']") for k in experts), got["layout"]
    assert got["loss_before"] == pytest.approx(ref["loss_before"], rel=1e-5)
    dense = {k: v for k, v in got["grad_norms"].items() if k not in experts}
    assert dense == pytest.approx({k: ref["grad_norms"][k] for k in dense}, rel=1e-5)
    # GroupedExperts computes in bf16, so each grouped_mm call rounds an expert's weight gradient
    # (summed over the tokens it saw) to bf16 once. One process runs each document separately
    # (forward_logits) and adds two rounded sums; under EP the expert's rank receives both ranks'
    # tokens and rounds their sum once. (One process running both documents in one batch gives
    # EP's expert gradients bit for bit.) Measured: loss_before and all non-expert gradients
    # identical; expert gradient norms up to 1.1e-4 relative; loss_after 2.0e-5 relative, as
    # Adam's first step (about lr * sign(g)) turns over a few near-zero elements.
    assert {k: got["grad_norms"][k] for k in experts} == pytest.approx(
        {k: ref["grad_norms"][k] for k in experts}, rel=1e-3)
    assert got["loss_after"] == pytest.approx(ref["loss_after"], rel=1e-4)
