"""
Acknowledged delivery end to end: the real C{twistd -n dallal}, the real
C{dallal} command and L{dallal.client}, over TCP on the loopback, every wait
bounded.  Slow consumers are C{dallal subscribe} processes stopped with
SIGSTOP; the broker's memory is read from C{/proc/<pid>/status}.
"""

import json
import os
import re
import signal
import socket
import time

import pytest
import pytest_twisted
from helpers import DALLAL, BrokerProcess, OutputCollector, SlowHandler, countersAddUp, dallal
from twisted.internet import reactor
from twisted.internet.defer import Deferred, gatherResults
from twisted.internet.task import deferLater
from twisted.internet.threads import deferToThread

from dallal.client import connect

pytestmark = pytest.mark.e2e

MiB = 1024 * 1024
FLOOD = 50
GROWTH_LIMIT = 32 * MiB
PUBLISHED = b"your message published successfully\n"
TIMEOUT = 30.0
GAP = re.compile(rb"^dallal: (\S+): (\d+) message\(s\) not received", re.MULTILINE)


@pytest.fixture
def startBroker(tmp_path):
    """
    Start C{twistd -n dallal} with extra options; each is stopped (and
    checked for a clean exit) at the end of the test.
    """
    started = []

    def start(*options):
        process = BrokerProcess.plugin(tmp_path, *map(str, options))
        started.append(process)
        return process

    yield start
    for process in started:
        process.stop()


class Subscriber:
    """
    A C{dallal subscribe} process: what it prints on standard output is
    collected, what it reports on standard error goes to a file.
    """

    def __init__(self, port, topic, errors, mode=None):
        self.topic = topic.encode()
        self.errors = errors
        modeOptions = ["--mode", mode] if mode else []
        self.collector = OutputCollector(
            ["sh", "-c", 'exec "$@" 2>"$0"', errors, DALLAL, "127.0.0.1", port, "subscribe"]
            + modeOptions
            + [topic],
            None,
        )
        self.pid = self.collector.process.pid
        try:
            self.collector.waitFor(re.escape(b"subscribing on " + self.topic + b"\n"), TIMEOUT)
        except BaseException:
            self.collector.kill()
            raise

    def signal(self, number):
        os.kill(self.pid, number)

    def waitForLine(self, payload, timeout=TIMEOUT):
        """
        Wait until the last line printed is the message C{payload}.
        """
        line = self.topic + b": " + payload + b"\n"
        self.collector.waitUntil(lambda output: output.endswith(line), timeout, "the last message")

    def waitForLines(self, count, timeout=TIMEOUT):
        self.collector.waitUntil(
            lambda output: output.count(b"\n") >= count + 1, timeout, f"{count} messages"
        )

    def payloads(self):
        """
        The payload of each message line printed after C{subscribing on}.
        """
        header, *lines = self.collector.output.split(b"\n")
        assert header == b"subscribing on " + self.topic
        assert lines[-1] == b"", "the output ends in the middle of a line"
        prefix = self.topic + b": "
        assert all(line.startswith(prefix) for line in lines[:-1])
        return [line[len(prefix) :] for line in lines[:-1]]

    def gaps(self):
        """
        The number of missed messages each gap report on standard error gave.
        """
        return [int(missed) for _, missed in GAP.findall(self.errors.read_bytes())]

    def stop(self):
        """
        Continue it if it was stopped, then stop it with SIGTERM.

        @return: its exit status.
        """
        if self.collector.process.poll() is None:
            self.signal(signal.SIGCONT)
        return self.collector.terminate()


@pytest.fixture
def subscribers(tmp_path):
    """
    Start L{Subscriber}s; any still running at the end is stopped.
    """
    started = []

    def start(port, topic, mode=None):
        errors = tmp_path / f"subscriber-{len(started)}.stderr"
        process = Subscriber(port, topic, errors, mode)
        started.append(process)
        return process

    yield start
    for process in started:
        process.stop()


def residentBytes(pid):
    """
    The resident memory of process C{pid}, from C{/proc}.
    """
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                size, unit = line.split()[1:]
                assert unit == "kB"
                return int(size) * 1024
    raise AssertionError(f"no VmRSS for process {pid}")


def floodPayload(number):
    """
    1 MiB (the broker's largest payload) that says which message it is, and
    whose filler differs from its neighbours'.
    """
    head = b"%04d " % number
    return head + bytes([ord("a") + number % 26]) * (MiB - len(head))


def numberOf(payload):
    return int(payload[:4])


