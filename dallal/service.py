"""
The broker as a Twisted service, for twistd or for embedding.

L{DallalService} is a C{MultiService}: it owns one L{Broker} core and its
ping sweep, and has one child L{ListenerService} per endpoint, all sharing
that core (as C{twisted.names.tap} puts a TCP and a UDP server over one
resolver).
"""

from twisted.application.service import MultiService, Service
from twisted.internet.endpoints import serverFromString

from dallal.core import Broker, BrokerConfig
from dallal.keepalive import DEFAULT_INTERVAL, PingSweep
from dallal.tcp import BrokerFactory, formatAddress


class ListenerService(Service):
    """
    Listens on one stream endpoint while running, and logs where.

    Listening happens in C{privilegedStartService}, as Twisted's own
    C{StreamServerEndpointService} does, so a port that cannot be bound
    stops twistd at start with the reason instead of leaving a broker that
    serves nothing.
    """

    def __init__(self, endpoint, factory, events):
        self.endpoint = endpoint
        self.factory = factory
        self.events = events
        self.port = None
        self._listenCalled = False

    def privilegedStartService(self):
        Service.privilegedStartService(self)
        self._listenCalled = True
        failures = []
        self.endpoint.listen(self.factory).addCallbacks(
            self._listening, failures.append
        )
        if failures:
            failures[0].raiseException()

    def _listening(self, port):
        self.port = port
        self.events.emit(
            "listening", transport="tcp", address=formatAddress(port.getHost())
        )

    def startService(self):
        if not self._listenCalled:
            self.privilegedStartService()
        Service.startService(self)

    def stopService(self):
        Service.stopService(self)
        self._listenCalled = False
        port, self.port = self.port, None
        if port is not None:
            return port.stopListening()


class DallalService(MultiService):
    """
    A broker and everything that serves it.

    @ivar broker: the L{Broker} core.
    @ivar factory: the TCP protocol factory for that core; attach it to more
        endpoints with L{listenTCP}.
    """

    def __init__(self, reactor, config=BrokerConfig(), pingInterval=DEFAULT_INTERVAL):
        MultiService.__init__(self)
        self.reactor = reactor
        self.broker = Broker(reactor, config)
        self.sweep = PingSweep(reactor, pingInterval)
        self.factory = BrokerFactory(self.broker, self.sweep)

    def listenTCP(self, description):
        """
        Serve TCP clients on a server endpoint description
        (C{"tcp:1373:interface=127.0.0.1"}, C{"ssl:..."}, ...).

        @return: the child L{ListenerService}.
        """
        listener = ListenerService(
            serverFromString(self.reactor, description), self.factory, self.broker.events
        )
        listener.setServiceParent(self)
        return listener

    def startService(self):
        MultiService.startService(self)
        self.sweep.start()

    def stopService(self):
        self.sweep.stop()
        stopped = MultiService.stopService(self)
        self.broker.shutdown()
        return stopped
