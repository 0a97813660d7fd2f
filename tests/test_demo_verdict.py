"""The demo's verdict on issue 17's target, from the four evaluations' figures."""

from __future__ import annotations

from service.demo import target_verdict


def ev(p: float, lo: float, hi: float, fmt: float = 0.05) -> dict:
    return {"heldout": {"pass_at_1": p, "pass_at_1_ci": [lo, hi], "format_error_rate": fmt}}


def test_met_only_when_every_part_holds():
    good = {"before SFT": ev(0.0, 0.0, 0.01, 1.0), "after SFT": ev(0.25, 0.21, 0.29),
            "after RL": ev(0.36, 0.32, 0.40), "SFT continued": ev(0.27, 0.23, 0.31)}
    assert target_verdict(good).startswith("Target: met")
    overlapping = good | {"after RL": ev(0.31, 0.27, 0.35)}
    assert "missed: after RL >= after SFT + 0.05, intervals apart" in target_verdict(overlapping)
    beaten = good | {"SFT continued": ev(0.40, 0.36, 0.44)}
    assert "missed: after RL > SFT continued" in target_verdict(beaten)
    broken_format = good | {"after RL": ev(0.36, 0.32, 0.40, fmt=0.2)}
    assert "NOT met" in target_verdict(broken_format)
    assert target_verdict({"after SFT": good["after SFT"]}).startswith("Target: not checked yet")


def test_a_demo_resumes_only_the_same_unfinished_plan(tmp_path):
    """results.json of an unfinished demo with the same plan is taken up (a plan field added since
    counts at its default); another plan, or a finished demo, starts afresh."""
    import json
    from dataclasses import asdict, replace

    from service.demo import LearnPlan, _resumable

    path = tmp_path / "results.json"
    assert _resumable(path, LearnPlan()) is None
    saved = {"plan": asdict(LearnPlan()), "evals": {"before SFT": {}}, "stages": [], "wall_s": 5.0,
             "complete": False}
    path.write_text(json.dumps(saved))
    assert _resumable(path, LearnPlan())["evals"] == {"before SFT": {}}
    # other RL settings: the stages before RL stand, RL and what takes its wall time start afresh
    stages = [{"name": n, "wall_s": 2.0, "detail": {}} for n in ("generate", "SFT", "evaluate after SFT", "RL")]
    path.write_text(json.dumps(saved | {"stages": stages, "evals": {"after SFT": {}, "after RL": {}},
                                        "rl_job": "demo-learn-s0"}))
    kept = _resumable(path, replace(LearnPlan(), rl_lr=1e-5))
    assert [st["name"] for st in kept["stages"]] == ["generate", "SFT", "evaluate after SFT"]
    assert kept["evals"] == {"after SFT": {}} and kept["wall_s"] == 6.0 and kept["rl_job"] is None
    # another evaluation temperature: every checkpoint stands (the RL job's too), every evaluation again
    again = _resumable(path, replace(LearnPlan(), eval_temperature=0.25))
    assert [st["name"] for st in again["stages"]] == ["generate", "SFT", "RL"]
    assert again["evals"] == {} and again["rl_job"] == "demo-learn-s0" and again["wall_s"] == 6.0
    # other SFT settings: the tasks, the model, its evaluation and the demonstrations stand
    stages = [{"name": n, "wall_s": 2.0, "detail": {}} for n in ("generate", "model", "evaluate before SFT",
                                                                  "demonstrations", "SFT", "evaluate after SFT", "RL")]
    path.write_text(json.dumps(saved | {"stages": stages, "evals": {"before SFT": {}, "after SFT": {}, "after RL": {}},
                                        "rl_job": "demo-learn-s0", "chosen": {"after RL": {"version": 5}},
                                        "complete": True}))
    sft = _resumable(path, replace(LearnPlan(), sft_decay_steps=100, rl_lr=1e-5))
    assert [st["name"] for st in sft["stages"]] == ["generate", "model", "evaluate before SFT", "demonstrations"]
    assert sft["evals"] == {"before SFT": {}} and sft["chosen"] == {} and sft["rl_job"] is None
    assert sft["wall_s"] == 8.0
    path.write_text(json.dumps(saved))
    del saved["plan"]["train_names"]  # written before the field existed, when every train name came from the pools
    path.write_text(json.dumps(saved))
    pools = replace(LearnPlan(), train_names="pools")
    assert _resumable(path, pools)["evals"] == {"before SFT": {}}
    assert _resumable(path, LearnPlan()) is None  # generated names now: not what that demo ran
    assert _resumable(path, replace(pools, train_names="generated", sft_lr=1e-3)) is None  # other tasks: afresh
    path.write_text(json.dumps(saved | {"complete": True}))
    assert _resumable(path, pools) is None
    assert _resumable(path, replace(pools, eval_temperature=0.25))["evals"] == {}  # finished: re-evaluated


