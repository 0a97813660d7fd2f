"""The shell session's channel and capture, without a sandbox: the end marker is found wherever
the output put it, and a stream nobody reads pauses instead of growing."""

from __future__ import annotations

import asyncio

from sandboxes.shell import Channel, _Capture

MARKER = b"\n\x1f" + b"0123456789abcdef" * 2 + b"\x1f"


def test_marker_in_the_head_is_found_after_output_went_on_into_the_tail():
    # the command printed little, then a process it left running printed on before the nonce came
    capture = _Capture(4096)
    capture.add(b"started\n" + MARKER + b"a" * 10_000)
    after = capture.cut_marker(MARKER)
    assert after == b"a" * 10_000
    assert capture.text() == "started\n" and capture.total == len("started\n")


def test_marker_across_the_head_and_tail_is_found():
    capture = _Capture(64)  # a head of 32 bytes
    out = b"x" * 20
    capture.add(out + MARKER[:12])
    capture.add(MARKER[12:] + b"later" + b"b" * 100)
    assert capture.cut_marker(MARKER) == b"later" + b"b" * 100
    assert capture.text() == "x" * 20


def test_marker_in_the_tail_after_a_cut():
    capture = _Capture(64)
    capture.add(b"c" * 1_000_000)
    capture.add(MARKER + b"tail")
    assert capture.cut_marker(MARKER) == b"tail"
    assert capture.total == 1_000_000 and "bytes cut" in capture.text()


def test_marker_not_yet_there_is_none_and_the_head_is_searched_once():
    capture = _Capture(4096)
    capture.add(b"y" * 3000)
    assert capture.cut_marker(MARKER) is None
    capture.add(MARKER[:10])
    assert capture.cut_marker(MARKER) is None
    capture.add(MARKER[10:])
    assert capture.cut_marker(MARKER) == b"" and capture.text() == "y" * 3000


def test_a_stream_past_twice_its_limit_pauses_until_read_below_it():
    calls = []
    channel = Channel(limit=1000)
    channel.pause = lambda fd, on: calls.append((fd, on))
    channel.feed(1, b"o" * 1500)
    channel.feed(2, b"e" * 10)
    assert calls == []
    channel.feed(1, b"o" * 600)  # 2100 > 2000
    assert calls == [(1, True)]
    channel.feed(1, b"o" * 600)  # paused already: no second call
    assert calls == [(1, True)]
    assert len(channel.take_out(1000)) == 1000 and calls == [(1, True)]  # 1700 left
    assert len(channel.take_out(800)) == 800 and calls == [(1, True), (1, False)]  # 900 left
    assert channel.take_out() == b"o" * 900


def test_control_lines_one_at_a_time_and_the_rest_at_the_end():
    channel = Channel(limit=1000)
    channel.feed(2, b"ready 12\nexi")
    assert channel.take_line() == b"ready 12\n"
    assert channel.take_line() is None
    channel.feed(2, b"ted 0\npartial")
    assert channel.take_line() == b"exited 0\n"
    assert channel.take_line() is None
    channel.feed_eof(2)
    assert channel.take_line() == b"partial" and channel.take_line() is None


def test_a_line_longer_than_the_limit_is_given_whole_not_kept_growing():
    channel = Channel(limit=100)
    channel.feed(2, b"z" * 150)
    assert channel.take_line() == b"z" * 150 and len(channel.err) == 0


async def test_wait_wakes_on_either_stream_or_returns_false_at_its_deadline():
    loop = asyncio.get_running_loop()
    channel = Channel()
    assert await channel.wait(loop.time() + 0.05) is False
    loop.call_later(0.01, channel.feed, 2, b"x\n")
    assert await channel.wait(loop.time() + 5) is True
    loop.call_later(0.01, channel.feed_eof, 1)
    assert await channel.wait() is True and channel.out_eof


async def test_wait_wakes_only_for_what_its_reader_can_use():
    """A whole stderr line (or more than the limit without one), the stdout bytes asked for, a
    stream's end, or a paused stream: a partial line or fewer bytes leave the waiter asleep."""
    loop = asyncio.get_running_loop()
    channel = Channel(limit=100)

    async def woken(feed, out_bytes=1) -> bool:
        loop.call_soon(feed)
        return await channel.wait(loop.time() + 0.05, out_bytes)

    assert not await woken(lambda: channel.feed(2, b"no newline yet"))
    assert await woken(lambda: channel.feed(2, b" now\n"))
    assert channel.take_line() == b"no newline yet now\n"
    assert await woken(lambda: channel.feed(2, b"x" * 101))  # past the limit: take_line gives it whole
    assert channel.take_line() == b"x" * 101
    assert not await woken(lambda: channel.feed(1, b"a" * 9), out_bytes=10)
    assert await woken(lambda: channel.feed(1, b"a"), out_bytes=10)
    assert await woken(lambda: channel.feed(1, b"a"))  # any byte by default
    channel.take_out()
    channel.pause = lambda fd, on: None
    assert await woken(lambda: channel.feed(1, b"p" * 201), out_bytes=1000)  # paused: it must be read
    channel.take_out()
    assert await woken(lambda: channel.feed_eof(1), out_bytes=1000)
    assert await woken(lambda: channel.feed_eof(2))



