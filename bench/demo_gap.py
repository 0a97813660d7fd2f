"""Why a `swerve demo learn` policy solves train tasks far more often than held-out ones: one of
its checkpoints evaluated on splits that differ from each other in one thing, every episode's
failure classified, pass@1 per bug template.

The splits (all of family pyfix, the demo's difficulty):
- train-gen: the demo's own train tasks that no demonstration showed (made-up names, the
  train split's constants): what the RL job trains on;
- train-pools: new train tasks named from the train split's pools (dictionary words SFT never
  saw: its demonstrations were all made-up names), the train split's constants;
- heldout: the demo's held-out split (the held-out pools of names and constants).
train-gen against train-pools isolates the kind of name; train-pools against heldout, the pools
themselves and the constants.

An episode's outcome, from its tool calls against the gold fix (the demonstrated edit):
solved; no edit (no str_replace call, or only malformed turns); edit refused (the environment
answered an error, e.g. old_str not found); right line, wrong fix (old_str is the gold line,
new_str is not the gold one); other line (old_str is not the gold line); gold edit unsolved.

    .venv/bin/python bench/demo_gap.py --demo var/demo-learn [--model var/demo-learn/models/sft]
        [--tasks 64] [--samples 4] [--temperature 0.5] [--out var/demo-gap]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import sqlalchemy as sa  # noqa: E402
from rich.console import Console  # noqa: E402

from envs.families import HELDOUT_TEMPLATES, TEMPLATES, demo_calls, generate  # noqa: E402
from service.config import load_settings  # noqa: E402
from service.demo import FAMILY, LearnPlan, one_pass  # noqa: E402
from service.embedded import start_vllm  # noqa: E402
from service.store import db  # noqa: E402
from service.store.tables import Episode, Task, Turn  # noqa: E402

OUTCOMES = ("solved", "no edit", "edit refused", "right line, wrong fix", "other line", "gold edit unsolved")


def _template_patterns() -> list[tuple[str, re.Pattern]]:
    """A regex per template matching its fixed text (a line or a part of one), with any names
    and constant; the longest first, so a pattern inside another's line does not take it."""
    out = []
    for t in TEMPLATES + HELDOUT_TEMPLATES:
        parts = re.split(r"(\{\w+\})", t.fixed)
        rx = "".join(r"\w+" if p.startswith("{") and p != "{K}" else r".+?" if p == "{K}" else re.escape(p)
                     for p in parts)
        out.append((t.name, re.compile(rx)))
    return sorted(out, key=lambda p: -len(p[1].pattern))


PATTERNS = _template_patterns()


def template_of(row: dict) -> str:
    new = demo_calls(row)[1]["arguments"]["new_str"]
    return next((name for name, rx in PATTERNS if rx.search(new)), "?")


def outcome(reward: float | None, turns: list[tuple[dict | None, str | None]], gold: dict) -> str:
    if reward is not None and reward >= 1.0:
        return "solved"
    edits = [(call, obs) for call, obs in turns
             if call and call.get("name") == "str_replace_editor"
             and (call.get("arguments") or {}).get("command") == "str_replace"]
    if not edits:
        return "no edit"
    call, obs = edits[-1]
    args = call.get("arguments") or {}
    if obs and re.search(r"\b(error|did not appear|not found|no replacement)\b", obs, re.I):
        return "edit refused"
    if (args.get("old_str") or "").strip() != gold["old_str"].strip():
        return "other line"
    if (args.get("new_str") or "").strip() != gold["new_str"].strip():
        return "right line, wrong fix"
    return "gold edit unsolved"


async def classify(settings, run_id, rows: dict[str, dict]) -> list[dict]:
    engine = db.make_async_engine(settings.resolved_database_url)
    try:
        async with engine.connect() as conn:
            episodes = (await conn.execute(sa.select(Episode.id, Task.instance_id, Episode.reward)
                                           .join(Task, Task.id == Episode.task_id)
                                           .where(Episode.run_id == run_id))).all()
            turns = defaultdict(list)
            for eid, call, obs in (await conn.execute(
                    sa.select(Turn.episode_id, Turn.tool_call, Turn.observation).join(Episode, Episode.id == Turn.episode_id)
                    .where(Episode.run_id == run_id).order_by(Turn.episode_id, Turn.idx))).all():
                turns[eid].append((call, obs))
    finally:
        await engine.dispose()
    out = []
    for eid, iid, reward in episodes:
        row = rows[iid]
        gold = demo_calls(row)[1]["arguments"]
        out.append({"task": iid, "template": template_of(row), "reward": reward,
                    "outcome": outcome(reward, turns[eid], gold)})
    return out


