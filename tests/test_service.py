"""
L{dallal.server.service.DallalService}'s TCP listeners on a L{MemoryReactorClock}.
"""

import errno

import pytest
from twisted.internet.error import CannotListenError
from twisted.internet.testing import MemoryReactorClock

from dallal.server.service import DEFAULT_BACKLOG, DallalService, ListenFailed


@pytest.mark.parametrize(
    "description, backlog",
    [
        ("tcp:0:interface=127.0.0.1", DEFAULT_BACKLOG),
        ("tcp:0:backlog=7:interface=127.0.0.1", 7),
        ("tcp:port=0:interface=127.0.0.1:backlog=4096", 4096),
    ],
)
def test_listenQueue(description, backlog):
    """
    A TCP listener's queue of connections not yet accepted holds
    C{DEFAULT_BACKLOG} (Twisted's 50 overflows when the broker is busy for a
    moment), unless its endpoint description says otherwise.
    """
    reactor = MemoryReactorClock()
    service = DallalService(reactor, sysInterval=0)
    service.listenTCP(description)
    service.startService()
    try:
        ((port, factory, queued, interface),) = reactor.tcpServers
        assert (port, queued, interface) == (0, backlog, "127.0.0.1")
    finally:
        service.stopService()


class _BusyReactor(MemoryReactorClock):
    """
    A reactor on which every port is taken.
    """

    def listenTCP(self, port, factory, backlog=50, interface=""):
        raise CannotListenError(interface, port, OSError(errno.EADDRINUSE, "in use"))

    def listenUDP(self, port, protocol, interface="", maxPacketSize=8192):
        raise CannotListenError(interface, port, OSError(errno.EACCES, "denied"))

    def listenUNIX(self, address, factory, backlog=50, mode=0o666, wantPID=0):
        raise CannotListenError(None, address, OSError(errno.ENOENT, "no such file"))


@pytest.mark.parametrize(
    "listen, sentence",
    [
        (
            lambda service: service.listenTCP("tcp:1373:interface=127.0.0.1"),
            "cannot listen on 127.0.0.1:1373: address already in use",
        ),
        (
            lambda service: service.listenTCP("tcp6:1373:interface=\\:\\:1"),
            "cannot listen on [::1]:1373: address already in use",
        ),
        (
            lambda service: service.listenTCP("unix:/run/dallal/broker.sock:lockfile=0"),
            "cannot listen on /run/dallal/broker.sock: no such file or directory",
        ),
        (
            lambda service: service.listenUDP(1234, ""),
            "cannot listen on 0.0.0.0:1234 (UDP): permission denied",
        ),
    ],
)
def test_cannotListen(listen, sentence):
    """
    A port that cannot be bound fails the start with one sentence saying
    where and why.
    """
    service = DallalService(_BusyReactor(), sysInterval=0)
    listen(service)
    with pytest.raises(ListenFailed) as raised:
        service.startService()
    assert str(raised.value) == sentence