# The session end to end on a plain supervisor (no sandbox around it), over both ways of running
# the process: pipes and a pidfd on the event loop (PipeProcess), and asyncio's subprocess
# transport (TransportProcess, the fallback where the kernel has no pidfd).

import os  # noqa: E402
import signal  # noqa: E402

import pytest  # noqa: E402

from sandboxes import shell  # noqa: E402


@pytest.fixture(params=["pidfd", "transport"])
def kind(request, monkeypatch):
    if request.param == "pidfd" and not shell._HAS_PIDFD:
        pytest.fail("this kernel has no pidfd_open: PipeProcess cannot be tested here")
    monkeypatch.setattr(shell, "_HAS_PIDFD", request.param == "pidfd")
    return request.param


async def _session(limit: int = 4096) -> shell.ShellSession:
    return await shell.ShellSession.start(["bash", "--noprofile", "--norc", "-c", shell.SUPERVISOR],
                                          output_limit=limit)


async def _no_kill(include_shell: bool) -> None:
    raise AssertionError("no command here times out")


async def test_a_session_runs_commands_keeps_state_and_cuts_long_output(kind):
    fds = set(os.listdir("/proc/self/fd"))
    session = await _session()
    want = shell.PipeProcess if kind == "pidfd" else shell.TransportProcess
    assert type(session.proc) is want
    try:
        r = await session.run("cd /tmp && X=41; echo $((X + 1)); false", 10, _no_kill)
        assert (r.output, r.exit_code, r.timed_out) == ("42\n", 1, False)
        r = await session.run("pwd; echo $X", 10, _no_kill)
        assert r.output == "/tmp\n41\n"
        # 3 MB of output: past twice the channel's limit the pipe pauses, the capture keeps the ends
        r = await session.run("head -c 3000000 /dev/zero | tr '\\0' a; echo; echo end", 30, _no_kill)
        assert r.exit_code == 0 and r.output_bytes == 3000005
        assert r.output.startswith("a" * 2048) and r.output.endswith("a\nend\n") and "bytes cut" in r.output
        # a command larger than the pipe's buffer: written in parts as the shell reads
        big = "echo " + "b" * 300_000
        r = await session.run(big, 30, _no_kill)
        assert r.exit_code == 0 and r.output_bytes == 300_001
    finally:
        await session.kill()
    assert session.proc.returncode == -signal.SIGKILL and not session.alive
    await asyncio.sleep(0)  # asyncio's transport closes its pipes on the next turn of the loop
    assert set(os.listdir("/proc/self/fd")) <= fds  # its pipes (and pidfd) are closed


async def test_a_command_wakes_its_reader_once_whatever_its_writes(kind, monkeypatch):
    """A command's output, end marker and control line come in separate writes (here its output
    in three, apart in time); the command's reader waits for its control line, not for each, so
    its task steps once per command: each wake-up cost a step and a timer."""
    wakes = []
    woken = shell.Channel._wake

    def counted(self, moved: bool) -> None:
        if self._waiter is not None and not self._waiter.done():
            wakes.append(moved)
        woken(self, moved)

    monkeypatch.setattr(shell.Channel, "_wake", counted)
    session = await _session()
    try:
        wakes.clear()
        r = await session.run("printf a; sleep 0.05; printf b; sleep 0.05; echo c", 10, _no_kill)
        assert (r.output, r.exit_code) == ("abc\n", 0)
        assert wakes == [True]
        wakes.clear()
        r = await session.run("echo out; echo err >&2; sleep 0.05; false", 10, _no_kill)
        assert r.output == "out\nerr\n" and r.exit_code == 1 and wakes == [True]
    finally:
        await session.kill()


async def test_a_shell_that_exits_is_replaced_and_a_dead_session_is_told(kind):
    session = await _session()
    try:
        with pytest.raises(shell.ShellDied) as died:
            await session.run("echo bye; exit 3", 10, _no_kill)
        assert died.value.returncode == 3 and "bye" in died.value.output
        r = await session.run("echo again", 10, _no_kill)
        assert (r.output, r.exit_code) == ("again\n", 0)
        os.kill(session.proc.pid, signal.SIGKILL)  # the supervisor first: no shell comes back
        os.kill(session.shell_pid, signal.SIGKILL)  # then the shell holding the pipes
        with pytest.raises(shell.SessionDead) as dead:
            await session.run("echo never", 10, _no_kill)
        assert dead.value.returncode == -signal.SIGKILL
    finally:
        await session.kill()
    assert await session.proc.wait() == -signal.SIGKILL