def publishPipelined(port, topic, payloads):
    """
    Publish every payload over one raw connection without waiting, then
    wait for all the PubAcks.
    """
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as sock:
        for number, payload in enumerate(payloads):
            sock.sendall(b"PUB %d %s %d\r\n" % (number, topic, len(payload)))
            sock.sendall(payload)
            sock.sendall(b"\r\n")
        expected = b"".join(b"PUBACK %d\r\n" % number for number in range(len(payloads)))
        received = b""
        while len(received) < len(expected):
            chunk = sock.recv(65536)
            assert chunk, f"connection closed after {received[-200:]!r}"
            received += chunk
        assert received == expected


@pytest.mark.parametrize("mode", [None, "fire"], ids=["latest", "fire"])
def test_stoppedSubscriberDoesNotGrowTheBroker(startBroker, subscribers, mode):
    """
    50 messages of 1 MiB for a subscriber stopped with SIGSTOP: the broker's
    resident memory grows by less than 32 MiB, and once continued the
    subscriber prints the last message, intact, after any others it got (in
    order), and reports on standard error as many missed as it did not get.
    """
    broker = startBroker()
    listener = subscribers(broker.port, "flood", mode)
    listener.signal(signal.SIGSTOP)
    before = residentBytes(broker.process.pid)
    publishPipelined(broker.port, b"flood", [floodPayload(n) for n in range(1, FLOOD + 1)])
    growth = residentBytes(broker.process.pid) - before
    assert growth < GROWTH_LIMIT, f"the broker grew by {growth / MiB:.1f} MiB"

    listener.signal(signal.SIGCONT)
    listener.waitForLine(floodPayload(FLOOD))
    received = listener.payloads()
    numbers = [numberOf(payload) for payload in received]
    assert received == [floodPayload(number) for number in numbers]
    assert numbers == sorted(set(numbers))
    assert numbers[-1] == FLOOD
    assert len(numbers) < FLOOD
    assert sum(listener.gaps()) == FLOOD - len(numbers)
    assert listener.stop() == 0


async def connected(port):
    return await connect(reactor, f"tcp:127.0.0.1:{port}").addTimeout(TIMEOUT, reactor)


async def closeAll(clients):
    await gatherResults([client.close() for client in clients]).addTimeout(TIMEOUT, reactor)


async def statsWhen(client, predicate, what, timeout=TIMEOUT):
    """
    Ask the broker for its counters until C{predicate(stats)} is true.

    @return: those counters.
    """
    deadline = reactor.seconds() + timeout
    while True:
        stats = await client.stats().addTimeout(TIMEOUT, reactor)
        if predicate(stats):
            return stats
        assert reactor.seconds() < deadline, f"no {what} within {timeout} s: {stats}"
        await deferLater(reactor, 0.05)


async def publishAll(client, topic, payloads):
    await gatherResults([client.publish(topic, payload) for payload in payloads]).addTimeout(
        TIMEOUT, reactor
    )


@pytest_twisted.ensureDeferred
async def test_allModeSlowAcksLoseNothing(startBroker, subscribers):
    """
    In C{all} mode a subscriber that acks more slowly than the ack timeout
    gets redeliveries, yet its handler sees every message once, in order;
    the C{dallal subscribe --mode all} command prints each one exactly once.
    """
    count = 200
    # The handler takes about a second to work through a full window of 100,
    # so messages are sent two or three times; 20 attempts keep a busy
    # machine from turning that into drops.
    broker = startBroker("--ack-timeout", "0.5", "--max-attempts", "20")
    printer = subscribers(broker.port, "work", "all")
    handler = SlowHandler(0.01, reactor)
    subscriber = await connected(broker.port)
    publisher = await connected(broker.port)
    try:
        await subscriber.subscribe(["work"], handler, mode="all").addTimeout(TIMEOUT, reactor)
        payloads = [b"job %03d" % number for number in range(1, count + 1)]
        await publishAll(publisher, "work", payloads)
        stats = await statsWhen(
            publisher, lambda stats: stats["acked"] == 2 * count, f"{2 * count} acks"
        )
        assert handler.seen == list(zip(range(1, count + 1), payloads))
        assert stats["redelivered"] > 0
        assert (stats["dropped"], stats["inflight"]) == (0, 0)
        assert countersAddUp(stats), stats
        assert printer.payloads() == payloads
        assert printer.gaps() == []
    finally:
        await closeAll([subscriber, publisher])


def silentHandler(handed):
    """
    A handler that never finishes: its messages are never acked.
    """

    def handle(message):
        handed.append(message)
        return Deferred()

    return handle


