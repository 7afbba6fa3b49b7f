"""
Bridges: this broker as a client of another Dallal broker, so that brokers
form a hub topology (seeds/003: "Brokers can also be clients themselves"),
as Mosquitto's bridges let them.

A L{BridgeLink} connects to the remote broker with Twisted's
L{ClientService}, which reconnects with backoff, over any client endpoint
(C{tcp:hub.example:1373}, C{tls:...}), speaking L{dallal.client}'s protocol.
It moves the messages of its topic filters in one direction or both:

  - B{in}: on every connection it subscribes on the remote in mode C{all}
    with C{bridge=1}, and publishes each message it receives on this
    broker; the remote gets the ack once this broker has accepted it.
  - B{out}: it is a session of this broker (transport C{bridge}),
    subscribed in mode C{all} to the same filters; it publishes each
    message on the remote and acks it here once the remote's C{PUBACK}
    arrives.  While the link is down that session is paused: messages wait
    in its queue within the broker's queue limits (C{--max-queued},
    C{--max-queued-bytes}; the oldest are dropped first, and counted), and
    those sent but not acked are sent again once the link is back.

Every bridged message carries its origin (L{dallal.broker.origin}), so that no
message loops or arrives twice, whatever the shape of the bridges.

A remote that takes passwords is logged in to first, on every connection,
with the C{user=} of the C{--bridge} option and the password read from a
file or an environment variable at start (never from the command line,
where C{ps} would show it); the remote lets the bridge send bridge frames
if that user is one of its C{--bridge-users}.

The link's state is C{connecting} (an attempt is under way), C{up}
(connected and subscribed) or C{down} (waiting to try again); it is logged
(C{bridge_connecting}, C{bridge_up}, C{bridge_down}), and shown by C{STATS}
and C{$SYS/broker/bridges/<name>/...}.
"""

import os
from dataclasses import dataclass, field

from twisted.application.internet import ClientService
from twisted.application.service import Service
from twisted.internet.defer import CancelledError, Deferred, TimeoutError
from twisted.internet.endpoints import clientFromString
from twisted.internet.error import (
    ConnectError,
    ConnectionDone,
    ConnectionRefusedError,
    DNSLookupError,
    TCPTimedOutError,
)
from twisted.internet.interfaces import IStreamClientEndpoint
from twisted.internet.protocol import Factory
from twisted.logger import Logger, LogLevel
from zope.interface import implementer

from dallal.broker.counters import BRIDGE_REFUSED
from dallal.broker.delivery import DROP_OLDEST
from dallal.broker.interfaces import ISubscriber
from dallal.client import DallalClientProtocol, ServerError, reconnectDelays
from dallal.errors import NO_ID, SHUTTING_DOWN, RequestError
from dallal.modes import ALL
from dallal.names import checkBrokerName, checkUserName
from dallal.server.addresses import formatAddress
from dallal.server.keepalive import IPingable
from dallal.server.origins import originFromOptions, originOptions
from dallal.topics import TopicError
from dallal.topictree import MULTI_LEVEL, RESERVED_PREFIX, checkFilter

IN = "in"
OUT = "out"
BOTH = "both"
DIRECTIONS = (IN, OUT, BOTH)

CONNECTING = "connecting"
UP = "up"
DOWN = "down"

# How long the remote may take to acknowledge the link's subscriptions.
SETUP_TIMEOUT = 10.0

USAGE = (
    "NAME=ENDPOINT[,topics=FILTER;FILTER...][,direction=in|out|both]"
    "[,user=USER,password-file=PATH|password-env=VARIABLE]"
)
# What failed while a new connection was being set up -> how the log says it.
_SET_UP_STEPS = {"login": "the login", "subscribe": "the subscriptions"}


