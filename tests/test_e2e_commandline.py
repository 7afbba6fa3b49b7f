"""
End to end: the C{dallal} command as people use it in a shell -- in a
pipeline, with a message that begins with a dash, messages from standard
input or a file, and a subscriber that outlives a broker restart.
"""

import json
import os
import re
import socket
import subprocess

import pytest
from helpers import (
    COMMAND_TIMEOUT,
    DALLAL,
    TWISTD,
    BrokerProcess,
    OutputCollector,
    dallal,
    subscriber,
)

pytestmark = pytest.mark.e2e

PUBLISHED = b"your message published successfully\n"
PUBLISH_FAILED = b"your message publishing failed\n"

# What a command whose standard output was closed exits with.
OUTPUT_GONE = 141


def publish(port, *arguments, input=None):
    return dallal("127.0.0.1", port, "publish", *arguments, input=input)


def stats(port):
    result = dallal("127.0.0.1", port, "stats", "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def closedPipe():
    """
    The writing end of a pipe whose reader is gone.
    """
    reading, writing = os.pipe()
    os.close(reading)
    return writing


# Pipelines


def test_statsIntoHead(broker):
    """
    C{dallal ... stats | head -1}: the first line, and no traceback.
    """
    result = subprocess.run(
        f"'{DALLAL}' 127.0.0.1 {broker.port} stats | head -1",
        shell=True,
        capture_output=True,
        timeout=COMMAND_TIMEOUT,
    )
    assert re.fullmatch(rb"\S+ +\d+\n", result.stdout), result.stdout
    assert (result.stderr, result.returncode) == (b"", 0)


def test_statsIntoAClosedPipe(broker):
    """
    Nobody reads its output: the command stops silently, as one SIGPIPE
    stops.
    """
    output = closedPipe()
    try:
        result = subprocess.run(
            [str(DALLAL), "127.0.0.1", str(broker.port), "stats"],
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.PIPE,
            timeout=COMMAND_TIMEOUT,
        )
    finally:
        os.close(output)
    assert (result.stderr, result.returncode) == (b"", OUTPUT_GONE)


def test_subscriberIntoHead(broker):
    """
    C{dallal ... subscribe t | head -2}: once C{head} has its two lines, the
    subscriber exits at once, without waiting for another message to fail
    to print.
    """
    process = subprocess.Popen(
        [str(DALLAL), "127.0.0.1", str(broker.port), "subscribe", "news"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert process.stdout.readline() == b"subscribing on news\n"
        assert publish(broker.port, "news", "one").stdout == PUBLISHED
        assert process.stdout.readline() == b"news: one\n"
        process.stdout.close()
        assert process.wait(COMMAND_TIMEOUT) == OUTPUT_GONE
        assert process.stderr.read() == b""
    finally:
        process.kill()
        process.wait()


def test_subscriberDoesNotAckWhatItCouldNotPrint(broker):
    """
    A message whose line cannot be written is not acked: the broker counts
    it lost, not delivered, and the subscriber exits at once.
    """
    # A socket, not a pipe: the subscriber only finds out by writing.
    mine, its = socket.socketpair()
    process = subprocess.Popen(
        [str(DALLAL), "127.0.0.1", str(broker.port), "subscribe", "--mode", "all", "news"],
        stdin=subprocess.DEVNULL,
        stdout=its,
        stderr=subprocess.PIPE,
    )
    its.close()
    try:
        received = mine.makefile("rb")
        assert received.readline() == b"subscribing on news\n"
        assert publish(broker.port, "news", "one").stdout == PUBLISHED
        assert received.readline() == b"news: one\n"
        received.close()
        mine.close()
        assert publish(broker.port, "news", "two").stdout == PUBLISHED
        assert process.wait(COMMAND_TIMEOUT) == OUTPUT_GONE
        assert process.stderr.read() == b""
    finally:
        process.kill()
        process.wait()
    broker.waitFor(rb"event=disconnect ")
    counters = stats(broker.port)
    assert (counters["acked"], counters["dropped_disconnected"]) == (1, 1), counters


# Arguments


def test_messageBeginningWithADash(broker):
    listening = subscriber(broker.port, "weather")
    try:
        assert publish(broker.port, "weather", "-5C").stdout == PUBLISHED
        # After --, even what looks like an option is the message.
        assert publish(broker.port, "weather", "--", "--retain").stdout == PUBLISHED
        listening.waitFor(rb"weather: -5C\nweather: --retain\n")
    finally:
        listening.terminate()


def test_everyWithoutCount():
    result = dallal("127.0.0.1", 1373, "publish", "--every", "1", "news", "hello")
    assert result.returncode == 2
    assert result.stdout == b""
    assert result.stderr.endswith(b"dallal: error: --every goes with --count\n")


# Messages from standard input and from a file


def test_publishLinesFromStandardInput(broker):
    """
    C{publish -l}: each line is a message, empty ones are skipped, and the
    success line comes once all are acknowledged -- many more than are
    ever sent unacknowledged at once.
    """
    lines = [f"line {number}" for number in range(250)]
    listening = subscriber(broker.port, "log", mode="all")
    try:
        text = "\n".join(lines[:2]) + "\n\n" + "\r\n".join(lines[2:])
        result = publish(broker.port, "-l", "log", input=text.encode())
        assert (result.stdout, result.stderr, result.returncode) == (PUBLISHED, b"", 0)
        expected = "".join(f"log: {line}\n" for line in lines).encode()
        listening.waitUntil(lambda output: expected in output, COMMAND_TIMEOUT, "every line")
    finally:
        listening.terminate()


def test_publishLinesFromEmptyInput(broker):
    result = publish(broker.port, "-l", "log", input=b"\n\n")
    assert (result.stdout, result.stderr, result.returncode) == (
        PUBLISH_FAILED,
        b"dallal: standard input had no message (empty lines are skipped)\n",
        1,
    )


def test_publishAFile(broker, tmp_path):
    (tmp_path / "notice.txt").write_bytes(b"two\nlines")
    listening = subscriber(broker.port, "notices")
    try:
        result = publish(broker.port, "-f", tmp_path / "notice.txt", "notices")
        assert (result.stdout, result.stderr, result.returncode) == (PUBLISHED, b"", 0)
        listening.waitFor(rb"notices: two\nlines\n")
    finally:
        listening.terminate()


def test_publishAMissingFile(tmp_path):
    result = publish(1373, "-f", tmp_path / "missing.txt", "notices")
    assert result.returncode == 2
    assert result.stderr.endswith(
        f"dallal: error: -f {tmp_path / 'missing.txt'}: No such file or directory\n".encode()
    )


# A broker restart


def test_subscriberReconnects(tmp_path):
    """
    C{subscribe --reconnect} says on standard error that the connection is
    lost and when it is back, and prints the messages published after.
    """
    broker = BrokerProcess.plugin(tmp_path)
    port = broker.port
    listening = OutputCollector(
        [DALLAL, "127.0.0.1", port, "subscribe", "--reconnect", "news"], tmp_path
    )
    try:
        listening.waitFor(rb"subscribing on news\n")
        broker.stop()
        listening.waitFor(
            rb"dallal: the broker at 127\.0\.0\.1:%d closed the connection "
            rb"\(connecting again in \d+\.\d s\)\n" % port
        )
        # The same port again.
        broker = BrokerProcess(
            [TWISTD, "-n", "--pidfile=", "dallal", "--tcp", f"tcp:{port}:interface=127.0.0.1"],
            tmp_path,
        )
        listening.waitFor(
            rb"dallal: connected to 127\.0\.0\.1:%d again, subscribed on news\n" % port
        )
        assert publish(port, "news", "back").stdout == PUBLISHED
        listening.waitFor(rb"news: back\n")
        assert listening.terminate() == 0
    finally:
        listening.kill()
        broker.stop()
