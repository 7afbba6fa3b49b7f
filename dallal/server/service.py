"""
The broker as a Twisted service, for twistd or for embedding.

L{DallalService} is a C{MultiService}: it owns one L{Broker} core and its
ping sweep, and has one child per listener (Dallal's TCP and UDP, MQTT,
the web listener with MQTT over WebSockets) and per bridge, all sharing
that core (as C{twisted.names.tap} puts a TCP and a UDP server over
one resolver).
"""

import dataclasses
import functools
import os
import signal
import sys

from twisted.application.service import MultiService, Service
from twisted.internet.defer import gatherResults, maybeDeferred
from twisted.internet.endpoints import serverFromString
from twisted.internet.error import CannotListenError
from twisted.logger import Logger, LogLevel

from dallal.broker.core import Broker, BrokerConfig
from dallal.broker.origin import storedName
from dallal.broker.retained import RetainedStore
from dallal.broker.sysstats import DEFAULT_INTERVAL as DEFAULT_SYS_INTERVAL
from dallal.broker.sysstats import SysPublisher
from dallal.limits import DEFAULT_MAX_OFFLINE_BYTES, DEFAULT_MAX_OFFLINE_SESSIONS
from dallal.protocol.datagram import MAX_PACKET_SIZE
from dallal.security.auth import beyondLoopback
from dallal.server.addresses import formatAddress
from dallal.server.bridge import BridgeLink
from dallal.server.keepalive import DEFAULT_INTERVAL, PingSweep
from dallal.server.mqtt import MQTTFactory
from dallal.server.mqttstore import SessionStore
from dallal.server.tcp import BrokerFactory
from dallal.server.udp import DEFAULT_ACK_TIMEOUT, BrokerDatagramProtocol

DEFAULT_INTERFACE = "127.0.0.1"
# Seconds a stopping broker gives what is in flight to be acked.
DEFAULT_SHUTDOWN_GRACE = 2.0


# The listen queue of a TCP endpoint whose description sets none.  Twisted's
# default, 50, overflows whenever the broker is busy for a moment (a ping
# sweep over 20,000 connections, a burst of subscribers) and the clients
# whose SYN was dropped wait a second before they try again
# (docs/CONNECTIONS.md).  Linux caps it at net.core.somaxconn.
DEFAULT_BACKLOG = 1024
# The fields of a BrokerConfig that a running broker takes again on SIGHUP
# (README.md, "Configuration"): limits checked on each request, settings of
# the sessions that start next, and the per-message events.  The others
# were told to clients or sized resources at start.
RELOADABLE_FIELDS = (
    "maxPayload",
    "maxTopicLength",
    "maxTopicLevels",
    "maxSubscriptions",
    "maxUdpClients",
    "maxUdpClientsPerIp",
    "delivery",
    "messageEvents",
)

# The server endpoint types that take a backlog= option.
_QUEUED_ENDPOINTS = ("tcp", "tcp6", "ssl")


def withBacklog(description, backlog=DEFAULT_BACKLOG):
    """
    C{description} with C{backlog=} added if it is a TCP or TLS endpoint
    that does not set one.
    """
    fields = description.split(":")
    if fields[0] in _QUEUED_ENDPOINTS and not any(
        field.startswith("backlog=") for field in fields[1:]
    ):
        return f"{description}:backlog={backlog}"
    return description


class ListenFailed(Exception):
    """
    A listener could not listen; its message says where and why, in one
    line (C{cannot listen on 127.0.0.1:1373: address already in use}).
    """


def _describeListenError(error, transportName):
    """
    The sentence of a L{ListenFailed}, from the reactor's
    C{CannotListenError}.
    """
    if isinstance(error.port, (str, bytes)):
        # A UNIX socket's path.
        where = os.fsdecode(error.port)
    else:
        host = error.interface or "0.0.0.0"
        if ":" in host:
            host = f"[{host}]"
        where = f"{host}:{error.port}"
    if transportName != "tcp":
        where += f" ({transportName.upper()})"
    reason = error.socketError
    number = getattr(reason, "errno", None)
    reason = os.strerror(number) if number else str(reason)
    return f"cannot listen on {where}: {reason[:1].lower()}{reason[1:]}"


