"""Docker sandboxes: one labelled container per sandbox, limits set on the container, and a
persistent bash reached over `docker exec -i`. Timeouts are enforced inside the container
(killing a `docker exec` client does not kill what it started).
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import contextlib
import logging
import os
import shlex
import signal
import socket
import threading
import time
import uuid
from dataclasses import dataclass

from sandboxes.admission import paced_creation
from sandboxes.base import SandboxError, SandboxLimits, path_with_env
from sandboxes.cgroups import ROOT as CGROUP_ROOT
from sandboxes.cgroups import Cgroups, ns_pid, ns_ppid
from sandboxes.common import ShellSandbox
from sandboxes.docker_exec import Exec, ExecProcess, socket_path, start_exec
from sandboxes.images import BASE_IMAGE, ensure_base_image
from sandboxes.netns import NetworkError, docker_egress_network
from sandboxes.reaper import PeriodicReaper, process_start_time
from sandboxes.shell import SUPERVISOR, SessionDead, ShellSession

logger = logging.getLogger(__name__)
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

LABEL = "swerve.sandbox"
SANDBOX_USER = "1000:1000"
# Kills every process in the container but init, the keeper and the given pids (and itself).
_KILL = r"""
[ -n "$ABANDON" ] && kill -USR1 "$ABANDON" 2>/dev/null
for round in 1 2 3 4 5 6 7 8 9 10; do
  left=0
  for d in /proc/[0-9]*; do p=${d#/proc/}
    case " 1 $KEEP $$ " in *" $p "*) continue ;; esac
    [ "$(cut -d' ' -f4 "$d/stat" 2>/dev/null)" = "$SUP" ] && continue
    kill -9 "$p" 2>/dev/null && left=1
  done
  [ "$left" = 0 ] && break
