"""The SWE environment: a task's repository at its base commit in a sandbox, the tools the
agent acts through, the agent's diff, and grading in a fresh copy.

`test_patch` and `patch` never enter the agent's sandbox: grading opens a new one.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field

from envs.grading import GradingReport, RewardError, apply_patch, guard_changes, patch_files, run_tests
from envs.harnesses import (
    R2E_HIDDEN, R2E_SWEBENCH_PATH, drop_hidden, r2e_grade, r2e_swebench_grade, remove_paths, swe_smith_log,
    swe_smith_parser, swe_smith_start, swe_smith_test_cmd,
)  # fmt: skip
from envs.integrity import Guard, IntegrityMode, file_of_test
from envs.task import Task
from envs.tools import TOOLS, Editor, ToolCall, parse_tool_call, truncate_middle
from sandboxes.base import SandboxError, SandboxLimits, open_sandbox
from sandboxes.config import BwrapSandboxConfig, DockerSandboxConfig
from sandboxes.task_images import BASE_TAG, ImageSpec, cut_history, exclude_untracked, prepare_bwrap, prepare_docker

EXAMPLE_BUNDLES = Path(__file__).resolve().parent / "example_suite" / "bundles"
SYSTEM_PROMPT = (
    "You are a software engineer fixing an issue in the repository in your current folder. "
    "Explore with the tools, change the code so the issue is fixed, then call submit."
)
DEFAULT_TEST_CMD = "python -m pytest -rA -p no:cacheprovider"
GRADING_OUTPUT_BYTES = 64 * 1024 * 1024  # test logs are parsed whole, never cut


class SWEEnvConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    backend: Literal["bwrap", "docker"] = "bwrap"
    limits: SandboxLimits = SandboxLimits(command_timeout_s=180)
    image_cache_dir: Path = Path(os.environ.get("SWERVE_DATA_DIR", "var")) / "images"
    """Task images (bubblewrap), one folder per content key."""
    bundle_dirs: tuple[Path, ...] = (Path(os.environ.get("SWERVE_DATA_DIR", "var")) / "bundles", EXAMPLE_BUNDLES)
    """Where `source: bundle:NAME` is looked up (NAME.bundle)."""
    source_roots: tuple[Path, ...] | None = None
    """Host folders a task's local `source` must be under (None: any)."""
    integrity: IntegrityMode = "revert"
    """The agent's changes to test files and test configuration before grading: reverted,
    rejected (resolution NO), or left ("off"). Either way they are recorded (envs/integrity.py)."""
    max_observation_chars: int = Field(16000, ge=200)
    test_timeout_s: float = Field(900, gt=0)
    build_timeout_s: float = Field(1800, gt=0)
    system_prompt: str = SYSTEM_PROMPT


def resolve_source(task: Task, cfg: SWEEnvConfig) -> str:
    source = task.source or f"https://github.com/{task.repo}.git"
    if source.startswith("bundle:"):
        name = source.removeprefix("bundle:")  # a file name: Task's validator allows no folders
        for folder in cfg.bundle_dirs:
            if (folder / f"{name}.bundle").is_file():
                return str(folder / f"{name}.bundle")
        raise SandboxError(f"bundle {name!r} of {task.instance_id} not found in {[str(d) for d in cfg.bundle_dirs]}")
    if problem := source_problem(source, cfg.source_roots):
        raise SandboxError(f"{task.instance_id}: {problem}")
    return source


def source_problem(source: str | None, roots: tuple[Path, ...] | None) -> str | None:
    """Why a task may not come from `source` on this host (None: it may). A local path (or
    file:// URL) must be under one of `roots` (None: any); git URLs and bundles are not
    host paths."""
    local = _local_path(source)
    if local is None or roots is None:
        return None
    real = Path(os.path.realpath(local))
    if any(real.is_relative_to(os.path.realpath(root)) for root in roots):
        return None
    return (f"source: {source} is a path on this host outside the allowed source folders "
            f"({', '.join(map(str, roots)) or 'none'}; SWERVE_SOURCE_ROOTS allows folders); "
            "give a git URL or bundle:NAME instead")


def _local_path(source: str | None) -> str | None:
    if not source or source.startswith("bundle:"):
        return None
    if source.startswith("file://"):
        return urlsplit(source).path or "/"
    if "://" in source or ":" in source.split("/", 1)[0]:
        return None  # a remote URL, or scp-like [user@]host:path (git's rule: a colon before any slash)
    return source