@dataclass(frozen=True)
class BridgeSpec:
    """
    What one C{--bridge} option asks for.

    @ivar endpoint: a client endpoint description, C{tcp:hub.example:1373}.
    @ivar filters: the topic filters whose messages cross the bridge.
    @ivar direction: C{in} (from the remote to this broker), C{out} or
        C{both}.
    @ivar credentials: C{(user, password)} to log in to the remote with, the
        password as bytes; or C{None}.  Never shown in its C{repr}.
    """

    name: str
    endpoint: str
    filters: tuple = (MULTI_LEVEL,)
    direction: str = BOTH
    credentials: tuple = field(default=None, repr=False)

    @property
    def inbound(self):
        return self.direction in (IN, BOTH)

    @property
    def outbound(self):
        return self.direction in (OUT, BOTH)


def parseBridge(text, reactor, environ=os.environ):
    """
    Read one C{--bridge} option: C{NAME=ENDPOINT[,topics=FILTER;FILTER]
    [,direction=in|out|both][,user=USER,password-file=PATH|
    password-env=VARIABLE]}.

    @param reactor: the reactor the endpoint will use, to check it.
    @param environ: where C{password-env=} looks.
    @return: a L{BridgeSpec}.
    @raise ValueError: with a one-line reason a person can act on.
    """
    name, equals, rest = text.partition("=")
    if not equals or not rest:
        raise ValueError(f"{text!r} is not {USAGE}")
    checkBrokerName(name, "name")
    endpoint, *options = rest.split(",")
    try:
        clientFromString(reactor, endpoint)
    except Exception as error:
        # Twisted's reasons are terse ("Unknown endpoint type", a missing
        # argument): say which option and what was expected.
        raise ValueError(
            f"{name}: {endpoint!r} is not a client endpoint description "
            f"such as tcp:hub.example:1373 ({error})"
        ) from error
    filters, direction = (MULTI_LEVEL,), BOTH
    user, password = None, None
    for option in options:
        key, equals, value = option.partition("=")
        if key == "topics" and equals:
            filters = tuple(value.split(";"))
            for topicFilter in filters:
                _checkBridgedFilter(name, topicFilter)
        elif key == "direction" and equals:
            if value not in DIRECTIONS:
                raise ValueError(
                    f"{name}: direction must be one of {', '.join(DIRECTIONS)}, not {value!r}"
                )
            direction = value
        elif key == "user" and equals:
            try:
                checkUserName(value)
            except ValueError as error:
                raise ValueError(f"{name}: {error}") from error
            user = value
        elif key in ("password-file", "password-env") and equals:
            if password is not None:
                raise ValueError(f"{name}: give one password-file= or password-env=")
            password = _readPassword(name, key, value, environ)
        else:
            raise ValueError(
                f"{name}: unknown option {option!r}; expected {USAGE} "
                "(an endpoint cannot contain a comma)"
            )
    if (user is None) != (password is None):
        raise ValueError(f"{name}: user= and one of password-file= or password-env= go together")
    credentials = None if user is None else (user, password)
    return BridgeSpec(name, endpoint, filters, direction, credentials)


def _readPassword(name, key, value, environ):
    """
    The password of a bridge's login, from a file (its first line) or an
    environment variable, as bytes.
    """
    if key == "password-env":
        password = environ.get(value)
        if password is None:
            raise ValueError(f"{name}: the environment has no variable {value!r}")
        password = os.fsencode(password)
    else:
        try:
            with open(value, "rb") as file:
                password = file.readline().rstrip(b"\r\n")
        except OSError as error:
            raise ValueError(
                f"{name}: cannot read the password from {value}: {error.strerror}"
            ) from error
    if not password:
        raise ValueError(f"{name}: the password in {value} is empty")
    return password


def _checkBridgedFilter(name, topicFilter):
    try:
        checkFilter(topicFilter)
    except TopicError as error:
        raise ValueError(f"{name}: bad topic filter {topicFilter!r}: {error}") from error
    if topicFilter.startswith(RESERVED_PREFIX):
        raise ValueError(
            f"{name}: {topicFilter!r}: topics starting with '$' are each "
            "broker's own and are not bridged"
        )


