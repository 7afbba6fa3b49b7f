"""
End to end: the real C{twistd -n dallal} and the real C{dallal} command,
over TCP on the loopback, every wait bounded.
"""

import random
import re
import socket
import time

import pytest
import pytest_twisted
from helpers import BrokerProcess, dallal, subscriber
from twisted.internet import reactor
from twisted.internet.defer import Deferred, gatherResults
from twisted.internet.threads import deferToThread

from dallal.client import connect

pytestmark = pytest.mark.e2e

PUBLISHED = b"your message published successfully\n"
PUBLISH_FAILED = b"your message publishing failed\n"
SUBSCRIBE_FAILED = b"subscribing failed\n"

# How long a command may take beyond the time it was told to wait: a Python
# start, a Twisted import and a reactor, on a busy two-core machine.
STARTUP_ALLOWANCE = 8.0
SOCKET_TIMEOUT = 20.0


def publish(port, topic, message):
    result = dallal("127.0.0.1", port, "publish", topic, message)
    assert (result.stdout, result.stderr, result.returncode) == (PUBLISHED, b"", 0)


def rawConnection(port):
    return socket.create_connection(("127.0.0.1", port), timeout=SOCKET_TIMEOUT)


def readUntil(sock, ending):
    """
    Read from C{sock} until what was read ends with C{ending}.
    """
    received = b""
    while not received.endswith(ending):
        chunk = sock.recv(65536)
        assert chunk, f"connection closed after {received[-200:]!r}"
        received += chunk
    return received


def rawPublish(port, topic, payload):
    """
    Publish over a plain socket: the C{dallal} command takes its message as
    an argument, and the system limits an argument to 128 KiB.
    """
    with rawConnection(port) as sock:
        sock.sendall(b"PUB 1 %s %d\r\n%s\r\n" % (topic, len(payload), payload))
        assert readUntil(sock, b"\r\n") == b"PUBACK 1\r\n"


def test_publish(broker):
    result = dallal("127.0.0.1", broker.port, "publish", "news", "hello world")
    assert result.stdout == PUBLISHED
    assert result.returncode == 0


def test_subscribeOnSeveralTopics(broker):
    """
    The subscriber says what it subscribed on, then prints each message as
    C{<topic>: <message>}, in the order they were published, several on one
    topic included.
    """
    listener = subscriber(broker.port, "a", "b", "c")
    try:
        published = [("b", "msg"), ("a", "msg"), ("c", "hello world"), ("a", "again")]
        for topic, message in published:
            publish(broker.port, topic, message)
        expected = b"subscribing on a b c\nb: msg\na: msg\nc: hello world\na: again\n"
        listener.waitUntil(lambda output: len(output) >= len(expected), 20, "messages")
        assert listener.output == expected
    finally:
        assert listener.terminate() == 0


def test_messageWithSpacesAndNewlines(broker):
    message = "  two  spaces\nnew line\r\nCRLF\ttab, 'quotes' \"and\" é\n"
    listener = subscriber(broker.port, "text")
    try:
        publish(broker.port, "text", message)
        expected = b"subscribing on text\ntext: " + message.encode() + b"\n"
        listener.waitUntil(lambda output: len(output) >= len(expected), 20, "the message")
        assert listener.output == expected
    finally:
        assert listener.terminate() == 0


def test_largestPayload(broker):
    """
    A payload of exactly the broker's default maximum, 1 MiB of arbitrary
    bytes, reaches the subscriber intact.
    """
    payload = random.Random(1).randbytes(1024 * 1024)
    listener = subscriber(broker.port, "big")
    try:
        rawPublish(broker.port, b"big", payload)
        expected = b"subscribing on big\nbig: " + payload + b"\n"
        listener.waitUntil(lambda output: len(output) >= len(expected), 30, "1 MiB")
        assert listener.output == expected
    finally:
        assert listener.terminate() == 0


def test_subscriberExitsOnSigterm(broker):
    listener = subscriber(broker.port, "news")
    assert listener.terminate() == 0
    assert listener.output == b"subscribing on news\n"
    broker.waitFor(rb"event=disconnect session=\d+ client=\S+ transport=tcp reason=closed")


def closedPort():
    """
    A loopback port where nothing listens.
    """
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize(
    "command, failed",
    [(["publish", "news", "hello"], PUBLISH_FAILED), (["subscribe", "news"], SUBSCRIBE_FAILED)],
    ids=["publish", "subscribe"],
)
def test_noBroker(command, failed):
    """
    Without a broker the command fails at once, long before its 10 seconds
    are up, with the reason on standard error.
    """
    port = closedPort()
    started = time.monotonic()
    result = dallal("127.0.0.1", port, *command)
    elapsed = time.monotonic() - started
    assert result.stdout == failed
    assert result.returncode == 1
    assert b"refused" in result.stderr
    assert elapsed < STARTUP_ALLOWANCE


