"""SWE-smith's repository profiles, from the swesmith package itself: which test command a
mirror's tests run with and which parser reads their log (`swesmith/profiles/*.py`: Python, Go,
Rust, JavaScript, TypeScript, Java, C, C++, PHP, C#; 673 repositories in 0.0.9).

swesmith 0.0.9 imports from swebench names that swebench 5 no longer has (`DOCKER_USER`,
`DOCKER_WORKDIR`, `KEY_INSTANCE_ID`, the module `swebench.harness.dockerfiles`). They are given
here with swebench 4's values before the import, only where swebench lacks them; nothing that
grading calls reads them (the dockerfiles function, used to build images, raises).
"""

from __future__ import annotations

import functools
import re
import sys
import types

PROFILE_PARSER = "swe_smith_profile"
"""Task.log_parser of a row whose log is read by its profile's own parser."""

_SWEBENCH4 = {"DOCKER_USER": "root", "DOCKER_WORKDIR": "/testbed", "KEY_INSTANCE_ID": "instance_id",
              "FAIL_TO_PASS": "FAIL_TO_PASS", "PASS_TO_PASS": "PASS_TO_PASS", "KEY_PATCH": "patch"}


class ProfileUnavailable(RuntimeError):
    """The swesmith package is missing, or knows no profile of the row's repository."""


def _dockerfile_env(*_args, **_kwargs):
    raise NotImplementedError("swebench 5 builds no images from swebench 4's dockerfiles")


@functools.cache
def _registry():
    try:
        import swebench.harness.constants as constants
    except ImportError as e:
        raise ProfileUnavailable("SWE-smith's profiles need the swebench package: pip install 'swerve[swesmith]'") from e
    for name, value in _SWEBENCH4.items():
        if not hasattr(constants, name):
            setattr(constants, name, value)
    try:
        import swebench.harness.dockerfiles  # noqa: F401
    except ImportError:
        stand_in = types.ModuleType("swebench.harness.dockerfiles")
        stand_in.get_dockerfile_env = _dockerfile_env
        sys.modules["swebench.harness.dockerfiles"] = stand_in
    try:
        from swesmith.profiles import registry
    except ImportError as e:
        raise ProfileUnavailable(f"SWE-smith's profiles are read from the swesmith package, which does not import "
                                 f"({e}): pip install 'swerve[swesmith]'") from e
    return registry


def profile(repo: str):
    """The profile of a SWE-smith mirror (`swesmith/<owner>__<name>.<commit8>` or without the
    organisation), as the harness finds it (`registry.get_from_inst`). Raises ProfileUnavailable."""
    registry = _registry()
    try:
        return registry.get(repo)
    except KeyError:
        raise ProfileUnavailable(f"the swesmith package has no profile of {repo!r}") from None


def is_python(prof) -> bool:
    from swesmith.profiles.python import PythonProfile

    return isinstance(prof, PythonProfile)


def is_go(prof) -> bool:
    from swesmith.profiles.golang import GoProfile

    return isinstance(prof, GoProfile)


def parse(repo: str, log: str) -> dict[str, str]:
    """The profile's own parser on a test log."""
    return profile(repo).log_parser(log)


_GO_FUNC = re.compile(r"^\w+$")


def go_test_files_script(tests: list[str]) -> str | None:
    """GoProfile.get_test_files run where the repository is (the sandbox) instead of on a fresh
    clone from GitHub: the `*_test.go` files that define a function of a test's name (a shell
    command printing them one per line), or None when no test is a plain function name."""
    names = sorted({t for t in tests if _GO_FUNC.match(t)})
    if not names:
        return None
    pattern = r"^[[:space:]]*func[[:space:]]+(" + "|".join(names) + r")([^[:alnum:]_]|$)"
    return f"grep -rlE --include='*_test.go' -e '{pattern}' . | sed 's|^\\./||' | sort"
