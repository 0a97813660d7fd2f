"""bubblewrap sandboxes: Linux namespaces, a read-only system, a copy-on-write view of the
task image, cgroup limits, a non-root user inside, and a persistent bash. The system is /usr and
a copy of a few /etc entries (sandboxes/etc.py), each bound read-only once.

The overlay and its tmpfs upper layer are mounted in a private mount namespace that dies
with the sandbox, so nothing is ever mounted on the host. bubblewrap itself runs as an
unprivileged host uid (`SWERVE_SANDBOX_HOST_UID`), so uid 1000 inside is that uid outside,
never root; nested user namespaces are refused. With `network` on, the sandbox keeps its own
network namespace with a filtered user-mode link (sandboxes/netns.py), never the host's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import posixpath
import signal
import uuid
from pathlib import Path

from sandboxes import etc
from sandboxes.base import SandboxError, SandboxLimits, path_with_env
from sandboxes.cgroups import CgroupError, Cgroups, ns_pid, ns_ppid
from sandboxes.common import ShellSandbox
from sandboxes.launcher import LauncherError, built, launcher
from sandboxes.netns import SLIRP_DNS, NetworkError, UserNet, read_child_pid
from sandboxes.reaper import Owner, PeriodicReaper, remove_state, remove_state_now, state_root
from sandboxes.shell import SUPERVISOR, SessionDead, ShellSession

logger = logging.getLogger(__name__)

SANDBOX_UID = 1000
SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"
# Where bwrap, already unprivileged, finds the sandbox's state: the state folder is bound here in
# the sandbox's private mount namespace, as its own parents need not be open to the host uid.
VIEW = "/run/swerve-sandbox"
# and the copy of the host's /etc entries it binds as /etc (sandboxes/etc.py), likewise
ETC_VIEW = "/run/swerve-sandbox-etc"
# the sandbox's /etc/passwd and /etc/group, written into its state by the launcher
PASSWD = (f"root:x:0:0::/root:/usr/sbin/nologin\nsandbox:x:{SANDBOX_UID}:{SANDBOX_UID}::/tmp:/bin/bash\n"
          "nobody:x:65534:65534::/nonexistent:/usr/sbin/nologin\n")
GROUP = f"root:x:0:\nsandbox:x:{SANDBOX_UID}:\nnogroup:x:65534:\n"


def _under_etc(path: str) -> str | None:
    """`path` relative to /etc if it lies under it, else None."""
    normal = posixpath.normpath(path)
    return normal[len("/etc/"):] if normal.startswith("/etc/") else None


def etc_entries(ro_binds: tuple[str, ...]) -> tuple[str, ...]:
    """The extra read-only paths that lie under /etc, as entries of its copy (sandboxes/etc.py)."""
    return tuple(name for name in map(_under_etc, ro_binds) if name is not None)


def host_uid() -> int:
    """The unprivileged host uid (and gid) sandboxed processes run as."""
    value = os.environ.get("SWERVE_SANDBOX_HOST_UID", "61000")
    if not value.isdigit() or int(value) == 0:
        raise SandboxError(f"SWERVE_SANDBOX_HOST_UID: {value!r} must be a non-zero uid, unused by anything else")
    return int(value)


# Joins the cgroups, makes a private mount namespace, mounts a size-limited tmpfs for all
# writes and the overlay of the task image on it, then becomes bwrap as the sandbox's host
# uid (argv in "$@"). sandboxes/launch.c does the same in one process (sandboxes/launcher.py):
# this script is its fallback where no C compiler is found, and the two must stay alike.
_LAUNCH = r"""
set -e
for f in $SWERVE_CGROUP_PROCS; do echo $$ > "$f"; done
exec unshare --mount --propagation private -- sh -c '
set -e
mount -t tmpfs -o "size=${SWERVE_DISK_MB}m,mode=0755" swerve "$SWERVE_STATE"
mkdir -m 0755 "$SWERVE_STATE/rw" "$SWERVE_STATE/merged"
mkdir "$SWERVE_STATE/rw/upper" "$SWERVE_STATE/rw/work" "$SWERVE_STATE/rw/tmp"
chmod 1777 "$SWERVE_STATE/rw/tmp"
chown "$SWERVE_UID:$SWERVE_UID" "$SWERVE_STATE/rw/upper"
if [ -n "$SWERVE_WRITABLE" ]; then
  mount --bind "$SWERVE_LOWER" "$SWERVE_STATE/merged"
elif [ -n "$SWERVE_LOWER" ]; then
  mount -t overlay overlay -o "lowerdir=$SWERVE_LOWER,upperdir=$SWERVE_STATE/rw/upper,workdir=$SWERVE_STATE/rw/work" "$SWERVE_STATE/merged"
else
  mount --bind "$SWERVE_STATE/rw/upper" "$SWERVE_STATE/merged"
