"""How a bubblewrap sandbox is launched: the compiled launcher (sandboxes/launch.c), built once
per host with the system's C compiler, or the shell script it replaces.

The shell script starts ten programs in turn before bwrap (sh, unshare, sh, mount three times,
mkdir, chmod, chown, setpriv); the launcher makes the same system calls in one process, which
is most of a sandbox start's time outside bwrap itself (bench/sandbox.py).

The binary runs as root, so it is only taken from a folder this user owns that nobody else
may write: $SWERVE_LAUNCHER_DIR, or `.bin` in the sandbox state root. It is named by the hash
of its source, so an edited launch.c is built afresh. Without a compiler (or with
SWERVE_SANDBOX_LAUNCHER=sh) sandboxes start through the shell script, with a warning once.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import stat
import subprocess
import tempfile
import time
from pathlib import Path

from sandboxes.reaper import state_root

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("launch.c")
_built: dict[Path, Path | None] = {}


class LauncherError(RuntimeError):
    pass


def launcher_dir() -> Path:
    return Path(os.environ.get("SWERVE_LAUNCHER_DIR") or state_root() / ".bin")


def _check_private(path: Path) -> None:
    """`path` must belong to this user and be writable by nobody else (it runs as root)."""
    info = path.lstat()
    if info.st_uid != os.geteuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) or stat.S_ISLNK(info.st_mode):
        raise LauncherError(f"{path} must be owned by uid {os.geteuid()} and writable by it alone "
                            f"(owner {info.st_uid}, mode {stat.filemode(info.st_mode)}): remove it, or set "
                            "SWERVE_LAUNCHER_DIR to a folder of this user's")


def build(folder: Path | None = None) -> Path:
    """The launcher binary for this source, compiled into `folder` unless already there."""
    folder = folder or launcher_dir()
    source = SOURCE.read_bytes()
    target = folder / f"swerve-launch-{hashlib.sha256(source).hexdigest()[:16]}"
    folder.mkdir(parents=True, exist_ok=True, mode=0o755)
    _check_private(folder.parent)  # whoever may write there could swap the folder itself
    _check_private(folder)
    if target.exists():
        _check_private(target)
        return target
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        raise LauncherError(f"no C compiler ({os.environ.get('CC', 'cc')}) to build {SOURCE.name}")
    for stale in folder.glob(".swerve-launch-*"):  # a compile killed midway left it
        with contextlib.suppress(FileNotFoundError):
            if time.time() - stale.lstat().st_mtime > 3600:
                stale.unlink()
    fd, tmp = tempfile.mkstemp(prefix=".swerve-launch-", dir=folder)
    os.close(fd)
    try:
        done = subprocess.run([compiler, "-O2", "-Wall", "-o", tmp, str(SOURCE)], capture_output=True, text=True)
        if done.returncode:
            raise LauncherError(f"{compiler} failed on {SOURCE}: {done.stderr.strip()[-2000:]}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)  # atomic: another process building the same source gets one of the two
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def built() -> bool:
    """Whether launcher() answers without building (no thread needed to ask it)."""
    return os.environ.get("SWERVE_SANDBOX_LAUNCHER") == "sh" or launcher_dir() in _built


def launcher() -> Path | None:
    """The compiled launcher, built at the first call in this process; None where sandboxes
    launch through the shell script (asked for, or no compiler: warned once)."""
    how = os.environ.get("SWERVE_SANDBOX_LAUNCHER", "compiled")
    if how not in ("compiled", "sh"):
        raise LauncherError(f"SWERVE_SANDBOX_LAUNCHER: {how!r} must be 'compiled' (the default) or 'sh'")
    if how == "sh":
        return None
    folder = launcher_dir()
    if folder not in _built:
        try:
            _built[folder] = build(folder)
        except (LauncherError, OSError) as e:
            logger.warning("bubblewrap sandboxes start through the shell launcher (slower, at 4x the CPU: "
                           "bench/sandbox_cpu.py): %s", e)
            _built[folder] = None
    return _built[folder]