def table(results: dict[str, list[dict]]) -> str:
    splits = list(results)
    lines = ["| split | pass@1 | " + " | ".join(OUTCOMES[1:]) + " |", "|---" * (len(OUTCOMES) + 1) + "|"]
    for s in splits:
        eps = results[s]
        c = Counter(e["outcome"] for e in eps)
        lines.append(f"| {s} | {c['solved'] / len(eps):.3f} | "
                     + " | ".join(f"{c[o] / len(eps):.3f}" for o in OUTCOMES[1:]) + " |")
    templates = sorted({e["template"] for eps in results.values() for e in eps})
    lines += ["", "pass@1 by template (episodes):", "",
              "| template | " + " | ".join(splits) + " |", "|---" * (len(splits) + 1) + "|"]
    for t in templates:
        cells = []
        for s in splits:
            eps = [e for e in results[s] if e["template"] == t]
            cells.append(f"{sum(e['outcome'] == 'solved' for e in eps) / len(eps):.2f} ({len(eps)})" if eps else "-")
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


async def main(args) -> None:
    demo = args.demo.resolve()
    results_json = json.loads((demo / "results.json").read_text())
    plan = LearnPlan(seed=results_json["plan"]["seed"])
    seed = plan.seed
    model = (args.model or demo / "models" / "sft").resolve()
    base = next((demo / "models").glob(f"pretrained-s{seed}-*"))
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    # the demo's folder (its bundles, task images and models), this script's own database
    settings = load_settings(data_dir=demo, database_url=f"sqlite:///{out / 'gap.db'}")
    db.upgrade(settings.resolved_database_url)
    console = Console()

    suites = demo / "suites"
    train = [json.loads(line) for line in (suites / f"{FAMILY}-train-s{seed}.jsonl").read_text().splitlines()]
    train_gen = train[plan.demos:plan.demos + args.tasks]
    (out / "train-gen.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train_gen))
    pools_path = out / "train-pools.jsonl"
    pools = (json.loads(line) for line in pools_path.read_text().splitlines()) if pools_path.exists() else \
        generate(FAMILY, args.tasks, seed + 1000, "train", pools_path, bundles_dir=demo / "bundles",
                 distractors=plan.distractors, names="pools")
    heldout = [json.loads(line) for line in (suites / f"{FAMILY}-heldout-s{seed}.jsonl").read_text().splitlines()]
    splits = {"train-gen": (out / "train-gen.jsonl", train_gen), "train-pools": (pools_path, list(pools)),
              "heldout": (suites / f"{FAMILY}-heldout-s{seed}.jsonl", heldout[:args.tasks])}

    vllm = start_vllm(settings, model, args.vllm_port, console, max_model_len=plan.max_model_len, die_with_parent=True)
    results = {}
    try:
        sampler = {"type": "vllm", "endpoints": [vllm.url], "tokenizer": str(base)}
        for name, (path, rows) in splits.items():
            run_id, summary = await one_pass(settings, path, f"demo-gap {model.name}: {name}", sampler, args.samples,
                                             plan, args.port, console, instance_ids=[r["instance_id"] for r in rows],
                                             temperature=args.temperature)
            results[name] = await classify(settings, run_id, {r["instance_id"]: r for r in rows})
            console.print(f"{name}: pass@1 {summary['pass_at_1']:.3f}, format errors {summary['format_error_rate']:.3f}")
    finally:
        vllm.stop()
    (out / "episodes.json").write_text(json.dumps(results, indent=1))
    text = table(results)
    (out / "gap.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--demo", type=Path, default=Path("var/demo-learn"))
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--tasks", type=int, default=64)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--temperature", type=float, default=0.5)
    p.add_argument("--out", type=Path, default=Path("var/demo-gap"))
    p.add_argument("--port", type=int, default=8032)
    p.add_argument("--vllm-port", type=int, default=8132)
    asyncio.run(main(p.parse_args()))