fi
printf %s "$SWERVE_PASSWD" > "$SWERVE_STATE/passwd"
printf %s "$SWERVE_GROUP" > "$SWERVE_STATE/group"
if [ -n "$SWERVE_RESOLV" ]; then printf %s "$SWERVE_RESOLV" > "$SWERVE_STATE/resolv.conf"; fi
mount --rbind "$SWERVE_STATE" "$SWERVE_VIEW"
mount --bind "$SWERVE_ETC" "$SWERVE_ETC_VIEW"
exec setpriv --reuid="$SWERVE_UID" --regid="$SWERVE_UID" --clear-groups --inh-caps=-all -- "$@"' sh "$@"
"""


_SETTLE_S = (0, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064)
"""How long close() waits, in steps, for the sandbox's cgroups to empty once its init is killed,
before it kills what is left on a thread (Cgroups.destroy). The kernel kills the namespace's
processes when its init dies, so they go by themselves: without this wait every close froze
the cgroup (a v1 freezer write patches the kernel's code on every CPU) and went through a
thread, 1.3 ms of a 4.3 ms lifecycle's CPU (bench/sandbox_cpu.py, 2026-12-07)."""


class BwrapSandbox(ShellSandbox):
    """Use BwrapSandboxConfig.build() or open_sandbox(); close() removes every trace."""

    def __init__(self, config, sandbox_id: str, state: Path, cgroups: Cgroups, etc_copy: Path):
        super().__init__()
        self.config, self.id, self.state, self.cgroups = config, sandbox_id, state, cgroups
        self.etc = etc_copy
        self.limits: SandboxLimits = config.limits
        self.workdir = config.workdir
        self.shell: ShellSession | None = None
        self._lifetime: asyncio.TimerHandle | None = None
        self.net: UserNet | None = None

    @classmethod
    async def start(cls, config) -> BwrapSandbox:
        PeriodicReaper.ensure_running()
        sandbox_id = f"swb-{uuid.uuid4().hex[:16]}"
        root = config.state_dir or state_root()
        state = root / sandbox_id
        owner = Owner.me(config.limits.lifetime_s, episode=config.episode)
        try:  # the extra read-only paths under /etc go into the copy, which bwrap binds read-only
            etc_copy = await etc.current(root, etc_entries(config.ro_binds))
        except (OSError, ValueError) as e:
            raise SandboxError(f"cannot copy the host's /etc entries into {root / etc.FOLDER}: {e}") from e
        owner.etc = etc_copy.name
        state.mkdir(parents=True)
        try:
            limits = config.limits
            cgroups = Cgroups.create(sandbox_id, memory_mb=limits.memory_mb, pids=limits.pids,
                                     cpus=limits.cpus)
        except CgroupError as e:
            remove_state(state, None)
            raise SandboxError(str(e)) from e
        owner.cgroups = [str(p) for p in cgroups.paths]
        owner.write(state)
        sandbox = cls(config, sandbox_id, state, cgroups, etc_copy)
        try:
            await sandbox._start_shell()
        except BaseException:
            await sandbox.close()
            raise
        loop = asyncio.get_running_loop()
        sandbox._lifetime = loop.call_later(limits.lifetime_s, lambda: loop.create_task(sandbox.close()))
        logger.info("sandbox up", extra={"sandbox": sandbox_id, "episode": config.episode})
        return sandbox

    def _bwrap_argv(self, net_fds: tuple[int, int] | None) -> list[str]:
        cfg = self.config
        argv = ["bwrap", "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
                "--new-session", "--cap-drop", "ALL",
                "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--hostname", "sandbox",
                "--ro-bind", "/usr", "/usr", "--proc", "/proc", "--dev", "/dev"]
        if net_fds is not None:  # wait until the namespace is filtered and linked
            argv += ["--info-fd", str(net_fds[0]), "--block-fd", str(net_fds[1])]
        for link in ("bin", "sbin", "lib", "lib64"):
            target = os.readlink(f"/{link}") if os.path.islink(f"/{link}") else None
            argv += ["--symlink", target, f"/{link}"] if target else ["--ro-bind-try", f"/{link}", f"/{link}"]
        argv += ["--ro-bind", ETC_VIEW, "/etc"]  # one bind of the host entries' copy, not one per entry
        if net_fds is not None:  # written by the launcher (SWERVE_RESOLV)
            argv += ["--ro-bind", f"{VIEW}/resolv.conf", "/etc/resolv.conf"]
        argv += ["--ro-bind", f"{VIEW}/passwd", "/etc/passwd", "--ro-bind", f"{VIEW}/group", "/etc/group"]
        for path in cfg.ro_binds:
            if _under_etc(path) is None:
                argv += ["--ro-bind", path, path]
        argv += ["--bind", f"{VIEW}/merged", self.workdir, "--bind", f"{VIEW}/rw/tmp", "/tmp",
                 "--remount-ro", "/", "--chdir", self.workdir, "--clearenv",
                 "--setenv", "PATH", path_with_env(self.workdir, SYSTEM_PATH), "--setenv", "HOME", "/tmp", "--setenv", "USER", "sandbox",
                 "--setenv", "LANG", "C.UTF-8", "--setenv", "TERM", "dumb",
                 "--setenv", "PAGER", "cat", "--setenv", "GIT_PAGER", "cat",
                 "--setenv", "PYTHONDONTWRITEBYTECODE", "1",
                 "bash", "--noprofile", "--norc", "-c", SUPERVISOR]
        return argv

    async def _start_shell(self) -> None:
        for view in (VIEW, ETC_VIEW):
            with contextlib.suppress(FileExistsError):
                os.mkdir(view, 0o755)
        env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "SWERVE_STATE": str(self.state), "SWERVE_VIEW": VIEW,
               "SWERVE_ETC": str(self.etc), "SWERVE_ETC_VIEW": ETC_VIEW,
               "SWERVE_CGROUP_PROCS": " ".join(self.cgroups.procs_files),
               "SWERVE_DISK_MB": str(self.limits.disk_mb), "SWERVE_UID": str(host_uid()),
               "SWERVE_LOWER": str(self.config.root) if self.config.root else "",
               "SWERVE_WRITABLE": "1" if self.config.writable_root and self.config.root else "",
               "SWERVE_PASSWD": PASSWD, "SWERVE_GROUP": GROUP,
               "SWERVE_RESOLV": f"nameserver {SLIRP_DNS}\n" if self.limits.network else ""}
        fds: dict[str, int] = {}
        if self.limits.network:
            (fds["info_r"], fds["info_w"]), (fds["block_r"], fds["block_w"]) = os.pipe(), os.pipe()

        def close(*names: str) -> None:
            for name in names:
                if name in fds:
                    os.close(fds.pop(name))

        async def link_network() -> None:
            close("info_w", "block_r")  # the child holds its own copies: its exit now reads as EOF
            child = await read_child_pid(fds["info_r"])
            try:
                self.net = await UserNet.attach(child)
            except BaseException:
                # the sandbox waits on block_fd holding the shell's pipes, and the shell's end
                # waits for them: kill its init (and with it the namespace) first
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child, signal.SIGKILL)
                raise
            os.write(fds["block_w"], b"1")

        net_fds = (fds["info_w"], fds["block_r"]) if fds else None
        try:
            compiled = launcher() if built() else await asyncio.to_thread(launcher)
            launch_argv = [str(compiled)] if compiled else ["sh", "-c", _LAUNCH, "sh"]
            self.shell = await ShellSession.start(
                [*launch_argv, *self._bwrap_argv(net_fds)],
                output_limit=self.limits.output_limit_bytes, env=env, pass_fds=net_fds or (),
                spawned=link_network if net_fds else None)
        except SessionDead as e:
            raise SandboxError(f"bubblewrap sandbox failed to start: {e.output.strip()[-2000:]}") from e
        except NetworkError as e:
            raise SandboxError(f"bubblewrap sandbox network: {e}") from e
        except LauncherError as e:
            raise SandboxError(str(e)) from e
        finally:
            close(*list(fds))

    async def _kill(self, include_shell: bool) -> None:
        """Kill every process but the sandbox's init and supervisor, and the shell if asked.

        Any child of the supervisor is spared: it is the shell, or the one replacing it.
        """
        shell = next((p for p in self.cgroups.procs() if ns_pid(p) == self.shell.shell_pid), None)
        outer = self.shell.proc.pid

        def keep(pid: int) -> bool:
            return pid == outer or ns_pid(pid) in (1, 2, None) or ns_ppid(pid) == 2

        if shell is not None and not include_shell:
            with contextlib.suppress(ProcessLookupError):
                os.kill(shell, signal.SIGUSR1)  # abandon the rest of the command line
        await asyncio.to_thread(self.cgroups.kill_all, keep)
        if include_shell and shell is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(shell, signal.SIGKILL)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._lifetime is not None:
            self._lifetime.cancel()
        if self.shell is not None:
            await self.shell.kill()
        if self.net is not None:
            await self.net.close()
        for delay in _SETTLE_S:  # the namespace's processes die with its init, most within 1 ms
            if delay:
                await asyncio.sleep(delay)
            if remove_state_now(self.state, self.cgroups):
                break
        else:  # still there (a process in uninterruptible sleep): kill, freezing, and wait apart
            await asyncio.to_thread(remove_state, self.state, Owner(0, None, 0, 0, cgroups=[str(p) for p in self.cgroups.paths]))
        logger.info("sandbox down", extra={"sandbox": self.id, "episode": self.config.episode})
