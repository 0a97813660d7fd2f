"""Orphan reaping: whatever a sandbox left behind is removed once its owner is gone or its
lifetime is over. Runs at start-up and periodically in every process that opens sandboxes.

Every bubblewrap sandbox (and every image build) owns a folder under the state root with
an `owner.json`; Docker containers carry the same facts as labels.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from sandboxes import etc
from sandboxes.cgroups import Cgroups

logger = logging.getLogger(__name__)
INCOMPLETE_GRACE_S = 120.0


def state_root() -> Path:
    """Where sandboxes keep their state: $SWERVE_SANDBOX_DIR, or a folder under /tmp."""
    return Path(os.environ.get("SWERVE_SANDBOX_DIR") or "/tmp/swerve-sandboxes")


def process_start_time(pid: int) -> int | None:
    """The kernel's start time of a process (clock ticks), to tell a live owner from pid reuse."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


@lru_cache(maxsize=4)
def _start_time_of(pid: int) -> int | None:
    """This process's start time, read once per pid (a fork child asks with its own)."""
    return process_start_time(pid)


@dataclass
class Owner:
    pid: int
    start_time: int | None
    created_at: float
    lifetime_s: float
    kind: str = "sandbox"
    episode: str | None = None
    cgroups: list[str] = field(default_factory=list)
    etc: str | None = None  # the copy of /etc it binds (sandboxes/etc.py)

    @classmethod
    def me(cls, lifetime_s: float, kind: str = "sandbox", episode: str | None = None) -> Owner:
        pid = os.getpid()
        return cls(pid, _start_time_of(pid), time.time(), lifetime_s, kind, episode)

    def alive(self) -> bool:
        return process_start_time(self.pid) == self.start_time

    def expired(self, now: float | None = None) -> bool:
        return (now or time.time()) > self.created_at + self.lifetime_s

    def write(self, folder: Path) -> None:
        tmp = folder / "owner.json.tmp"
        tmp.write_text(json.dumps({**vars(self), "cgroups": list(self.cgroups)}))  # asdict deep-copies
        tmp.replace(folder / "owner.json")


def remove_state(folder: Path, owner: Owner | None) -> None:
    if owner is not None and owner.cgroups:
        Cgroups([Path(p) for p in owner.cgroups]).destroy()
    shutil.rmtree(folder, ignore_errors=True)


def remove_state_now(folder: Path, cgroups: Cgroups | None) -> bool:
    """remove_state when it need not wait: False (nothing removed) while a cgroup still holds a
    process, dying or not, for remove_state on a thread to kill and wait for."""
    if cgroups is not None and not cgroups.remove_if_empty():
        return False
    shutil.rmtree(folder, ignore_errors=True)
    return True


def reap_local(root: Path | None = None, prefixes: tuple[str, ...] = ("swb-", ".build-")) -> list[str]:
    """Remove state folders whose owner died or whose lifetime is over; return their names.

    Only folders named with `prefixes` are considered (sandboxes and image builds). Copies of
    /etc that no live sandbox binds go too, once unused for a while (sandboxes/etc.py).
    """
    root = root or state_root()
    if not root.is_dir():
        return []
    reaped, in_use = [], set()
    for folder in root.iterdir():
        if not folder.name.startswith(prefixes) or not folder.is_dir():
            continue
        try:
            owner = Owner(**json.loads((folder / "owner.json").read_text()))
        except FileNotFoundError:
            owner = None
            if time.time() - folder.stat().st_mtime < INCOMPLETE_GRACE_S:
                continue  # being created right now
        except (ValueError, TypeError) as e:
            logger.warning("unreadable sandbox owner record %s: %s", folder, e)
            owner = None
        if owner is not None and owner.alive() and not owner.expired():
            in_use.add(owner.etc)
            continue
        remove_state(folder, owner)
        reaped.append(folder.name)
    reaped += etc.prune(root, in_use)
    if reaped:
        logger.info("reaped %d sandbox folder(s)", len(reaped), extra={"reaped": reaped})
    return reaped


class PeriodicReaper:
    """One per process: reaps at start and then every `interval_s` while the loop runs.

    Local state is always reaped; a backend with state of its own (Docker's containers) adds its
    reaper when its first sandbox opens.
    """

    _task: asyncio.Task | None = None
    _also: tuple[Callable[[], object], ...] = ()

    @classmethod
    def ensure_running(cls, interval_s: float = 60.0, also: Callable[[], object] | None = None) -> None:
        loop = asyncio.get_running_loop()
        if also is not None and also not in cls._also:
            cls._also += (also,)
            try:
                also()
            except Exception:  # noqa: BLE001 - a failed sweep must not fail the sandbox that asked
                logger.exception("reaper %s failed; the next sweep tries again", getattr(also, "__name__", also))
        if cls._task is not None and not cls._task.done() and cls._task.get_loop() is loop:
            return
        reap_local()
        cls._task = loop.create_task(cls._loop(interval_s))

    @classmethod
    async def _loop(cls, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            for reap in (reap_local, *cls._also):
                try:
                    await asyncio.to_thread(reap)
                except Exception:  # noqa: BLE001 - an engine or disk blip: the loop must outlive it
                    logger.exception("reaper %s failed; the next sweep tries again", reap.__name__)
