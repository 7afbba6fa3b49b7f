"""
Faults, end to end: the real C{twistd -n --pidfile= dallal} with clients
killed (SIGKILL) in the middle of a frame, a subscriber that stops
answering without closing its connection (stopped with SIGSTOP, or cut off
by taking its network namespace's link down), a SIGTERM in the middle of
traffic, and a data directory that is full or read-only.  Every wait is
bounded.

The other faults of the hardening list are proved elsewhere: a subscriber
that never reads (tests/test_e2e_delivery.py,
test_stoppedSubscriberDoesNotGrowTheBroker), retained messages across a
restart and a data directory unusable at start (tests/test_e2e_topics.py),
SIGTERM with no traffic (tests/test_e2e_tcp.py and every end-to-end test's
BrokerProcess.stop), the ping sweep on a clock (tests/test_keepalive.py),
the shutdown's drain on a clock (tests/test_shutdown.py), and all of them
at once under load (tests/test_soak_short.py, bench/soak.py).
"""

import json
import os
import re
import resource
import signal
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest
import pytest_twisted
from helpers import (
    COMMAND_TIMEOUT,
    LOOPBACK_ANY_PORT,
    STOP_TIMEOUT,
    TWISTD,
    BrokerProcess,
    OutputCollector,
    countersAddUp,
    dallal,
    loggedEvents,
    subscriber,
)
from test_e2e_delivery import publishPipelined
from twisted.internet import reactor
from twisted.internet.defer import Deferred, gatherResults
from twisted.internet.error import ConnectionRefusedError
from twisted.internet.threads import deferToThread

from dallal.client import ServerError, connect

pytestmark = pytest.mark.e2e

PUBLISHED = b"your message published successfully\n"
PUBLISH_FAILED = b"your message publishing failed\n"
TIMEOUT = 30.0


def publish(port, *arguments):
    result = dallal("127.0.0.1", port, "publish", *arguments)
    assert (result.stdout, result.stderr, result.returncode) == (PUBLISHED, b"", 0), result
    return result


def stats(port):
    result = dallal("127.0.0.1", port, "stats", "--json")
    assert result.returncode == 0, result
    return json.loads(result.stdout)


# Clients killed in the middle of a frame.

# Connects, sends the head it is given and that many filler bytes, says so,
# and waits to be killed.
HALF_A_FRAME = """
import socket, sys, time
sock = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
sock.sendall(bytes.fromhex(sys.argv[2]) + b"p" * int(sys.argv[3]))
print("sent from", sock.getsockname()[1], flush=True)
time.sleep(120)
"""

MiB = 1024 * 1024


