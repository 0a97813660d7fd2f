"""The bubblewrap launcher: the compiled one (sandboxes/launch.c) starts the very sandbox the
shell script does, is built once per source in a folder only its user may write, and a failure
names its step. Real sandboxes (bubblewrap, cgroups, mounts)."""

from __future__ import annotations

import logging
import re
import subprocess
from pathlib import Path

import pytest

from sandboxes import etc
from sandboxes.base import SandboxError, SandboxLimits, open_sandbox
from sandboxes.bwrap import host_uid
from sandboxes.config import BwrapSandboxConfig
from sandboxes.launcher import LauncherError, build, launcher
from tests.sandbox_fixtures import require_bwrap


# What a sandbox's processes see of themselves and of the sandbox: identity, capabilities,
# mounts with their options, users, disk, ownership of what they write, limits, environment.
PROBE = r"""id; umask; grep -E '^(Cap|NoNewPrivs|Seccomp|Uid|Gid|Groups)' /proc/self/status
awk '{print $4, $5, $6, $9, $10, $11}' /proc/self/mountinfo; cat /etc/passwd /etc/group
touch /work/new /tmp/new && ls -ln /work/new /tmp/new; df -k --output=source,size,target /tmp /work
ls -lnA / /tmp /work | grep -v ' proc$'; ulimit -a; env | sort; echo $$ > /dev/null"""


@pytest.fixture(autouse=True)
def _own_launcher_dir(tmp_path, monkeypatch):
    require_bwrap()
    monkeypatch.setenv("SWERVE_LAUNCHER_DIR", str(tmp_path / "bin"))


def _repo(path: Path) -> Path:
    path.mkdir()
    (path / "mod.py").write_text("x = 1\n")
    subprocess.run("git init -q && git add -A && git -c user.name=t -c user.email=t@t commit -qm env", shell=True,
                   cwd=path, check=True)
    return path


async def _probe(config: BwrapSandboxConfig, state: Path) -> tuple[str, bool, list[str]]:
    async with open_sandbox(config) as sb:
        out = (await sb.execute(PROBE + "; cat /etc/resolv.conf")).output
        in_cgroups = sb.shell.proc.pid in sb.cgroups.procs()
        on_host = sorted(p.name for p in sb.state.iterdir())
    return re.sub(r"swb-[0-9a-f]{16}", "SANDBOX", out).replace(str(state), "STATE"), in_cgroups, on_host


@pytest.mark.parametrize("layout", ["overlay", "writable", "empty", "network"])
async def test_compiled_and_shell_launchers_start_the_same_sandbox(tmp_path, monkeypatch, layout):
    """Every mount branch of the launcher: the task image copy-on-write, bound writable (image
    builds), or none, and with a network (its resolv.conf written by the launcher). The two
    launchers' sandboxes look the same from inside, to the byte. On the host, a live sandbox's
    state folder holds its owner record alone: its files are in its own tmpfs."""
    seen = {}
    for how in ("compiled", "sh"):
        monkeypatch.setenv("SWERVE_SANDBOX_LAUNCHER", how)
        assert (launcher() is None) == (how == "sh")
        root = _repo(tmp_path / f"repo-{how}") if layout != "empty" else None
        if layout == "writable":  # as image builds hand their folder to the sandbox's host uid
            subprocess.run(["chown", "-R", f"{host_uid()}:{host_uid()}", str(root)], check=True)
        state = tmp_path / f"state-{how}"
        config = BwrapSandboxConfig(root=root, writable_root=layout == "writable", state_dir=state,
                                    limits=SandboxLimits(memory_mb=256, pids=64, disk_mb=64,
                                                         network=layout == "network"))
        out, in_cgroups, on_host = await _probe(config, state)
        assert on_host == ["owner.json"], f"{how}: {on_host}"
        assert in_cgroups, f"{how}: the sandbox's processes are outside its cgroups"
        seen[how] = out.replace(str(root), "ROOT")
        if layout == "writable":
            assert (root / "new").is_file()  # written through to the image itself
        elif root is not None:
            assert not (root / "new").exists()
    assert "uid=1000(sandbox)" in seen["compiled"] and "CapEff:\t0000000000000000" in seen["compiled"]
    assert "size=65536k" in seen["compiled"]  # the disk limit's tmpfs
    if layout == "network":
        assert "nameserver 10.0.2.3" in seen["compiled"]
    assert seen["compiled"] == seen["sh"]


def test_the_launcher_is_built_once_per_source(tmp_path):
    folder = tmp_path / "bin"
    first = build(folder)
    assert first.parent == folder and re.fullmatch(r"swerve-launch-[0-9a-f]{16}", first.name)
    mtime = first.stat().st_mtime_ns
    assert build(folder) == first and first.stat().st_mtime_ns == mtime
    assert [p.name for p in folder.iterdir()] == [first.name]  # no temporary file left behind


def test_a_folder_others_may_write_is_refused(tmp_path, caplog):
    folder = tmp_path / "bin"
    folder.mkdir()
    folder.chmod(0o777)
    with pytest.raises(LauncherError, match="SWERVE_LAUNCHER_DIR"):
        build(folder)
    with caplog.at_level(logging.WARNING, logger="sandboxes.launcher"):
        assert launcher() is None  # the shell script launches instead, said once
    assert "shell launcher" in caplog.text
    assert not list(folder.iterdir())


async def test_a_bad_launcher_setting_names_the_setting(tmp_path, monkeypatch):
    monkeypatch.setenv("SWERVE_SANDBOX_LAUNCHER", "fast")
    with pytest.raises(SandboxError, match="SWERVE_SANDBOX_LAUNCHER: 'fast' must be"):
        async with open_sandbox(BwrapSandboxConfig(state_dir=tmp_path / "state")):
            pass


async def test_a_failed_launch_names_its_step(tmp_path):
    """An image folder that is gone: the overlay mount fails, before bwrap runs."""
    config = BwrapSandboxConfig(root=tmp_path / "gone", state_dir=tmp_path / "state")
    with pytest.raises(SandboxError, match=r"swerve-launch: mount the overlay of .*gone"):
        async with open_sandbox(config):
            pass
    # nothing left of it: the copy of /etc is the state folder's, shared by its sandboxes (sandboxes/etc.py)
    assert [p.name for p in (tmp_path / "state").iterdir()] == [etc.FOLDER]
