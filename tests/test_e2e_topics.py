"""
End to end: topic filters, retained messages, publishing to every matching
topic, the topics list, and the interactive shell and chat, through the
real C{dallal} command against the real C{twistd dallal}; every wait
bounded.
"""

import fcntl
import json
import os
import re
import socket
import struct
import subprocess
import termios

import pytest
from helpers import (
    COMMAND_TIMEOUT,
    DALLAL,
    LOOPBACK_ANY_PORT,
    TWISTD,
    BrokerProcess,
    Conversation,
    dallal,
    subscriber,
)
from twisted.conch.insults.helper import TerminalBuffer
from twisted.conch.insults.insults import ClientProtocol
from twisted.internet.testing import StringTransport

pytestmark = pytest.mark.e2e

PUBLISHED = b"your message published successfully\n"
PUBLISH_FAILED = b"your message publishing failed\n"


def publish(port, *arguments):
    result = dallal("127.0.0.1", port, "publish", *arguments)
    assert (result.stderr, result.returncode) == (b"", 0)
    return result.stdout


def waitForLine(process, line):
    """
    Wait until C{process} has printed C{line} (bytes, without its line end).
    """
    process.waitFor(b"(?m)^" + re.escape(line) + b"\n", COMMAND_TIMEOUT)


def runShell(port, commands):
    """
    Run C{dallal shell} with C{commands} piped to its standard input.
    """
    return subprocess.run(
        [DALLAL, "127.0.0.1", str(port), "shell"],
        input=commands,
        capture_output=True,
        timeout=COMMAND_TIMEOUT,
    )


def test_singleLevelWildcard(broker):
    """
    C{a/+} matches one level: a/x, not a/x/y nor a itself; C{a/#} matches a
    and every level below it.
    """
    onePlus = subscriber(broker.port, "a/+")
    allBelow = subscriber(broker.port, "a/#")
    try:
        for topic in ("a/x/y", "a", "a/x", "b/x", "a/z"):
            publish(broker.port, topic, f"on {topic}")
        waitForLine(onePlus, b"a/z: on a/z")
        waitForLine(allBelow, b"a/z: on a/z")
        assert onePlus.output == b"subscribing on a/+\na/x: on a/x\na/z: on a/z\n"
        assert allBelow.output == (
            b"subscribing on a/#\na/x/y: on a/x/y\na: on a\na/x: on a/x\na/z: on a/z\n"
        )
    finally:
        assert onePlus.terminate() == 0
        assert allBelow.terminate() == 0


def storeRetained(port, count):
    """
    Publish C{count} retained messages, on r/0 to r/<count - 1>, pipelined
    over one raw connection, and wait for their PubAcks.
    """
    with socket.create_connection(("127.0.0.1", port), timeout=COMMAND_TIMEOUT) as sock:
        sock.sendall(b"".join(b"PUB %d r/%d 1 retain=1\r\nx\r\n" % (n, n) for n in range(count)))
        received = b""
        while received.count(b"PUBACK ") < count:
            chunk = sock.recv(65536)
            assert chunk and b"ERR" not in received, received[-200:]
            received += chunk


def test_subscribingToEverythingGetsEveryRetainedMessage(broker):
    """
    C{subscribe --mode fire '#'} over 5000 retained messages, more than the
    subscriber's queue holds: they come as fast as it reads, none dropped.
    """
    count = 5000
    storeRetained(broker.port, count)
    everything = subscriber(broker.port, "#", mode="fire")
    try:
        everything.waitUntil(
            lambda output: output.count(b"\nr/") >= count, COMMAND_TIMEOUT, f"{count} messages"
        )
    finally:
        assert everything.terminate() == 0
    lines = [line for line in everything.output.split(b"\n") if line.startswith(b"r/")]
    assert sorted(lines) == sorted(b"r/%d: x" % n for n in range(count))


def test_retainedMessageOutlivesTheBroker(tmp_path):
    """
    A retained message is on disk once published (under the broker's
    ./dallal-data), so a broker started afresh in the same folder still
    gives it to new subscribers; an empty retained message clears one.
    """
    first = BrokerProcess.plugin(tmp_path)
    try:
        assert publish(first.port, "--retain", "news/today", "sunny") == PUBLISHED
        assert publish(first.port, "--retain", "news/old", "stale") == PUBLISHED
        assert publish(first.port, "--retain", "news/old", "") == PUBLISHED
    finally:
        first.stop()
    second = BrokerProcess.plugin(tmp_path)
    try:
        listener = subscriber(second.port, "news/#")
        try:
            publish(second.port, "news/end", "live")
            waitForLine(listener, b"news/end: live")
            assert listener.output == (
                b"subscribing on news/#\nnews/today: sunny\nnews/end: live\n"
            )
        finally:
            assert listener.terminate() == 0
    finally:
        second.stop()