@pytest.mark.parametrize(
    "head, filler",
    [
        (b"PUB 1 partial 5", 0),
        (b"PUB 1 partial %d\r\n" % MiB, MiB // 2),
        (b"PUB 1 partial 5\r\nhello", 0),
    ],
    ids=["half a control line", "half a payload", "payload without its line end"],
)
def test_clientKilledMidFrame(broker, head, filler):
    """
    A publisher killed with SIGKILL after part of a frame: the broker logs
    its disconnect and no traceback, publishes nothing of it, and goes on
    serving the others.
    """
    listener = subscriber(broker.port, "partial")
    try:
        victim = OutputCollector(
            [sys.executable, "-c", HALF_A_FRAME, broker.port, head.hex(), filler], None
        )
        try:
            port = victim.waitFor(rb"sent from (\d+)\n", COMMAND_TIMEOUT).group(1)
        finally:
            victim.kill()  # SIGKILL
        broker.waitFor(
            rb"event=disconnect session=\d+ client=127\.0\.0\.1:%s transport=tcp reason=closed "
            % port,
            COMMAND_TIMEOUT,
        )
        publish(broker.port, "partial", "whole")
        listener.waitFor(rb"partial: whole\n", COMMAND_TIMEOUT)
        assert listener.output == b"subscribing on partial\npartial: whole\n"
        counters = stats(broker.port)
        assert (counters["published"], counters["bytes_in"]) == (1, len(b"whole"))
    finally:
        assert listener.terminate() == 0


# A subscriber that stops answering.

PING_INTERVAL = 1.0
# How late, beyond the documented bound, a busy two-core machine may log
# the drop.
SCHEDULING_SLACK = 3.0


class Stopped:
    """
    A subscriber stopped with SIGSTOP: its kernel still takes the bytes and
    acks them, but it never answers a PING.  Continued, it finds its
    connection closed.
    """

    brokerOptions = ()

    def __init__(self, tmp_path):
        pass

    def subscribe(self, broker, topic):
        return subscriber(broker.port, topic)

    def silence(self, process):
        process.process.send_signal(signal.SIGSTOP)

    def afterwards(self, process):
        process.process.send_signal(signal.SIGCONT)
        process.waitFor(rb"closed the connection\n", COMMAND_TIMEOUT)
        assert process.process.wait(COMMAND_TIMEOUT) == 1

    def close(self, process):
        if process is not None:
            process.process.send_signal(signal.SIGCONT)
            process.kill()


class Unplugged:
    """
    A subscriber in a network namespace of its own, reaching the broker
    through a virtual cable whose far end goes down: the peer vanishes
    without a FIN or an RST, and the broker's kernel gets no more TCP acks
    (it would retransmit for about 15 minutes before giving up).  Creating
    the namespace needs root; the test is skipped where it is not allowed.
    """

    def __init__(self, tmp_path):
        tag = os.getpid() % 10000
        self.namespace = f"dallal-test-{tag}"
        self.near, self.far = f"dlt{tag}a", f"dlt{tag}b"
        self.brokerAddress, peerAddress = "10.254.73.1", "10.254.73.2"
        self.brokerOptions = ("--tcp", f"tcp:0:interface={self.brokerAddress}")
        inside = ["ip", "netns", "exec", self.namespace]
        self.prefix = inside
        steps = [
            ["ip", "netns", "add", self.namespace],
            ["ip", "link", "add", self.near, "type", "veth", "peer", "name", self.far],
            ["ip", "link", "set", self.far, "netns", self.namespace],
            ["ip", "addr", "add", f"{self.brokerAddress}/30", "dev", self.near],
            ["ip", "link", "set", self.near, "up"],
            [*inside, "ip", "addr", "add", f"{peerAddress}/30", "dev", self.far],
            [*inside, "ip", "link", "set", self.far, "up"],
        ]
        for step in steps:
            done = subprocess.run(step, capture_output=True)
            if done.returncode != 0:
                self.close(None)
                pytest.skip(f"cannot make a network namespace here: {done.stderr.decode()}")

    def subscribe(self, broker, topic):
        listening = rb"event=listening transport=tcp address=%s:(\d+)" % re.escape(
            self.brokerAddress.encode()
        )
        port = int(broker.waitFor(listening).group(1))
        return subscriber(port, topic, host=self.brokerAddress, prefix=self.prefix)

    def silence(self, process):
        subprocess.run([*self.prefix, "ip", "link", "set", self.far, "down"], check=True)

    def afterwards(self, process):
        # It sends nothing over TCP unless asked: it cannot tell.
        pass

    def close(self, process):
        if process is not None:
            process.kill()
        subprocess.run(["ip", "link", "del", self.near], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.namespace], capture_output=True)


