"""RL again from a finished `swerve demo learn`'s SFT checkpoint with some RL settings changed, and
the held-out evaluation after it: an ablation on one checkpoint. Demos compare RL with SFT
within a run, but the SFT checkpoint of one seed differs from CPU to CPU (float reductions), so
two settings compare only from the same checkpoint, on the same machine.

The demo's folder ($SWERVE_DATA_DIR/demo-learn) is copied to --to without its RL job and the
models made after SFT; the demo then resumes there with the plan's fields changed by --set (rl_
fields only: the stages before RL are kept), runs RL under a job of its own name and evaluates
it, and stops before SFT continued (the original's row stands for it: it does not depend on the
RL settings, only on RL's wall time). The original folder is not touched.

    .venv/bin/python bench/demo_rl_variant.py --to var/demo-fw0 --set rl_format_weight=0.0

    .venv/bin/python bench/demo_rl_variant.py --to var/demo-repeat --set rl_seed=1000 --label repeat

(the second: RL again with the same settings, another seed: the run-to-run spread from one checkpoint).

With sft_ fields in --set, SFT is run again too, from the same pretrained model on the same
demonstrations (the folder is copied without SFT's checkpoints), and evaluated; --until SFT stops
there, before RL:

    .venv/bin/python bench/demo_rl_variant.py --to var/demo-decay --set sft_decay_steps=150 --until SFT

Prints the variant's rows (after SFT as the demo measured it, after RL with the variant, and its
last version when the validation split chose another) and the paired differences, and the
original's after-RL row beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
from dataclasses import asdict, fields, replace
from pathlib import Path

from rich.console import Console

from service import demo
from service.cli import _settings
from service.control.evaluation import paired_difference
from service.log import setup_logging

SKIP = ("rl", "models/rl", "models/rl-last", "models/sft-continued", "models/sft-continued-last", "results.json",
        "demo-learn.log")
SKIP_SFT = SKIP + ("sft", "models/sft", "sft.trainer.log", "sft.trainer.json", "sft-continued.trainer.log",
                   "sft-continued.trainer.json")
"""What is not copied when SFT runs again as well (sft.db, the demonstrations, is)."""


class _Stop(Exception):
    """Raised where the demo would start SFT continued (or RL, with --until SFT)."""


def _value(text: str, like):
    if isinstance(like, bool):
        if text not in ("true", "false"):
            raise SystemExit(f"--set: {text!r} must be true or false")
        return text == "true"
    if like is not None:
        return type(like)(text)
    return None if text == "none" else int(text) if text.lstrip("-").isdigit() else float(text)


def parse_sets(pairs: list[str], plan: demo.LearnPlan) -> dict:
    known = {f.name for f in fields(plan)}
    out = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or name not in known:
            raise SystemExit(f"--set {pair!r}: give FIELD=VALUE with FIELD one of LearnPlan's fields")
        if not name.startswith(("rl_", "sft_")):
            raise SystemExit(f"--set {name}: only the RL and SFT settings (rl_ and sft_ fields) can change")
        out[name] = _value(text, getattr(plan, name))
    return out


async def main(args) -> None:
    base = _settings()
    source = base.data_dir / "demo-learn"
    saved = json.loads((source / "results.json").read_text())
    if not saved.get("complete") and "evaluate after SFT" not in {s["name"] for s in saved["stages"]}:
        raise SystemExit(f"{source}: the demo there has not evaluated its SFT checkpoint yet")
    plan = demo.LearnPlan(seed=saved["plan"]["seed"])
    now = json.loads(json.dumps(asdict(plan)))
    ran = {k: saved["plan"].get(k, demo._AS_BEFORE.get(k, v)) for k, v in now.items()}  # a field it lacks: as before
    if ran != now or set(saved["plan"]) - set(now):
        raise SystemExit(f"{source}: that demo ran another plan than this code's default; run the variant from "
                         "the code that made it")
    changes = parse_sets(args.set, plan)
    variant = replace(plan, **changes)
    label = args.label or "-".join(f"{k.removeprefix('rl_')}{v}" for k, v in changes.items())
    sft = any(k.startswith("sft_") for k in changes)
    if args.until == "SFT" and not sft:
        raise SystemExit("--until SFT: give an sft_ field in --set (the SFT checkpoint is otherwise the demo's)")
    root = args.to.resolve()
    if root.exists():
        raise SystemExit(f"--to {root}: exists; give a new folder")
    skip = SKIP_SFT if sft else SKIP
    shutil.copytree(source, root, ignore=lambda folder, names: [
        n for n in names if str((Path(folder) / n).relative_to(source)) in skip])
    # RL (and SFT, with sft_ fields) and what follows start afresh there, whatever the settings (the same: a repeat)
    kept = demo.BEFORE_SFT if sft else [st["name"] for st in saved["stages"] if st["name"] not in demo.AFTER_RL]
    (root / "results.json").write_text(json.dumps(saved | {
        "stages": [st for st in saved["stages"] if st["name"] in kept], "chosen": {}, "rl_run_id": None,
        "rl_job": None, "complete": False, "evals": {k: v for k, v in saved["evals"].items()
                                                     if k in ("before SFT",) + (() if sft else ("after SFT",))}}))
    settings = base.model_copy(update={"data_dir": root, "models_dir": root / "models"})
    setup_logging(settings.log_format, level="INFO", path=root / "demo-learn.log")

    async def fresh_job(_settings, name: str) -> str:
        if args.until == "SFT":
            raise _Stop
        return f"{name}-{label}"

    def trainer(config: dict, database_url: str, log: Path) -> float:
        if config.get("time_limit_s"):  # SFT continued
            raise _Stop
        return trainer_before(config, database_url, log)

    demo._rl_job, trainer_before, demo._trainer = fresh_job, demo._trainer, trainer
    try:
        await demo.learn(settings, variant, Console(width=160), port=args.port, vllm_port=args.vllm_port,
                         screenshot=False)
    except _Stop:
        pass
    out = json.loads((root / "results.json").read_text())
    start = "the pretrained model and demonstrations" if sft else "the SFT checkpoint"
    print(f"\nvariant {label} ({', '.join(args.set)}) from {start} of {source}; folder {root}\n")
    print("| policy | held-out pass@1 (95% CI) | pass@k | format errors | held-out templates pass@1 | wall |")
    print("|---|---|---|---|---|---|")
    walls = {s["name"]: s["wall_s"] for s in out["stages"]}
    rows = [(f"after SFT ({label})", out["evals"]["after SFT"], walls.get("SFT")) if sft else
            ("after SFT", out["evals"]["after SFT"], None)]
    if sft:
        rows.append(("after SFT (the demo's)", saved["evals"]["after SFT"],
                     next((s["wall_s"] for s in saved["stages"] if s["name"] == "SFT"), None)))
    if "after RL" in out["evals"]:
        rows.append((f"after RL ({label})", out["evals"]["after RL"], walls.get("RL")))
    last = demo.LAST_ROWS["after RL"]
    if last in out["evals"]:
        rows.append((f"{last} ({label})", out["evals"][last], walls.get("RL")))
    if pick := (out.get("chosen") or {}).get("after RL"):
        print(f"\nafter RL ({label}): version {pick['version']} of {pick['last']}, chosen on the validation split: "
              + ", ".join(f"v{v} {p:.3f}" for v, p in pick["validation"]))
    if "after RL" in saved["evals"]:
        rows.append(("after RL (the demo's)", saved["evals"]["after RL"],
                     next((s["wall_s"] for s in saved["stages"] if s["name"] == "RL"), None)))
    for name, e, wall in rows:
        h, t = e["heldout"], e["heldout-templates"]
        lo, hi = h["pass_at_1_ci"]
        print(f"| {name} | {h['pass_at_1']:.3f} ({lo:.3f}-{hi:.3f}) | {h['pass_at_k']:.3f} | "
              f"{h['format_error_rate']:.3f} | {t['pass_at_1']:.3f} | {'-' if wall is None else f'{wall / 60:.1f} min'} |")
    solved = {name: e["heldout"]["solved"] for name, e, _ in rows}
    first = rows[0][0]
    for a, b in ((first, "after SFT (the demo's)"), (f"after RL ({label})", first),
                 (f"after RL ({label})", "after RL (the demo's)"),
                 (f"{last} ({label})", first), (f"after RL ({label})", f"{last} ({label})")):
        if a in solved and b in solved and (d := paired_difference(solved[b], solved[a])) is not None:
            print(f"paired {a} - {b}: {d['difference']:+.3f} ({d['ci'][0]:+.3f} to {d['ci'][1]:+.3f}), "
                  f"{d['better']} tasks better, {d['worse']} worse, of {d['tasks']}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--to", type=Path, required=True, help="A new folder for the variant's copy of the demo.")
    parser.add_argument("--set", nargs="+", required=True, metavar="FIELD=VALUE",
                        help="LearnPlan RL fields to change, e.g. rl_format_weight=0.0; rl_seed=N repeats RL with "
                             "the same settings as an independent run")
    parser.add_argument("--label", default=None, help="Suffix of the variant's RL job name (default: from --set).")
    parser.add_argument("--until", choices=("SFT", "RL"), default="RL",
                        help="Stop after the SFT checkpoint's evaluation (sft_ fields only) or after RL's (default).")
    parser.add_argument("--port", type=int, default=8031)
    parser.add_argument("--vllm-port", type=int, default=8131)
    asyncio.run(main(parser.parse_args()))