def _endWithoutTraceback(kind):
    """
    Have an uncaught exception of C{kind} end the program with its message
    alone on standard error, and the others as usual.
    """
    report = sys.excepthook

    def reportBriefly(type, value, traceback):
        if issubclass(type, kind):
            sys.stderr.write(f"{value}\n")
        else:
            report(type, value, traceback)

    sys.excepthook = reportBriefly


class _Listener(Service):
    """
    Listens on one port while running, and logs where.

    Listening happens in C{privilegedStartService}, as Twisted's own
    C{StreamServerEndpointService} does, so a port that cannot be bound
    stops twistd at start with the reason instead of leaving a broker that
    serves nothing.

    @cvar transportName: C{tcp} or C{udp}, for the C{listening} event.
    @cvar openToAll: what anyone who reaches it may do when the broker
        takes no passwords, for the warning about it.
    """

    transportName = None
    openToAll = "publish and subscribe"

    def __init__(self, events):
        self.events = events
        self.port = None
        self._listenCalled = False

    def privilegedStartService(self):
        Service.privilegedStartService(self)
        self._listenCalled = True
        try:
            self._listen()
        except CannotListenError as error:
            raise ListenFailed(_describeListenError(error, self.transportName)) from error

    def _listen(self):
        """
        Start listening, and call L{_listening} with the port; raise
        C{CannotListenError} if the port cannot be bound.
        """
        raise NotImplementedError

    def _listening(self, port):
        self.port = port
        self.events.emit(
            "listening",
            transport=self.transportName,
            address=formatAddress(port.getHost()),
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


class ListenerService(_Listener):
    """
    Serves TCP clients (or TLS, or any stream) on one server endpoint.

    @param transportName: C{tcp} for Dallal's protocol, C{mqtt} for MQTT.
    @cvar closesFirst: whether a stopping broker stops listening here
        before it drains what is in flight (its clients' listeners), or
        only after (the web listener, whose C{/health} says it drains).
    """

    closesFirst = True

    def __init__(self, endpoint, factory, events, transportName="tcp"):
        _Listener.__init__(self, events)
        self.endpoint = endpoint
        self.factory = factory
        self.transportName = transportName

    def _listen(self):
        failures = []
        self.endpoint.listen(self.factory).addCallbacks(self._listening, failures.append)
        if failures:
            failures[0].raiseException()


class WebListenerService(ListenerService):
    """
    Serves the broker's web pages (L{dallal.server.web}) on one server
    endpoint, until the broker has drained.

    @ivar site: the C{Site}; its C{resource} is the
        L{dallal.server.web.WebRoot}, where more resources may be put.
    """

    closesFirst = False
    openToAll = "read the broker's metrics and dashboard, and publish and subscribe over /mqtt"

    def __init__(self, endpoint, site, events):
        ListenerService.__init__(self, endpoint, site, events, "http")
        self.site = site

    def stopService(self):
        self.site.figures.stop()
        return ListenerService.stopService(self)


class DatagramListenerService(_Listener):
    """
    Serves UDP clients on one port.  (UDP has no endpoint descriptions in
    Twisted: a port and an interface say where.)
    """

    transportName = "udp"

    def __init__(self, reactor, portNumber, protocol, interface, events):
        _Listener.__init__(self, events)
        self.reactor = reactor
        self.portNumber = portNumber
        self.protocol = protocol
        self.interface = interface

    def _listen(self):
        self._listening(
            self.reactor.listenUDP(
                self.portNumber,
                self.protocol,
                interface=self.interface,
                maxPacketSize=MAX_PACKET_SIZE,
            )
        )


class DallalService(MultiService):
    """
    A broker and everything that serves it.

    @ivar broker: the L{Broker} core.
    @ivar factory: the TCP protocol factory for that core; attach it to more
        endpoints with L{listenTCP}.
    @ivar mqttFactory: the MQTT protocol factory for that core (L{listenMQTT}),
        sharing the TCP factory's connection limits.
    """

    # Sentences for people, not events: its namespace is not dallal's.
    _log = Logger()

    def __init__(
        self,
        reactor,
        config=None,
        pingInterval=DEFAULT_INTERVAL,
        dataDir=None,
        sysInterval=DEFAULT_SYS_INTERVAL,
        gatekeeper=None,
        shutdownGrace=DEFAULT_SHUTDOWN_GRACE,
        events=None,
        reloadOnHangup=False,
        maxOfflineSessions=DEFAULT_MAX_OFFLINE_SESSIONS,
        maxOfflineBytes=DEFAULT_MAX_OFFLINE_BYTES,
    ):
        """
        @param dataDir: the directory of the retained message store and of
            the MQTT sessions kept across restarts, or C{None} for a broker
            that keeps no retained messages and no sessions across restarts.
        @param sysInterval: seconds between updates of the C{$SYS/broker/...}
            statistics topics, or 0 for none.
        @param gatekeeper: who may connect and what they may do
            (L{dallal.security.auth.Gatekeeper}), or C{None} for everyone, anything.
        @param shutdownGrace: the longest L{stopService} waits for what is
            in flight to be acked, in seconds.
        @param events: the L{dallal.broker.events.EventLog} to log to, if not the
            global log.
        @param reloadOnHangup: whether SIGHUP makes the running service
            L{reload} (not on Windows, which has no SIGHUP).
        @param maxOfflineSessions: the most MQTT sessions kept while their
            clients are away.
        @param maxOfflineBytes: the most payload bytes they hold together.
        @raise dallal.broker.retained.StoreError: the store cannot be opened.
        @raise dallal.broker.origin.BrokerNameError: C{config} names no broker, and
            the name kept in C{dataDir} cannot be read or written.
        """
        MultiService.__init__(self)
        if config is None:
            config = BrokerConfig()
        self.reactor = reactor
        self.shutdownGrace = shutdownGrace
        retained = RetainedStore.open(dataDir, reactor) if dataDir is not None else None
        if config.name is None and dataDir is not None:
            config = dataclasses.replace(config, name=storedName(dataDir))
        self.broker = Broker(reactor, config, events, retained)
        self.sweep = PingSweep(reactor, pingInterval)
        self.gatekeeper = gatekeeper
        self.factory = BrokerFactory(self.broker, self.sweep, gatekeeper)
        self.mqttFactory = MQTTFactory(
            self.broker,
            gatekeeper,
            self.factory.batch,
            self.factory.connections,
            maxOfflineSessions,
            SessionStore.open(dataDir) if dataDir is not None else None,
            maxOfflineBytes,
        )
        self.mqttFactory.restoreSessions()
        self.sysPublisher = SysPublisher(self.broker, reactor, sysInterval) if sysInterval else None
        self.reloadOnHangup = reloadOnHangup and hasattr(signal, "SIGHUP")
        self._previousHangupHandler = None
        # Re-reads a configuration file on reload, given the service
        # (twistd dallal --config sets it).
        self.rereadConfig = None

    def listenTCP(self, description):
        """
        Serve TCP clients on a server endpoint description
        (C{"tcp:1373:interface=127.0.0.1"}, C{"ssl:..."}, ...), with a
        listen queue of L{DEFAULT_BACKLOG} unless it says C{backlog=}.

        @return: the child L{ListenerService}.
        """
        return self._listenStream(description, self.factory, "tcp")

    def listenMQTT(self, description):
        """
        Serve MQTT clients on a server endpoint description
        (C{"tcp:1883:interface=127.0.0.1"}, C{"ssl:8883:..."}, ...), as
        L{listenTCP} serves Dallal's.

        @return: the child L{ListenerService}.
        """
        return self._listenStream(description, self.mqttFactory, "mqtt")

    def _listenStream(self, description, factory, transportName):
        listener = ListenerService(
            serverFromString(self.reactor, withBacklog(description)),
            factory,
            self.broker.events,
            transportName,
        )
        listener.setServiceParent(self)
        return listener

    def listenHTTP(self, description):
        """
        Serve the broker's metrics, health and dashboard over HTTP
        (L{dallal.server.web}) on a server endpoint description, behind the
        broker's passwords if it takes any, and MQTT over WebSockets at
        C{/mqtt} (L{dallal.server.websocket}), whose clients log in with
        MQTT's CONNECT.

        @return: the child L{WebListenerService}.
        """
        listener = WebListenerService(
            serverFromString(self.reactor, withBacklog(description)),
            self.webSite(),
            self.broker.events,
        )
        listener.setServiceParent(self)
        return listener

    # The web and WebSocket modules (twisted.web, prometheus_client,
    # autobahn) are imported by the first web listener, not by every
    # broker: they are about a fifth of a broker's resting memory.

    @functools.cached_property
    def mqttWebSocketFactory(self):
        """
        The WebSocket factory of MQTT over WebSockets, whose sessions are
        L{mqttFactory}'s (C{/mqtt} on L{listenHTTP}).
        """
        from dallal.server.websocket import MQTTWebSocketFactory

        return MQTTWebSocketFactory(self.mqttFactory, self.reactor)

    def webSite(self):
        """
        The web listener's site: L{dallal.server.web.webSite}, with MQTT
        over WebSockets at C{/mqtt}, outside the HTTP passwords (its
        clients log in with MQTT's CONNECT).
        """
        from autobahn.twisted.resource import WebSocketResource

        from dallal.server.web import webSite

        site = webSite(self.broker, self.reactor, self.gatekeeper)
        site.resource.putChild(b"mqtt", WebSocketResource(self.mqttWebSocketFactory))
        return site

    def listenUDP(self, port, interface=DEFAULT_INTERFACE, ackTimeout=DEFAULT_ACK_TIMEOUT):
        """
        Serve UDP clients on a port of an interface.

        @param ackTimeout: seconds before a message a UDP client has not
            acked is sent again.
        @return: the child L{DatagramListenerService}; its C{protocol} is
            the L{BrokerDatagramProtocol}.
        """
        protocol = BrokerDatagramProtocol(
            self.broker, self.sweep, ackTimeout, gatekeeper=self.gatekeeper
        )
        listener = DatagramListenerService(
            self.reactor, port, protocol, interface, self.broker.events
        )
        listener.setServiceParent(self)
        return listener

    def addBridge(self, spec, endpoint=None):
        """
        Connect to another broker as its client while running, and carry
        the messages of some topics between the two: a bridge.

        @param spec: the bridge's L{dallal.server.bridge.BridgeSpec}.
        @param endpoint: the remote's C{IStreamClientEndpoint}, if not the
            one C{spec} describes.
        @return: the child L{BridgeLink}.
        """
        link = BridgeLink(spec, self.broker, self.reactor, self.sweep, endpoint)
        link.setServiceParent(self)
        return link

    def privilegedStartService(self):
        """
        Listen on every port, as twistd does before it runs the reactor.

        @raise ListenFailed: a listener could not listen.  If nothing
            catches it, the program ends with its one line on standard
            error (twistd's log), not a traceback.
        """
        try:
            MultiService.privilegedStartService(self)
        except ListenFailed:
            # An exception still, not SystemExit: twistd then removes its
            # pid file, and a daemon tells the parent waiting for it why.
            _endWithoutTraceback(ListenFailed)
            raise

    def startService(self):
        MultiService.startService(self)
        self.sweep.start()
        if self.sysPublisher is not None:
            self.sysPublisher.start()
        if self.reloadOnHangup:
            previous = signal.signal(signal.SIGHUP, self._hangup)
            # None: a handler not set from Python, which cannot be put back.
            self._previousHangupHandler = signal.SIG_DFL if previous is None else previous
        self._warnIfOpenToAll()

    def _hangup(self, signalNumber, frame):
        # A signal handler runs between two bytecodes of whatever the
        # reactor was doing: the reload waits for its next turn.
        self.reactor.callFromThread(self.reload)

    def reload(self):
        """
        What SIGHUP does: read again the configuration file (through
        C{rereadConfig}, if set), the password file and the ACL file, and
        hold every session to the new ACL.  Connections stay; a file that
        cannot be read, or is wrong, leaves what it had set as it was.
        """
        if self.rereadConfig is not None:
            self.rereadConfig(self)
        if self.gatekeeper is None:
            return
        for name, error in self.gatekeeper.reload():
            self.fileReloaded(name, error)
        acl = self.gatekeeper.realm.acl
        if acl is not None:
            self.broker.revisePermissions(acl.permissionsFor)

    def fileReloaded(self, name, error=None):
        """
        Log that a file was read again: C{reloaded}, or C{reload_failed}
        and a line saying why.

        @param name: C{passwords}, C{acl} or C{config}.
        @param error: why it could not be used, or C{None}.
        """
        if error is None:
            self.broker.events.emit("reloaded", file=name)
            return
        self.broker.events.emit("reload_failed", LogLevel.warn, file=name)
        self._log.warn(
            "cannot reload the {name} file, what it set stays as it was: {error}",
            name=name,
            error=error,
        )

    def reconfigure(self, config, shutdownGrace):
        """
        Take the settings of C{config} that can change while the broker
        runs (L{RELOADABLE_FIELDS}), and a new shutdown grace; the other
        fields of C{config} are not used.
        """
        self.broker.config = dataclasses.replace(
            self.broker.config, **{name: getattr(config, name) for name in RELOADABLE_FIELDS}
        )
        self.broker.events.messageEvents = config.messageEvents
        self.shutdownGrace = shutdownGrace
        for child in self:
            if isinstance(child, DatagramListenerService):
                child.protocol.followConfig()
        # A broker without a web listener never made (nor imported) it.
        if "mqttWebSocketFactory" in vars(self):
            self.mqttWebSocketFactory.followConfig()

    def _warnIfOpenToAll(self):
        """
        Warn, once per port, when other machines can reach a broker that
        lets anyone in.
        """
        if self.gatekeeper is not None and self.gatekeeper.loginRequired:
            return
        for listener in self:
            port = getattr(listener, "port", None)
            if port is not None and beyondLoopback(port.getHost()):
                self._log.warn(
                    "WARNING: listening on {address} ({transport}) beyond the loopback "
                    "without --passwords: anyone who can reach it may {what} "
                    "(README.md, Security)",
                    address=formatAddress(port.getHost()),
                    transport=listener.transportName,
                    what=listener.openToAll,
                )

    def stopService(self):
        """
        Stop gracefully: stop accepting connections, refuse new publishes
        and subscriptions, give what is in flight up to C{shutdownGrace}
        seconds to be acked, then close every session (dropping, and
        counting, what is still unacked), stop the UDP ports and close the
        retained store.

        @return: a Deferred that fires once all that is done.
        """
        if self._previousHangupHandler is not None:
            signal.signal(signal.SIGHUP, self._previousHangupHandler)
            self._previousHangupHandler = None
        Service.stopService(self)
        self.sweep.stop()
        if self.sysPublisher is not None:
            self.sysPublisher.stop()
        # UDP ports stay open while draining: UDP clients' acks come
        # through them.  Stream listeners only take new connections.
        streams = [
            child for child in self if isinstance(child, ListenerService) and child.closesFirst
        ]
        stopped = [maybeDeferred(child.stopService) for child in streams]
        self.mqttFactory.stopping()
        drained = self.broker.drain(self.shutdownGrace)
        drained.addCallback(lambda _: self._closeSessions(streams))
        return gatherResults([*stopped, drained])

    def _closeSessions(self, streams):
        # Before the broker ends them, and drops what waits for them.
        saved = self.mqttFactory.saveSessions()
        self.broker.shutdown()
        stopped = [saved] + [
            maybeDeferred(child.stopService)
            for child in reversed(list(self))
            if child not in streams
        ]
        if self.broker.retained is not None:
            stopped.append(self.broker.retained.close())
        return gatherResults(stopped)
