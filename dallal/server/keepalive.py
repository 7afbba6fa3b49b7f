"""
Keepalive: the server pings its clients and drops the ones that stop answering.

One L{PingSweep} serves every connection of a broker: each interval it
reports the peers whose previous ping went unanswered, drops those that have
missed C{maxMissed} in a row, and pings the rest, but for those it heard
from during the interval: any frame proves a connection alive as well as a
C{PONG} would.  A single timer costs the reactor one delayed call however
many clients there are, and an idle client that answers its pings is pinged
every other interval (the C{PONG} counts), which halves the sweep's cost at
tens of thousands of connections.
"""

from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from zope.interface import Attribute, Interface

DEFAULT_INTERVAL = 10.0
DEFAULT_MAX_MISSED = 3


class IPingable(Interface):
    """
    A connection the sweep can ping and drop.
    """

    peer = Attribute("The client's address as 'host:port', for the log.")

    def sendPing():
        """
        Send the peer a ping.
        """

    def pingMissed(missed):
        """
        The last ping went unanswered for a whole interval; C{missed} counts
        how many in a row.
        """

    def keepaliveExpired(missed):
        """
        The peer missed C{missed} pings in a row: drop it.
        """


class _PeerState:
    __slots__ = ("awaiting", "missed", "heard")

    def __init__(self):
        self.awaiting = False
        self.missed = 0
        self.heard = False


class PingSweep:
    """
    Pings registered peers every C{interval} seconds of C{clock}.
    """

    _log = Logger()

    def __init__(self, clock, interval=DEFAULT_INTERVAL, maxMissed=DEFAULT_MAX_MISSED):
        self._clock = clock
        self.interval = interval
        self.maxMissed = maxMissed
        self._peers = {}
        self._loop = None

    def add(self, peer):
        self._peers[peer] = _PeerState()

    def remove(self, peer):
        self._peers.pop(peer, None)

    def pongReceived(self, peer):
        """
        C{peer} answered its ping (for peers that are not really pinged,
        UDP sessions: it sent something).
        """
        state = self._peers.get(peer)
        if state is not None:
            state.awaiting = False
            state.missed = 0

    def heardFrom(self, peer):
        """
        Something arrived from C{peer}: it is alive, so the next sweep does
        not ping it.
        """
        state = self._peers.get(peer)
        if state is not None:
            state.heard = True

    def start(self):
        loop = self._loop = LoopingCall(self.sweep)
        loop.clock = self._clock
        # A LoopingCall whose function raises stops for good: say so loudly.
        loop.start(self.interval, now=False).addErrback(
            lambda failure: self._log.failure("ping sweep stopped", failure)
        )

    def stop(self):
        if self._loop is not None and self._loop.running:
            self._loop.stop()
        self._loop = None

    def sweep(self):
        """
        One period: count missed pings, drop the silent, ping everyone left
        but those heard from since the last sweep.
        """
        for peer, state in list(self._peers.items()):
            if state.heard:
                state.heard = False
                state.awaiting = False
                state.missed = 0
                continue
            if state.awaiting:
                state.missed += 1
                if state.missed >= self.maxMissed:
                    del self._peers[peer]
                    peer.keepaliveExpired(state.missed)
                    continue
                peer.pingMissed(state.missed)
            state.awaiting = True
            peer.sendPing()
