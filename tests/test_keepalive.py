"""
L{dallal.server.keepalive.PingSweep} on a fake clock: a ping every interval, a
report for each one missed, a drop after three in a row.
"""

from twisted.internet.task import Clock
from zope.interface import implementer
from zope.interface.verify import verifyObject

from dallal.server.keepalive import IPingable, PingSweep

INTERVAL = 10.0


@implementer(IPingable)
class Peer:
    """
    Records what the sweep does to it; answers pings only when told to.
    """

    def __init__(self, peer):
        self.peer = peer
        self.pings = 0
        self.missed = []
        self.expired = []

    def sendPing(self):
        self.pings += 1

    def pingMissed(self, missed):
        self.missed.append(missed)

    def keepaliveExpired(self, missed):
        self.expired.append(missed)


def started(*addresses):
    """
    A started sweep on a fresh clock, with one L{Peer} per address.
    """
    clock = Clock()
    sweep = PingSweep(clock, INTERVAL)
    peers = [Peer(address) for address in addresses]
    for peer in peers:
        sweep.add(peer)
    sweep.start()
    return clock, sweep, peers


def tick(clock, intervals):
    """
    Let C{intervals} intervals pass, one at a time (a L{LoopingCall} runs
    once for a single jump over several of its intervals).
    """
    for _ in range(intervals):
        clock.advance(INTERVAL)


def test_peerInterface():
    verifyObject(IPingable, Peer("127.0.0.1:1"))


def test_pingEachInterval():
    """
    Every peer gets one ping per interval, the first one interval after the
    start; peers that answer are never reported.
    """
    clock, sweep, peers = started("127.0.0.1:1", "127.0.0.1:2")
    clock.advance(INTERVAL - 0.001)
    assert [peer.pings for peer in peers] == [0, 0]
    clock.advance(0.001)
    for interval in range(1, 6):
        assert [peer.pings for peer in peers] == [interval, interval]
        for peer in peers:
            sweep.pongReceived(peer)
        tick(clock, 1)
    assert [(peer.missed, peer.expired) for peer in peers] == [([], []), ([], [])]


def test_missedPingsReportedThenDropped():
    """
    A silent peer is reported once per interval it leaves a ping
    unanswered, counting in a row, and is dropped at the third; it is never
    pinged again.  Its neighbour, who answers, is unaffected.
    """
    clock, sweep, (silent, healthy) = started("127.0.0.1:1", "127.0.0.1:2")
    clock.advance(INTERVAL)  # first ping
    for expectedMissed in ([], [1], [1, 2]):
        assert silent.missed == expectedMissed
        assert silent.expired == []
        sweep.pongReceived(healthy)
        clock.advance(INTERVAL)
    assert silent.missed == [1, 2]
    assert silent.expired == [3]
    assert silent.pings == 3
    for _ in range(5):
        sweep.pongReceived(healthy)
        clock.advance(INTERVAL)
    assert (silent.pings, silent.missed, silent.expired) == (3, [1, 2], [3])
    assert (healthy.pings, healthy.missed, healthy.expired) == (9, [], [])


def test_pongResetsTheCount():
    """
    Only misses in a row count: a pong after two misses starts again from
    zero, so five misses in all do not drop the peer.
    """
    clock, sweep, (peer,) = started("127.0.0.1:1")
    tick(clock, 3)  # pinged, missed 1, missed 2
    assert peer.missed == [1, 2]
    sweep.pongReceived(peer)
    tick(clock, 3)  # pinged, missed 1, missed 2
    assert peer.missed == [1, 2, 1, 2]
    assert peer.expired == []
    clock.advance(INTERVAL)
    assert peer.expired == [3]


def test_unsolicitedPongIsHarmless():
    """
    A pong from a peer that was not pinged, or is not known, changes
    nothing.
    """
    clock, sweep, (peer,) = started("127.0.0.1:1")
    sweep.pongReceived(peer)
    sweep.pongReceived(Peer("127.0.0.1:9"))
    tick(clock, 2)
    assert (peer.pings, peer.missed) == (2, [1])


def test_removedPeerIsForgotten():
    clock, sweep, (gone, staying) = started("127.0.0.1:1", "127.0.0.1:2")
    clock.advance(INTERVAL)
    sweep.remove(gone)
    sweep.remove(gone)  # removing twice is harmless
    tick(clock, 5)
    assert (gone.pings, gone.missed, gone.expired) == (1, [], [])
    assert staying.expired == [3]


def test_newPeerIsNotReportedBeforeItsFirstPing():
    """
    A peer that arrives between two sweeps has had no ping to miss.
    """
    clock, sweep, _ = started()
    clock.advance(INTERVAL * 1.5)
    late = Peer("127.0.0.1:3")
    sweep.add(late)
    clock.advance(INTERVAL * 0.5)
    assert (late.pings, late.missed) == (1, [])


def test_stop():
    clock, sweep, (peer,) = started("127.0.0.1:1")
    clock.advance(INTERVAL)
    sweep.stop()
    sweep.stop()  # stopping twice is harmless
    tick(clock, 10)
    assert (peer.pings, peer.missed, peer.expired) == (1, [], [])
    assert clock.getDelayedCalls() == []


def test_aPeerHeardFromIsNotPinged():
    """
    A peer heard from during an interval is not pinged at its end, and its
    count of missed pings starts again; one that then falls silent is
    pinged, reported and dropped as any other, one interval later.
    """
    clock, sweep, (peer,) = started("127.0.0.1:1")
    tick(clock, 2)  # pinged, missed 1
    assert (peer.pings, peer.missed) == (2, [1])
    for _ in range(3):
        sweep.heardFrom(peer)
        tick(clock, 1)
    assert (peer.pings, peer.missed) == (2, [1])
    tick(clock, 4)  # pinged, missed 1, missed 2, dropped
    assert (peer.pings, peer.missed, peer.expired) == (5, [1, 1, 2], [3])


def test_heardFromAnUnknownPeerIsHarmless():
    clock, sweep, (peer,) = started("127.0.0.1:1")
    sweep.heardFrom(Peer("127.0.0.1:9"))
    sweep.remove(peer)
    sweep.heardFrom(peer)
    tick(clock, 1)
    assert peer.pings == 0
