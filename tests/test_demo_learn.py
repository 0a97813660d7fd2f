"""`swerve demo learn --quick`: every stage of the learning demo end to end on real parts (a
vLLM CPU server, bubblewrap sandboxes, the in-process worker, the trainer's processes, the RL
job), a few steps on a few tasks. It checks the pipeline, not the learning: the full demo is
a benchmark (bench/RESULTS.md)."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import clean_env, require_torchtitan
from tests.servers import free_port

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
require_torchtitan()
REPO = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(1500)  # a vLLM server of its own starts beside the session's (minutes on a busy machine)
def test_demo_learn_quick_runs_every_stage(tmp_path):
    from service.fleet.server import vllm_python
    from tests.conftest import missing_service

    if not os.path.exists(vllm_python()):
        missing_service(f"vLLM at {vllm_python()} (make vllm)")
    results = tmp_path / "RESULTS.md"
    results.write_text("# Results\n\n## other\n\nkept\n")
    env = clean_env() | {"SWERVE_DATA_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "service.cli", "demo", "learn", "--quick", "--seed", "3",
                           f"--results={results}", f"--port={free_port()}", f"--vllm-port={free_port()}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    root = tmp_path / "demo-learn"
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    out = json.loads((root / "results.json").read_text())
    stages = [s["name"] for s in out["stages"]]
    # the trained rows are the versions the validation split chose; a run's last version, when
    # another, is evaluated as its own row
    rl_pick, cont_pick = out["chosen"]["after RL"], out["chosen"]["SFT continued"]
    assert [v for v, _ in rl_pick["validation"]] == [0, 1, 2] and rl_pick["last"] == 2
    assert rl_pick["version"] == max(rl_pick["validation"], key=lambda vp: (vp[1], vp[0]))[0]
    assert cont_pick["last"] > 2 and cont_pick["validation"][0][0] == 2 and cont_pick["validation"][-1][0] == cont_pick["last"]
    assert len(cont_pick["validation"]) == 3 and cont_pick["version"] in [v for v, _ in cont_pick["validation"]]
    rl_last, cont_last = rl_pick["version"] != 2, cont_pick["version"] != cont_pick["last"]
    assert stages == ["generate", "model", "evaluate before SFT", "demonstrations", "SFT", "evaluate after SFT",
                      "RL", "evaluate after RL"] + ["evaluate RL, last version"] * rl_last + [
                      "SFT continued", "validate SFT continued", "evaluate SFT continued"] + [
                      "evaluate SFT continued, last version"] * cont_last
    assert out["stages"][0]["detail"] == {"train": 4, "heldout": 2, "heldout-templates": 2, "validation": 2}
    validation = [json.loads(line) for line in (root / "suites" / "pyfix-validation-s3.jsonl").read_text().splitlines()]
    heldout = [json.loads(line) for line in (root / "suites" / "pyfix-heldout-s3.jsonl").read_text().splitlines()]
    assert len(validation) == 2 and not {r["instance_id"] for r in validation} & {r["instance_id"] for r in heldout}
    assert out["stages"][3]["detail"] == {"episodes": 2}  # both demonstrations solved their tasks
    # the policy started from the pretrained model (a few steps here), tied and soft-normed
    assert 0.0 <= out["stages"][1]["detail"]["copy_accuracy"] <= 1.0
    assert out["pretrain"]["spec"]["copy_steps"] == 2 and out["pretrain"]["tokens"] > 0
    [pretrained] = (root / "models").glob("pretrained-s3-*")
    assert json.loads((pretrained / "config.json").read_text())["tie_word_embeddings"] is True
    assert out["stages"][stages.index("SFT continued")]["detail"]["steps"] >= 1  # SFT went on for RL's wall time
    rows = ["before SFT", "after SFT", "after RL", "SFT continued"] + ["RL, last version"] * rl_last + [
        "SFT continued, last version"] * cont_last
    assert sorted(out["evals"]) == sorted(rows)
    for row in rows:
        held, templ = out["evals"][row]["heldout"], out["evals"][row]["heldout-templates"]
        assert (held["tasks"], held["samples"], held["final"]) == (2, 4, 4), held
        assert (templ["tasks"], templ["samples"]) == (2, 2), templ
        assert 0.0 <= held["pass_at_1"] <= 1.0 and held["pass_at_1_ci"] is not None
        # each task's solved fraction, for the paired comparisons: their mean is pass@1
        assert len(held["solved"]) == 2 and sum(held["solved"].values()) / 2 == pytest.approx(held["pass_at_1"])
    # the section went into the results file, next to what was there
    text = results.read_text()
    assert "## other\n\nkept" in text and "## demo learn" in text and "swerve demo learn --quick --seed 3" in text
    assert text.count(f"<!-- swerve demo learn {out['id']} -->") == 1  # its own, replaced at each stage
    for row in ("| before SFT |", "| after SFT |", "| after RL |", "| SFT continued |", "| after RL - after SFT |",
                "| after RL - SFT continued |"):
        assert row in text
    # the RL job's training run stays in the demo's database, with its versions and evaluations
    conn = sqlite3.connect(root / "swerve.db")
    kind, status = conn.execute("select kind, status from runs where id = ?",
                                (out["rl_run_id"].replace("-", ""),)).fetchone()
    assert (kind, status) == ("train", "finished")
    versions = [v for (v,) in conn.execute("select version from policies order by version")]
    assert versions == [0, 1, 2]
    evals = conn.execute("select policy_version, status, config from runs where kind = 'eval' and parent_id = ? "
                         "order by policy_version", (out["rl_run_id"].replace("-", ""),)).fetchall()
    assert [v for v, s, _ in evals if s == "finished"] == [0, 1, 2]
    assert {tuple(sorted(json.loads(c)["instance_ids"])) for _, _, c in evals} == {
        tuple(sorted(r["instance_id"] for r in validation))}  # the RL job evaluated on the validation split
    one_pass = conn.execute("select count(*) from runs where kind = 'sample' and status = 'finished'").fetchone()[0]
    assert one_pass == 2 * len(rows) + 3  # each row x two held-out splits, SFT continued's versions on the validation
    # the SFT trainer kept its own database: the demonstrations and its versions
    sft = sqlite3.connect(root / "sft.db")
    assert sft.execute("select count(*) from runs").fetchone()[0] == 1
    assert sft.execute("select max(version) from policies").fetchone()[0] > 2
    assert Path(out["screenshot"]).stat().st_size > 10_000