def test_publishToMatchingAndTopics(broker):
    """
    C{publish --to-matching} reaches every existing topic the filter
    matches (subscribed by name, or retained) and says how many; a plain
    publish refuses a filter and says what to use; C{topics} lists them.
    """
    listener = subscriber(broker.port, "WEATHER/MN", "WEATHER/WI")
    try:
        assert publish(broker.port, "--retain", "WEATHER/TX", "hot") == PUBLISHED
        assert publish(broker.port, "--to-matching", "WEATHER/#", "storm") == (
            PUBLISHED + b"published on 3 topics\n"
        )
        waitForLine(listener, b"WEATHER/WI: storm")
        assert listener.output == (
            b"subscribing on WEATHER/MN WEATHER/WI\nWEATHER/MN: storm\nWEATHER/WI: storm\n"
        )
        assert publish(broker.port, "--to-matching", "NEWS/+", "quiet") == (
            PUBLISHED + b"no topic matches NEWS/+\n"
        )

        refused = dallal("127.0.0.1", broker.port, "publish", "WEATHER/+", "storm")
        assert (refused.stdout, refused.returncode) == (PUBLISH_FAILED, 1)
        assert refused.stderr == (
            b"dallal: the broker refused the request: BAD_TOPIC: '+' and '#' are "
            b"reserved for subscription wildcards (publish --to-matching publishes "
            b"on every topic a filter matches)\n"
        )

        table = dallal("127.0.0.1", broker.port, "topics")
        assert (table.stdout, table.stderr, table.returncode) == (
            b"TOPIC       RETAINED  SUBSCRIBERS\n"
            b"WEATHER/MN  -         1\n"
            b"WEATHER/TX  3 bytes   0\n"
            b"WEATHER/WI  -         1\n",
            b"",
            0,
        )
        first = dallal("127.0.0.1", broker.port, "topics", "--limit", "1")
        assert first.stdout == (
            b"TOPIC       RETAINED  SUBSCRIBERS\nWEATHER/MN  -         1\n(showing 1 of 3 topics)\n"
        )
        asJson = dallal("127.0.0.1", broker.port, "topics", "--json", "--limit", "1")
        assert json.loads(asJson.stdout) == {
            "topics": [{"topic": "WEATHER/MN", "retained_bytes": None, "subscribers": 1}],
            "total": 3,
            "truncated": True,
        }
    finally:
        assert listener.terminate() == 0


def test_shellFromAPipe(broker):
    """
    Commands piped in are carried out in order, with no prompt and no
    terminal control sequences; errors (the broker's and the user's) go to
    standard error, one line each, and the shell goes on; /disc leaves with
    exit status 0.
    """
    tooLarge = b"x" * (1024 * 1024 + 1)
    result = runShell(
        broker.port,
        b"/sub a/+\n/SUB b all\n/sub a/#/b\n/pub a/x hi there\n/pub a/y %s\n/list\n"
        b"/unsub a/+\n/unsub nope\n/list\n/frobnicate\n/disc\n/list\n" % tooLarge,
    )
    assert result.stdout == (
        b"subscribed to a/+\n"
        b"subscribed to b\n"
        b"a/x: hi there\n"
        b"published on a/x\n"
        b"2 subscriptions:\n"
        b"  a/+ (latest)\n"
        b"  b (all)\n"
        b"unsubscribed from a/+\n"
        b"1 subscription:\n"
        b"  b (all)\n"
        b"disconnected\n"
    )
    assert result.stderr == (
        b"error: '#' must be the last level of a filter (BAD_TOPIC)\n"
        b"error: payload of 1048577 bytes is larger than the maximum of 1048576 "
        b"(PAYLOAD_TOO_LARGE)\n"
        b"error: not subscribed to 'nope' (NOT_SUBSCRIBED)\n"
        b"error: unknown command /frobnicate; /help lists the commands\n"
    )
    assert result.returncode == 0


def test_shellEndOfInputLeaves(broker):
    result = runShell(broker.port, b"/sub x\r\n/list\r\n")
    assert (result.stdout, result.stderr, result.returncode) == (
        b"subscribed to x\n1 subscription:\n  x (latest)\ndisconnected\n",
        b"",
        0,
    )