def tableRows(output):
    """
    The C{name value} rows of C{dallal stats}, as numbers.
    """
    rows = (line.split() for line in output.decode("ascii").splitlines())
    return {name: json.loads(value) for name, value in rows}


@pytest_twisted.ensureDeferred
async def test_mixedRunAddsUp(startBroker, subscribers):
    """
    Subscribers in every mode, one of them killed mid-run and one that never
    acks: the counters C{dallal stats --json} prints add up, count what was
    published, and C{dallal stats} prints the same numbers.
    """
    batch = 100
    topic = "mixed"
    # No redelivery while the test runs, so that the counters settle.
    broker = startBroker("--ack-timeout", "60")
    printers = [subscribers(broker.port, topic, mode) for mode in ("latest", "all", "fire")]
    doomed = subscribers(broker.port, topic, "all")
    clients = [await connected(broker.port) for _ in range(5)]
    publisher, *listeners = clients
    try:
        inboxes = []
        for client, mode in zip(listeners, ("latest", "all", "fire")):
            inbox = []
            inboxes.append(inbox)
            await client.subscribe([topic], inbox.append, mode=mode).addTimeout(TIMEOUT, reactor)
        silent = []
        await listeners[3].subscribe([topic], silentHandler(silent)).addTimeout(TIMEOUT, reactor)
        subscriptions = len(printers) + 1 + len(listeners)
        payloads = [b"mixed %03d" % number for number in range(1, 2 * batch + 1)]

        await publishAll(publisher, topic, payloads[:batch])
        doomed.signal(signal.SIGKILL)
        await statsWhen(
            publisher,
            lambda stats: stats["subscriptions"] == subscriptions - 1,
            "the killed subscriber's disconnect",
        )
        await publishAll(publisher, topic, payloads[batch:])

        for printer in printers:
            await deferToThread(printer.waitForLine, payloads[-1])
        # The silent subscriber holds its first message, unacked, and the
        # last one, waiting; everything else has ended one way or another.
        settled = await statsWhen(
            publisher,
            lambda stats: (
                stats["inflight"] == 2
                and all(inbox and inbox[-1].payload == payloads[-1] for inbox in inboxes)
            ),
            "settled deliveries",
        )
        assert [message.payload for message in silent] == payloads[:1]
        assert settled["published"] == 2 * batch
        assert settled["matched"] == batch * subscriptions + batch * (subscriptions - 1)
        assert settled["fired"] == 2 * 2 * batch
        assert settled["replaced"] >= 2 * batch - 2
        assert countersAddUp(settled), settled

        reported = await deferToThread(dallal, "127.0.0.1", broker.port, "stats", "--json")
        table = await deferToThread(dallal, "127.0.0.1", broker.port, "stats")
        assert (reported.returncode, reported.stderr) == (0, b"")
        assert (table.returncode, table.stderr) == (0, b"")
        counters = json.loads(reported.stdout)
        assert countersAddUp(counters), counters
        assert counters["published"] == 2 * batch
        # Each `dallal stats` is a connection of its own, and time passes.
        changing = {"uptime", "connections", "connections_total"}
        rows = tableRows(table.stdout)
        assert rows.keys() == counters.keys()
        for name in counters.keys() - changing:
            assert (name, rows[name]) == (name, counters[name])
            assert (name, settled[name]) == (name, counters[name])
    finally:
        await closeAll(clients)


def test_publishCountEvery(startBroker, subscribers):
    """
    C{publish --count 5 --every 0.1} takes at least 0.4 s, prints its
    success line once, and an C{all} subscriber gets the 5 messages; a
    C{latest} subscriber stopped meanwhile gets the first and the last, and
    reports the 3 in between on standard error.
    """
    broker = startBroker()
    everything = subscribers(broker.port, "ticks", "all")
    stopped = subscribers(broker.port, "ticks")
    stopped.signal(signal.SIGSTOP)
    started = time.monotonic()
    result = dallal(
        "127.0.0.1", broker.port, "publish", "--count", "5", "--every", "0.1", "ticks", "tick"
    )
    elapsed = time.monotonic() - started
    assert (result.stdout, result.stderr, result.returncode) == (PUBLISHED, b"", 0)
    assert elapsed >= 0.4
    everything.waitForLines(5)
    stopped.signal(signal.SIGCONT)
    stopped.waitForLines(2)
    assert everything.stop() == 0
    assert stopped.stop() == 0
    assert everything.payloads() == [b"tick"] * 5
    assert everything.gaps() == []
    assert stopped.payloads() == [b"tick"] * 2
    assert stopped.gaps() == [3]