@pytest.mark.parametrize("silent", [Stopped, Unplugged], ids=["SIGSTOP", "link down"])
def test_silentSubscriberIsDroppedByPings(tmp_path, silent):
    """
    A subscriber that stops answering PINGs without closing its connection
    is reported missing 1, then 2 pings, and dropped with reason
    missed_pings within 5 ping intervals of going silent (PROTOCOL.md: 4 to
    5 intervals after the last thing it sent); what the broker held for it
    is counted as dropped.  Another subscriber is served throughout.
    """
    silent = silent(tmp_path)
    quiet = None
    try:
        broker = BrokerProcess.plugin(
            tmp_path, "--ping-interval", f"{PING_INTERVAL:g}", *silent.brokerOptions
        )
        try:
            healthy = subscriber(broker.port, "half/open")
            try:
                quiet = silent.subscribe(broker, "half/open")
                subscribed = rb"event=subscribe session=\d+ client=(\S+) topic=half/open "
                broker.waitUntil(
                    lambda output: len(re.findall(subscribed, output)) == 2,
                    COMMAND_TIMEOUT,
                    "both subscriptions",
                )
                healthyAddress, quietAddress = re.findall(subscribed, broker.output)
                quietClient = b"client=" + re.escape(quietAddress)
                silent.silence(quiet)
                silencedAt = time.monotonic()
                # Both at once: the drop comes 2 to 5 intervals after the
                # silence, sooner than two `dallal publish` may start on a
                # busy machine.
                publishPipelined(broker.port, b"half/open", [b"one", b"two"])

                missed = rb"event=ping_missed session=\d+ %s missed=" % quietClient
                broker.waitFor(missed + b"1 ", 4 * PING_INTERVAL + SCHEDULING_SLACK)
                broker.waitFor(missed + b"2 ", 2 * PING_INTERVAL + SCHEDULING_SLACK)
                broker.waitFor(
                    rb"event=client_dropped session=\d+ %s missed=3 " % quietClient,
                    5 * PING_INTERVAL + SCHEDULING_SLACK,
                )
                elapsed = time.monotonic() - silencedAt
                # It last spoke at most 2 intervals (an idle client's ping
                # period) before it went silent.
                assert 2 * PING_INTERVAL <= elapsed <= 5 * PING_INTERVAL + SCHEDULING_SLACK
                broker.waitFor(
                    rb"event=disconnect session=\d+ %s transport=tcp "
                    rb"reason=missed_pings subscriptions=1 " % quietClient,
                    COMMAND_TIMEOUT,
                )
                counters = stats(broker.port)
                # It held "one" unacked and "two" behind it (latest mode).
                assert (counters["clients_dropped"], counters["dropped_disconnected"]) == (1, 2)
                assert countersAddUp(counters), counters
                silent.afterwards(quiet)

                publish(broker.port, "half/open", "three")
                healthy.waitFor(rb"half/open: three\n", COMMAND_TIMEOUT)
                assert healthy.output == (
                    b"subscribing on half/open\nhalf/open: one\nhalf/open: two\nhalf/open: three\n"
                )
                assert b"client=" + healthyAddress + b" missed" not in broker.output
            finally:
                assert healthy.terminate() == 0
        finally:
            broker.stop()
    finally:
        silent.close(quiet)


# SIGTERM in the middle of traffic.

GRACE = 4.0
WINDOW = 50


class Pump:
    """
    Publishes numbered messages over one connection, C{WINDOW} at a time
    without waiting, until the broker refuses one; records which were
    acked, refused, or left unanswered.

    @param publishOne: C{publishOne(number)} returns the publish's Deferred.
    """

    def __init__(self, publishOne):
        self.publishOne = publishOne
        self.acked = []
        self.refused = []
        self.unanswered = []
        self.sent = 0
        self._waiting = []
        self._outstanding = 0

    def start(self):
        while self._outstanding < WINDOW and not self.refused and not self.unanswered:
            self.sent += 1
            self._outstanding += 1
            self.publishOne(self.sent).addCallbacks(
                self._answered,
                self._failed,
                callbackArgs=(self.sent,),
                errbackArgs=(self.sent,),
            )

    def _answered(self, _, number):
        self.acked.append(number)
        self._settled()

    def _failed(self, failure, number):
        if failure.check(ServerError) and failure.value.code == "SHUTTING_DOWN":
            self.refused.append(number)
        else:
            self.unanswered.append(number)
        self._settled()

    def _settled(self):
        self._outstanding -= 1
        for condition, deferred in list(self._waiting):
            if condition():
                self._waiting.remove((condition, deferred))
                deferred.callback(None)
        self.start()

    def until(self, condition):
        """
        @return: a Deferred that fires once C{condition()} is true.
        """
        deferred = Deferred()
        self._waiting.append((condition, deferred))
        return deferred.addTimeout(TIMEOUT, reactor)


async def connected(port):
    return await connect(reactor, f"tcp:127.0.0.1:{port}").addTimeout(TIMEOUT, reactor)