def chatter(port, name):
    process = subprocess.Popen(
        [DALLAL, "127.0.0.1", str(port), "chat", "--name", name, "room"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    conversation = Conversation(process, process.stdout.fileno(), process.stdin.fileno())
    conversation.expect(re.escape(f"chatting on room as {name}\n".encode()))
    return conversation


def test_chatBetweenTwoProcesses(broker):
    """
    Each side sees the other's lines signed with the other's name, and not
    its own lines.
    """
    alice = chatter(broker.port, "alice")
    try:
        bob = chatter(broker.port, "bob")
        try:
            alice.type(b"hello bob\n")
            bob.expect(b"alice: hello bob\n")
            bob.type(b"hi alice\n")
            alice.expect(b"bob: hi alice\n")
            bob.process.stdin.close()
            assert bob.wait() == 0
            bob.expect(b"disconnected\n")
        finally:
            bob.process.kill()
        alice.process.stdin.close()
        assert alice.wait() == 0
        alice.expect(b"disconnected\n")
    finally:
        alice.process.kill()
    assert alice.output == b"chatting on room as alice\nbob: hi alice\ndisconnected\n"
    assert bob.output == b"chatting on room as bob\nalice: hello bob\ndisconnected\n"


def screen(output, columns=80):
    """
    What a terminal shows after receiving C{output}: its non-blank rows.
    """
    terminal = ClientProtocol(TerminalBuffer)
    terminal.makeConnection(StringTransport())
    terminal.terminal.width = columns
    terminal.terminal.reset()
    terminal.dataReceived(output)
    return [row.rstrip() for row in bytes(terminal.terminal).decode().split("\n") if row.strip()]


class TerminalShell(Conversation):
    """
    C{dallal shell} on a pseudo-terminal of 80 columns, which the test keeps
    open after the shell exits to see the state it left it in.
    """

    def __init__(self, port):
        master, self.terminal = os.openpty()
        fcntl.ioctl(self.terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
        self.settings = termios.tcgetattr(self.terminal)
        process = subprocess.Popen(
            [DALLAL, "127.0.0.1", str(port), "shell"],
            stdin=self.terminal,
            stdout=self.terminal,
            stderr=self.terminal,
            start_new_session=True,
        )
        Conversation.__init__(self, process, master, master)
        self.expect(re.escape(b"connected; /help lists the commands\r\ndallal> "))

    def close(self):
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(COMMAND_TIMEOUT)
        os.close(self.readFrom)
        os.close(self.terminal)

    def assertGivenBack(self):
        """
        The terminal is as it was: echo and line editing back, blocking.
        """
        assert termios.tcgetattr(self.terminal) == self.settings
        assert not fcntl.fcntl(self.terminal, fcntl.F_GETFL) & os.O_NONBLOCK


def test_shellOnATerminal(broker):
    """
    On a terminal a message that arrives while a line is half typed is
    printed on its own line, and the prompt and the partial input are drawn
    again below it; the line can then be finished.  Ctrl-D leaves, and gives
    the terminal back as it was.
    """
    shell = TerminalShell(broker.port)
    try:
        shell.type(b"/sub news\r")
        shell.expect(re.escape(b"subscribed to news\r\ndallal> "))
        shell.type(b"/pub news hel")
        shell.expect(re.escape(b"dallal> /pub news hel"))
        assert publish(broker.port, "news", "from elsewhere") == PUBLISHED
        shell.expect(re.escape(b"news: from elsewhere\r\ndallal> /pub news hel"))
        assert screen(shell.output)[-2:] == ["news: from elsewhere", "dallal> /pub news hel"]
        shell.type(b"lo\r")
        shell.expect(re.escape(b"published on news\r\ndallal> "))
        assert screen(shell.output)[-5:] == [
            "news: from elsewhere",
            "dallal> /pub news hello",
            "news: hello",
            "published on news",
            "dallal>",
        ]
        # Ctrl-D on an empty line.
        shell.type(b"\x04")
        shell.expect(re.escape(b"disconnected\r\n"))
        assert shell.wait() == 0
        assert screen(shell.output)[-1] == "disconnected"
        shell.assertGivenBack()
    finally:
        shell.close()


def test_shellOnATerminalStoppedBySigterm(broker):
    """
    SIGTERM stops the shell quietly, with exit status 0, and the terminal
    is given back all the same.
    """
    shell = TerminalShell(broker.port)
    try:
        shell.type(b"/pub news hal")
        shell.expect(re.escape(b"dallal> /pub news hal"))
        shell.process.terminate()
        assert shell.wait() == 0
        shell.assertGivenBack()
        # The last thing it writes takes the prompt off the screen.
        shell.expect(re.escape(b"\r\x1b[K"))
        assert screen(shell.output)[-1] == "connected; /help lists the commands"
        assert b"error" not in shell.output
    finally:
        shell.close()


@pytest.mark.parametrize(
    "makeStore, reason",
    [
        (lambda directory: (directory / "dallal-data").write_text("a file"), b"dallal-data"),
        (
            lambda directory: (
                (directory / "dallal-data").mkdir()
                or (directory / "dallal-data" / "retained.sqlite3").write_bytes(b"\0garbage" * 512)
            ),
            b"retained.sqlite3",
        ),
        (
            lambda directory: (
                (directory / "dallal-data").mkdir()
                or (directory / "dallal-data" / "retained.sqlite3").write_bytes(b"")
            ),
            b"retained.sqlite3 is empty",
        ),
    ],
    ids=["not a directory", "corrupt", "empty"],
)
def test_unusableStoreStopsTheBrokerAtStart(tmp_path, makeStore, reason):
    """
    A data directory that cannot hold the store, or a store that is not a
    database (or an empty file), stops twistd at start with a one-line reason naming the path,
    not a traceback.
    """
    makeStore(tmp_path)
    result = subprocess.run(
        [TWISTD, "-n", "--pidfile=", "dallal", "--tcp", LOOPBACK_ANY_PORT],
        cwd=tmp_path,
        capture_output=True,
        timeout=COMMAND_TIMEOUT,
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert b"dallal: cannot start:" in output and reason in output, output
    assert b"Traceback" not in output, output