done
"""
# Spared: init, the keeper, the supervisor and its children (the shell, or its replacement).


_clients: dict[tuple[int, str], object] = {}
_clients_lock = threading.Lock()


def docker_client(host: str | None = None):
    """This process's client of the engine `host` (default: the one DOCKER_HOST names), made
    once (making one asks the engine its API version: a round trip per sandbox start otherwise)."""
    import docker

    host = os.environ.get("DOCKER_HOST", "") if host is None else host
    key = (os.getpid(), host)  # a forked child makes its own
    with _clients_lock:
        if key in _clients:
            return _clients[key]
    try:
        client = docker.from_env(timeout=120, environment={**os.environ, "DOCKER_HOST": host} if host else
                                 {k: v for k, v in os.environ.items() if k != "DOCKER_HOST"})
    except docker.errors.DockerException as e:
        raise SandboxError(f"no Docker engine reachable (DOCKER_HOST={os.environ.get('DOCKER_HOST', 'unset')}): {e}") from e
    with _clients_lock:
        return _clients.setdefault(key, client)


def _labels(sandbox_id: str, limits: SandboxLimits, episode: str | None, idle_s: float = 0.0) -> dict[str, str]:
    """What the reaper reads. A pooled container (`idle_s`: the longest it waits in the pool)
    lives `limits.lifetime_s` from the moment it is handed out, at the latest."""
    pid = os.getpid()
    return {LABEL: sandbox_id, "swerve.owner_host": socket.gethostname(),
            "swerve.owner_pid": str(pid), "swerve.owner_start": str(process_start_time(pid)),
            "swerve.created_at": f"{time.time():.3f}", "swerve.lifetime_s": str(limits.lifetime_s + idle_s),
            "swerve.episode": episode or "", "swerve.pooled": "1" if idle_s else ""}


def _have_image(client, image: str) -> None:
    """The image on this engine: there already, or pulled from its registry. Raises SandboxError
    saying what to do when neither (a dataset's image where no registry is reachable)."""
    import docker
    from docker.utils import parse_repository_tag

    try:
        client.images.get(image)
        return
    except docker.errors.ImageNotFound:
        pass
    repository, tag = parse_repository_tag(image)
    try:
        client.images.pull(repository, tag=tag or "latest")
    except docker.errors.DockerException as e:
        raise SandboxError(f"image {image} is not on this Docker engine and could not be pulled from its registry "
                           f"({str(e)[:300]}): pull or build it there under that name (docker pull, docker load), "
                           "or give the engine access to the registry") from e


DISK_LIMIT_ENV = "SWERVE_DOCKER_DISK_LIMIT"
"""`enforce` (the default): a container's writes to its image (the work tree included) are
limited to `disk_mb` by the engine, and a sandbox is refused on an engine that cannot limit
them; `tmp-only`: such an engine is accepted with only /tmp limited (the operator's choice)."""
_TOTAL_DRIVERS = ("btrfs", "zfs")
"""Storage drivers whose `--storage-opt size` limits the image and the container's writes
together (btrfs: the snapshot's referenced bytes): the image's size is added to disk_mb."""
_disk_modes: dict[str, tuple[str | None, str]] = {}
_image_sizes: dict[str, int] = {}


def disk_limit_mode(client, image: str) -> tuple[str | None, str]:
    """How this engine limits a container's writes: "layer" (`--storage-opt size` applies to
    the writable layer: overlay2 on xfs with project quotas), "total" (to image and writes:
    btrfs, zfs), or None, and what the engine is. Probed once per engine: overlay2 takes the
    option only where its xfs is mounted with pquota, which `docker info` does not say (the
    probe creates, and removes, a container of `image`)."""
    import docker

    key = socket_path(client) or client.api.base_url  # the engine this client reaches (engines on a host share an ID)
    if key in _disk_modes:
        return _disk_modes[key]
    info = client.info()
    driver = info.get("Driver", "?")
    backing = dict(info.get("DriverStatus") or []).get("Backing Filesystem", "?")
    what = f"storage driver {driver} on {backing}"
    mode = "total" if driver in _TOTAL_DRIVERS else "layer" if driver == "overlay2" and backing == "xfs" else None
    if mode is not None:
        try:
            size = _image_size(client, image) if mode == "total" else 0
            probe = client.containers.create(image, ["true"], storage_opt={"size": f"{size // 2**20 + 64}M"},
                                             network_mode="none", labels={LABEL: "disk-probe"})
            probe.remove(force=True)
        except docker.errors.DockerException as e:
            mode, what = None, f"{what}, which refused --storage-opt size ({str(e)[:200]})"
    _disk_modes[key] = (mode, what)
    return _disk_modes[key]


def _image_size(client, image: str) -> int:
    key = f"{socket_path(client) or client.api.base_url} {image}"
    if key not in _image_sizes:
        _image_sizes[key] = int(client.images.get(image).attrs.get("Size") or 0)
    return _image_sizes[key]


def _storage_opt(client, image: str, limits: SandboxLimits, setting: str | None = None) -> dict[str, str]:
    """The engine's limit on what the container writes outside /tmp (the work tree, the
    system): disk_mb, as bubblewrap's sandboxes have. Raises SandboxError where the engine
    cannot enforce it, unless the operator accepted that (SWERVE_DOCKER_DISK_LIMIT=tmp-only,
    or `setting`)."""
    mode, what = disk_limit_mode(client, image)
    if mode is None:
        if (setting or os.environ.get(DISK_LIMIT_ENV, "enforce")) == "tmp-only":
            return {}
        raise SandboxError(
            f"this Docker engine cannot limit a container's disk ({what}): limits.disk_mb would hold for /tmp "
            "only and the agent could fill the host's disk through its work tree. Run dockerd with its data on "
            "btrfs (--storage-driver btrfs), zfs, or overlay2 on xfs mounted with pquota (see the README), or "
            f"set {DISK_LIMIT_ENV}=tmp-only to accept containers whose work tree is not limited")
    extra = _image_size(client, image) // 2**20 if mode == "total" else 0
    return {"size": f"{limits.disk_mb + extra}M"}


class DockerSandbox(ShellSandbox):
    def __init__(self, config, container, client):
        super().__init__()
        self.config, self.container, self.client = config, container, client
        self.id = container.name
        self.limits: SandboxLimits = config.limits
        self.workdir = config.workdir
        self.shell: ShellSession | None = None
        self._keeper_pid = "1"

    @classmethod
    async def start(cls, config) -> DockerSandbox:
        client = await asyncio.to_thread(docker_client)
        PeriodicReaper.ensure_running(also=reap_containers)
        ready = POOL.take(config)  # a container made and prepared ahead (SWERVE_DOCKER_POOL), or None
        if ready is not None:
            sandbox = cls(config, ready.container, client)
            sandbox._keeper_pid = ready.keeper_pid
            try:
                # its shell was started ahead: a dead one fails to attach, and one is made afresh
                revived = await sandbox._revive(check=False, ready=ready.shell)
            except SandboxError:
                revived = False
            except BaseException:
                await sandbox.close()
                raise
            if revived:
                logger.info("sandbox up", extra={"sandbox": sandbox.id, "episode": config.episode, "pooled": True})
                return sandbox
            await sandbox.close()  # it died waiting: one is made afresh below
        image = config.image or await asyncio.to_thread(ensure_base_image, client, BASE_IMAGE)
        sandbox_id = f"swd-{uuid.uuid4().hex[:16]}"
        container = await asyncio.to_thread(cls._create, client, config, image, sandbox_id)
        sandbox = cls(config, container, client)
        try:
            await sandbox._prepare()
            await sandbox._revive()
        except BaseException:
            await sandbox.close()
            raise
        logger.info("sandbox up", extra={"sandbox": sandbox_id, "episode": config.episode})
        return sandbox

    @staticmethod
    def _create(client, config, image: str, sandbox_id: str, idle_s: float = 0.0, disk_limit: str | None = None):
        import docker

        limits = config.limits
        try:
            network = docker_egress_network(client) if limits.network else "none"
        except NetworkError as e:
            raise SandboxError(str(e)) from e
        _have_image(client, image)
        storage_opt = _storage_opt(client, image, limits, disk_limit)
        try:
            return client.containers.run(
                image, ["sleep", "infinity"], name=sandbox_id, detach=True, init=True,
                labels=_labels(sandbox_id, limits, config.episode, idle_s),
                network_mode=network,
                mem_limit=f"{limits.memory_mb}m", memswap_limit=f"{limits.memory_mb}m",
                nano_cpus=int(limits.cpus * 1e9), pids_limit=limits.pids,
                cap_drop=["ALL"], cap_add=["CHOWN", "DAC_OVERRIDE", "FOWNER", "KILL"],
                security_opt=["no-new-privileges"],
                tmpfs={"/tmp": f"size={limits.disk_mb}m,mode=1777"}, storage_opt=storage_opt or None,
                environment={"HOME": "/tmp", "LANG": "C.UTF-8", "TERM": "dumb", "PAGER": "cat",
                             "GIT_PAGER": "cat", "PYTHONDONTWRITEBYTECODE": "1"}
                # the base image (builds, and through their commit every task image made from it)
                # puts the environment's Python environment first; a prebuilt image keeps its PATH
                | ({"PATH": path_with_env(config.workdir, SYSTEM_PATH)} if config.image is None else
                   {"PATH": ":".join((*config.path_first, SYSTEM_PATH))} if config.path_first else {}),
            )  # fmt: skip
        except docker.errors.DockerException as e:
            raise SandboxError(f"cannot start a container from {image}: {e}") from e

    async def _prepare(self) -> None:
        self._keeper_pid = await asyncio.to_thread(_prepare, self.container, self.config)

    async def _revive(self, check: bool = True, ready: Exec | None = None) -> bool:
        """Attach a new supervisor shell (`ready`: one started ahead); False if the container is
        gone (`check`: asked of the engine first)."""
        if self.shell is not None:
            await self.shell.kill()
        if check:
            try:
                await asyncio.to_thread(self.container.reload)
            except Exception as e:  # noqa: BLE001 - any engine error means the container is gone
                logger.warning("container %s vanished: %s", self.id, e)
                return False
            if self.container.status != "running":
                return False
        try:
            if socket_path(self.client) is None:  # an engine reached over TCP or ssh: its CLI attaches
                argv = ["docker", "exec", "-i", "-u", SANDBOX_USER, "-w", self.workdir, self.id, *SHELL]
                self.shell = await ShellSession.start(argv, output_limit=self.limits.output_limit_bytes)
            else:
                started = ready or await asyncio.to_thread(_start_shell, self.client, self.id, self.workdir)
                proc = await ExecProcess.adopt(self.client, started)
                self.shell = await ShellSession.attach(proc, output_limit=self.limits.output_limit_bytes)
        except SessionDead as e:
            raise SandboxError(f"cannot attach a shell to {self.id}: {e.output[-1000:]}") from e
        return True

    async def _kill(self, include_shell: bool) -> None:
        host = _host_cgroups(self.container.id)
        if host is not None:  # a local engine: freeze, kill and thaw from here, like bwrap
            await self._kill_from_host(host, include_shell)
            return
        supervisor = await asyncio.to_thread(self._supervisor_pid)
        env = {"KEEP": f"{self._keeper_pid} {supervisor}", "SUP": supervisor,
               "ABANDON": "" if include_shell else str(self.shell.shell_pid)}
        await asyncio.to_thread(self.container.exec_run, ["sh", "-c", _KILL], user="0",
                                environment=env)
        if include_shell:
            await asyncio.to_thread(self.container.exec_run,
                                    ["kill", "-9", str(self.shell.shell_pid)], user="0")

    async def _kill_from_host(self, host: Cgroups, include_shell: bool) -> None:
        shell = next((p for p in host.procs() if ns_pid(p) == self.shell.shell_pid), None)
        supervisor = ns_ppid(shell) if shell is not None else None
        spared = {1, supervisor, *map(int, self._keeper_pid.split())}

        def keep(pid: int) -> bool:
            return ns_pid(pid) in spared or ns_ppid(pid) == supervisor

        if shell is not None and not include_shell:
            with contextlib.suppress(ProcessLookupError):
                os.kill(shell, signal.SIGUSR1)
        await asyncio.to_thread(host.kill_all, keep)
        if shell is not None and include_shell:
            with contextlib.suppress(ProcessLookupError):
                os.kill(shell, signal.SIGKILL)

    def _supervisor_pid(self) -> str:
        """The supervisor is the shell's parent; read it inside the container."""
        code, out = self.container.exec_run(
            ["sh", "-c", f"cut -d' ' -f4 /proc/{self.shell.shell_pid}/stat"], user="0")
        return out.decode().strip() if code == 0 else ""

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.shell is not None:
            await self.shell.kill()
        await asyncio.to_thread(_remove, self.client, self.container.id)
        logger.info("sandbox down", extra={"sandbox": self.id, "episode": self.config.episode})


SHELL = ["bash", "--noprofile", "--norc", "-c", SUPERVISOR]


def _start_shell(client, container_id: str, workdir: str) -> Exec:
    """The sandbox's supervisor shell, started over the engine's socket (blocking)."""
    return start_exec(client, container_id, SHELL, user=SANDBOX_USER, workdir=workdir)


def _prepare(container, config) -> str:
    """Make the workdir (owned by the sandbox user); returns the keeper's pid."""
    # a prebuilt image's repository (SWE-bench's /testbed) belongs to root: hand it over whole
    removed = "".join(f"rm -rf -- {shlex.quote(p)} && " for p in config.remove_paths)
    script = (f"{removed}mkdir -p {config.workdir} && {{ [ \"$(stat -c %u {config.workdir})\" = 1000 ] || "
              f"chown -R 1000:1000 {config.workdir}; }} && "
              "for d in /proc/[0-9]*; do p=${d#/proc/}; "
              "[ \"$(cut -d' ' -f4 $d/stat 2>/dev/null)\" = 1 ] && echo $p; done; true")
    code, out = container.exec_run(["sh", "-c", script], user="0")
    if code != 0:
        raise SandboxError(f"cannot prepare {config.workdir} in {container.name}: {out.decode(errors='replace')}")
    return " ".join(out.decode().split())


POOL_ENV = "SWERVE_DOCKER_POOL"
"""Containers kept ready per environment (image, workdir, limits, removed paths) in each process
that opens Docker sandboxes: created, started and prepared ahead, so a start only attaches its
shell. 0 (the default): none, every sandbox is created when it starts."""
POOL_IDLE_ENV = "SWERVE_DOCKER_POOL_IDLE_S"
"""The longest a container waits in the pool (s, default 300); older ones are removed, not handed out."""


@dataclass(frozen=True)
class _Ready:
    container: object
    keeper_pid: str
    made_at: float
    shell: Exec | None
    """Its supervisor shell, started (over the engine's unix socket; None otherwise)."""

    def discard(self) -> None:
        if self.shell is not None:
            self.shell.close()
        try:
            _remove(self.container.client, self.container.id)
        except Exception as e:  # noqa: BLE001 - an engine gone or refusing: the reaper's to remove
            logger.debug("could not remove pooled %s: %s", self.container.name, e)


class WarmPool:
    """Ready containers per environment key, refilled in the background after every take, up
    to as many as that environment was asked for in the last idle period (at most the pool's size).

    Each container is handed out once and never comes back (a closed sandbox's container is
    removed as always), so no two episodes ever share one. A pooled container carries the
    same owner labels as any sandbox's, so the reaper removes the pool of a process that died;
    its lifetime label adds the longest idle wait, so a sandbox keeps its whole lifetime from
    the moment it is handed out. Takes are thread-safe; the filling runs in threads of its own,
    one per key at a time."""

    def __init__(self):
        self._lock = threading.Lock()
        self._ready: dict[object, collections.deque[_Ready]] = {}
        self._filling: set[object] = set()
        self._takes: dict[object, collections.deque[float]] = {}  # when each key was asked for lately
        self._target: dict[object, int] = {}
        self._generation = 0  # drain() ends the fills under way: what they make then is removed
        self._threads: list[threading.Thread] = []
        self._at_exit = False

    @staticmethod
    def size() -> int:
        return _env_number(POOL_ENV, 0, int, 0, 1024)

    @staticmethod
    def idle_s() -> float:
        return _env_number(POOL_IDLE_ENV, 300.0, float, 1.0, 86400.0)

    @staticmethod
    def key(config):
        """What makes containers interchangeable: the config but its episode, and the settings
        a container is made under (the engine, whether its disk limit is enforced)."""
        return (config.model_copy(update={"episode": None}), os.environ.get("DOCKER_HOST", ""),
                os.environ.get(DISK_LIMIT_ENV, "enforce"))

    def take(self, config) -> _Ready | None:
        """A ready container for this config's environment (None: the pool has none now), and
        the pool set to refill."""
        size = self.size()
        if size == 0:
            return None
        key, now, idle, stale, ready = self.key(config), time.time(), self.idle_s(), [], None
        with self._lock:
            takes = self._takes.setdefault(key, collections.deque())
            takes.append(now)
            while takes[0] < now - idle:
                takes.popleft()
            # as many as were asked for lately, up to the pool's size: an environment asked for
            # once (one task's image) costs one spare container, not a pool of them
            self._target[key] = min(size, len(takes))
            queue = self._ready.setdefault(key, collections.deque())
            while queue and ready is None:
                entry = queue.popleft()
                if now - entry.made_at > idle:
                    stale.append(entry)
                else:
                    ready = entry
            fill = key not in self._filling
            if fill:
                self._filling.add(key)
        if not self._at_exit:  # a process that exits cleanly removes its pool; the reaper, one that died
            self._at_exit = True
            atexit.register(self.drain, 5.0)
        if stale or fill:
            thread = threading.Thread(target=self._fill, args=(key, stale, fill), daemon=True,
                                      name="swerve-docker-pool")
            with self._lock:
                self._threads = [t for t in self._threads if t.is_alive()] + [thread]
            thread.start()
        return ready

    def ready_count(self, config) -> int:
        with self._lock:
            return len(self._ready.get(self.key(config), ()))

    def _fill(self, key, stale: list[_Ready], fill: bool) -> None:
        generation = self._generation
        config, host, disk_limit = key
        try:
            client = docker_client(host)
            for entry in stale:
                entry.discard()
            if not fill:  # another thread fills this key
                return
            image = config.image or ensure_base_image(client, BASE_IMAGE)
            idle = self.idle_s()
            while True:
                with self._lock:
                    if len(self._ready.get(key, ())) >= self._target.get(key, 0) or generation != self._generation:
                        return
                paced_creation()  # a creation like any start's: within the host's starts per second
                container = DockerSandbox._create(client, config, image, f"swd-{uuid.uuid4().hex[:16]}", idle,
                                                  disk_limit)
                try:
                    keeper = _prepare(container, config)
                    shell = _start_shell(client, container.id, config.workdir) if socket_path(client) else None
                except BaseException:
                    _remove(client, container.id)
                    raise
                entry = _Ready(container, keeper, time.time(), shell)
                with self._lock:
                    drained = generation != self._generation
                    if not drained:
                        self._ready.setdefault(key, collections.deque()).append(entry)
                if drained:
                    entry.discard()
                    return
        except Exception as e:  # noqa: BLE001 - the pool is an optimisation: starts create their own
            logger.warning("the Docker pool could not fill: %s", e)
        finally:
            if fill:
                with self._lock:
                    self._filling.discard(key)

    def drain(self, timeout_s: float = 60.0) -> int:
        """Remove every container the pool holds, after the fills under way have ended (at
        shutdown, in tests); how many."""
        with self._lock:
            self._generation += 1
            threads = list(self._threads)
        for thread in threads:
            thread.join(timeout_s)
        with self._lock:
            entries = [e for q in self._ready.values() for e in q]
            self._ready.clear()
            self._takes.clear()
            self._target.clear()
        for entry in entries:
            entry.discard()
        return len(entries)


def _env_number(name: str, default, kind, low, high):
    raw = os.environ.get(name)
    if raw in (None, ""):
        return default
    try:
        value = kind(raw)
    except ValueError:
        value = None
    if value is None or not low <= value <= high:
        raise SandboxError(f"{name}={raw!r}: give a number from {low} to {high}")
    return value


POOL = WarmPool()


def _host_cgroups(container_id: str) -> Cgroups | None:
    """The container's freezer and pids cgroups when the engine runs on this host (cgroupfs)."""
    paths = [CGROUP_ROOT / c / "docker" / container_id for c in ("freezer", "pids")]
    if all(p.is_dir() for p in paths):
        return Cgroups(paths)
    v2 = CGROUP_ROOT / "system.slice" / f"docker-{container_id}.scope"
    return Cgroups([v2]) if v2.is_dir() else None


def _remove(client, container_id: str) -> bool:
    """Remove a container; False when it is gone already or another process is removing it (409)."""
    import docker

    try:
        client.api.remove_container(container_id, force=True)
        return True
    except docker.errors.NotFound:
        return False
    except docker.errors.APIError as e:
        if e.status_code != 409:
            raise
        return False


def _owner_gone(labels: dict[str, str], now: float) -> bool:
    try:
        created, lifetime = float(labels["swerve.created_at"]), float(labels["swerve.lifetime_s"])
    except (KeyError, ValueError):
        return True
    if now > created + lifetime:
        return True
    if labels.get("swerve.owner_host") != socket.gethostname():
        return False  # another host's owner: only its lifetime can end it from here
    start = process_start_time(int(labels.get("swerve.owner_pid", "0")))
    return str(start) != labels.get("swerve.owner_start")


def reap_containers(client=None) -> list[str]:
    """Remove swerve containers whose owner died or whose lifetime is over."""
    import docker

    client = client or docker_client()
    now, reaped = time.time(), []
    # the list's own rows (labels included): no inspect per container, which fails with
    # NotFound for one another process removes meanwhile
    for row in client.api.containers(all=True, filters={"label": LABEL}):
        if _owner_gone(row.get("Labels") or {}, now):
            try:
                removed = _remove(client, row["Id"])
            except docker.errors.APIError as e:  # the engine refused: the next sweep tries again
                logger.debug("could not remove %s: %s", row["Id"][:12], e)
                continue
            if removed:
                reaped.append((row.get("Names") or [row["Id"][:12]])[0].lstrip("/"))
    if reaped:
        logger.info("reaped %d container(s)", len(reaped), extra={"reaped": reaped})
    return reaped
