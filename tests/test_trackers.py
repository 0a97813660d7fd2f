"""The RL job's metrics in TensorBoard and Weights & Biases (offline): each step and each
finished evaluation logged once under the field's names, a resumed job logging only what is new."""

from __future__ import annotations

import uuid

import pytest

from service.trackers import Trackers, TrackersConfig

SUITE = str(uuid.uuid4())


def view(steps: int, evals: dict[int, str]) -> dict:
    return {"steps": [{"version": v, "reward_mean": v / 10, "mismatch_kl": 1e-3 * v, "staleness_mean": 0.5,
                       "useful_fraction": 0.5, "filtered": v, "wait_s": 2.0, "step_s": 1.0, "publish_s": 0.5}
                      for v in range(1, steps + 1)],
            "evals": [{"run_id": f"run-{v}", "policy_version": v, "status": status, "suite_id": SUITE,
                       "pass_at_1": 0.25 * v, "pass_at_1_ci": (0.1, 0.6), "pass_at_k": 0.5, "format_error_rate": 0.1,
                       "mean_turns": 3.0, "mean_tokens": 100.0} for v, status in evals.items()]}


def scalars(folder) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder / "tensorboard"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_gets_each_step_and_finished_evaluation_once(tmp_path):
    import tensorboard  # noqa: F401 - installed with the trackers extra (make install)
    cfg = TrackersConfig(tensorboard=True)
    trackers = Trackers(cfg, tmp_path, "job", str(uuid.uuid4()), {})
    assert trackers.log(view(2, {0: "finished", 2: "running"}), {SUITE: "heldout"}) == 3
    assert trackers.log(view(2, {0: "finished", 2: "running"}), {SUITE: "heldout"}) == 0
    trackers.close()
    resumed = Trackers(cfg, tmp_path, "job", str(uuid.uuid4()), {})  # the job restarted: only what is new
    assert resumed.log(view(3, {0: "finished", 2: "finished"}), {SUITE: "heldout"}) == 2
    resumed.close()
    got = scalars(tmp_path)
    assert got["reward/mean"] == [(1, pytest.approx(0.1)), (2, pytest.approx(0.2)), (3, pytest.approx(0.3))]
    assert [s for s, _ in got["timing/wait_for_rollouts"]] == [1, 2, 3]
    assert got["eval/heldout/pass@1"] == [(0, 0.0), (2, 0.5)]
    assert {"off_policy/mean", "filter/skipped", "filter/useful_fraction", "mismatch_kl/mean", "timing/train",
            "timing/publish", "eval/heldout/pass@k", "eval/heldout/format_error_rate",
            "eval/heldout/pass@1_ci_low"} <= set(got)


def test_wandb_offline_writes_a_run_that_sync_can_upload(tmp_path, monkeypatch):
    import wandb  # noqa: F401 - installed with the trackers extra (make install)
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    run_id = str(uuid.uuid4())
    trackers = Trackers(TrackersConfig(wandb=True, wandb_mode="offline"), tmp_path, "job", run_id, {"job": {"steps": 2}})
    assert trackers.log(view(2, {0: "finished"}), {SUITE: "heldout"}) == 3
    trackers.close()
    runs = list((tmp_path / "wandb").glob(f"offline-run-*-{run_id.replace('-', '')[:32]}"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb")), list((tmp_path / "wandb").iterdir())


def test_a_missing_package_is_named(tmp_path, monkeypatch):
    import builtins

    real = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError("no wandb")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    from service.trackers import TrackerUnavailable

    with pytest.raises(TrackerUnavailable, match=r"trackers.wandb: install wandb"):
        Trackers(TrackersConfig(wandb=True), tmp_path, "job", "x", {})