async def sandbox_config(task: Task, cfg: SWEEnvConfig, episode: str | None = None,
                         limits: SandboxLimits | None = None, grading: bool = False):  # fmt: skip
    """The sandbox config for a task: its task image built (once) and ready to copy."""
    limits = limits or cfg.limits
    if missing := task.spec_missing():
        raise SandboxError(missing)
    if task.image and cfg.backend == "docker":
        return DockerSandboxConfig(image=task.image, limits=limits, episode=episode, workdir=task.repo_dir(),
                                   remove_paths=remove_paths(task, grading),
                                   path_first=R2E_SWEBENCH_PATH if task.harness == "r2e-swebench" else ())
    if task.harness:
        raise SandboxError(f"{task.instance_id}: a {task.harness} row runs in its `image`, which holds its hidden "
                           "tests" + (", and only the docker backend runs it: use --backend docker" if task.image
                                      else "; it has none: add the row's image"))
    if task.eval_script:
        raise SandboxError(f"{task.instance_id}: a SWE-bench 5 row (`eval_script`) runs in its `image`"
                           + (", which only the docker backend runs: use --backend docker" if task.image
                              else "; it has none: add the row's `image`"))
    spec = ImageSpec(source=resolve_source(task, cfg),
                           commit=task.environment_setup_commit or task.base_commit,
                           install=tuple(task.install or ()), build_timeout_s=cfg.build_timeout_s,
                           start=task.base_commit, history=task.history_mode(), python=task.python)
    if cfg.backend == "docker":
        return DockerSandboxConfig(image=await prepare_docker(spec), limits=limits, episode=episode)
    return BwrapSandboxConfig(root=await prepare_bwrap(spec, cfg.image_cache_dir), limits=limits,
                              episode=episode)


@asynccontextmanager
async def task_sandbox(task: Task, cfg: SWEEnvConfig, episode: str | None = None,
                       limits: SandboxLimits | None = None) -> AsyncIterator:  # fmt: skip
    """A sandbox with the task's repository at base_commit, tagged BASE_TAG, with no history
    after it (or none at all: Task.history) and nothing of the answers in it."""
    async with _task_sandbox(task, cfg, episode, limits, grading=False) as (sandbox, _):
        yield sandbox


@asynccontextmanager
async def _task_sandbox(task: Task, cfg: SWEEnvConfig, episode: str | None, limits: SandboxLimits | None,
                        grading: bool) -> AsyncIterator[tuple[object, str]]:  # fmt: skip
    """task_sandbox, and for grading the hidden tests a harness's image holds as a patch over
    the starting state ("" when they are in test_patch or in place)."""
    config = await sandbox_config(task, cfg, episode, limits, grading)
    async with open_sandbox(config, urgent=grading) as sandbox:  # a graded episode ends sooner than a new one starts
        hidden = ""
        if config.type == "docker" and config.image == task.image:
            # a prebuilt image is used as it ships: its history is cut in every sandbox
            start = task.base_commit
            if task.harness == "swe-smith":
                start, hidden = await swe_smith_start(sandbox, task, grading, cfg.build_timeout_s)
            await cut_history(sandbox, start, task.history_mode(), cfg.build_timeout_s)
            await exclude_untracked(sandbox, cfg.build_timeout_s)
        yield sandbox, hidden


@dataclass
class StepResult:
    observation: str
    done: bool
    tool_call: dict | None
    error: str | None = None
    error_at: int | None = None
    """Where in the text the action went wrong (tools.ParsedAction.error_at), when known."""


