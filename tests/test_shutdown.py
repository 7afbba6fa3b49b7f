"""
A broker that stops (L{dallal.server.service.DallalService.stopService}), on a
clock: it stops accepting connections, refuses new work with
C{SHUTTING_DOWN}, lets what is in flight be acked for a bounded grace, then
closes every session and logs its final counters.
"""

from helpers import BrokerHarness, FakeDatagramTransport, MemoryRetained, decodeFrames, resultOf
from twisted.internet.defer import Deferred
from twisted.internet.testing import MemoryReactorClock

from dallal.broker.core import DRAIN_CHECK_INTERVAL, BrokerConfig

GRACE = 2.0


def subscribedClient(harness, mode="all"):
    client = harness.connect()
    client.send(b"SUB s news mode=%s\r\n" % mode.encode())
    assert client.received() == b"SUBACK s\r\n"
    return client


def deliveryIds(data):
    """
    The delivery id (C{id=}) of each C{MSG} in C{data}.
    """
    return [
        frame.line.split(b" id=")[1].split(b" ")[0]
        for frame in decodeFrames(data)
        if frame.verb == b"MSG"
    ]


def finalStats(harness):
    (stats,) = harness.fields("stats")
    return stats


def test_drainEndsOnceEverythingIsAcked():
    """
    While messages are unacked the broker waits, refuses new publishes and
    subscriptions with SHUTTING_DOWN (what it did accept was acked), and
    still takes acks; once the last one is acked it closes every connection
    at its next check, long before the grace is over, having lost nothing.
    """
    harness = BrokerHarness(shutdownGrace=GRACE)
    subscriber = subscribedClient(harness)
    publisher = harness.connect()
    publisher.send(b"PUB 1 news 3\r\none\r\nPUB 2 news 3\r\ntwo\r\n")
    assert publisher.received() == b"PUBACK 1\r\nPUBACK 2\r\n"
    first, second = deliveryIds(subscriber.received())

    stopped = harness.service.stopService()
    assert harness.fields("shutdown") == [{"sessions": 2, "inflight": 2, "grace": GRACE}]
    publisher.send(b"PUB 3 news 5\r\nthree\r\nSUB 4 other\r\nPING\r\n")
    refused = decodeFrames(publisher.received())
    assert [frame.line.split(b" ")[:3] for frame in refused[:2]] == [
        [b"ERR", b"3", b"SHUTTING_DOWN"],
        [b"ERR", b"4", b"SHUTTING_DOWN"],
    ]
    assert refused[2].line == b"PONG"
    subscriber.send(b"ACK " + first + b"\r\n")
    harness.clock.advance(DRAIN_CHECK_INTERVAL)
    assert not stopped.called
    assert not subscriber.closing

    subscriber.send(b"ACK " + second + b"\r\n")
    harness.clock.advance(DRAIN_CHECK_INTERVAL)
    resultOf(stopped)
    assert subscriber.closing and publisher.closing
    assert [fields["reason"] for fields in harness.fields("disconnect")] == ["shutdown"] * 2
    stats = finalStats(harness)
    assert (stats["published"], stats["acked"], stats["dropped"], stats["inflight"]) == (2, 2, 0, 0)


def test_graceBoundsTheDrain():
    """
    A subscriber that never acks holds the broker for the grace, no longer;
    its message is then dropped as disconnected, and counted.
    """
    harness = BrokerHarness(shutdownGrace=GRACE)
    subscriber = subscribedClient(harness)
    publisher = harness.connect()
    publisher.send(b"PUB 1 news 4\r\nheld\r\n")
    assert publisher.received() == b"PUBACK 1\r\n"

    stopped = harness.service.stopService()
    harness.clock.advance(GRACE - DRAIN_CHECK_INTERVAL)
    assert not stopped.called and not subscriber.closing
    harness.clock.advance(DRAIN_CHECK_INTERVAL)
    resultOf(stopped)
    assert subscriber.closing
    stats = finalStats(harness)
    assert (stats["dropped"], stats["dropped_disconnected"], stats["inflight"]) == (1, 1, 0)


def test_noGraceClosesAtOnce():
    harness = BrokerHarness(shutdownGrace=0)
    subscriber = subscribedClient(harness)
    harness.connect().send(b"PUB 1 news 4\r\nheld\r\n")
    resultOf(harness.service.stopService())
    assert subscriber.closing
    assert finalStats(harness)["dropped_disconnected"] == 1


def test_fireAndLatestNeedNoAcksToDrain():
    """
    Only unacked deliveries hold the drain: with a C{fire} subscriber and a
    C{latest} one that acked, the broker closes at once.
    """
    harness = BrokerHarness(shutdownGrace=GRACE)
    fire = subscribedClient(harness, "fire")
    latest = subscribedClient(harness, "latest")
    harness.connect().send(b"PUB 1 news 2\r\nhi\r\n")
    (delivery,) = deliveryIds(latest.received())
    latest.send(b"ACK " + delivery + b"\r\n")
    resultOf(harness.service.stopService())
    assert fire.closing and latest.closing


class PendingStore(MemoryRetained):
    """
    A retained store whose one write is on its way to the disk until the
    test says it is written.
    """

    def __init__(self):
        MemoryRetained.__init__(self)
        self.written = Deferred()
        self.closed = False

    @property
    def writing(self):
        return not self.written.called

    def set(self, topic, payload):
        return self.written

    def close(self):
        self.closed = True
        return Deferred()


def test_retainedWriteFinishesDuringTheDrain():
    """
    A retained message still being written when the broker stops holds the
    drain; once it is on disk its publisher gets the PUBACK, then the store
    is closed.
    """
    harness = BrokerHarness(shutdownGrace=GRACE)
    store = harness.broker.retained = PendingStore()
    publisher = harness.connect()
    publisher.send(b"PUB 1 kept 4 retain=1\r\nthis\r\n")
    assert publisher.received() == b""

    harness.service.stopService()
    harness.clock.advance(GRACE / 2)
    assert not publisher.closing and not store.closed
    store.written.callback(None)
    assert publisher.received() == b"PUBACK 1\r\n"
    harness.clock.advance(DRAIN_CHECK_INTERVAL)
    assert publisher.closing and store.closed


class ListeningClock(MemoryReactorClock):
    """
    A memory reactor with fake UDP ports as well as TCP ones.
    """

    def listenUDP(self, port, protocol, interface="", maxPacketSize=8192):
        transport = FakeDatagramTransport((interface, port))
        protocol.makeConnection(transport)
        return transport


def test_listenersStopBeforeTheDrainAndUdpAfter():
    """
    TCP listeners stop at once (no new connections); UDP ports stay open
    while draining, since UDP clients' acks come through them, and close
    with the sessions.
    """
    harness = BrokerHarness(BrokerConfig(), shutdownGrace=GRACE, clock=ListeningClock())
    tcp = harness.service.listenTCP("tcp:0:interface=127.0.0.1")
    udp = harness.service.listenUDP(0)
    subscribedClient(harness)
    harness.connect().send(b"PUB 1 news 4\r\nheld\r\n")

    stopped = harness.service.stopService()
    assert (tcp.running, tcp.port) == (False, None)
    assert udp.port is not None
    harness.clock.advance(GRACE)
    resultOf(stopped)
    assert udp.port is None
