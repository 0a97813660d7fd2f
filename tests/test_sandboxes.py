"""Containment and shell behaviour, on bubblewrap and on Docker (real sandboxes, no fakes)."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

import pytest

from sandboxes.base import SandboxError, SandboxLimits, open_sandbox
from tests.sandbox_fixtures import backend, btrfs_docker, make_config, require_bwrap  # noqa: F401 - fixtures

pytestmark = pytest.mark.slow


def host_processes_with(needle: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    found.append(int(entry.name))
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                pass
    return found


async def test_shell_state_carries_over(backend, tmp_path):
    async with open_sandbox(make_config(backend, tmp_path)) as sb:
        assert (await sb.execute("cd /tmp && export GREETING=hi && mkdir -p d")).exit_code == 0
        r = await sb.execute("pwd; echo $GREETING; echo oops >&2; exit_code_test() { return 7; }; exit_code_test")
        assert (r.output, r.exit_code, r.timed_out) == ("/tmp\nhi\noops\n", 7, False)
        r = await sb.execute("printf 'no newline'")
        assert r.output == "no newline"
        r = await sb.execute("cat")  # stdin is /dev/null: must not eat the protocol
        assert (r.output, r.exit_code) == ("", 0)
        assert (await sb.execute("id -u")).output.strip() == "1000"


async def test_output_cannot_forge_the_end_marker(backend, tmp_path):
    forged = ("printf '\\n\\037%s\\037' 0123456789abcdef0123456789abcdef; "
              "echo '0123456789abcdef0123456789abcdef 0' >&2; echo ready 1 >&2; echo exited 0 >&2; "
              "echo tail; exit_code=3; (exit 4)")
    async with open_sandbox(make_config(backend, tmp_path)) as sb:
        r = await sb.execute(forged)
        assert r.exit_code == 4
        assert r.output == ("\n\x1f0123456789abcdef0123456789abcdef\x1f"
                            "0123456789abcdef0123456789abcdef 0\nready 1\nexited 0\ntail\n")
        assert (await sb.execute("echo next")).output == "next\n"


async def test_command_timeout_kills_the_process_tree(backend, tmp_path):
    async with open_sandbox(make_config(backend, tmp_path)) as sb:
        r = await sb.execute("sleep 100000.25 & sleep 100000.5; echo never", timeout_s=1)
        assert r.timed_out and r.exit_code is None and "never" not in r.output
        assert 1 <= r.duration_s < 10
        assert host_processes_with("100000.25") == host_processes_with("100000.5") == []
        assert (await sb.execute("echo still here")).output.endswith("still here\n")


async def test_command_that_never_prints_times_out(backend, tmp_path):
    async with open_sandbox(make_config(backend, tmp_path)) as sb:
        r = await sb.execute("tail -f /dev/null", timeout_s=1)
        assert r.timed_out and r.output_bytes < 200


async def test_shell_builtin_loop_times_out_and_keeps_the_shell(backend, tmp_path):
    async with open_sandbox(make_config(backend, tmp_path)) as sb:
        await sb.execute("cd /tmp && export X=1")
        r = await sb.execute("while :; do :; done; echo never", timeout_s=1)
        assert r.timed_out and not r.shell_restarted and "never" not in r.output
        assert (await sb.execute("pwd; echo $X")).output == "/tmp\n1\n"


async def test_shell_that_ignores_the_interrupt_is_replaced(backend, tmp_path):
    async with open_sandbox(make_config(backend, tmp_path)) as sb:
        await sb.execute("echo kept > /tmp/f; cd /tmp")
        r = await sb.execute("trap '' USR1; while :; do :; done", timeout_s=1)
        assert r.timed_out and r.shell_restarted and "fresh shell" in r.output
        assert (await sb.execute("pwd; cat /tmp/f")).output == "/work\nkept\n"


async def test_fork_bomb_is_contained(backend, tmp_path):
    async with open_sandbox(make_config(backend, tmp_path, pids=64)) as sb:
        await sb.execute(":(){ :|:& };:", timeout_s=5)
        await asyncio.sleep(2)  # let it hit the process limit
        r = await sb.execute("ls /proc | grep -c '^[0-9]'", timeout_s=3)
        if not r.timed_out and r.exit_code == 0:  # the count itself may not get to fork
            # dying bomb processes may print "fork: Resource temporarily unavailable" around the count
            counts = [int(line) for line in r.output.splitlines() if line.strip().isdigit()]
            assert counts and counts[-1] <= 64 + 5, r.output[-500:]
        r = await sb.execute("sleep 5", timeout_s=2)  # always times out: the timeout clears the bomb
        assert r.timed_out
        r = await sb.execute("ls /proc | grep -c '^[0-9]'", timeout_s=10)
        assert r.exit_code == 0 and int(r.output.split()[-1]) < 20, r
        assert (await sb.execute("echo alive")).output == "alive\n"


async def test_memory_hog_is_killed(backend, tmp_path):
    hog = "python3 -c 'a = []\nwhile True: a.append(bytearray(10**7))'"
    async with open_sandbox(make_config(backend, tmp_path, memory_mb=128)) as sb:
        r = await sb.execute(hog, timeout_s=60)
        assert r.exit_code in (137, 1) and not r.timed_out, r
        assert (await sb.execute("echo alive")).output == "alive\n"


async def test_huge_output_is_capped_in_the_middle(backend, tmp_path):
    async with open_sandbox(make_config(backend, tmp_path, output_limit_bytes=4096)) as sb:
        r = await sb.execute("echo START; head -c 1000000000 /dev/zero | tr '\\0' a; echo; echo END",
                             timeout_s=300)
        assert r.exit_code == 0 and not r.timed_out
        assert r.output_bytes == 1_000_000_000 + len("START\n\nEND\n")
        assert r.output.startswith("START\naaa") and r.output.endswith("aaa\nEND\n")
        assert "bytes cut" in r.output and len(r.output) < 4096 + 100


async def test_output_left_running_between_commands_waits_in_its_pipe(backend, tmp_path):
    """A process still printing after its command returned is not read into the worker's memory
    past the session's limit (its stream pauses), and the next command still ends, its output
    capped as any."""
    async with open_sandbox(make_config(backend, tmp_path, output_limit_bytes=4096)) as sb:
        r = await sb.execute("(head -c 64000000 /dev/zero | tr '\\0' a; echo FLOOD-END) & echo started")
        assert r.exit_code == 0 and "started" in r.output
        channel = sb.shell.channel
        await asyncio.sleep(2)  # unpaused, the 64 MB would all be read by now
        held = len(channel.out)
        assert channel.limit < held <= 2 * channel.limit + (1 << 20), held
        r = await sb.execute("wait; echo next", timeout_s=120)
        assert r.exit_code == 0 and r.output.endswith("FLOOD-END\nnext\n"), r.output[-200:]
        assert "bytes cut" in r.output and len(channel.out) == 0
        assert (await sb.execute("echo quiet")).output == "quiet\n"


async def test_writes_outside_the_work_tree_fail_and_never_reach_the_host(backend, tmp_path):
    async with open_sandbox(make_config(backend, tmp_path)) as sb:
        for target in ("/usr/swerve-escape", "/etc/swerve-escape", "/swerve-escape"):
            r = await sb.execute(f"echo x > {target}")
            assert r.exit_code != 0, target
            assert not Path(target).exists()
        assert (await sb.execute("echo x > /work/inside && echo x > /tmp/inside")).exit_code == 0


async def test_host_files_are_not_readable(backend, tmp_path):
    secret = Path("/tmp") / f"swerve-secret-{os.getpid()}"
    secret.write_text("host secret")
    try:
        async with open_sandbox(make_config(backend, tmp_path)) as sb:
            for command in (f"cat {secret}", "cat /etc/shadow", "ls /root"):
                r = await sb.execute(command)
                assert r.exit_code != 0 and "host secret" not in r.output, command
            await sb.execute("ln -s /etc/shadow /work/link; ln -s " + str(secret) + " /work/link2")
            with pytest.raises(FileNotFoundError):  # the sandbox's /tmp is its own
                await sb.read_file("link2")
            try:  # the sandbox's own /etc/shadow (absent, or not readable by the sandbox user)
                content = await sb.read_file("link")
            except (FileNotFoundError, SandboxError):
                content = b""
            assert b"host secret" not in content and b"root:" not in content
    finally:
        secret.unlink()


async def test_no_network_by_default(backend, tmp_path):
    with socket.socket() as server:  # a host service the sandbox must not reach
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        probe = (f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}), 2)\" "
                 "&& echo CONNECTED; python3 -c \"import socket; "
                 "socket.create_connection(('1.1.1.1', 53), 2)\" && echo CONNECTED")
        async with open_sandbox(make_config(backend, tmp_path)) as sb:
            r = await sb.execute(probe, timeout_s=30)
        assert "CONNECTED" not in r.output and "Error" in r.output


@pytest.mark.parametrize("killer", ["exit", "exit 5", "kill -9 $$"])
async def test_killing_the_shell_gives_a_fresh_shell(backend, tmp_path, killer):
    async with open_sandbox(make_config(backend, tmp_path)) as sb:
        await sb.execute("cd /tmp && export X=1 && echo kept > /work/file")
        r = await sb.execute(killer)
        assert r.shell_restarted and "fresh shell" in r.output
        r = await sb.execute("pwd; echo ${X:-unset}; cat /work/file")
        assert r.output == "/work\nunset\nkept\n"


async def test_killing_the_shell_is_an_error_when_configured(backend, tmp_path):
    async with open_sandbox(make_config(backend, tmp_path, on_shell_exit="error")) as sb:
        with pytest.raises(SandboxError, match="exited"):
            await sb.execute("exit 2")


async def test_files_round_trip_binary_and_big(backend, tmp_path):
    blob = bytes(range(256)) * 4096 + b"\x00\xff"
    async with open_sandbox(make_config(backend, tmp_path)) as sb:
        await sb.write_file("deep/dir/blob.bin", blob)
        assert await sb.read_file("/work/deep/dir/blob.bin") == blob
        assert (await sb.execute("wc -c < deep/dir/blob.bin")).output.strip() == str(len(blob))
        with pytest.raises(FileNotFoundError):
            await sb.read_file("missing.txt")


async def test_lifetime_ends_the_sandbox(backend, tmp_path):
    async with open_sandbox(make_config(backend, tmp_path, lifetime_s=2)) as sb:
        assert (await sb.execute("echo up")).exit_code == 0
        if backend == "docker":
            from sandboxes.docker import reap_containers

            await asyncio.sleep(2.5)
            reap_containers()
        else:
            await asyncio.sleep(2.5)
        with pytest.raises(SandboxError):
            await sb.execute("echo still up")


@pytest.mark.parametrize("backend", ["bwrap", pytest.param("docker", marks=pytest.mark.docker)])
async def test_disk_limit_holds_for_the_work_tree(backend, tmp_path, request, monkeypatch):
    """disk_mb bounds what the agent writes into its work tree on both backends (Docker: the
    engine's --storage-opt size, on an engine with its data on btrfs), and what it removes is
    free again."""
    if backend == "bwrap":
        require_bwrap()
    else:
        monkeypatch.setenv("DOCKER_HOST", request.getfixturevalue("btrfs_docker"))
        monkeypatch.setenv("SWERVE_DOCKER_DISK_LIMIT", "enforce")
    async with open_sandbox(make_config(backend, tmp_path, disk_mb=32)) as sb:
        r = await sb.execute("head -c 64000000 /dev/zero > /work/big")
        assert r.exit_code != 0 and ("No space left" in r.output or "Disk quota exceeded" in r.output), r.output
        assert int((await sb.execute("stat -c %s /work/big")).output) <= 32 * 2**20
        assert (await sb.execute("rm /work/big && echo freed")).output == "freed\n"
        assert (await sb.execute("head -c 4000000 /dev/zero > /work/small && echo wrote")).output == "wrote\n"


@pytest.mark.docker
async def test_an_engine_that_cannot_limit_disk_is_refused_clearly(monkeypatch):
    """Where the engine cannot limit a container's writes, no sandbox starts unless the
    operator accepts a work tree without a limit (SWERVE_DOCKER_DISK_LIMIT=tmp-only)."""
    from sandboxes import docker as docker_sandbox
    from sandboxes.config import DockerSandboxConfig
    from tests.sandbox_fixtures import require_docker

    require_docker()
    monkeypatch.setenv("SWERVE_DOCKER_DISK_LIMIT", "enforce")
    monkeypatch.setattr(docker_sandbox, "disk_limit_mode", lambda client, image: (None, "storage driver vfs on extfs"))
    with pytest.raises(SandboxError, match="cannot limit a container's disk .storage driver vfs on extfs.*"
                                           "SWERVE_DOCKER_DISK_LIMIT=tmp-only"):
        async with open_sandbox(DockerSandboxConfig(limits=SandboxLimits(disk_mb=32))):
            pass
    monkeypatch.setenv("SWERVE_DOCKER_DISK_LIMIT", "tmp-only")
    async with open_sandbox(DockerSandboxConfig(limits=SandboxLimits(disk_mb=32))) as sb:
        assert (await sb.execute("echo up")).output == "up\n"
