"""The trainer configs at real sizes, built on the meta device (no memory) with their parallel
layouts checked; the CLI names bad overrides."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import require_torchtitan  # noqa: E402

require_torchtitan()

from trainer.config import load_config
from trainer.layout import LayoutError, check

CONFIGS = Path(__file__).resolve().parent.parent / "trainer" / "configs"
EXPECTED = {  # total parameters (billions), MoE layers, experts
    "qwen3-32b": (32.8, 0, None), "qwen3-235b-a22b": (235.1, 94, 128), "deepseek-v3-671b": (671.0, 58, 256),
    "glm5-class": (671.0, 58, 256), "kimi-k2": (1026.9, 60, 384)}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_real_size_configs_build_on_meta_and_fit_their_layout(name):
    cfg = load_config(CONFIGS / f"{name}.toml")
    layout = check(cfg)
    params, moe_layers, experts = EXPECTED[name]
    assert layout.params / 1e9 == pytest.approx(params, abs=0.1)
    assert (layout.moe_layers, layout.experts) == (moe_layers, experts)
    assert layout.active_params <= layout.params
    assert layout.bytes_per_rank < 80e9, f"{layout.bytes_per_rank / 1e9:.0f} GB per rank does not fit an 80 GB GPU"
    assert cfg.data.seq_len == 131072 and cfg.parallelism.context_parallel_degree >= 2


def test_debug_config_is_the_tiny_model(tmp_path):
    from service.fleet.tiny_model import init_tiny

    model = init_tiny(tmp_path / "tiny")
    cfg = load_config(CONFIGS / "debug.toml", [f"--model={model}", "--steps=5", "--loss.kl_coef=0.01"])
    assert (cfg.steps, cfg.loss.kl_coef) == (5, 0.01)
    assert check(cfg).params < 2e6


@pytest.mark.parametrize("override,field", [
    (["--parallelism.expert_parallel_degree=3"], "expert_parallel_degree"),
    (["--parallelism.data_parallel_shard_degree=3"], "world_size"),
    (["--titan_flavor=qwen3:1T"], "titan_flavor"),
])
def test_bad_layouts_are_named(override, field):
    cfg = load_config(CONFIGS / "qwen3-235b-a22b.toml", override)
    with pytest.raises(LayoutError, match=field):
        check(cfg)


def test_cli_names_a_bad_override(tmp_path):
    done = subprocess.run([sys.executable, "-m", "service.cli", "train", "--config", str(CONFIGS / "debug.toml"),
                           "--loss.ratio_low=5"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "ratio_low" in done.stderr, done.stderr


@pytest.mark.parametrize(("override", "code", "expected"), [
    ([], 0, '"moe_layers": 94'),
    (["--parallelism.expert_parallel_degree=3"], 2, "expert_parallel_degree"),
])
def test_trainer_process_checks_a_layout(override, code, expected):
    """`python -m trainer --check` (what `swerve train --check` runs): the layout as JSON, or
    exit 2 naming the field."""
    done = subprocess.run([sys.executable, "-m", "trainer", "--config", str(CONFIGS / "qwen3-235b-a22b.toml"),
                           "--check", *override], capture_output=True, text=True, timeout=120)
    assert done.returncode == code, done.stderr
    assert expected in (done.stdout if code == 0 else done.stderr)