def test_a_demo_replaces_its_own_section_and_no_other(tmp_path):
    """A demo's section goes before the file's first (newest first), marked with the demo's id;
    written again (a later stage, a resumed demo) it replaces that section only: a hand-written
    section of another run, a demo section without a mark, the text around them stay byte for
    byte."""
    import json

    from service.demo import write_results

    out = json.loads(json.dumps({
        "plan": {"demos": 2, "n_heldout": 2, "eval_samples": 2, "n_heldout_templates": 1, "eval_templates_samples": 1,
                 "temperature": 1.0, "max_turns": 3, "max_tokens": 48},
        "machine": {"cores": 2, "cpu": "x"}, "wall_s": 60.0, "parameters": 1e6, "pretrain": None, "evals": {},
        "stages": [], "rl_run_id": None}))
    path = tmp_path / "RESULTS.md"
    before = "## demo learn (old)\n\nold figures\n\n## Copy probe\n\ntext\n"
    path.write_text("# Results\n\npreamble\n\n" + before)
    write_results(path, out | {"id": "a1"}, "swerve demo learn --seed 0")
    first = path.read_text()
    assert first.startswith("# Results\n\npreamble\n\n## demo learn (`swerve demo learn`)") and first.endswith(before)
    assert first.count("<!-- swerve demo learn a1 -->") == 1 and first.count("## demo learn") == 2
    assert "\n\n\n" not in first
    write_results(path, out | {"id": "a1", "wall_s": 120.0}, "swerve demo learn --seed 0")  # later: replaced
    again = path.read_text()
    assert "1.0 min in all" in first and again == first.replace("1.0 min in all", "2.0 min in all")
    assert again != first and again.count("## demo learn") == 2 and again.endswith(before)
    write_results(path, out | {"id": "b2"}, "swerve demo learn --seed 1")  # another demo: a section of its own
    third = path.read_text()
    assert third.count("## demo learn") == 3 and third.endswith(again.split("preamble\n\n", 1)[1])
    assert third.index("b2 -->") < third.index("a1 -->")
    bare = tmp_path / "BARE.md"  # a file that starts with its first section
    bare.write_text("## Copy probe\n\ntext\n")
    write_results(bare, out | {"id": "d4"}, "swerve demo learn --seed 0")
    assert bare.read_text().startswith("## demo learn") and bare.read_text().endswith("d4 -->\n\n## Copy probe\n\ntext\n")
    empty = tmp_path / "NEW.md"
    write_results(empty, out | {"id": "c3"}, "swerve demo learn --seed 0")
    assert empty.read_text().startswith("## demo learn") and empty.read_text().endswith("c3 -->\n")


def test_the_rl_job_samples_at_its_temperature_and_evaluates_at_the_evaluations(tmp_path):
    """The RL job's rollouts sample at rl_temperature, its evaluations every few steps at the
    final evaluations' eval_temperature; a demo saved when one `temperature` was both (1.0) and
    had no rl_temperature resumes as that."""
    import json
    from dataclasses import asdict, replace

    from service.demo import LearnPlan, _resumable, rl_config

    plan = replace(LearnPlan(), rl_temperature=0.7, eval_temperature=0.5, rl_format_weight=0.2, rl_normalize="batch")
    cfg = rl_config(plan, "job", tmp_path / "train.jsonl", [f"t{i}" for i in range(plan.demos + 8)],
                    tmp_path / "heldout.jsonl", ["h0", "h1"], tmp_path / "model", "http://127.0.0.1:1", 8030)
    assert cfg["rollouts"]["agent"]["sampling"]["temperature"] == 0.7
    assert cfg["eval"]["sampling"]["temperature"] == 0.5
    assert cfg["suite"]["instance_ids"] == [f"t{i}" for i in range(plan.demos, plan.demos + 8)]  # none demonstrated
    import uuid

    from service.rl import RLConfig, trainer_config

    trainer = trainer_config(RLConfig.model_validate(cfg), tmp_path, tmp_path, ["http://127.0.0.1:1"], uuid.uuid4())
    assert trainer["data"]["format_weight"] == plan.rl_format_weight > 0  # the trainer's own check took it
    assert trainer["loss"]["normalize"] == "batch"
    old = asdict(LearnPlan()) | {"temperature": 1.0}
    del old["rl_temperature"]
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"plan": old, "evals": {}, "stages": [], "wall_s": 1.0, "complete": False}))
    assert _resumable(path, replace(LearnPlan(), rl_temperature=1.0)) is not None
    kept = _resumable(path, LearnPlan())  # only an RL setting differs: the stages before RL stand
    assert kept is not None and kept["rl_job"] is None