def _reasonFor(failure):
    """
    One word for why a connection attempt failed or a connection ended.
    """
    if failure.check(ConnectionRefusedError):
        return "refused"
    if failure.check(TCPTimedOutError, TimeoutError):
        return "timeout"
    if failure.check(DNSLookupError):
        return "unknown_host"
    if failure.check(CancelledError):
        return "stopped"
    if failure.check(ConnectError):
        return "unreachable"
    if failure.check(ConnectionDone):
        return "closed"
    return "lost"


@implementer(IStreamClientEndpoint)
class _ObservedEndpoint:
    """
    The remote's endpoint, telling the link of each connection attempt and
    of each that fails: L{ClientService} keeps both to itself.
    """

    def __init__(self, endpoint, link):
        self.endpoint = endpoint
        self.link = link

    def __repr__(self):
        # How ClientService's own log lines ("Scheduling retry ...") name it.
        return f"<bridge {self.link.name} to {self.link.spec.endpoint}>"

    def connect(self, factory):
        self.link.connecting()
        return self.endpoint.connect(factory).addErrback(self.link.connectFailed)


@implementer(ISubscriber, IPingable)
class BridgeLink(Service):
    """
    One bridge: a connection to a remote broker, kept up, and this broker's
    session for it.

    To this broker's core it is a client session (L{ISubscriber}, transport
    C{bridge}) that publishes what comes in and subscribes to what goes
    out; to the broker's ping sweep it is a peer (L{IPingable}) while it is
    up, so that a remote that stops answering is noticed and left.

    @ivar state: C{connecting}, C{up} or C{down}.
    @ivar connects: how many times the link came up.
    @ivar received: messages received from the remote.
    @ivar forwarded: messages the remote acknowledged.
    """

    transportName = "bridge"
    _log = Logger()

    def __init__(self, spec, broker, clock, sweep, endpoint=None, retryPolicy=None):
        """
        @param broker: this broker's L{dallal.broker.core.Broker}.
        @param sweep: this broker's L{dallal.server.keepalive.PingSweep}.
        @param endpoint: the remote's C{IStreamClientEndpoint}; by default
            the one C{spec} describes.
        @param retryPolicy: seconds to wait after a number of failed
            attempts in a row; by default exponential backoff with jitter.
        """
        self.spec = spec
        self.broker = broker
        self.clock = clock
        self.sweep = sweep
        # A named child of the broker's service: getServiceNamed(name).
        self.name = spec.name
        self.peer = f"bridge:{spec.name}"
        self.state = DOWN
        self.connects = 0
        self.received = 0
        self.forwarded = 0
        # The connection while the link is up.
        self.protocol = None
        self._attached = False
        self._stopping = False
        self._attempts = 0
        # Connections that ended before the link came up: they count as
        # failed attempts for the backoff, which ClientService restarts at
        # each connection.
        self._failedSetups = 0
        self._downReason = None
        # What a new connection's set-up is doing: a key of _SET_UP_STEPS.
        self._setUpStep = None
        # Delivery id -> message, for what went out and the remote has not
        # acked; and the ids published on the current connection.
        self._unacked = {}
        self._outstanding = set()
        # Whether a subscriber here that the remote's messages reach has a
        # full queue: the connection to the remote is not read meanwhile.
        self._held = False
        if endpoint is None:
            endpoint = clientFromString(clock, spec.endpoint)
        self._backoff = retryPolicy or reconnectDelays()
        factory = Factory.forProtocol(DallalClientProtocol)
        # The link logs its own events; "Starting factory" at each attempt
        # would be noise.
        factory.noisy = False
        self._client = ClientService(
            _ObservedEndpoint(endpoint, self),
            factory,
            retryPolicy=lambda failed: self._backoff(failed + self._failedSetups),
            clock=clock,
            prepareConnection=self._prepare,
        )
        broker.bridges[spec.name] = self

    def status(self):
        """
        The link's state and counts, for C{STATS} and C{$SYS}.
        """
        return {
            "state": self.state,
            "remote": self.spec.endpoint,
            "direction": self.spec.direction,
            "connects": self.connects,
            "received": self.received,
            "forwarded": self.forwarded,
            "unacked": len(self._unacked),
        }

    # Service

    def startService(self):
        Service.startService(self)
        self._stopping = False
        self.broker.attach(self, self.broker.config.delivery.replace(slowConsumer=DROP_OLDEST))
        self._attached = True
        # Nothing goes out before the link is up: it waits in the queue.
        self.broker.pauseDelivery(self)
        if self.spec.outbound:
            for topicFilter in self.spec.filters:
                self.broker.subscribe(self, topicFilter, topicFilter, ALL, bridge=True)
        self._client.startService()

    def stopService(self):
        Service.stopService(self)
        self._stopping = True
        stopped = self._client.stopService()
        self._attached = False
        self.broker.detach(self, "shutdown")
        return stopped

    # The connection

    def _setState(self, state, event, level=LogLevel.info, **fields):
        self.state = state
        self.broker.events.emit(event, level, bridge=self.name, **fields)

    def connecting(self):
        """
        A connection attempt begins (L{_ObservedEndpoint}).
        """
        self._attempts += 1
        self._setState(CONNECTING, "bridge_connecting", attempt=self._attempts)

    def connectFailed(self, failure):
        """
        A connection attempt failed (L{_ObservedEndpoint}): log why, and
        return C{failure} for L{ClientService} to retry.
        """
        reason = "stopped" if self._stopping else _reasonFor(failure)
        self._setState(DOWN, "bridge_down", LogLevel.warn, reason=reason)
        self._log.info(
            "bridge {name}: cannot connect to {remote}: {why}",
            name=self.name,
            remote=self.spec.endpoint,
            why=failure.getErrorMessage(),
        )
        return failure

    def _prepare(self, protocol):
        """
        Set up each new connection: subscribe on the remote, then up.

        It never fails, although ClientService would take that as a failed
        attempt: it would leave the connection open, and Twisted 26.10 then
        raises C{NoTransition} when that connection closes.  The link closes
        a connection it cannot use itself.
        """
        protocol.whenDisconnected().addCallback(lambda _: self._lost(protocol))
        Deferred.fromCoroutine(self._setUp(protocol)).addErrback(self._setUpFailed, protocol)

    async def _setUp(self, protocol):
        if self.spec.credentials is not None:
            self._setUpStep = "login"
            await protocol.login(self.spec.credentials, self.broker.name).addTimeout(
                SETUP_TIMEOUT, self.clock
            )
        if self.spec.inbound:
            self._setUpStep = "subscribe"
            await protocol.subscribe(
                list(self.spec.filters), self._received, mode=ALL, options={"bridge": "1"}
            ).addTimeout(SETUP_TIMEOUT, self.clock)
        if protocol.connected and not self._stopping:
            self._up(protocol)

    def _setUpFailed(self, failure, protocol):
        if not protocol.connected:
            # Lost while logging in or subscribing: _lost says so.
            return
        self._downReason = f"{self._setUpStep}_failed"
        self._log.warn(
            "bridge {name}: the remote did not take {step}: {why}",
            name=self.name,
            step=_SET_UP_STEPS[self._setUpStep],
            why=failure.getErrorMessage(),
        )
        protocol.transport.abortConnection()

    def _up(self, protocol):
        self.protocol = protocol
        self.connects += 1
        self._attempts = 0
        self._failedSetups = 0
        self._setState(
            UP,
            "bridge_up",
            address=formatAddress(protocol.transport.getPeer()),
            subscriptions=len(self.spec.filters) if self.spec.inbound else 0,
        )
        self.sweep.add(self)
        if self._held:
            protocol.pauseProducing()
        # What the last connection took and never acked goes first, in the
        # order it was sent; then what waited in the queue.
        for deliveryId, message in list(self._unacked.items()):
            self._publishRemote(deliveryId, message)
        if self._attached:
            self.broker.resumeDelivery(self)

    def _lost(self, protocol):
        wasUp = protocol is self.protocol
        if wasUp:
            self.protocol = None
            self.sweep.remove(self)
            if self._attached:
                self.broker.pauseDelivery(self)
        else:
            self._failedSetups += 1
        self._outstanding.clear()
        reason = self._downReason
        self._downReason = None
        if self._stopping:
            reason = "stopped"
        elif reason is None:
            reason = _reasonFor(protocol.lostReason)
        self._setState(DOWN, "bridge_down", LogLevel.warn, reason=reason)

    # In: from the remote to this broker

    def _received(self, message):
        """
        A message from the remote: publish it here.  Returning acks it to
        the remote, so it returns once this broker has accepted it (or
        refused it for good: a payload over this broker's limit).
        """
        if not self._attached:
            # Stopping: never acked, so the remote keeps it, and counts it
            # as dropped when the connection closes.
            return Deferred()
        self.received += 1
        try:
            self.broker.publishBridged(
                self, message.topic, message.payload, originFromOptions(message.options), NO_ID
            )
        except RequestError as error:
            if error.code == SHUTTING_DOWN:
                # Never acked: the remote keeps it for the next connection,
                # to this broker's next run.
                return Deferred()
            self._log.warn(
                "bridge {name}: refused a message on {topic} from the remote: {reason}",
                name=self.name,
                topic=message.topic,
                reason=error.reason,
            )

    # Out: from this broker to the remote

    def sendMessage(self, message, subscriptionId, seq, deliveryId, redelivered):
        self._unacked[deliveryId] = message
        # A resend while its PUB is still unanswered on this connection
        # waits for that answer: the remote is slow, not deaf.
        if self.protocol is not None and deliveryId not in self._outstanding:
            self._publishRemote(deliveryId, message)

    def _publishRemote(self, deliveryId, message):
        self._outstanding.add(deliveryId)
        self.protocol.publish(
            message.topic,
            message.payload,
            options=originOptions(self.broker.originOf(message)),
        ).addCallbacks(
            self._remoteAcked,
            self._remoteFailed,
            callbackArgs=(deliveryId,),
            errbackArgs=(deliveryId,),
        )

    def _remoteAcked(self, _, deliveryId):
        self._outstanding.discard(deliveryId)
        if self._unacked.pop(deliveryId, None) is not None:
            self.forwarded += 1
            if self._attached:
                self.broker.acknowledge(self, deliveryId)

    def _remoteFailed(self, failure, deliveryId):
        self._outstanding.discard(deliveryId)
        if not failure.check(ServerError) or failure.value.code == SHUTTING_DOWN:
            # The connection went, or is about to with the remote broker:
            # sent again once the link is back up.
            return
        message = self._unacked.pop(deliveryId, None)
        if message is not None and self._attached:
            self._log.warn(
                "bridge {name}: the remote refused a message on {topic}: {why}",
                name=self.name,
                topic=message.topic,
                why=failure.value,
            )
            self.broker.reject(self, deliveryId, BRIDGE_REFUSED)

    def subscriptionRevoked(self, subscriptionId, reason):
        # The bridge's own session never logs in, so no ACL applies to it and
        # the broker never ends its subscriptions.
        pass

    def pausePublishing(self):
        self._held = True
        if self.protocol is not None:
            self.protocol.pauseProducing()

    def resumePublishing(self):
        self._held = False
        if self.protocol is not None:
            self.protocol.resumeProducing()

    def disconnect(self, reason):
        # Only the broker's shutdown asks (the link's queue drops its
        # oldest rather than disconnect a slow consumer); stopService closes
        # the connection.
        pass

    # IPingable: the remote must answer the link's pings while it is up.

    def sendPing(self):
        if self._held:
            # The connection is not read meanwhile: a PONG could not be.
            self.sweep.heardFrom(self)
            return
        self.protocol.ping().addCallbacks(
            lambda _: self.sweep.pongReceived(self), lambda failure: None
        )

    def pingMissed(self, missed):
        self.broker.pingMissed(self, missed)

    def keepaliveExpired(self, missed):
        self._downReason = "missed_pings"
        self.protocol.transport.abortConnection()