@pytest_twisted.ensureDeferred
async def test_sigtermDuringTraffic(tmp_path):
    """
    SIGTERM while a publisher pipelines messages to two C{all}
    subscribers, one of which never acks: the broker stops accepting
    connections at once, refuses the publishes that follow with
    SHUTTING_DOWN, waits the grace for the unacked ones, and exits cleanly.
    Every message the publisher got a PUBACK for reached the subscriber that
    acks, in order, and nothing else did; the final counters account for
    the other subscriber's as dropped when its connection was closed.
    """
    broker = BrokerProcess.plugin(tmp_path, "--shutdown-grace", f"{GRACE:g}")
    clients = []
    try:
        receiver, holder, publisher = [await connected(broker.port) for _ in range(3)]
        clients += [receiver, holder, publisher]
        received = []
        await receiver.subscribe(
            ["traffic"], lambda message: received.append(int(message.payload)), mode="all"
        ).addTimeout(TIMEOUT, reactor)
        await holder.subscribe(["traffic"], lambda message: Deferred(), mode="all").addTimeout(
            TIMEOUT, reactor
        )
        pump = Pump(lambda number: publisher.publish("traffic", b"%d" % number))
        pump.start()
        await pump.until(lambda: len(pump.acked) >= 500)

        broker.process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        await pump.until(lambda: pump.refused)
        with pytest.raises(ConnectionRefusedError):
            await connected(broker.port)
        await gatherResults([client.whenDisconnected() for client in clients]).addTimeout(
            GRACE + TIMEOUT, reactor
        )
        await deferToThread(broker.process.wait, STOP_TIMEOUT)
        drained = time.monotonic() - signalled
        assert GRACE - 0.5 <= drained <= GRACE + SCHEDULING_SLACK + 2

        acked = pump.acked
        assert acked == list(range(1, len(acked) + 1))
        assert pump.refused == list(range(len(acked) + 1, pump.sent + 1))
        assert pump.unanswered == []
        assert received == acked

        (shutdown,) = loggedEvents(broker.output, "shutdown")
        assert (shutdown["sessions"], shutdown["grace"]) == ("3", f"{GRACE}")
        reasons = [fields["reason"] for fields in loggedEvents(broker.output, "disconnect")]
        assert reasons == ["shutdown"] * 3
        (final,) = loggedEvents(broker.output, "stats")
        assert countersAddUp(final), final
        counted = {name: int(final[name]) for name in ("published", "matched", "acked")}
        assert counted == {"published": len(acked), "matched": 2 * len(acked), "acked": len(acked)}
        assert int(final["dropped_disconnected"]) == len(acked)
        assert int(final["errors"]) == len(pump.refused)
    finally:
        for client in clients:
            client.transport.abortConnection()
        broker.stop()


@pytest_twisted.ensureDeferred
async def test_retainedMessagesAckedBeforeSigtermSurviveTheRestart(tmp_path):
    """
    SIGTERM while a publisher pipelines retained messages over five topics:
    after a restart in the same folder, each topic's retained message is
    the last one acked on it or a later one the broker had taken (a write
    may be on disk before its PUBACK goes out), never an older one.
    """
    topics = 5
    broker = BrokerProcess.plugin(tmp_path)
    publisher = None
    try:
        publisher = await connected(broker.port)
        pump = Pump(
            lambda number: publisher.publish(f"keep/{number % topics}", b"%d" % number, retain=True)
        )
        pump.start()
        await pump.until(lambda: len(pump.acked) >= 200)
        broker.process.send_signal(signal.SIGTERM)
        await publisher.whenDisconnected().addTimeout(TIMEOUT, reactor)
        await deferToThread(broker.process.wait, STOP_TIMEOUT)
    finally:
        if publisher is not None:
            publisher.transport.abortConnection()
        broker.stop()

    restarted = BrokerProcess.plugin(tmp_path)
    try:
        reader = await connected(restarted.port)
        kept = {}
        allKept = Deferred()

        def keep(message):
            kept[message.topic] = int(message.payload)
            if len(kept) == topics:
                allKept.callback(None)

        # Retained messages follow the SUBACK.
        await reader.subscribe(["keep/#"], keep).addTimeout(TIMEOUT, reactor)
        await allKept.addTimeout(TIMEOUT, reactor)
        await reader.close()
        for topic in range(topics):
            lastAcked = max(number for number in pump.acked if number % topics == topic)
            stored = kept[f"keep/{topic}"]
            assert stored % topics == topic
            assert lastAcked <= stored <= pump.sent
    finally:
        restarted.stop()


# A data directory that is full, or read-only.


@contextmanager
def tmpfs(path, *options):
    """
    Mount a small tmpfs at C{path} for the duration, or skip the test where
    that is not allowed (mounting needs root).
    """
    path.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", ",".join(options), "tmpfs", str(path)],
        capture_output=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "--lazy", str(path)], check=True)


def fill(directory):
    """
    Write a file in C{directory} until its file system is full.

    @return: the file.
    """
    filler = directory / "filler"
    descriptor = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(descriptor, b"\0" * 4096)
    except OSError as error:
        assert error.errno == 28, error  # ENOSPC
    finally:
        os.close(descriptor)
    return filler


