"""A training job's metrics for the experiment trackers labs already watch: Weights & Biases
(offline mode included) and TensorBoard. Each trainer step and each evaluation is logged once,
under the names prime-rl and SkyRL use (reward/, eval/<suite>/pass@k, off_policy/, timing/...),
with the policy version as its x-axis; what was logged is remembered in the job's folder, so a
resumed job logs only what is new. The packages are optional: `pip install -e '.[trackers]'`."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

logger = logging.getLogger(__name__)

STEP_NAMES = {  # the step's metric -> the tracker's name
    "reward_mean": "reward/mean", "loss": "loss/mean", "mismatch_kl": "mismatch_kl/mean", "entropy": "entropy/mean", "nll": "loss/nll",
    "masked_fraction": "loss/masked_fraction", "grad_norm": "optim/grad_norm", "staleness_mean": "off_policy/mean",
    "staleness_max": "off_policy/max", "dropped_groups": "off_policy/dropped", "filtered": "filter/skipped",
    "useful_fraction": "filter/useful_fraction", "zero_advantage_groups": "filter/zero_advantage_groups",
    "sampled_tokens": "progress/sampled_tokens", "wait_s": "timing/wait_for_rollouts", "step_s": "timing/train",
    "publish_s": "timing/publish",
}  # fmt: skip
EVAL_NAMES = {"pass_at_1": "pass@1", "pass_at_k": "pass@k", "format_error_rate": "format_error_rate",
              "mean_turns": "num_turns", "mean_tokens": "num_tokens"}


class TrackersConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    wandb: bool = False
    wandb_project: str = "swerve"
    wandb_mode: Literal["offline", "online"] = "offline"
    """offline: files under the job's folder (`wandb sync` uploads them later)."""
    tensorboard: bool = False
    dir: Path | None = None
    """Where the trackers write; None: the job's folder."""

    @property
    def enabled(self) -> bool:
        return self.wandb or self.tensorboard


class TrackerUnavailable(RuntimeError):
    """A tracker's package is not installed; the message says what to install."""


def step_metrics(step: dict) -> dict[str, float]:
    return {name: float(step[k]) for k, name in STEP_NAMES.items() if step.get(k) is not None}


def eval_metrics(evaluation: dict, suite: str) -> dict[str, float]:
    out = {f"eval/{suite}/{name}": float(evaluation[k]) for k, name in EVAL_NAMES.items()
           if evaluation.get(k) is not None}
    if evaluation.get("pass_at_1_ci"):
        low, high = evaluation["pass_at_1_ci"]
        out |= {f"eval/{suite}/pass@1_ci_low": low, f"eval/{suite}/pass@1_ci_high": high}
    return out


class Trackers:
    """The job's open trackers. `log(training)`: the steps and evaluations not logged yet."""

    def __init__(self, cfg: TrackersConfig, folder: Path, name: str, run_id: str, config: dict):
        self.cfg, self.folder = cfg, (cfg.dir or folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.state_path = self.folder / "logged.json"
        state = json.loads(self.state_path.read_text()) if self.state_path.exists() else {}
        self.last_step: int = state.get("step", 0)
        self.evals: set[str] = set(state.get("evals", []))
        self.tb = self.wandb = None
        if cfg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise TrackerUnavailable("trackers.tensorboard: install tensorboard "
                                         "(pip install -e '.[trackers]')") from e
            self.tb = SummaryWriter(log_dir=str(self.folder / "tensorboard"))
        if cfg.wandb:
            try:
                import wandb
            except ImportError as e:
                raise TrackerUnavailable("trackers.wandb: install wandb (pip install -e '.[trackers]')") from e
            self.wandb = wandb.init(project=cfg.wandb_project, name=name, id=run_id.replace("-", "")[:32],
                                    resume="allow", mode=cfg.wandb_mode, dir=str(self.folder), config=config)
            self.wandb.define_metric("trainer/step")
            for prefix in ("reward", "loss", "mismatch_kl", "entropy", "optim", "off_policy", "filter", "progress",
                           "timing"):
                self.wandb.define_metric(f"{prefix}/*", step_metric="trainer/step")
            self.wandb.define_metric("eval/version")
            self.wandb.define_metric("eval/*", step_metric="eval/version")

    def log(self, training: dict, suites: dict) -> int:
        """Log what is new in a training run's view (service.control.views.training); `suites`
        names the evaluations' suites by id. Returns how many records were logged."""
        logged = 0
        for step in training.get("steps") or []:
            if step["version"] <= self.last_step:
                continue
            self._write(step_metrics(step), step["version"], "trainer/step")
            self.last_step, logged = step["version"], logged + 1
        for ev in training.get("evals") or []:
            key = str(ev["run_id"])
            if key in self.evals or ev["status"] != "finished":
                continue
            suite = suites.get(str(ev["suite_id"]), "eval")
            self._write(eval_metrics(ev, suite), ev["policy_version"], "eval/version")
            self.evals.add(key)
            logged += 1
        if logged:
            self.state_path.write_text(json.dumps({"step": self.last_step, "evals": sorted(self.evals)}))
        return logged

    def _write(self, metrics: dict[str, float], step: int, axis: str) -> None:
        if self.tb is not None:
            for name, value in metrics.items():
                self.tb.add_scalar(name, value, global_step=step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(metrics | {axis: step})

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
