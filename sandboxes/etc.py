"""A bubblewrap sandbox's /etc: the host entries a sandbox may see (ETC_FILES), copied once into
the state folder and bound as one read-only folder.

Each entry used to be a bwrap bind of its own: 18 binds, each a mount, a read-only remount and
a reread of the mount table by bwrap, about 6 ms of a 30 ms start on a slow host
(bench/RESULTS.md). The copy costs one bind in the launcher and one in bwrap.

The copy shows what the binds showed: an entry that is a symlink is copied as what it points to
(a bind follows it), a symlink inside a folder stays a symlink (resolved inside the sandbox),
and modes and owners are kept, so /etc/ssl/private stays closed to the sandbox user. The files
bound over it (passwd, group, and resolv.conf with a network) always exist in it as mount points.
A sandbox's extra read-only paths under /etc (BwrapSandboxConfig.ro_binds: an image build's pip
settings) are copied into a copy of their own in the same way, as bwrap could not bind them into
a read-only /etc.

A copy is named by a digest of the entries' stat data, so a change to any of them makes a new
one. The host is rechecked at most every RECHECK_S seconds per state folder (a walk of some 700
entries, in a thread, by the start that finds the check due; the others meanwhile take the copy
checked last), so a change reaches sandboxes started RECHECK_S after it. Each check touches the
copy it names; the reaper removes a copy untouched for GRACE_S that no live sandbox's owner
record names, under an exclusive lock that checks take shared.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import os
import shutil
import stat
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

ETC_FILES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "ssl", "ca-certificates",
             "localtime", "nsswitch.conf", "hosts", "resolv.conf", "mime.types", "gitconfig",
             "python3", "python3.11", "debian_version", "os-release", "protocols", "services")
# files bound over the copy in the sandbox (bwrap binds only onto what exists in a read-only /etc)
MOUNT_POINTS = ("passwd", "group", "resolv.conf")
RECHECK_S = 30.0
"""A check costs 3.5-5 ms of CPU on an idle host and about twice that beside a busy event loop
(py-spy: 0.6 ms of each 11-turn episode of bench/rollouts.py at 3.5 episodes/s with 5 s); a host
change to /etc (a CA update) reaching new sandboxes within 30 s is soon enough."""
GRACE_S = 120.0
FOLDER = ".etc"  # under the state folder, beside the sandboxes' own
_TMP = ".tmp-"

_Key = tuple[Path, tuple[str, ...]]  # a state folder, the entries copied beyond ETC_FILES
_checked: dict[_Key, tuple[Path, float]] = {}  # -> (the copy, when checked, monotonic)
_checking: set[_Key] = set()


def entries(extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    """What a copy holds: ETC_FILES and `extra`, paths relative to /etc (a bad one is refused)."""
    for name in extra:
        if name.startswith("/") or ".." in name.split("/") or name in ("", "."):
            raise ValueError(f"{name!r}: an entry of /etc must be a path inside it")
    names = tuple(dict.fromkeys(ETC_FILES + tuple(os.path.normpath(n) for n in extra)))
    # one inside another is copied with it
    return tuple(n for n in names if not any(n.startswith(f"{other}/") for other in names))


def signature(etc: Path = Path("/etc"), extra: tuple[str, ...] = ()) -> str:
    """A digest of what the sandbox would see of `etc`: every entry's stat data, the top ones
    followed through symlinks (as a bind is), those within folders not."""
    digest = hashlib.sha256()

    def add(name: str, st: os.stat_result) -> None:
        digest.update(f"{name}\0{st.st_dev}:{st.st_ino}:{st.st_mode}:{st.st_uid}:{st.st_gid}:{st.st_size}:"
                      f"{st.st_mtime_ns}:{st.st_ctime_ns}\n".encode(errors="surrogateescape"))

    def walk(folder: str) -> None:
        with os.scandir(folder) as found:
            for entry in sorted(found, key=lambda e: e.name):
                st = entry.stat(follow_symlinks=False)
                add(entry.path, st)
                if stat.S_ISDIR(st.st_mode):
                    walk(entry.path)
                elif stat.S_ISLNK(st.st_mode):
                    digest.update(os.readlink(entry.path).encode(errors="surrogateescape"))

    for name in entries(extra):
        try:
            st = os.stat(etc / name)
        except OSError:
            digest.update(f"{name}\0-\n".encode())
            continue
        add(name, st)
        if stat.S_ISDIR(st.st_mode):
            walk(str(etc / name))
    return digest.hexdigest()[:16]


def _copy(etc: Path, into: Path, extra: tuple[str, ...]) -> None:
    """The entries of `etc` copied into the new folder `into`, as a bind of each would show them."""
    into.mkdir(mode=0o755)

    def keep_owner(source: str, target: str) -> None:
        st = os.lstat(source)
        os.chown(target, st.st_uid, st.st_gid, follow_symlinks=False)

    def copy_file(source: str, target: str) -> None:
        shutil.copy2(source, target, follow_symlinks=False)
        keep_owner(source, target)

    def only_plain(folder: str, names: list[str]) -> list[str]:  # no fifo, socket or device
        return [n for n in names if not stat.S_ISDIR(m := os.lstat(os.path.join(folder, n)).st_mode)
                and not stat.S_ISREG(m) and not stat.S_ISLNK(m)]

    for name in entries(extra):
        source, target = etc / name, into / name
        try:
            st = os.stat(source)
        except OSError:
            continue  # as --ro-bind-try skipped it
        target.parent.mkdir(parents=True, exist_ok=True, mode=0o755)  # as bwrap makes a bind's parents
        if stat.S_ISDIR(st.st_mode):
            shutil.copytree(source, target, symlinks=True, copy_function=copy_file, ignore=only_plain)
            for folder, dirs, _ in os.walk(target):  # copytree keeps the folders' modes, not owners
                for d in dirs:
                    keep_owner(os.path.join(source, os.path.relpath(os.path.join(folder, d), target)),
                               os.path.join(folder, d))
        elif stat.S_ISREG(st.st_mode):
            shutil.copy2(source, target)  # through a symlink, as a bind goes
        else:
            continue
        os.chown(target, st.st_uid, st.st_gid)
        os.chmod(target, stat.S_IMODE(st.st_mode))
    for name in MOUNT_POINTS:
        with contextlib.suppress(FileExistsError):
            (into / name).touch(mode=0o644, exist_ok=False)


@contextlib.contextmanager
def _locked(folder: Path, how: int) -> Iterator[bool]:
    """`folder`'s lock held `how` (fcntl.LOCK_SH or LOCK_EX, with LOCK_NB: False if busy)."""
    fd = os.open(folder / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, how)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def prepare(state_root: Path, etc: Path = Path("/etc"), extra: tuple[str, ...] = ()) -> Path:
    """The copy of `etc` (its ETC_FILES and `extra`) as it is now under `state_root`, made if
    missing; touched, so the reaper leaves it for GRACE_S."""
    folder = state_root / FOLDER
    folder.mkdir(parents=True, exist_ok=True, mode=0o755)
    with _locked(folder, fcntl.LOCK_SH):
        target = folder / signature(etc, extra)
        try:
            os.utime(target)
            return target
        except FileNotFoundError:
            pass
        tmp = folder / f"{_TMP}{uuid.uuid4().hex}"
        try:
            _copy(etc, tmp, extra)
            try:
                tmp.rename(target)  # atomic; another process's copy of the same state may be there first
            except OSError:
                if not target.is_dir():
                    raise
                os.utime(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return target


async def current(state_root: Path, extra: tuple[str, ...] = ()) -> Path:
    """The copy a sandbox starting now binds as /etc: the one checked last, unless RECHECK_S have
    passed since, when this start checks the host again in a thread."""
    key = (state_root, extra)
    known = _checked.get(key)
    if known is not None and (time.monotonic() - known[1] < RECHECK_S or key in _checking):
        return known[0]
    _checking.add(key)
    try:
        path = await asyncio.to_thread(prepare, state_root, Path("/etc"), extra)
    finally:
        _checking.discard(key)
    _checked[key] = (path, time.monotonic())
    return path


def prune(state_root: Path, in_use: set[str]) -> list[str]:
    """Remove the copies under `state_root` untouched for GRACE_S and named by no live sandbox
    (`in_use`), and copies a killed process left half made; return their names."""
    folder = state_root / FOLDER
    if not folder.is_dir():
        return []
    removed = []
    with _locked(folder, fcntl.LOCK_EX | fcntl.LOCK_NB) as held:
        if not held:
            return []  # a check is under way: the next sweep
        now = time.time()
        for copy in folder.iterdir():
            if copy.name == ".lock" or copy.name in in_use:
                continue
            with contextlib.suppress(FileNotFoundError):  # no check holds the lock: a .tmp- is a dead one's
                if not copy.name.startswith(_TMP) and now - copy.lstat().st_mtime < GRACE_S:
                    continue
                shutil.rmtree(copy, ignore_errors=True)
                removed.append(copy.name)
    return removed