def test_the_section_compares_the_policies_task_by_task():
    """With each evaluation's per-task solved fractions, the section adds the paired differences:
    RL against SFT and against SFT continued, on the tasks both evaluated."""
    from service.demo import paired_rows, results_section

    def row(solved: dict) -> dict:
        p = sum(solved.values()) / len(solved)
        held = {"pass_at_1": p, "pass_at_1_ci": [p - 0.1, p + 0.1], "pass_at_k": p, "format_error_rate": 0.1,
                "mean_turns": 3.0, "solved": solved}
        return {"heldout": held, "heldout-templates": {"pass_at_1": 0.0}}

    sft = {f"t{i}": (i % 4) / 4 for i in range(32)}
    rl = {t: v + 0.25 if v < 0.75 else v for t, v in sft.items()}  # 24 tasks better, 8 the same
    evals = {"after SFT": row(sft), "after RL": row(rl), "SFT continued": row(sft)}
    names = [name for name, _ in paired_rows(evals)]
    assert names == ["after RL - after SFT", "after RL - SFT continued", "SFT continued - after SFT"]
    out = {"plan": {"demos": 2, "n_heldout": 32, "eval_samples": 4, "n_heldout_templates": 1,
                    "eval_templates_samples": 1, "max_turns": 3, "max_tokens": 48},
           "machine": {"cores": 2, "cpu": "x"}, "wall_s": 60.0, "parameters": 1e6, "pretrain": None,
           "evals": evals, "stages": [], "rl_run_id": None}
    text = results_section(out, "swerve demo learn")
    gain = sum(rl.values()) / 32 - sum(sft.values()) / 32
    assert f"| after RL - after SFT | {gain:+.3f} (" in text and "| 24 / 0 / 8 |" in text
    assert "| SFT continued - after SFT | +0.000 (+0.000 to +0.000) | 0 / 0 / 32 |" in text
    del evals["after SFT"]["heldout"]["solved"]  # a demo made before per-task figures: no paired rows for it
    assert [name for name, _ in paired_rows(evals)] == ["after RL - SFT continued"]


def test_the_section_names_the_training_runs_screenshot():
    from service.demo import results_section

    held = {"pass_at_1": 0.3, "pass_at_1_ci": [0.2, 0.4], "pass_at_k": 0.4, "format_error_rate": 0.1, "mean_turns": 3.0}
    out = {"plan": {"demos": 2, "n_heldout": 32, "eval_samples": 4, "n_heldout_templates": 1,
                    "eval_templates_samples": 1, "max_turns": 3, "max_tokens": 48},
           "machine": {"cores": 2, "cpu": "x"}, "wall_s": 60.0, "parameters": 1e6, "pretrain": None,
           "evals": {"after SFT": {"heldout": held, "heldout-templates": {"pass_at_1": 0.0}}}, "stages": [],
           "rl_run_id": "4920b79a-e61d-4dc3-9af1-031323323ed5", "complete": True,
           "screenshot": "/data/screenshots/demo-learn-4920b79a-e61d-4dc3-9af1-031323323ed5.png"}
    text = results_section(out, "swerve demo learn")
    assert "over the steps (screenshot: screenshots/demo-learn-4920b79a-e61d-4dc3-9af1-031323323ed5.png)." in text
    out["screenshot"] = None  # no browser where it ran: the run is still named, no screenshot claimed
    assert "(4920b79a-e61d-4dc3-9af1-031323323ed5) stays in the demo's database" in results_section(out, "x")
    assert "screenshot" not in results_section(out, "x")