@pytest.mark.parametrize(
    "command, failed",
    [
        pytest.param(
            ["publish", "--timeout", "1", "news", "hello"],
            PUBLISH_FAILED,
            id="publish",
        ),
        pytest.param(
            ["subscribe", "--timeout", "1", "news", "sport"], SUBSCRIBE_FAILED, id="subscribe"
        ),
    ],
)
def test_silentServer(command, failed):
    """
    A server that accepts the connection and never answers: the command
    gives up when its timeout is over.
    """
    with socket.create_server(("127.0.0.1", 0)) as silent:
        port = silent.getsockname()[1]
        started = time.monotonic()
        result = dallal("127.0.0.1", port, *command)
        elapsed = time.monotonic() - started
    assert result.stdout == failed
    assert result.returncode == 1
    assert b"no answer" in result.stderr
    assert 1 <= elapsed < 1 + STARTUP_ALLOWANCE


def garbage(rng, size):
    """
    Random bytes, with pieces of frames mixed in: sizes far beyond the
    maximum or beyond any integer type, wrong sizes, bad UTF-8, long lines.
    """
    fragments = [
        b"PUB 1 t 999999999999\r\n",
        b"PUB 2 t 99999999999999999999999999\r\n",
        b"PUB 3 t 1048577\r\n",
        b"PUB 4 t -5\r\n",
        b"PUB 5 t 10\r\n0123456789XX",
        b"SUB 6 \xff\xfe\r\n",
        b"SUB 7 " + b"t" * 5000,
        b"MSG t 5\r\n",
        b"\r\n\n\r",
        b"PING\r\n",
    ]
    parts = []
    while sum(map(len, parts)) < size:
        parts.append(rng.randbytes(rng.randrange(1, 2000)))
        parts.append(rng.choice(fragments))
    return b"".join(parts)


def test_randomBytesDoNotHurtTheBroker(broker):
    """
    A few hundred kilobytes of garbage over several connections: the broker
    answers or closes them, and goes on serving everyone else.
    """
    rng = random.Random(1373)
    for _ in range(8):
        with rawConnection(broker.port) as sock:
            try:
                sock.sendall(garbage(rng, 50_000))
                sock.shutdown(socket.SHUT_WR)
                # Read to the end, so the broker has dealt with everything.
                while sock.recv(65536):
                    pass
            except (BrokenPipeError, ConnectionResetError):
                pass  # the broker closed the connection: that is allowed
    publish(broker.port, "after", "still here")
    broker.waitFor(rb"event=protocol_error ")
    assert b"Traceback" not in broker.output


def test_pings(tmp_path):
    """
    With pings every half second, a raw connection that never answers gets
    three pings, is reported with its address and port for the two it
    missed, then dropped; a C{dallal subscribe} connected all along answers
    every ping and still gets its messages.
    """
    broker = BrokerProcess.plugin(tmp_path, "--ping-interval", "0.5")
    try:
        listener = subscriber(broker.port, "news")
        try:
            subscribed = broker.waitFor(rb"event=subscribe session=\d+ client=(\S+) topic=news")
            with rawConnection(broker.port) as silent:
                host, port = silent.getsockname()
                address = re.escape(f"{host}:{port}".encode())
                pings = b""
                while pings.count(b"PING\r\n") < 3:
                    pings += readUntil(silent, b"PING\r\n")
                assert pings == b"PING\r\n" * 3
                missed = rb"event=ping_missed session=\d+ client=%s missed=" % address
                broker.waitFor(missed + b"1 ")
                broker.waitFor(missed + b"2 ")
                broker.waitFor(rb"event=client_dropped session=\d+ client=%s missed=3 " % address)
                broker.waitFor(
                    rb"event=disconnect session=\d+ client=%s transport=tcp "
                    rb"reason=missed_pings subscriptions=0 " % address
                )
                try:
                    assert silent.recv(100) == b""
                except ConnectionResetError:
                    pass  # aborted rather than closed: it may not be reading
            assert b"client=" + subscribed.group(1) + b" missed" not in broker.output
            publish(broker.port, "news", "still subscribed")
            expected = b"subscribing on news\nnews: still subscribed\n"
            listener.waitUntil(lambda output: len(output) >= len(expected), 20, "message")
            assert listener.output == expected
        finally:
            assert listener.terminate() == 0
    finally:
        broker.stop()


@pytest_twisted.ensureDeferred
async def test_manySubscribers(broker):
    """
    200 connections subscribed to one topic all get the message that the
    C{dallal} command publishes on it.
    """
    count = 200
    timeout = 60
    clients = []
    try:
        for _ in range(count):
            clients.append(
                await connect(reactor, f"tcp:127.0.0.1:{broker.port}").addTimeout(timeout, reactor)
            )
        inboxes = [[] for _ in clients]
        arrived = [Deferred() for _ in clients]

        def receiver(inbox, first):
            def received(message):
                inbox.append((message.topic, message.payload))
                if not first.called:
                    first.callback(None)

            return received

        await gatherResults(
            [
                client.subscribe(["crowd"], receiver(inbox, first))
                for client, inbox, first in zip(clients, inboxes, arrived)
            ]
        ).addTimeout(timeout, reactor)
        result = await deferToThread(
            dallal, "127.0.0.1", broker.port, "publish", "crowd", "hello all"
        )
        assert result.stdout == PUBLISHED
        await gatherResults(arrived).addTimeout(timeout, reactor)
        assert inboxes == [[("crowd", b"hello all")]] * count
    finally:
        await gatherResults([client.close() for client in clients]).addTimeout(timeout, reactor)
