"""
L{dallal.server.service.DallalService}'s TCP listeners on a L{MemoryReactorClock}.
"""

import pytest
from twisted.internet.testing import MemoryReactorClock

from dallal.server.service import DEFAULT_BACKLOG, DallalService


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