def test_the_trained_rows_are_the_versions_the_validation_split_chose(tmp_path):
    """LearnPlan.select: the best validation pass@1 (ties: the later version) among the run's
    evaluated versions; SFT continued's candidates spread evenly from its start to its last; the
    RL job evaluates on the validation split, none of whose tasks the table holds; the section
    names the chosen versions and adds each run's last version as its own row."""
    import json
    from dataclasses import asdict, replace

    from service.demo import LearnPlan, _resumable, choose, paired_rows, results_section, rl_config, spread

    assert choose([[0, 0.5], [5, 0.6], [10, 0.6], [15, 0.4]]) == 10
    assert choose([[0, 0.7], [5, 0.6]]) == 0  # RL that only lost: its start, the SFT checkpoint
    assert spread(450, 1350, 9) == [450, 562, 675, 788, 900, 1012, 1125, 1238, 1350]
    assert spread(450, 452, 9) == [450, 451, 452] and spread(450, 450, 9) == [450] and spread(2, 7, 1) == [7]
    plan = LearnPlan()
    cfg = rl_config(plan, "job", tmp_path / "train.jsonl", [f"t{i}" for i in range(plan.demos + 8)],
                    tmp_path / "heldout.jsonl", [f"h{i}" for i in range(64)], tmp_path / "model",
                    "http://127.0.0.1:1", 8030, tmp_path / "validation.jsonl", ["v0", "v1"])
    assert (cfg["eval"]["path"], cfg["eval"]["instance_ids"]) == (str(tmp_path / "validation.jsonl"), ["v0", "v1"])
    old = rl_config(plan, "job", tmp_path / "train.jsonl", [f"t{i}" for i in range(plan.demos + 8)],
                    tmp_path / "heldout.jsonl", [f"h{i}" for i in range(64)], tmp_path / "model",
                    "http://127.0.0.1:1", 8030)
    assert old["eval"]["instance_ids"] == [f"h{i}" for i in range(plan.rl_eval_tasks)]
    assert old["job"]["seed"] == plan.seed  # rl_seed: another RL run from the same checkpoint
    assert rl_config(replace(plan, rl_seed=7), "job", tmp_path / "t.jsonl", ["t"], tmp_path / "h.jsonl", ["h"],
                     tmp_path / "model", "http://127.0.0.1:1", 8030)["job"]["seed"] == 7

    def row(p: float) -> dict:
        solved = {f"t{i}": p for i in range(4)}
        held = {"pass_at_1": p, "pass_at_1_ci": [p - 0.1, p + 0.1], "pass_at_k": p, "format_error_rate": 0.1,
                "mean_turns": 3.0, "solved": solved}
        return {"heldout": held, "heldout-templates": {"pass_at_1": 0.0}}

    evals = {"after SFT": row(0.25), "after RL": row(0.5), "RL, last version": row(0.25), "SFT continued": row(0.25)}
    chosen = {"after RL": {"version": 25, "last": 40, "validation": [[0, 0.5], [25, 0.625], [40, 0.5]]},
              "SFT continued": {"version": 40, "last": 40, "validation": [[0, 0.5], [40, 0.55]]}}
    out = {"plan": asdict(plan), "machine": {"cores": 2, "cpu": "x"}, "wall_s": 60.0, "parameters": 1e6,
           "pretrain": None, "evals": evals, "chosen": chosen, "stages": [{"name": "RL", "wall_s": 600.0}],
           "rl_run_id": None}
    text = results_section(out, "swerve demo learn")
    assert "| RL, last version | 0.250 (0.150-0.350) |" in text and "| 10.0 min |" in text
    assert (f"after RL: version 25 of the run's 40, chosen on the validation split ({plan.n_validation} held-out-name "
            f"tasks x {plan.rl_eval_samples}, "
            "none of the table's; pass@1 v0 0.500, v25 0.625, v40 0.500); its last version is the row "
            "\"RL, last version\".") in text
    assert "SFT continued: version 40 of the run's 40, chosen" in text
    assert [n for n, _ in paired_rows(evals)][-1] == "RL, last version - after SFT"
    # a resumed demo with other RL settings chooses again; one with other evaluation settings too
    path = tmp_path / "results.json"
    stages = [{"name": n, "wall_s": 2.0, "detail": {}}
              for n in ("generate", "SFT", "RL", "evaluate after RL", "validate SFT continued")]
    path.write_text(json.dumps(out | {"stages": stages, "complete": False}))
    assert _resumable(path, plan)["chosen"] == chosen
    assert _resumable(path, replace(plan, rl_lr=1e-5))["chosen"] == {}
    again = _resumable(path, replace(plan, eval_temperature=0.25))
    assert again["chosen"] == {} and [st["name"] for st in again["stages"]] == ["generate", "SFT", "RL"]
    # a demo saved before the split existed ran without it: its plan is another one
    del out["plan"]["n_validation"], out["plan"]["select"]
    path.write_text(json.dumps(out | {"stages": stages, "complete": False}))
    assert _resumable(path, plan) is None
    assert _resumable(path, replace(plan, n_validation=0, select=False)) is not None
