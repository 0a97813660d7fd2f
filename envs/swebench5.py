"""SWE-bench 5 rows as they ship (`image`, `eval_script`, `log_parser`, `eval_type`), graded as
the `swebench` package's own harness grades them, with its own code wherever it does the work:
the model patch applied with the harness's fallbacks (GIT_APPLY_CMDS, a pristine tree between
tries, an already-applied patch accepted), the row's eval script made by `make_test_spec` (which
records the test command's exit code) and run in the image's repository (/testbed), its log
read by `get_logs_eval` (the row's parser, between the harness's markers, the exit code checked)
and judged by `get_eval_tests_report` and `get_resolution_status` for the row's eval_type.

swerve's integrity guards still run on the model patch before the eval script (envs/swe_env.grade).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from envs.grading import GradingReport, RewardError
from envs.task import Task

PATCH_FILE = "/tmp/.swerve-model.patch"
EVAL_FILE = "/tmp/.swerve-eval.sh"


def _require_swebench() -> None:
    try:
        import swebench  # noqa: F401
    except ImportError as e:
        raise RewardError("a SWE-bench 5 row (`eval_script`) is graded by the swebench package's own code, "
                          "which is not installed: pip install 'swerve[swebench]'") from e


def test_spec(task: Task):
    """The swebench package's TestSpec of the row (as `make_test_spec` builds it)."""
    _require_swebench()
    from swebench.harness.log_parsers import PARSER_REGISTRY
    from swebench.harness.utils import make_test_spec

    parser = f"parse_log_{task.log_parser}"
    if parser not in PARSER_REGISTRY:
        raise RewardError(f"{task.instance_id}: log_parser {parser!r} is not a parser of the installed swebench "
                          f"package; use one of {', '.join(sorted(PARSER_REGISTRY))}")
    return make_test_spec({"instance_id": task.instance_id, "image": task.image or "", "repo": task.repo,
                           "version": task.version or "", "FAIL_TO_PASS": task.FAIL_TO_PASS,
                           "PASS_TO_PASS": task.PASS_TO_PASS, "log_parser": parser, "eval_type": task.eval_type,
                           "eval_script": task.eval_script})


async def apply_model_patch(sandbox, patch: str) -> None:
    """The harness's patch chain in the sandbox's repository. Raises RewardError (its
    APPLY_PATCH_FAIL) when no command applies the patch."""
    _require_swebench()
    from swebench.harness.constants import APPLY_PATCH_FAIL
    from swebench.harness.run_evaluation import GIT_APPLY_CMDS

    if not patch.strip():
        return
    await sandbox.write_file(PATCH_FILE, patch if patch.endswith("\n") else patch + "\n")
    result = None
    for attempt, command in enumerate(GIT_APPLY_CMDS):
        if attempt:  # a failed try (--reject) leaves partial state: start again from a pristine tree
            await sandbox.execute("git checkout -- . ; git clean -fdq", timeout_s=120)
        result = await sandbox.execute(f"{command} {PATCH_FILE}", timeout_s=120)
        if result.exit_code == 0:
            return
    if (await sandbox.execute(f"git apply --check --reverse {PATCH_FILE}", timeout_s=120)).exit_code == 0:
        return  # the chain left it applied while each command exited non-zero
    raise RewardError(f"{APPLY_PATCH_FAIL}: {result.output[-1500:]}", log=result.output)


async def run_eval_script(sandbox, task: Task, timeout_s: float) -> GradingReport:
    """Run the row's eval script and judge its log as the harness does."""
    from swebench.harness.constants import EvalType, ResolvedStatus
    from swebench.harness.grading import (
        get_eval_tests_report, get_logs_eval, get_resolution_status, parse_test_exit_code,
    )  # fmt: skip

    spec = test_spec(task)
    await sandbox.write_file(EVAL_FILE, spec.eval_script)
    started = time.monotonic()
    result = await sandbox.execute(f"bash {EVAL_FILE} 2>&1", timeout_s=timeout_s)
    if result.timed_out:
        raise RewardError(f"the eval script did not finish within {timeout_s} s", kind="test_timeout",
                          log=result.output)
    log = result.output
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "test_output.txt"
        path.write_text(log)
        status_map, found = get_logs_eval(spec, str(path))
    ref = {"FAIL_TO_PASS": spec.FAIL_TO_PASS, "PASS_TO_PASS": spec.PASS_TO_PASS}
    tests = get_eval_tests_report(status_map, ref, eval_type=EvalType(spec.eval_type))
    verdict = {ResolvedStatus.FULL.value: "FULL", ResolvedStatus.PARTIAL.value: "PARTIAL"}
    resolution = verdict.get(get_resolution_status(tests), "NO") if found else "NO"
    return GradingReport(resolution=resolution, fail_to_pass=tests["FAIL_TO_PASS"], pass_to_pass=tests["PASS_TO_PASS"],
                         tests=status_map, test_exit_code=parse_test_exit_code(log), log_tail=log[-4000:], log=log,
                         duration_s=time.monotonic() - started)