class SWEEnv:
    def __init__(self, task: Task, sandbox, cfg: SWEEnvConfig):
        self.task, self.sandbox, self.cfg = task, sandbox, cfg
        self.editor = Editor(sandbox, workdir=task.repo_dir())
        self._base: str | None = None

    async def base(self) -> str:
        """The starting commit's id, read before the agent's first action (it may move tags)."""
        if self._base is None:
            r = await self.sandbox.execute(f"git rev-parse --verify -q '{BASE_TAG}^{{commit}}'", timeout_s=60)
            if r.exit_code != 0:
                raise SandboxError(f"the repository of {self.task.instance_id} has no {BASE_TAG}: {r.output[-500:]}")
            self._base = r.output.strip()
        return self._base

    def first_messages(self) -> list[dict]:
        return [{"role": "system", "content": self.cfg.system_prompt},
                {"role": "user", "content": self.task.problem_statement}]

    tools = TOOLS

    async def step(self, text: str) -> StepResult:
        """Act on the model's text. Raises SandboxError only if the sandbox itself is gone."""
        await self.base()
        parsed = parse_tool_call(text)
        if parsed.call is None:
            return StepResult(parsed.error, False, None, parsed.error, parsed.error_at)
        call = parsed.call
        record = {"name": call.name, "arguments": call.arguments}
        if call.name == "submit":
            return StepResult("Submitted.", True, record)
        observation = await self._run(call)
        return StepResult(truncate_middle(observation, self.cfg.max_observation_chars), False, record)

    async def _run(self, call: ToolCall) -> str:
        if call.name == "bash":
            command = call.arguments.get("command")
            if not isinstance(command, str) or not command.strip():
                return 'bash needs a non-empty "command" string.'
            result = await self.sandbox.execute(command)
            status = ("timed out" if result.timed_out else f"exit code {result.exit_code}")
            return f"{result.output}\n[{status}]" if result.output else f"[{status}]"
        if call.name == "str_replace_editor":
            return await self.editor.run(call.arguments)
        return f"Unknown tool {call.name!r}; the tools are bash, str_replace_editor and submit."

    async def diff(self) -> str:
        """The agent's change against base_commit: new and binary files included."""
        r = await self.sandbox.execute(f"git add -A && git diff --cached --binary {await self.base()}"
                                       " && git reset -q", timeout_s=300)
        if r.exit_code != 0:
            raise SandboxError(f"cannot take the diff: {r.output[-1000:]}")
        return r.output


async def grade(task: Task, diff: str, cfg: SWEEnvConfig) -> GradingReport:
    """Apply the diff and the hidden tests in a fresh copy and grade. Raises RewardError."""
    try:
        limits = cfg.limits.model_copy(update={"output_limit_bytes": GRADING_OUTPUT_BYTES})
        async with _task_sandbox(task, cfg, f"grade:{task.instance_id}", limits, grading=True) as (sandbox, hidden):
            dropped: list[str] = []
            if task.harness == "r2e-gym":  # its hidden tests are linked in: the agent may not write there
                diff, dropped = drop_hidden(diff, R2E_HIDDEN)
            if task.eval_script:
                from envs.swebench5 import apply_model_patch

                await apply_model_patch(sandbox, diff)
            else:
                await apply_patch(sandbox, diff, "agent")
            test_patch = hidden or task.test_patch
            graded = {file_of_test(t) for t in task.FAIL_TO_PASS + task.PASS_TO_PASS} | set(patch_files(test_patch))
            guards = [asdict(Guard("rejected" if cfg.integrity == "reject" else "reverted", path)) for path in dropped]
            guards += [asdict(g) for g in await guard_changes(
                sandbox, diff=diff, base_commit=BASE_TAG, graded=graded, mode=cfg.integrity, allow=task.integrity_allow)]
            if any(g["guard"] == "rejected" for g in guards):
                return GradingReport(resolution="NO", fail_to_pass={"success": [], "failure": list(task.FAIL_TO_PASS)},
                                     pass_to_pass={"success": [], "failure": []}, guards=guards)
            if task.eval_script:
                from envs.swebench5 import run_eval_script

                report = await run_eval_script(sandbox, task, cfg.test_timeout_s)
                report.guards = guards + report.guards
                return report
            if task.harness == "r2e-gym":
                report = await r2e_grade(sandbox, task, cfg.test_timeout_s)
            elif task.harness == "r2e-swebench":
                report = await r2e_swebench_grade(sandbox, task, cfg.test_timeout_s)
            elif task.harness == "swe-smith":
                report = await run_tests(sandbox, base_commit=BASE_TAG, test_patch=test_patch,
                                         test_cmd=swe_smith_test_cmd(task), parser=swe_smith_parser(task),
                                         f2p=task.FAIL_TO_PASS, p2p=task.PASS_TO_PASS, timeout_s=cfg.test_timeout_s,
                                         exit_code_counts=False, log_of=swe_smith_log)
            else:
                report = await run_tests(sandbox, base_commit=BASE_TAG, test_patch=task.test_patch,
                                         test_cmd=task.test_cmd or DEFAULT_TEST_CMD, parser=task.log_parser,
                                         f2p=task.FAIL_TO_PASS, p2p=task.PASS_TO_PASS,
                                         timeout_s=cfg.test_timeout_s, exit_code_counts=task.exit_code_counts)
            report.guards = guards + report.guards
            return report
    except SandboxError as e:
        raise RewardError(f"grading sandbox failed: {e}") from e
