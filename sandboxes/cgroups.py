"""Per-sandbox cgroups (v1 or v2): memory, process-count and CPU limits, and the process list.

v1 groups go under this process's own memory cgroup (the only place we may create them on
hosts that nest us) and under the root of the pids and cpu hierarchies.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")


class CgroupError(OSError):
    pass


def _own_path(controller: str) -> str:
    """This process's cgroup in `controller`'s hierarchy ("" for v2's unified one)."""
    return _own_paths(os.getpid()).get(controller, "")


@lru_cache(maxsize=4)
def _own_paths(pid: int) -> dict[str, str]:
    """/proc/self/cgroup as {controller: path}, read once per process (a fork child reads its own):
    every sandbox asks for four of them."""
    paths: dict[str, str] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            paths.setdefault(controller, path.lstrip("/"))
    return paths


def _write(path: str, value: str) -> None:
    """A cgroup file's value, in one write (no text layer: a sandbox writes five)."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def is_v2() -> bool:
    return (ROOT / "cgroup.controllers").exists()


@dataclass
class Cgroups:
    """The cgroup folders of one sandbox; `procs_files` are where a process joins them."""

    paths: list[Path]

    @classmethod
    def create(cls, name: str, *, memory_mb: int, pids: int, cpus: float) -> Cgroups:
        try:
            return cls._create_v2(name, memory_mb, pids, cpus) if is_v2() else \
                cls._create_v1(name, memory_mb, pids, cpus)  # fmt: skip
        except OSError as e:
            raise CgroupError(f"cannot create cgroups for {name}: {e}") from e

    @classmethod
    def _create_v1(cls, name: str, memory_mb: int, pids: int, cpus: float) -> Cgroups:
        memory, pid, cpu, freezer = (os.path.join(ROOT, controller, _own_path(controller), name)
                                     for controller in ("memory", "pids", "cpu", "freezer"))
        for path in (memory, pid, cpu, freezer):
            os.mkdir(path)
        limit = str(memory_mb * 1024 * 1024)
        _write(f"{memory}/memory.limit_in_bytes", limit)
        try:  # no swap beyond the limit, where the kernel accounts swap
            _write(f"{memory}/memory.memsw.limit_in_bytes", limit)
        except OSError:
            pass
        _write(f"{pid}/pids.max", str(pids))
        _write(f"{cpu}/cpu.cfs_period_us", "100000")
        _write(f"{cpu}/cpu.cfs_quota_us", str(int(cpus * 100000)))
        return cls([Path(memory), Path(pid), Path(cpu), Path(freezer)])

    @classmethod
    def _create_v2(cls, name: str, memory_mb: int, pids: int, cpus: float) -> Cgroups:
        path = ROOT / _own_path("") / name
        path.mkdir()
        (path / "memory.max").write_text(str(memory_mb * 1024 * 1024))
        (path / "memory.swap.max").write_text("0")
        (path / "pids.max").write_text(str(pids))
        (path / "cpu.max").write_text(f"{int(cpus * 100000)} 100000")
        return cls([path])

    @property
    def procs_files(self) -> list[str]:
        return [str(p / "cgroup.procs") for p in self.paths]

    def procs(self) -> set[int]:
        pids: set[int] = set()
        for path in self.paths:
            try:
                pids |= {int(x) for x in (path / "cgroup.procs").read_text().split()}
            except FileNotFoundError:
                pass
        return pids

    def _freeze(self, frozen: bool) -> bool:
        """Freeze or thaw every process (so a fork bomb cannot outrun the kill)."""
        for path in self.paths:
            for name, value in (("freezer.state", "FROZEN" if frozen else "THAWED"),
                                ("cgroup.freeze", "1" if frozen else "0")):
                if (path / name).exists():
                    (path / name).write_text(value)
                    return True
        return False

    def kill_all(self, keep: Callable[[int], bool] = lambda pid: False, rounds: int = 50) -> None:
        """SIGKILL every process in the groups for which keep(pid) is false, until none is left."""
        for _ in range(rounds):
            if not [pid for pid in self.procs() if not keep(pid)]:
                return
            frozen = self._freeze(True)
            try:
                for pid in self.procs():
                    if not keep(pid):
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
            finally:
                if frozen:
                    self._freeze(False)
            time.sleep(0.01)

    def remove_if_empty(self) -> bool:
        """Remove the folders if no process is left in any (without killing or waiting); whether
        they are all gone."""
        for path in self.paths:
            try:
                path.rmdir()  # the kernel refuses (EBUSY) while a process, even a dying one, is in it
            except FileNotFoundError:
                pass
            except OSError:
                return False
        return True

    def destroy(self) -> None:
        """Kill what is left and remove the folders (retrying while the kernel lets go)."""
        self.kill_all()
        for path in self.paths:
            for _ in range(200):
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    self.kill_all()
                    time.sleep(0.01)


def ns_ppid(pid: int) -> int | None:
    """The parent's pid as the sandbox sees it (for children of the sandbox's own processes)."""
    try:
        ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (FileNotFoundError, ProcessLookupError, ValueError, IndexError):
        return None
    return ns_pid(ppid)


def ns_pid(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("NSpid:"):
                return int(line.split()[-1])
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None