class FullDisk:
    """
    A data directory on a 1 MiB tmpfs, filled by a file.
    """

    error = b"database or disk is full"
    code = b"SQLITE_FULL"

    def __init__(self, tmp_path):
        self._mount = tmpfs(tmp_path / "data", "size=1m")
        self.directory = self._mount.__enter__()

    def fill(self, pid):
        self._filler = fill(self.directory)

    def free(self, pid):
        self._filler.unlink()

    def close(self):
        self._mount.__exit__(None, None, None)


class FileSizeLimit:
    """
    A data directory on the test's own file system, the broker's files
    limited to 64 KiB by C{RLIMIT_FSIZE} (as a quota would; no root
    needed).  The write fails with C{EFBIG}, which SQLite reports as an
    I/O error.
    """

    error = b"disk I/O error"
    code = b"SQLITE_IOERR_WRITE"

    def __init__(self, tmp_path):
        self.directory = tmp_path / "data"

    def fill(self, pid):
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))

    def free(self, pid):
        resource.prlimit(
            pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY)
        )

    def close(self):
        pass


@pytest.mark.parametrize("disk", [FullDisk, FileSizeLimit], ids=["full tmpfs", "RLIMIT_FSIZE"])
def test_fullDataDirectory(tmp_path, disk):
    """
    A retained publish the disk has no room for is refused with
    STORE_FAILED and the reason, logged as store_failed with SQLite's error
    name, and still delivered to the current subscribers; the topic keeps
    the retained message it had on disk; the broker goes on serving, and
    stores retained messages again once there is room.
    """
    disk = disk(tmp_path)
    try:
        broker = BrokerProcess.plugin(tmp_path, "--data-dir", disk.directory)
        try:
            publish(broker.port, "--retain", "disk/t", "small")
            listener = subscriber(broker.port, "disk/t")
            try:
                listener.waitFor(rb"disk/t: small\n", COMMAND_TIMEOUT)
                disk.fill(broker.process.pid)
                big = "b" * 100_000
                refused = dallal("127.0.0.1", broker.port, "publish", "--retain", "disk/t", big)
                assert (refused.stdout, refused.returncode) == (PUBLISH_FAILED, 1)
                assert refused.stderr.startswith(
                    b"dallal: the broker refused the request: STORE_FAILED: the retained "
                    b"message was not stored: retained message of 'disk/t' not stored in "
                )
                assert refused.stderr.endswith(disk.error + b"\n"), refused.stderr
                broker.waitFor(rb"event=store_failed topic=disk/t error=%s " % disk.code)
                listener.waitFor(rb"disk/t: %s\n" % big.encode(), COMMAND_TIMEOUT)

                publish(broker.port, "disk/t", "not retained")
                listener.waitFor(rb"disk/t: not retained\n", COMMAND_TIMEOUT)
                onDisk = subscriber(broker.port, "disk/t")
                try:
                    onDisk.waitFor(rb"disk/t: small\n", COMMAND_TIMEOUT)
                finally:
                    assert onDisk.terminate() == 0

                disk.free(broker.process.pid)
                publish(broker.port, "--retain", "disk/t", big)
                later = subscriber(broker.port, "disk/t")
                try:
                    later.waitFor(rb"disk/t: %s\n" % big.encode(), COMMAND_TIMEOUT)
                finally:
                    assert later.terminate() == 0
            finally:
                assert listener.terminate() == 0
        finally:
            broker.stop()
    finally:
        disk.close()


@contextmanager
def readOnlyDirectory(path):
    """
    A directory the broker cannot write to: a read-only tmpfs for root (whom
    permissions do not stop), a directory without write permission for
    anyone else.
    """
    if os.geteuid() == 0:
        with tmpfs(path, "ro", "size=64k"):
            yield path
        return
    path.mkdir()
    path.chmod(0o555)
    try:
        yield path
    finally:
        path.chmod(0o755)


def test_readOnlyDataDirectoryStopsTheBrokerAtStart(tmp_path):
    """
    A data directory the broker cannot write to stops twistd at start with
    a one-line reason naming it, not a traceback.
    """
    with readOnlyDirectory(tmp_path / "data") as directory:
        result = subprocess.run(
            [TWISTD, "-n", "--pidfile=", "dallal", "--tcp", LOOPBACK_ANY_PORT,
             "--data-dir", directory],
            cwd=tmp_path,
            capture_output=True,
            timeout=COMMAND_TIMEOUT,
        )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert (
        b"dallal: cannot start: the data directory %s is not writable" % bytes(directory)
    ) in output, output
    assert b"Traceback" not in output, output
