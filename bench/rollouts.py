"""Rollout service throughput: N concurrent episodes of a scripted sampler that waits a simulated
model latency per turn, on this machine, through the real path (orchestrator -> Redis -> one
`swerve worker` process -> bubblewrap sandboxes -> PostgreSQL, graded by the task's tests).

For each concurrency (64 -> 512 by default) one run of that many episodes of the example suite:
wall time, episodes/s, turns/s, the worker process's own CPU per turn (the service's own cost:
agent loop, Celery, database writes, sandbox and grading management, all its threads; not the
processes it starts), the CPU of the processes it started and reaped (the sandboxes' commands
and pytest grading), CPU per episode of the whole machine (PostgreSQL included), and the mean
turn overhead beyond model latency and tool time.

Every row is the worker's steady state: --warmup episodes (20) run first, not counted, behind which lie
the worker's start-up, its imports and the tokenizer's first load (about 2.5 s of CPU, which a lone
128 row counted as 1.6 ms a turn on 2026-12-07).

With --profile FOLDER the worker is sampled by py-spy (--rate, 100 Hz) during the last concurrency: a flame
graph (worker.svg), the collapsed stacks (worker.txt), and the worker's CPU split into phases
(a sample under envs/swe_env.grade is grading: its sandbox, patch and test run; any other goes to
the innermost frame that names one: sandbox, database, Celery, agent loop with tokenizer and chat
template; else, in asyncio's frames alone, the event loop's scheduling and polling; else other), and the CPU per turn without grading, which the issue's target leaves out. py-spy samples the thread holding the
GIL (--gil): by default it counts every thread it finds runnable, and a thread blocked in a
pipe write or waitpid without the GIL drew most samples while using little CPU (2026-12-04).

With --sampler stub the model is an HTTP stand-in for vLLM in a process of its own
(service/fleet/stub.py, answering the same calls after the same latency, and echoing the prompt's
ids as vLLM does), reached through the fleet client as a real fleet is: the worker's CPU then
includes each turn's request (its body, the prompt's JSON, the answer's parse), which the
default in-process replay sampler leaves out.

With --also-turns N the last concurrency runs again with N tool calls an episode, and the worker's CPU an episode
is split in two from the pair: what an episode costs whatever its length, and what each further turn adds.

    .venv/bin/python bench/rollouts.py [--concurrency 64 128 256 512] [--turns 10] [--latency 1.0]
                                       [--profile bench/profiles] [--warmup 20] [--also-turns 40]
                                       [--sampler replay|stub]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402
import redis  # noqa: E402
import sqlalchemy as sa  # noqa: E402

from service.store import db  # noqa: E402
from service.worker.app import episode_sender, make_celery  # noqa: E402
from service.config import load_settings  # noqa: E402
from service.control.orchestrator import Supervisor  # noqa: E402
from service.control.runs import create_run  # noqa: E402
from service.worker.config import RunConfig  # noqa: E402
from service.control.suites import file_chunks, import_suite, parser_for_file  # noqa: E402
from service.store.tables import Episode, Run, Turn  # noqa: E402
from service.fleet import stub  # noqa: E402
from service.fleet.tiny_model import init_tiny  # noqa: E402
from tests.servers import free_port  # noqa: E402

SUITE = ROOT / "envs" / "example_suite" / "suite.jsonl"
PG_ADMIN = os.environ.get("SWERVE_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
BROKER = os.environ.get("SWERVE_BENCH_REDIS_URL", "redis://127.0.0.1:6379/13")


def tree_cpu(proc: psutil.Process) -> tuple[float, float]:
    """CPU seconds of the process itself (all its threads), and of the children it reaped (the
    sandboxes' processes, grading)."""
    own = proc.cpu_times()
    return own.user + own.system, own.children_user + own.children_system


# innermost frame first: a psycopg call made by the agent loop is database time. Grading first of
# all, by an outer frame: its sandbox, patch and test run are grading, not the episode's sandbox
GRADING = "grade (envs/swe_env.py"
PHASES = [("sandbox", ("sandboxes/",)), ("grading", ("grading", "envs/harness", "log_parsers")),
          ("database", ("sqlalchemy/", "psycopg", "service/store/", "asyncpg")),
          ("Celery", ("celery/", "kombu/", "billiard/", "redis/", "amqp/")),
          # the fleet client's request (--sampler stub), apart from its tokenizer helpers in the same module
          ("inference request", ("aiohttp/", "yarl/", "multidict/", "generate (service/fleet/client.py",
                                 "_complete (service/fleet/client.py", "json_items (service/fleet/client.py",
                                 "_drop_prompt_echo (service/fleet/client.py")),
          ("agent loop", ("service/worker/", "envs/", "transformers/", "tokenizers/", "jinja2/", "service/fleet/"))]


# the worker's event loop thread (service/worker/runtime.py), and asyncio's own frames: a sample in
# nothing but these is the loop's scheduling and polling (before 2026-12-07 it counted as agent loop);
# under uvloop the loop is C code, and such a sample ends in the thread's function itself
LOOP_THREAD = "EpisodeRuntime._main"
EVENT_LOOP = ("asyncio/", "selectors.py")


def phase_split(collapsed: Path) -> dict[str, float]:
    """Fractions of the worker's sampled CPU per phase, from py-spy's collapsed stacks."""
    counts: dict[str, float] = {name: 0.0 for name, _ in PHASES} | {"event loop": 0.0, "other": 0.0}
    for line in collapsed.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack:
            continue
        frames = stack.split(";")
        if any(GRADING in frame for frame in frames):
            phase = "grading"
        elif LOOP_THREAD in frames[-1]:  # uvloop's run_forever, in C: its polling and scheduling
            phase = "event loop"
        else:  # the loop's own thread function is no phase: a sample in the loop itself is the event loop's
            phase = next((name for frame in reversed(frames) if LOOP_THREAD not in frame for name, marks in PHASES
                          if any(m in frame for m in marks)), None)
            phase = phase or ("event loop" if any(m in f for f in frames for m in EVENT_LOOP) else "other")
        counts[phase] += float(n)
    total = sum(counts.values()) or 1.0
    return {k: v / total for k, v in counts.items()}


def machine_cpu() -> float:
    t = psutil.cpu_times()
    return t.user + t.system + t.nice + getattr(t, "irq", 0) + getattr(t, "softirq", 0)


CALL = {"name": "bash", "arguments": {"command": "head -c 1000 README.md 2>/dev/null || ls"}}


@contextlib.contextmanager
def stub_fleet(tokenizer: Path, turns: int, latency: float):
    """An HTTP stand-in for vLLM in its own process, answering `turns` times CALL and then a
    submit, each after `latency`; yields its URL."""
    from transformers import AutoTokenizer

    from service.fleet.client import text_encoder
    from service.worker.scripted import tool_call_text

    tok = AutoTokenizer.from_pretrained(str(tokenizer))
    encode, eos = text_encoder(tok), tok.convert_tokens_to_ids("<|im_end|>")
    script = [[*encode(tool_call_text(CALL["name"], CALL["arguments"])), eos]] * turns
    script.append([*encode(tool_call_text("submit", {})), eos])
    kwargs = {"model": "stub", "max_model_len": 1 << 20, "script": script,
              "turn_token": tok.convert_tokens_to_ids("<tool_response>"), "latency_s": latency}
    with stub.in_process(free_port(), **kwargs) as url:
        yield url


async def one(engine, supervisor: Supervisor, suite_id: uuid.UUID, tokenizer: Path, n: int, turns: int,
              latency: float, worker: psutil.Process, sampler: str = "replay") -> dict:  # fmt: skip
    if sampler == "stub":
        with stub_fleet(tokenizer, turns, latency) as url:
            return await one_with(engine, supervisor, suite_id, n, turns, worker, {
                "type": "vllm", "endpoints": [url], "tokenizer": str(tokenizer)})
    return await one_with(engine, supervisor, suite_id, n, turns, worker, {
        "type": "replay", "tokenizer": str(tokenizer), "calls": [CALL] * turns, "latency_s": latency})


async def one_with(engine, supervisor: Supervisor, suite_id: uuid.UUID, n: int, turns: int, worker: psutil.Process,
                   sampler: dict) -> dict:  # fmt: skip
    tasks = 20
    cfg = RunConfig.model_validate({
        "suite_id": suite_id, "samples_per_task": -(-n // tasks), "concurrency": n, "worker_timeout_s": 600,
        "sampler": sampler, "agent": {"max_turns": turns + 2}})  # fmt: skip
    (worker_before, kids_before), machine_before = tree_cpu(worker), machine_cpu()
    sys_before = worker.cpu_times().system
    started = time.perf_counter()
    run_id = await create_run(engine, cfg)
    supervisor.start(run_id)
    peak_running = 0
    while True:
        async with engine.connect() as conn:
            status = await conn.scalar(sa.select(Run.status).where(Run.id == run_id))
            running = await conn.scalar(sa.select(sa.func.count()).select_from(Episode).where(
                Episode.run_id == run_id, Episode.status == "running"))
        peak_running = max(peak_running, running)
        if status not in ("pending", "running", "cancelling"):
            break
        await asyncio.sleep(0.5)
    wall = time.perf_counter() - started
    (worker_cpu, kids_cpu), machine = tree_cpu(worker), machine_cpu() - machine_before
    worker_cpu, kids_cpu = worker_cpu - worker_before, kids_cpu - kids_before
    worker_sys = worker.cpu_times().system - sys_before
    async with engine.connect() as conn:
        counts = dict((await conn.execute(sa.select(Episode.status, sa.func.count()).where(Episode.run_id == run_id)
                                          .group_by(Episode.status))).all())
        n_turns = await conn.scalar(sa.select(sa.func.sum(Episode.n_turns)).where(Episode.run_id == run_id)) or 0
        spans = (await conn.execute(sa.select(Turn.episode_id, Turn.idx, Turn.started_at, Turn.generation_s, Turn.tool_s)
                                    .join(Episode, Episode.id == Turn.episode_id).where(Episode.run_id == run_id)
                                    .order_by(Turn.episode_id, Turn.idx))).all()
    gaps = []  # time between consecutive turn records beyond what the model and the tool took
    for a, b in zip(spans, spans[1:]):
        if a.episode_id == b.episode_id:
            gaps.append((b.started_at - a.started_at).total_seconds() - b.generation_s - b.tool_s)
    episodes = sum(counts.values())
    return {"concurrency": n, "episodes": episodes, "statuses": counts, "peak_running": peak_running,
            "wall_s": wall, "episodes_per_s": episodes / wall, "turns_per_s": n_turns / wall,
            "worker_cpu_ms_per_turn": 1000 * worker_cpu / max(n_turns, 1),
            "worker_cpu_ms_per_episode": 1000 * worker_cpu / max(episodes, 1),
            "turns_per_episode": n_turns / max(episodes, 1),
            "worker_system_share": worker_sys / max(worker_cpu, 1e-9),
            "children_cpu_ms_per_turn": 1000 * kids_cpu / max(n_turns, 1),
            "machine_cpu_s_per_episode": machine / max(episodes, 1),
            "turn_overhead_ms": 1000 * statistics.mean(gaps) if gaps else float("nan")}


async def main(args) -> None:
    name = f"swerve_bench_rollouts_{uuid.uuid4().hex[:8]}"
    url = db.create_database(PG_ADMIN, name)
    redis.Redis.from_url(BROKER).flushdb()
    data = ROOT / "var" / "bench" / "rollouts"
    data.mkdir(parents=True, exist_ok=True)
    # the worker runs this checkout's code, whatever the caller's directory (`-m` puts the
    # working directory first on the path): a worktree's copy of this script measures that worktree
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWERVE_")} | {
        "SWERVE_DATABASE_URL": url, "SWERVE_BROKER_URL": BROKER, "SWERVE_DATA_DIR": str(data),
        "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    if args.event_loop:
        env["SWERVE_WORKER_EVENT_LOOP"] = args.event_loop
    proc = None
    try:
        db.upgrade(url)
        engine = db.make_async_engine(url)
        parse = parser_for_file(str(SUITE))
        suite = await import_suite(engine, "example", parse(file_chunks(str(SUITE))), max_listed_errors=10)
        tokenizer = init_tiny(data / "tiny")
        proc = subprocess.Popen([sys.executable, "-m", "service.cli", "worker", "--concurrency",
                                 str(max(args.concurrency)), "--loglevel", "WARNING"],
                                env=env, cwd=ROOT, stdout=open(data / "worker.log", "w"), stderr=subprocess.STDOUT)
        celery = make_celery(load_settings(database_url=url, broker_url=BROKER))
        supervisor = Supervisor(engine, episode_sender(celery))
        worker = psutil.Process(proc.pid)
        await asyncio.sleep(3)  # the worker connects
        rows = []
        print(f"{args.turns} tool calls + submit per episode, {args.latency} s simulated model latency per turn, "
              f"{args.sampler} sampler, {psutil.cpu_count()} CPUs")
        if args.warmup:  # not counted: the worker's start-up (its imports and the tokenizer's first load)
            await one(engine, supervisor, suite.suite_id, tokenizer, args.warmup, args.turns, 0.1, worker, args.sampler)
        for i, n in enumerate(args.concurrency):
            spy = None
            if args.profile and i == len(args.concurrency) - 1:
                args.profile.mkdir(parents=True, exist_ok=True)
                pyspy = shutil.which("py-spy", path=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
                spy = [subprocess.Popen([pyspy or "py-spy", "record", "--pid", str(proc.pid), "--rate", str(args.rate), "--format", fmt, "--gil",
                                         "-o", str(args.profile / f"worker.{ext}"), "--nonblocking"],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                       for fmt, ext in (("raw", "txt"), ("flamegraph", "svg"))]
            row = await one(engine, supervisor, suite.suite_id, tokenizer, n, args.turns, args.latency, worker,
                            args.sampler)
            rows.append(row)
            for s in spy or ():
                s.send_signal(2)  # py-spy writes its output on SIGINT
                s.wait(timeout=60)
            if spy:
                row["phases"] = phase_split(args.profile / "worker.txt")
            print(f"{n:5d} in flight: {row['episodes']} episodes {row['statuses']} in {row['wall_s']:.1f} s "
                  f"(peak running {row['peak_running']}): {row['episodes_per_s']:.2f} episodes/s, "
                  f"{row['turns_per_s']:.0f} turns/s, worker CPU {row['worker_cpu_ms_per_turn']:.2f} ms/turn "
                  f"({row['worker_system_share']:.0%} in the kernel; + {row['children_cpu_ms_per_turn']:.2f} ms/turn in the sandboxes and grading it started), "
                  f"machine CPU {row['machine_cpu_s_per_episode']:.2f} s/episode, "
                  f"turn overhead {row['turn_overhead_ms']:.0f} ms", flush=True)
        base = rows[0]
        print("\n| in flight | episodes | wall s | episodes/s | x vs first | turns/s | worker CPU ms/turn | "
              "its children ms/turn | machine CPU s/episode | turn overhead ms |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['concurrency']} | {r['episodes']} | {r['wall_s']:.1f} | {r['episodes_per_s']:.2f} | "
                  f"{r['episodes_per_s'] / base['episodes_per_s']:.2f} | {r['turns_per_s']:.0f} | "
                  f"{r['worker_cpu_ms_per_turn']:.2f} | {r['children_cpu_ms_per_turn']:.2f} | "
                  f"{r['machine_cpu_s_per_episode']:.2f} | {r['turn_overhead_ms']:.0f} |")
        for r in rows:
            if "phases" in r:
                per_episode = r["worker_cpu_ms_per_episode"]
                print(f"\nworker CPU per episode at {r['concurrency']} in flight: {per_episode:.1f} ms, by phase "
                      "(py-spy samples): " + ", ".join(f"{k} {v * per_episode:.1f} ms ({v:.0%})"
                                                       for k, v in r["phases"].items()))
                print(f"worker CPU per turn without grading: "
                      f"{r['worker_cpu_ms_per_turn'] * (1 - r['phases']['grading']):.2f} ms")
        if args.also_turns:  # the same load with longer episodes: what an episode costs apart from its turns
            n = args.concurrency[-1]
            longer = await one(engine, supervisor, suite.suite_id, tokenizer, n, args.also_turns, args.latency, worker,
                               args.sampler)
            short = rows[-1]
            per_turn = ((longer["worker_cpu_ms_per_episode"] - short["worker_cpu_ms_per_episode"])
                        / (longer["turns_per_episode"] - short["turns_per_episode"]))
            fixed = short["worker_cpu_ms_per_episode"] - short["turns_per_episode"] * per_turn
            print(f"\nper episode and per turn apart, at {n} in flight: {short['turns_per_episode']:.1f} turns "
                  f"{short['worker_cpu_ms_per_episode']:.1f} ms an episode, {longer['turns_per_episode']:.1f} turns "
                  f"{longer['worker_cpu_ms_per_episode']:.1f} ms ({longer['worker_cpu_ms_per_turn']:.2f} a turn): "
                  f"{fixed:.1f} ms of worker CPU an episode whatever its length (sandboxes, start and end, "
                  f"Celery, grading), {per_turn:.2f} ms each turn")
        await supervisor.close()
        await engine.dispose()
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
        db.drop_database(PG_ADMIN, url)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64, 128, 256, 512])
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--latency", type=float, default=1.0)
    parser.add_argument("--profile", type=Path, default=None)
    parser.add_argument("--event-loop", choices=["uvloop", "asyncio"], default=None,
                        help="the worker's event loop (SWERVE_WORKER_EVENT_LOOP); its default if not given")
    parser.add_argument("--rate", type=int, default=100, help="py-spy's samples a second with --profile")
    parser.add_argument("--also-turns", type=int, default=0, metavar="N",
                        help="then the last concurrency again with N tool calls an episode: the worker's CPU an "
                             "episode split into what every episode costs and what each turn does")
    parser.add_argument("--sampler", choices=["replay", "stub"], default="replay",
                        help="replay: scripted in the worker; stub: an HTTP stand-in for vLLM through the fleet client")
    parser.add_argument("--warmup", type=int, default=20,
                        help="episodes run first and not counted, so that every row is the worker's steady state")
    asyncio.run(main(parser.parse_args()))
