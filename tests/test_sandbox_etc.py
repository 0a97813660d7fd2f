"""A bubblewrap sandbox's /etc is one copy of the host entries it may see, bound once: the copy
shows what a bind of each entry showed (contents, symlinks, modes, owners), follows the host
within RECHECK_S, and is removed only once no live sandbox binds it."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import time
from pathlib import Path

import pytest

from sandboxes import etc
from sandboxes.base import SandboxLimits, open_sandbox
from sandboxes.config import BwrapSandboxConfig
from sandboxes.reaper import reap_local
from tests.sandbox_fixtures import require_bwrap


def fake_etc(path: Path) -> Path:
    """An /etc with what a host may hold: files of other owners and modes, symlinks at the top and
    within folders, a closed folder, a fifo, and entries sandboxes must not see."""
    path.mkdir()
    (path / "hosts").write_text("127.0.0.1 localhost\n")
    os.chown(path / "hosts", 123, 456)
    (path / "hosts").chmod(0o640)
    (path.parent / "zone").write_text("UTC zone data")
    (path / "localtime").symlink_to(path.parent / "zone")
    ssl = path / "ssl"
    (ssl / "certs").mkdir(parents=True)
    (ssl / "certs" / "a.pem").write_text("CERT A")
    (ssl / "certs" / "b.pem").symlink_to("a.pem")
    (ssl / "certs" / "ca.crt").symlink_to("/usr/share/ca-certificates/x.crt")  # resolved in the sandbox
    (ssl / "private").mkdir(mode=0o710)
    (ssl / "private" / "key.pem").write_text("PRIVATE")
    (ssl / "private" / "key.pem").chmod(0o600)
    os.chown(ssl / "private", 0, 789)
    os.mkfifo(ssl / "pipe")
    (path.parent / "conf.d").mkdir()
    (path.parent / "conf.d" / "x.conf").write_text("/opt/lib\n")
    (path / "ld.so.conf.d").symlink_to(path.parent / "conf.d")
    (path / "shadow").write_text("root:secret\n")
    (path / "passwd").write_text("host users\n")
    return path


def test_the_copy_shows_what_a_bind_of_each_entry_showed(tmp_path):
    source = fake_etc(tmp_path / "etc")
    copy = etc.prepare(tmp_path / "state", source)
    assert copy.parent == tmp_path / "state" / etc.FOLDER
    names = sorted(p.name for p in copy.iterdir())
    # what ETC_FILES names and the host has, and the files bound over it; never shadow or passwd's content
    assert names == sorted({"hosts", "localtime", "ssl", "ld.so.conf.d", *etc.MOUNT_POINTS}), names
    assert (copy / "passwd").read_text() == "" and (copy / "resolv.conf").read_text() == ""
    hosts = (copy / "hosts").stat()
    assert (copy / "hosts").read_text() == "127.0.0.1 localhost\n"
    assert (hosts.st_uid, hosts.st_gid, stat.S_IMODE(hosts.st_mode)) == (123, 456, 0o640)
    # a symlink at the top is what it points to (a bind follows it), and so is a linked folder
    assert not (copy / "localtime").is_symlink() and (copy / "localtime").read_text() == "UTC zone data"
    assert not (copy / "ld.so.conf.d").is_symlink() and (copy / "ld.so.conf.d" / "x.conf").read_text() == "/opt/lib\n"
    # within folders symlinks stay symlinks, resolved where the sandbox looks
    assert os.readlink(copy / "ssl" / "certs" / "b.pem") == "a.pem"
    assert os.readlink(copy / "ssl" / "certs" / "ca.crt") == "/usr/share/ca-certificates/x.crt"
    private = (copy / "ssl" / "private").stat()
    assert (private.st_uid, private.st_gid, stat.S_IMODE(private.st_mode)) == (0, 789, 0o710)
    assert stat.S_IMODE((copy / "ssl" / "private" / "key.pem").stat().st_mode) == 0o600
    assert not (copy / "ssl" / "pipe").exists()  # a fifo is not copied (reading it would block)
    assert [p.name for p in copy.parent.iterdir() if p.name != ".lock"] == [copy.name]  # no half copy left


def test_a_change_on_the_host_makes_a_new_copy_and_none_reuses_the_one_there(tmp_path):
    source = fake_etc(tmp_path / "etc")
    state = tmp_path / "state"
    first = etc.prepare(state, source)
    os.utime(first, (0, 0))
    assert etc.prepare(state, source) == first
    assert time.time() - first.stat().st_mtime < 60  # touched: the reaper keeps it GRACE_S more
    (source / "ssl" / "certs" / "a.pem").write_text("CERT A, renewed")  # within a folder, same size or not
    second = etc.prepare(state, source)
    assert second != first and (second / "ssl" / "certs" / "a.pem").read_text() == "CERT A, renewed"
    assert (first / "ssl" / "certs" / "a.pem").read_text() == "CERT A"  # a live sandbox's copy is never edited
    (source / "localtime").unlink()
    (source / "localtime").symlink_to(source / "hosts")  # a top entry pointed elsewhere
    third = etc.prepare(state, source)
    assert third not in (first, second) and (third / "localtime").read_text() == "127.0.0.1 localhost\n"


def test_extra_entries_are_copied_at_their_place_in_a_copy_of_their_own(tmp_path):
    source = fake_etc(tmp_path / "etc")
    (source / "xdg" / "pip").mkdir(parents=True)
    (source / "xdg" / "pip" / "pip.conf").write_text("[global]\n")
    (source / "xdg" / "other").write_text("not asked for")
    plain = etc.prepare(tmp_path / "state", source)
    more = etc.prepare(tmp_path / "state", source, ("xdg/pip", "shadow", "hosts", "ssl/certs/a.pem", "xdg/pip/pip.conf"))
    assert more != plain and not (plain / "xdg").exists() and not (plain / "shadow").exists()
    assert (more / "xdg" / "pip" / "pip.conf").read_text() == "[global]\n" and (more / "shadow").is_file()
    assert sorted(p.name for p in (more / "xdg").iterdir()) == ["pip"]  # the path asked for, not its folder
    for bad in ("/etc/x", "../x", "a/../../x", ""):
        with pytest.raises(ValueError, match="must be a path inside it"):
            etc.prepare(tmp_path / "state", source, (bad,))


async def test_sandboxes_take_the_copy_checked_last_until_recheck_s_have_passed(tmp_path, monkeypatch):
    source = fake_etc(tmp_path / "etc")
    state = tmp_path / "state"
    calls, real = [], etc.prepare

    def prepare(root, _etc, extra):
        calls.append(root)
        return real(root, source, extra)

    monkeypatch.setattr(etc, "prepare", prepare)
    monkeypatch.setattr(etc, "_checked", {})
    first = await etc.current(state)
    assert await etc.current(state) == first and len(calls) == 1
    (source / "hosts").write_text("changed\n")
    assert await etc.current(state) == first  # within RECHECK_S
    etc._checked[(state, ())] = (first, time.monotonic() - etc.RECHECK_S)
    second = await etc.current(state)
    assert len(calls) == 2 and second != first and (second / "hosts").read_text() == "changed\n"
    # starts that find a check under way take the last copy instead of waiting for it
    etc._checked[(state, ())] = (second, time.monotonic() - etc.RECHECK_S)
    firsts = await asyncio.gather(*(etc.current(state) for _ in range(5)))
    assert firsts == [second] * 5 and len(calls) == 3


def test_the_reaper_removes_copies_unused_for_grace_s_and_no_other(tmp_path):
    source = fake_etc(tmp_path / "etc")
    state = tmp_path / "state"
    named = etc.prepare(state, source)
    (source / "hosts").write_text("changed\n")
    unused = etc.prepare(state, source)
    (source / "hosts").write_text("changed again\n")
    recent = etc.prepare(state, source)
    half = state / etc.FOLDER / ".tmp-0123"  # a copy a killed process left half made
    half.mkdir()
    old = time.time() - etc.GRACE_S - 1
    for copy in (named, unused):
        os.utime(copy, (old, old))
    with etc._locked(state / etc.FOLDER, etc.fcntl.LOCK_SH):  # a check under way: nothing goes
        assert etc.prune(state, {named.name}) == []
    assert sorted(etc.prune(state, {named.name})) == sorted([unused.name, half.name])
    assert named.is_dir() and recent.is_dir() and not unused.exists() and not half.exists()
    assert etc.prune(state, set()) == [named.name]  # its sandbox gone


@pytest.mark.bwrap
async def test_a_sandbox_binds_the_copy_as_etc_in_one_mount_and_the_reaper_spares_it_while_it_lives(tmp_path):
    require_bwrap()
    state = tmp_path / "state"
    config = BwrapSandboxConfig(state_dir=state, limits=SandboxLimits(memory_mb=256, pids=64, disk_mb=64))
    host = Path("/etc")
    # a file every Debian has, outside ETC_FILES: asked for as an extra read-only path, it is copied
    extra = next(p for p in ("/etc/shells", "/etc/issue", "/etc/login.defs", "/etc/host.conf") if Path(p).is_file())
    more = BwrapSandboxConfig(state_dir=state, ro_binds=(extra, "/usr/lib"))
    async with open_sandbox(more) as sb:
        assert (await sb.execute(f"cat {extra}")).output == Path(extra).read_text()
        assert (await sb.execute("ls -d /usr/lib")).exit_code == 0
        assert [m for m in (await sb.execute("awk '{print $5}' /proc/self/mountinfo")).output.split()
                if m.startswith("/etc")] == ["/etc", "/etc/passwd", "/etc/group"]
    async with open_sandbox(config) as sb:
        seen = (await sb.execute("ls -A /etc")).output.split()
        expected = {n for n in etc.ETC_FILES if (host / n).exists()} | set(etc.MOUNT_POINTS)
        assert sorted(seen) == sorted(expected)
        mounts = (await sb.execute("awk '{print $5}' /proc/self/mountinfo")).output.split()
        assert [m for m in mounts if m.startswith("/etc")] == ["/etc", "/etc/passwd", "/etc/group"], mounts
        for name in ("hosts", "nsswitch.conf", "os-release"):
            if (host / name).exists():
                assert (await sb.execute(f"cat /etc/{name}")).output == (host / name).read_text(), name
        if (host / "ssl" / "private").exists():
            assert (await sb.execute("ls /etc/ssl/private")).exit_code != 0
        r = await sb.execute("echo x > /etc/hosts || echo x > /etc/new")
        assert r.exit_code != 0 and "Read-only" in r.output
        copy = sb.etc
        hidden = (await sb.execute(f"cat {extra}")).exit_code
        assert json.loads((sb.state / "owner.json").read_text())["etc"] == copy.name
        old = time.time() - etc.GRACE_S - 1
        os.utime(copy, (old, old))
        assert hidden != 0  # the extra path is not in the copy of a sandbox that did not ask for it
        assert copy.name not in reap_local(state) and copy.is_dir()  # a live sandbox binds it
    assert reap_local(state) == [copy.name] and not copy.exists()
