"""
The broker core: who is subscribed to what, and who gets each message.

It is transport-independent: clients reach it as L{ISubscriber} providers
(a TCP connection, a UDP address), it hands them L{Message}s, and it knows
nothing of sockets, frames or ports.  Time comes from an injected
C{IReactorTime}, so tests drive it with C{task.Clock}.
"""

import secrets
from collections import Counter
from dataclasses import dataclass, field

from twisted.internet.task import LoopingCall
from twisted.logger import Logger, LogLevel

from dallal.broker.delivery import (
    DeliveryConfig,
    FlowControl,
    Ledger,
    Outbox,
    Subscription,
)
from dallal.broker.events import EventLog
from dallal.broker.feed import RetainedFeed
from dallal.broker.origin import MAX_HOPS, Origin, SeenMessages, generatedName, originFromOptions
from dallal.broker.retained import StoreError
from dallal.broker.sharing import ShareGroup
from dallal.broker.sysstats import TopicTraffic
from dallal.errors import (
    BAD_ARGUMENTS,
    BAD_TOPIC,
    FORBIDDEN,
    NO_ID,
    NOT_AUTHORIZED,
    NOT_SUBSCRIBED,
    SHUTTING_DOWN,
    STORE_FAILED,
    RequestError,
)
from dallal.limits import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_CONNECTIONS_PER_IP,
    DEFAULT_MAX_CONSECUTIVE_ERRORS,
    DEFAULT_MAX_FRAME_SECONDS,
    DEFAULT_MAX_HELLOS_PER_SECOND,
    DEFAULT_MAX_LINE,
    DEFAULT_MAX_LISTED,
    DEFAULT_MAX_MATCHING_TOPICS,
    DEFAULT_MAX_OUTPUT_BYTES,
    DEFAULT_MAX_PENDING_LOGINS,
    DEFAULT_MAX_PENDING_LOGINS_PER_IP,
    DEFAULT_MAX_RETAINED,
    DEFAULT_MAX_RETAINED_BYTES,
    DEFAULT_MAX_SUBSCRIPTIONS,
    DEFAULT_MAX_TOPIC_LEVELS,
    DEFAULT_MAX_UDP_ANSWER_BYTES,
    DEFAULT_MAX_UDP_ANSWER_BYTES_TOTAL,
    DEFAULT_MAX_UDP_CLIENTS,
    DEFAULT_MAX_UDP_CLIENTS_PER_IP,
    ERRORS_LOGGED,
    ERRORS_LOGGED_PER_CLIENT,
    MATCHING_TOPICS,
    PAYLOAD,
    RETAINED,
    RETAINED_BYTES,
    SUBSCRIPTION_EVENTS_LOGGED,
    SUBSCRIPTION_EVENTS_LOGGED_PER_CLIENT,
    SUBSCRIPTIONS,
    LimitLog,
    LogWindow,
    RateLimitedLog,
)
from dallal.modes import ALL, FIRE, LATEST, MODES
from dallal.security.acl import READ, WRITE
from dallal.sortednames import SortedNames
from dallal.topics import MAX_TOPIC_LENGTH, WILDCARDS, TopicError, checkTopic
from dallal.topictree import RESERVED_PREFIX, SubscriptionTree, TopicMap, checkFilter

DEFAULT_MAX_PAYLOAD = 1024 * 1024
# Bounds of the broker's memos of work done per topic rather than per
# message (valid topics, routes): past them a memo starts again empty.
TOPICS_REMEMBERED = 10_000
# How often a draining broker looks whether what was in flight has settled.
# Acks, drops and disk writes all settle things: polling while the broker
# stops keeps that check off the per-message path.
DRAIN_CHECK_INTERVAL = 0.05

# Who publishes the broker's own topics, as the publish event names it.
OWN_PUBLISHER = "$SYS"
OWN_TRANSPORT = "sys"


@dataclass(frozen=True)
class BrokerConfig:
    """
    The limits and switches of one broker (README.md, "Limits").

    The core enforces the limits on requests; the transports those on
    connections, UDP clients and hellos (L{dallal.limits}).
    """

    maxPayload: int = DEFAULT_MAX_PAYLOAD
    maxTopicLength: int = MAX_TOPIC_LENGTH
    maxTopicLevels: int = DEFAULT_MAX_TOPIC_LEVELS
    maxControlLine: int = DEFAULT_MAX_LINE
    maxSubscriptions: int = DEFAULT_MAX_SUBSCRIPTIONS
    maxConnections: int = DEFAULT_MAX_CONNECTIONS
    maxConnectionsPerIp: int = DEFAULT_MAX_CONNECTIONS_PER_IP
    maxUdpClients: int = DEFAULT_MAX_UDP_CLIENTS
    maxUdpClientsPerIp: int = DEFAULT_MAX_UDP_CLIENTS_PER_IP
    maxHellosPerSecond: int = DEFAULT_MAX_HELLOS_PER_SECOND
    maxOutputBytes: int = DEFAULT_MAX_OUTPUT_BYTES
    maxConsecutiveErrors: int = DEFAULT_MAX_CONSECUTIVE_ERRORS
    maxFrameSeconds: int = DEFAULT_MAX_FRAME_SECONDS
    # Enforced by the gatekeeper (dallal.security.auth.CheckQueue).
    maxPendingLogins: int = DEFAULT_MAX_PENDING_LOGINS
    maxPendingLoginsPerIp: int = DEFAULT_MAX_PENDING_LOGINS_PER_IP
    maxUdpAnswerBytes: int = DEFAULT_MAX_UDP_ANSWER_BYTES
    maxUdpAnswerBytesTotal: int = DEFAULT_MAX_UDP_ANSWER_BYTES_TOTAL
    maxMatchingTopics: int = DEFAULT_MAX_MATCHING_TOPICS
    maxRetained: int = DEFAULT_MAX_RETAINED
    maxRetainedBytes: int = DEFAULT_MAX_RETAINED_BYTES
    messageEvents: bool = True
    delivery: DeliveryConfig = field(default_factory=DeliveryConfig)
    maxListed: int = DEFAULT_MAX_LISTED
    # The broker's name among bridged brokers; generated if None.
    name: str | None = None


class Message:
    """
    One published message, shared by every delivery of it.

    @ivar mid: the broker's id for it, unique for the broker's lifetime.
    @ivar wireTopic: the topic encoded as UTF-8, computed once for every
        frame that carries it.
    @ivar retained: whether it comes from the retained store, sent to a new
        subscription, rather than from a publish as it happened.
    @ivar encoded: what all its C{MSG} frames share, encoded by
        L{dallal.protocol.wire.encodeMessage} on the first delivery.
    @ivar origin: for a message that came over a bridge, the L{Origin} it
        came with, its C{hops} counting that bridge; C{None} for a message
        published here.
    @ivar properties: what the publisher's transport attached to it, opaque
        to the core and passed through to every subscriber's transport (an
        MQTT message's QoS, retain flag and properties), or C{None}.
    @ivar source: the L{ISubscriber} that published it, or C{None} (the
        broker's own, a retained message), for the subscriptions that do
        not want their own messages back.
    """

    __slots__ = (
        "mid",
        "topic",
        "wireTopic",
        "payload",
        "publisher",
        "published",
        "retained",
        "encoded",
        "origin",
        "properties",
        "source",
    )

    def __init__(
        self,
        mid,
        topic,
        payload,
        publisher,
        published,
        retained=False,
        origin=None,
        properties=None,
        source=None,
    ):
        self.mid = mid
        self.topic = topic
        self.wireTopic = topic.encode("utf-8")
        self.payload = payload
        self.publisher = publisher
        self.published = published
        self.retained = retained
        self.encoded = None
        self.origin = origin
        self.properties = properties
        self.source = source


# Why a bridged message is discarded on arrival -> what counts it: its own
# message coming back, or a copy, is a duplicate.
_DISCARD_COUNTERS = {
    "loop": "bridged_duplicates",
    "duplicate": "bridged_duplicates",
    "hop_limit": "bridged_hop_limit",
}


# When two filters of one session match a message, it is delivered once,
# through the subscription whose mode promises the most: its rank in the
# subscription tree.
_MODE_STRENGTH = {FIRE: 0, LATEST: 1, ALL: 2}


def _remember(cache, key, value):
    """
    Keep C{value} under C{key} in C{cache}, which holds at most
    L{TOPICS_REMEMBERED} keys: a full cache starts again empty, so that a
    publisher of endless new topics costs a bounded memory.
    """
    if len(cache) >= TOPICS_REMEMBERED:
        cache.clear()
    cache[key] = value


class _Session:
    """
    What the broker knows about one attached client.

    @ivar subscriptions: topic filter -> L{Subscription}.
    @ivar user: the name it logged in with, or C{None} (anonymous).
    @ivar clientId: the client id it logged in with, or C{None}.
    @ivar permissions: what the ACL lets it read and write
        (L{dallal.security.acl.Permissions}), or C{None} when the broker has no ACL.
    @ivar mayBridge: whether it may send bridge frames: not when it logged
        in as a user that is no bridge (L{dallal.security.auth.BrokerRealm}).
    @ivar errorWindow: the L{LogWindow} of its C{protocol_error} events.
    @ivar subscriptionWindow: the L{LogWindow} of its C{subscribe} and
        C{unsubscribe} events.
    """

    __slots__ = (
        "sid",
        "subscriber",
        "subscriptions",
        "outbox",
        "user",
        "clientId",
        "permissions",
        "mayBridge",
        "errorWindow",
        "subscriptionWindow",
    )

    def __init__(self, sid, subscriber, outbox):
        self.sid = sid
        self.subscriber = subscriber
        self.subscriptions = {}
        self.outbox = outbox
        self.user = None
        self.clientId = None
        self.permissions = None
        self.mayBridge = True
        self.errorWindow = LogWindow(ERRORS_LOGGED_PER_CLIENT)
        self.subscriptionWindow = LogWindow(SUBSCRIPTION_EVENTS_LOGGED_PER_CLIENT)


class Broker:
    """
    Routes published messages to the subscribers of their topic.

    @ivar counters: running totals (see docs/EVENTS.md for their meaning).
    @ivar retained: the L{dallal.broker.retained.RetainedStore}, or C{None} for a
        broker that keeps no retained messages.
    @ivar shuttingDown: whether L{drain} has begun: new publishes and
        subscriptions are refused.
    @ivar name: the broker's name among bridged brokers, the C{origin} of
        the messages published here.
    @ivar bridges: this broker's bridges to others by name, each with a
        C{status()} for C{STATS} (L{dallal.server.bridge.BridgeLink}).
    """

    _log = Logger()

    def __init__(self, clock, config=None, events=None, retained=None):
        if config is None:
            config = BrokerConfig()
        self.clock = clock
        self.config = config
        self.events = (
            events if events is not None else EventLog(clock, messageEvents=config.messageEvents)
        )
        self.name = config.name or generatedName()
        # Every event names the broker that logged it (docs/EVENTS.md).
        self.events.broker = self.name
        # Message ids restart at each start: this tells them apart, for the
        # brokers that remember the messages they saw.
        self.incarnation = secrets.token_hex(4)
        self.seen = SeenMessages(clock)
        self.bridges = {}
        self._sessions = {}
        self._tree = SubscriptionTree(ranks=len(_MODE_STRENGTH))
        # (group name, filter) -> its ShareGroup.
        self._groups = {}
        # filter -> number of sessions subscribed with it, for TOPICS; and
        # the filters without wildcards, which are topics clients named.
        self._filterCounts = Counter()
        self._namedTopics = TopicMap()
        # Sets _listedTopics: every topic TOPICS lists (retained or
        # subscribed to), in order, so that listing the first few costs what
        # they are.
        self.retained = retained
        # The broker's own topics ($SYS/...): their last values, kept in
        # memory as retained messages (they mean nothing after a restart).
        self._ownTopics = TopicMap()
        self._nextSid = 1
        self._nextMid = 1
        # Whether any session's topics are restricted by an ACL: until one
        # is, publishing skips the permission checks altogether.
        self._restricted = False
        # Publishers repeat their topics: each is checked once, and routed
        # through the tree once until the subscriptions change.
        self._validTopics = set()
        # topic -> the subscriptions a message on it goes to, one per
        # subscriber (the strongest of its filters that match), before the
        # ACL's say; and the same by the topic's shape in the tree
        # (SubscriptionTree.shape), so a new topic of a known shape, as a
        # device's first message on devices/<id>/state, costs no walk.
        self._routes = {}
        self._routesByShape = {}
        self.shuttingDown = False
        self.started = clock.seconds()
        # A plain dict: every counter is set here or by the ledger, and a
        # Counter's item access costs twice as much on the per-message path.
        self.counters = dict(
            connections=0,
            connections_total=0,
            subscriptions=0,
            published=0,
            bytes_in=0,
            bytes_out=0,
            errors=0,
            pings_missed=0,
            clients_dropped=0,
            duplicates=0,
            unsent=0,
            sys_published=0,
            logins=0,
            logins_failed=0,
            logins_abandoned=0,
            denied=0,
            bridged_published=0,
            bridged_duplicates=0,
            bridged_hop_limit=0,
            bridged_refused=0,
        )
        self.limits = LimitLog(clock, self.counters, self.events)
        self.errorLog = RateLimitedLog(
            clock, self.events, ERRORS_LOGGED, "protocol_errors_suppressed", "code"
        )
        self.subscriptionLog = RateLimitedLog(
            clock,
            self.events,
            SUBSCRIPTION_EVENTS_LOGGED,
            "subscriptions_suppressed",
            "kind",
            LogLevel.info,
        )
        self.topicTraffic = TopicTraffic(clock)
        self.ledger = Ledger(self.counters, self.events, self.limits, self.topicTraffic)
        self.flow = FlowControl(clock, self.counters)

    # Sessions

    def attach(self, subscriber, delivery=None):
        """
        A client has arrived.  Nothing is sent to it before it subscribes.

        @param delivery: the L{DeliveryConfig} of the client's transport, if
            not the broker's (UDP resends sooner, and carries less).
        """
        sid = self._nextSid
        self._nextSid += 1
        if delivery is None:
            delivery = self.config.delivery
        outbox = Outbox(subscriber, sid, delivery, self.clock, self.ledger, self.flow)
        session = _Session(sid, subscriber, outbox)
        self._sessions[subscriber] = session
        self.counters["connections"] += 1
        self.counters["connections_total"] += 1
        self.events.emit(
            "connect",
            session=session.sid,
            client=subscriber.peer,
            transport=subscriber.transportName,
        )

    def detach(self, subscriber, reason):
        """
        A client has gone; its subscriptions and everything queued for it go
        with it.

        @param reason: a one-word reason for the log (C{closed},
            C{missed_pings}, C{protocol_error}, ...).
        """
        session = self._sessions.pop(subscriber, None)
        if session is None:
            return
        for key in session.subscriptions:
            self._forgetFilter(key, subscriber)
        self.flow.forget(subscriber)
        session.outbox.close(session.subscriptions.values())
        self.counters["subscriptions"] -= len(session.subscriptions)
        self.counters["connections"] -= 1
        self.events.emit(
            "disconnect",
            session=session.sid,
            client=subscriber.peer,
            transport=subscriber.transportName,
            reason=reason,
            subscriptions=len(session.subscriptions),
        )

    def sessionId(self, subscriber):
        return self._sessions[subscriber].sid

    def login(self, subscriber, user):
        """
        A client logged in, or goes on anonymously under the ACL: from now
        on its requests and deliveries are those of C{user}.

        @param user: its L{dallal.security.auth.IBrokerUser}.
        """
        session = self._sessions[subscriber]
        session.user = user.name
        session.clientId = user.clientId
        session.permissions = user.permissions
        session.mayBridge = user.mayBridge
        if user.permissions is not None:
            self._restricted = True
        if user.name is not None:
            self.counters["logins"] += 1
            self.events.emit("login", session=session.sid, client=subscriber.peer, user=user.name)

    def revisePermissions(self, permissionsFor):
        """
        The ACL has changed (SIGHUP): give every session under it its new
        permissions, and end each subscription whose filter can no longer
        match a topic the session may read, telling its client.

        @param permissionsFor: returns the
            L{dallal.security.acl.Permissions} of a user name (C{None} for
            an anonymous client) and a client id.
        """
        for session in list(self._sessions.values()):
            if session.permissions is None:
                continue
            session.permissions = permissionsFor(session.user, session.clientId)
            for key, subscription in list(session.subscriptions.items()):
                if not session.permissions.mayMatch(subscription.topic, READ):
                    self._revoke(session, key, subscription)

    def _revoke(self, session, key, subscription):
        self._endSubscription(session, key, subscription)
        topicFilter = subscription.topic
        who = self._logAclEvent("subscription_revoked", session, topic=topicFilter)
        session.subscriber.subscriptionRevoked(
            subscription.id,
            f"{who} may no longer read {topicFilter}: the subscription has ended",
        )

    def loginFailed(self, subscriber, shownUser):
        """
        Record a refused login.

        @param subscriber: the client, attached or not (a UDP client has no
            session before it logs in).
        @param shownUser: the user name for the log (see
            L{dallal.security.auth.LoginFailed}).
        """
        self.counters["logins_failed"] += 1
        self.events.emit(
            "login_failed",
            LogLevel.warn,
            session=self._sessionNumber(subscriber),
            client=subscriber.peer,
            user=shownUser,
        )

    def _sessionNumber(self, subscriber):
        """
        The session id of a client for the log, 0 if it has no session.
        """
        session = self._sessions.get(subscriber)
        return session.sid if session else 0

    def _logAclEvent(self, name, session, **fields):
        """
        Log an event of the ACL's about a session: its user is C{-} when
        anonymous.

        @return: how a refusal told to the client names it.
        """
        user = session.user
        self.events.emit(
            name,
            LogLevel.warn,
            session=session.sid,
            client=session.subscriber.peer,
            user="-" if user is None else user,
            **fields,
        )
        return "anonymous clients" if user is None else f"user {user}"

    def _denied(self, session, action, topic):
        """
        Count and log a request its user may not make.

        @return: how a refusal told to the client names it.
        """
        self.counters["denied"] += 1
        return self._logAclEvent("denied", session, action=action, topic=topic)

    def _forbid(self, session, action, topic, requestId):
        """
        Count and log a request the ACL refuses, and refuse it.
        """
        who = self._denied(session, action, topic)
        preposition = "on" if action == "publish" else "to"
        raise RequestError(FORBIDDEN, f"{who} may not {action} {preposition} {topic}", requestId)

    def checkBridging(self, subscriber, topic, requestId):
        """
        Refuse a bridge frame (a C{PUB} with C{origin=}, a C{SUB} with
        C{bridge=1}) from a client that is no bridge: it could otherwise
        claim the origin of other brokers' messages (PROTOCOL.md, "Who may
        bridge").

        @raise RequestError: C{NOT_AUTHORIZED}, counted and logged as
            C{denied}.
        """
        session = self._sessions[subscriber]
        if not session.mayBridge:
            self._denied(session, "bridge", topic)
            raise RequestError(
                NOT_AUTHORIZED,
                f"user {session.user} is not a bridge: only the broker's --bridge-users "
                "may send origin= or bridge=1",
                requestId,
            )

    def acknowledge(self, subscriber, deliveryId):
        """
        The client acked a delivery; late and unknown acks are ignored.
        """
        self._sessions[subscriber].outbox.acknowledge(deliveryId)

    def reject(self, subscriber, deliveryId, reason):
        """
        The client can never take a delivery (a bridge's remote refused
        it): drop it for C{reason}; unknown ids are ignored.
        """
        self._sessions[subscriber].outbox.reject(deliveryId, reason)

    def pauseDelivery(self, subscriber):
        """
        The client's transport is full: hold its messages in the broker.
        """
        self._sessions[subscriber].outbox.pause()

    def resumeDelivery(self, subscriber):
        self._sessions[subscriber].outbox.resume()

    def drain(self, grace):
        """
        Begin shutting down: refuse new publishes and subscriptions with
        C{SHUTTING_DOWN}, and let what is in flight settle -- deliveries
        acked, retained messages written to disk -- for at most C{grace}
        seconds.  Then call L{shutdown}.

        @return: a Deferred that fires with C{None} once nothing is in
            flight, or once the grace is over.
        """
        self.shuttingDown = True
        self.events.emit(
            "shutdown",
            sessions=len(self._sessions),
            inflight=self.counters["inflight"],
            grace=grace,
        )
        deadline = self.clock.seconds() + grace

        def check():
            if self._settled() or self.clock.seconds() >= deadline:
                loop.stop()

        loop = LoopingCall(check)
        loop.clock = self.clock
        # Whatever goes wrong here, the broker must still shut down.
        return loop.start(DRAIN_CHECK_INTERVAL).addCallbacks(
            lambda _: None, lambda failure: self._log.failure("draining failed", failure)
        )

    def _settled(self):
        """
        Whether nothing is in flight: every delivery ended, and every
        retained message is on disk (or refused).
        """
        return self.counters["inflight"] == 0 and (
            self.retained is None or not self.retained.writing
        )

    def shutdown(self):
        """
        Close every session, accounting for what they still held, and log
        the final counters.
        """
        for session in list(self._sessions.values()):
            self.detach(session.subscriber, "shutdown")
            session.subscriber.disconnect("shutdown")
        self.errorLog.reportSuppressed()
        self.topicTraffic.log(self.events)
        self.subscriptionLog.reportSuppressed()
        self.logStats()

    def stats(self):
        """
        The counters of docs/EVENTS.md, and the broker's uptime in seconds.
        """
        stats = dict(self.counters)
        stats["uptime"] = round(self.clock.seconds() - self.started, 3)
        if self.bridges:
            stats["bridges"] = {name: link.status() for name, link in self.bridges.items()}
        return stats

    def connectionsByTransport(self):
        """
        The sessions now, by the name of their transport (C{tcp}, C{udp},
        C{bridge}): they add up to the C{connections} counter.

        @return: a C{Counter}.
        """
        return Counter(session.subscriber.transportName for session in self._sessions.values())

    def logStats(self):
        self.events.emit("stats", **self.counters)

    # Requests

    def _checkAccepting(self, requestId):
        if self.shuttingDown:
            raise RequestError(
                SHUTTING_DOWN,
                "the broker is shutting down: it delivers what it has and takes nothing new",
                requestId,
            )

    def refusedByLimit(self, subscriber, limit, maximum, reason=None, requestId=NO_ID):
        """
        Count and log a client's refusal by one of the limits of
        L{dallal.limits}.

        @return: the L{RequestError} to answer with, or C{None} for a limit
            whose refusals are not answered.
        """
        session = self._sessions.get(subscriber)
        return self.limits.refused(
            limit,
            maximum,
            subscriber.peer,
            subscriber.transportName,
            session.sid if session else 0,
            reason,
            requestId,
        )

    def _checkName(self, check, subscriber, name, requestId):
        try:
            check(name, self.config.maxTopicLength, self.config.maxTopicLevels)
        except TopicError as e:
            if e.limit is not None:
                raise self.refusedByLimit(subscriber, e.limit, e.maximum, str(e), requestId) from e
            raise RequestError(BAD_TOPIC, str(e), requestId) from e

    def checkTopic(self, subscriber, topic, requestId):
        if topic in self._validTopics:
            return
        self._checkName(checkTopic, subscriber, topic, requestId)
        if len(self._validTopics) >= TOPICS_REMEMBERED:
            self._validTopics.clear()
        self._validTopics.add(topic)

    def checkFilter(self, subscriber, topicFilter, requestId):
        self._checkName(checkFilter, subscriber, topicFilter, requestId)

    def checkPayloadSize(self, subscriber, size, requestId, maximum=None):
        """
        Refuse a payload larger than the broker accepts, before it is read.

        @param maximum: the largest the client's transport accepts, if less
            than the broker's C{maxPayload}.
        """
        if maximum is None:
            maximum = self.config.maxPayload
        if size > maximum:
            raise self.refusedByLimit(
                subscriber,
                PAYLOAD,
                maximum,
                f"payload of {size} bytes is larger than the maximum of {maximum}",
                requestId,
            )

    def subscribe(self, subscriber, topicFilter, requestId, mode=LATEST, bridge=False, group=None):
        """
        Subscribe a client to a topic filter (a topic, or a pattern with the
        wildcards C{+} and C{#}).  Subscribing again with the same filter
        changes the subscription's id and mode.  A message matching several
        filters of one client reaches it once.

        With a C{group} name, the subscription is shared: every message
        matching the filter goes to one of the subscriptions of that group
        to that filter, whichever their sessions
        (L{dallal.broker.sharing}), besides the client's own subscriptions.

        Retained messages are not sent here: call L{sendRetained} once the
        client has been told its subscription is in place.

        @param mode: C{latest}, C{all} or C{fire} (see L{dallal.broker.delivery}).
        @param bridge: whether it carries messages to another broker.
        @param group: the name of a share group, or C{None}.
        @return: the L{Subscription}.
        @raise RequestError: the filter or the mode is refused, or the
            client has as many subscriptions as it may, or the broker is
            shutting down.
        """
        self._checkAccepting(requestId)
        self.checkFilter(subscriber, topicFilter, requestId)
        if mode not in MODES:
            raise RequestError(
                BAD_ARGUMENTS, f"mode must be one of {', '.join(MODES)}, not {mode!r}", requestId
            )
        session = self._sessions[subscriber]
        permissions = session.permissions
        if permissions is not None and not permissions.mayMatch(topicFilter, READ):
            self._forbid(session, "subscribe", topicFilter, requestId)
        key = topicFilter if group is None else (group, topicFilter)
        subscription = session.subscriptions.get(key)
        if subscription is None:
            maxSubscriptions = self.config.maxSubscriptions
            if len(session.subscriptions) >= maxSubscriptions:
                raise self.refusedByLimit(
                    subscriber,
                    SUBSCRIPTIONS,
                    maxSubscriptions,
                    f"this client has its maximum of {maxSubscriptions} subscriptions: "
                    "unsubscribe from one first",
                    requestId,
                )
            subscription = Subscription(requestId, topicFilter, mode, session.outbox, bridge)
            session.subscriptions[key] = subscription
            if group is None:
                self._tree.add(topicFilter, subscriber, subscription, _MODE_STRENGTH[mode])
            else:
                self._joinGroup(key, subscription)
            self._filterCounts[topicFilter] += 1
            self._listedTopics.add(topicFilter)
            if WILDCARDS.isdisjoint(topicFilter):
                self._namedTopics[topicFilter] = self._filterCounts[topicFilter]
            self.counters["subscriptions"] += 1
        else:
            subscription.id = requestId
            subscription.mode = mode
            subscription.bridge = bridge
            if group is None:
                # Its mode, and so its rank among the client's filters, may
                # have changed.
                self._tree.add(topicFilter, subscriber, subscription, _MODE_STRENGTH[mode])
        # A new filter, or a new mode, which may change which of a
        # session's filters carries a message.
        self._routes.clear()
        self._routesByShape.clear()
        self._subscriptionEvent(
            session,
            "subscribe",
            client=subscriber.peer,
            topic=topicFilter,
            mode=mode,
            bridge=bridge,
        )
        return subscription

    def sendRetained(self, subscriber, subscription):
        """
        Offer a new subscription the retained messages its filter matches,
        marked as retained: the broker's own topics' last values, and the
        store's (those the client may read when each is offered).  The
        first slice is offered now, the rest on later turns of the reactor
        as the subscriber takes them (L{dallal.broker.feed}).
        """
        found = self._ownTopics.match(subscription.topic)
        if self.retained is not None:
            found += self.retained.match(subscription.topic)
        if subscription.retainedFeed is not None:
            subscription.retainedFeed.stop()
        session = self._sessions[subscriber]

        def offer(topic, payload):
            self._offerRetained(session, subscription, topic, payload)

        RetainedFeed(self.clock, subscription, found, offer).start()

    def _offerRetained(self, session, subscription, topic, payload):
        permissions = session.permissions
        if permissions is not None and not permissions.mayRead(topic):
            return
        message = Message(self._nextMid, topic, payload, "retained", self.clock.seconds(), True)
        self._nextMid += 1
        if self.events.messageEvents:
            self.events.emit(
                "retained",
                mid=message.mid,
                topic=topic,
                bytes=len(payload),
                session=session.sid,
                client=session.subscriber.peer,
            )
        session.outbox.offer(subscription, message)

    def unsubscribe(self, subscriber, topicFilter, requestId, group=None):
        """
        End one of a client's subscriptions (with C{group}, its shared
        subscription in that group).  What waits for it in C{latest} mode
        is dropped; what is in flight may still be acked.

        @raise RequestError: the client has no subscription with that filter.
        """
        session = self._sessions[subscriber]
        key = topicFilter if group is None else (group, topicFilter)
        subscription = session.subscriptions.get(key)
        if subscription is None:
            raise RequestError(NOT_SUBSCRIBED, f"not subscribed to {topicFilter!r}", requestId)
        self._endSubscription(session, key, subscription)
        self._subscriptionEvent(session, "unsubscribe", client=subscriber.peer, topic=topicFilter)

    def _subscriptionEvent(self, session, name, **fields):
        """
        Log a C{subscribe} or C{unsubscribe} event of C{session}, unless too
        many were logged this second (L{RateLimitedLog}).
        """
        if self.subscriptionLog.allow(session.subscriptionWindow):
            self.events.emit(name, session=session.sid, **fields)
        else:
            self.subscriptionLog.suppressed(name)

    def _endSubscription(self, session, key, subscription):
        del session.subscriptions[key]
        self._forgetFilter(key, session.subscriber)
        session.outbox.unsubscribe(subscription)
        self.counters["subscriptions"] -= 1

    def _joinGroup(self, key, subscription):
        """
        Add a shared subscription to its group, made (and routed to) when
        it gets its first member.

        @param key: C{(group name, filter)}.
        """
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = ShareGroup(key[0], key[1], self._memberMayRead)
            self._tree.add(key[1], group, group)
        group.members.append(subscription)

    def _memberMayRead(self, subscription, topic):
        if not self._restricted:
            # No session's topics are restricted: no ACL to ask.
            return True
        permissions = self._sessions[subscription.outbox.subscriber].permissions
        return permissions is None or permissions.mayRead(topic)

    def _forgetFilter(self, key, subscriber):
        """
        Take a session's subscription (a filter, or for a shared one
        C{(group name, filter)}) out of the routes.
        """
        if type(key) is tuple:
            topicFilter = key[1]
            group = self._groups[key]
            group.members = [
                member for member in group.members if member.outbox.subscriber is not subscriber
            ]
            if not group.members:
                del self._groups[key]
                self._tree.remove(topicFilter, group)
        else:
            topicFilter = key
            self._tree.remove(topicFilter, subscriber)
        self._routes.clear()
        self._routesByShape.clear()
        self._filterCounts[topicFilter] -= 1
        remaining = self._filterCounts[topicFilter]
        if not remaining:
            del self._filterCounts[topicFilter]
            if self.retained is None or self.retained.get(topicFilter) is None:
                self._listedTopics.discard(topicFilter)
        if WILDCARDS.isdisjoint(topicFilter):
            if remaining:
                self._namedTopics[topicFilter] = remaining
            else:
                del self._namedTopics[topicFilter]

    def subscriptions(self, subscriber):
        """
        A client's subscriptions, as C{(filter, mode)} pairs in the order
        they were made.
        """
        return [
            (subscription.topic, subscription.mode)
            for subscription in self._sessions[subscriber].subscriptions.values()
        ]

    def topics(self, limit):
        """
        The topics the broker knows -- those with a retained message, and
        every filter clients are subscribed with -- with the size of the
        retained message and the number of subscribed clients, sorted.

        @return: C{(rows, total)}: at most C{limit} rows
            C{(topic, retainedBytes or None, subscribers)}, and how many
            there are in all.
        """
        names = self._listedTopics.first(limit)
        rows = [(name, self._retainedSize(name), self._filterCounts.get(name, 0)) for name in names]
        return rows, len(self._listedTopics)

    @property
    def retained(self):
        """
        The retained store (a L{dallal.broker.retained.RetainedStore}), or
        C{None} without one.
        """
        return self._retained

    @retained.setter
    def retained(self, store):
        self._retained = store
        names = set(self._filterCounts)
        if store is not None:
            names.update(store.topics())
            store.watch(self._retainedTopicChanged)
        self._listedTopics = SortedNames(names)

    def _retainedSize(self, topic):
        """
        @return: the size of C{topic}'s retained message, or C{None}.
        """
        payload = self.retained.get(topic) if self.retained is not None else None
        return len(payload) if payload is not None else None

    def _retainedTopicChanged(self, topic, held):
        """
        Keep the listed topics up to date as the store gains or loses a
        topic.
        """
        if held:
            self._listedTopics.add(topic)
        elif topic not in self._filterCounts:
            self._listedTopics.discard(topic)

    def publish(self, subscriber, topic, payload, requestId, properties=None):
        """
        Publish a message and hand it to every subscription matching its
        topic.

        @param properties: the transport's own attributes of the message
            (L{Message.properties}), passed through to the subscribers'.
        @return: the L{Message}.
        @raise RequestError: the topic or the payload is refused, or the
            broker is shutting down.
        """
        self._checkAccepting(requestId)
        self.checkTopic(subscriber, topic, requestId)
        self.checkPayloadSize(subscriber, len(payload), requestId)
        if self._restricted:
            session = self._sessions[subscriber]
            if session.permissions is not None and not session.permissions.mayWrite(topic):
                self._forbid(session, "publish", topic, requestId)
        return self._route(subscriber, topic, payload, properties)

    def checkRetainable(self, subscriber, topic, payload, requestId):
        """
        Refuse a retained publish, before it is published, that would take
        the store over C{maxRetained} messages or C{maxRetainedBytes}
        payload bytes.  Clearing a topic, or replacing its message with one
        no larger, is always allowed.
        """
        if self.retained is None or not payload:
            return
        held = self.retained.stats
        previous = self.retained.get(topic)
        config = self.config
        if previous is None and held.count >= config.maxRetained:
            raise self.refusedByLimit(
                subscriber,
                RETAINED,
                config.maxRetained,
                f"the broker keeps its maximum of {config.maxRetained} retained messages: "
                "clear one first (a retained publish with no payload)",
                requestId,
            )
        size = held.bytes + len(payload) - (0 if previous is None else len(previous))
        if size > config.maxRetainedBytes and len(payload) > len(previous or b""):
            raise self.refusedByLimit(
                subscriber,
                RETAINED_BYTES,
                config.maxRetainedBytes,
                f"the retained messages would take {size} bytes, more than the maximum "
                f"of {config.maxRetainedBytes}",
                requestId,
            )

    def retain(self, topic, payload, requestId):
        """
        Keep a message as its topic's retained message, which every new
        subscription matching the topic receives; an empty payload clears
        the topic's retained message.  Call it after L{publish}, which
        checks the topic.

        @return: a Deferred that fires once it is stored for good (the
            publisher's ack waits for it), or fails with L{RequestError}.
        @raise RequestError: the broker keeps no retained messages.
        """
        if self.retained is None:
            raise RequestError(STORE_FAILED, "this broker keeps no retained messages", requestId)
        return self.retained.set(topic, payload).addErrback(self._storeFailed, topic, requestId)

    def _storeFailed(self, failure, topic, requestId):
        failure.trap(StoreError)
        self.events.emit("store_failed", LogLevel.warn, topic=topic, error=failure.value.code)
        raise RequestError(
            STORE_FAILED, f"the retained message was not stored: {failure.value}", requestId
        )

    def publishToMatching(self, subscriber, topicFilter, payload, requestId):
        """
        Publish one message on every existing topic a filter matches: the
        topics with a retained message and those clients subscribed to by
        name; under an ACL, those of them the client may write.

        @return: how many topics it was published on.
        @raise RequestError: the filter or the payload is refused, or the
            broker is shutting down.
        """
        self._checkAccepting(requestId)
        self.checkFilter(subscriber, topicFilter, requestId)
        if topicFilter.startswith(RESERVED_PREFIX):
            # It would reach the broker's own topics, which clients may not
            # publish on (a filter starting with a wildcard never does).
            raise RequestError(
                BAD_TOPIC, "topics starting with '$' are reserved for the broker", requestId
            )
        self.checkPayloadSize(subscriber, len(payload), requestId)
        permissions = self._sessions[subscriber].permissions
        if permissions is not None and not permissions.mayMatch(topicFilter, WRITE):
            self._forbid(self._sessions[subscriber], "publish", topicFilter, requestId)
        maximum = self.config.maxMatchingTopics
        topics = {topic for topic, _ in self._namedTopics.match(topicFilter, maximum)}
        if self.retained is not None:
            topics.update(topic for topic, _ in self.retained.match(topicFilter, maximum))
        if len(topics) > maximum:
            # (Counted before the ACL's say: the matches were not all found.)
            raise self.refusedByLimit(
                subscriber,
                MATCHING_TOPICS,
                maximum,
                f"{topicFilter} matches more than {maximum} topics: publish to a narrower filter",
                requestId,
            )
        if permissions is not None:
            topics = {topic for topic in topics if permissions.mayWrite(topic)}
        for topic in sorted(topics):
            self._route(subscriber, topic, payload)
        return len(topics)

    def _route(self, subscriber, topic, payload, properties=None):
        message = Message(
            self._nextMid,
            topic,
            payload,
            subscriber.peer,
            self.clock.seconds(),
            properties=properties,
            source=subscriber,
        )
        self._nextMid += 1
        counters = self.counters
        counters["published"] += 1
        counters["bytes_in"] += len(payload)
        self._offer(
            message,
            self._routeOf(topic),
            self._sessions[subscriber].sid,
            subscriber.peer,
            subscriber.transportName,
            subscriber,
        )
        return message

    def publishBridged(self, subscriber, topic, payload, options, requestId):
        """
        Publish a message that came over a bridge (PROTOCOL.md, "Bridges"),
        unless this broker has routed it already: it is never sent back on
        the session it came on, its copies that come by other paths are
        discarded, and so is a message that crossed too many bridges.

        @param subscriber: the session it came on: another broker's bridge
            connected to this one, or this broker's own bridge to another.
        @param options: the options of the frame that carried it, with its
            origin (L{originFromOptions}).
        @return: the L{Message}, or C{None} if it was discarded (counted,
            and logged with the per-message events).
        @raise RequestError: refused: a bad origin, topic or payload size, or
            a topic the session may not write (counted in
            C{bridged_refused}); or the broker is shutting down (the bridge
            sends it again to the broker's next run).
        """
        self._checkAccepting(requestId)
        counters = self.counters
        session = self._sessions[subscriber]
        try:
            sent = originFromOptions(options, requestId)
            self.checkTopic(subscriber, topic, requestId)
            self.checkPayloadSize(subscriber, len(payload), requestId)
            if session.permissions is not None and not session.permissions.mayWrite(topic):
                self._forbid(session, "publish", topic, requestId)
        except RequestError:
            counters["bridged_refused"] += 1
            raise
        origin = Origin(sent.broker, sent.messageId, sent.hops + 1)
        if origin.broker == self.name:
            discarded = "loop"
        elif origin.hops > MAX_HOPS:
            discarded = "hop_limit"
        elif not self.seen.firstTime(origin, topic, payload):
            discarded = "duplicate"
        else:
            discarded = None
        if discarded is not None:
            counters[_DISCARD_COUNTERS[discarded]] += 1
            if self.events.messageEvents:
                self.events.emit(
                    "bridge_discard",
                    topic=topic,
                    session=session.sid,
                    origin=origin.broker,
                    hops=origin.hops,
                    reason=discarded,
                )
            return None
        message = Message(
            self._nextMid, topic, payload, subscriber.peer, self.clock.seconds(), False, origin
        )
        self._nextMid += 1
        counters["published"] += 1
        counters["bytes_in"] += len(payload)
        counters["bridged_published"] += 1
        # Never back on the session it came on.
        receivers = [
            subscription
            for subscription in self._routeOf(topic)
            if subscription.outbox.subscriber is not subscriber
        ]
        self._offer(
            message, receivers, session.sid, subscriber.peer, subscriber.transportName, subscriber
        )
        return message

    def originOf(self, message):
        """
        The L{Origin} a message carries over a bridge.
        """
        if message.origin is None:
            return Origin(self.name, f"{self.incarnation}.{message.mid}", 0)
        return message.origin

    def publishOwn(self, topic, payload):
        """
        Set the value of one of the broker's own topics (C{$SYS/...}), which
        no client may publish on: keep it as the topic's retained message,
        in memory only, and publish it to the topic's subscribers.

        A value nobody subscribes to is not published at all: it is no
        message, and is neither counted nor logged.
        """
        self._ownTopics[topic] = payload
        receivers = self._routeOf(topic)
        if not receivers:
            return
        message = Message(self._nextMid, topic, payload, OWN_PUBLISHER, self.clock.seconds())
        self._nextMid += 1
        counters = self.counters
        counters["published"] += 1
        counters["bytes_in"] += len(payload)
        counters["sys_published"] += 1
        self._offer(message, receivers, 0, OWN_PUBLISHER, OWN_TRANSPORT)

    def _offer(self, message, receivers, sid, peer, transportName, publisher=None):
        """
        Hand a new message to the subscriptions that want it, one per
        session.

        @param receivers: the subscriptions L{_routeOf} found for its topic.
        @param sid: the publishing session's id, C{peer} its address and
            C{transportName} its transport, for the C{publish} event.
        @param publisher: the publishing session, which a full queue holds
            back (never its own: a session that publishes to itself must
            not stop itself reading its acks); C{None} for the broker's own
            messages.
        """
        if self._restricted and receivers:
            receivers = self._readers(receivers, message.topic)
        self.topicTraffic.received(message.topic, len(message.payload))
        events = self.events
        if events.messageEvents:
            events.emit(
                "publish",
                mid=message.mid,
                topic=message.topic,
                bytes=len(message.payload),
                session=sid,
                client=peer,
                transport=transportName,
                subscribers=len(receivers),
                origin=self.name if message.origin is None else message.origin.broker,
                hops=0 if message.origin is None else message.origin.hops,
            )
        for subscription in receivers:
            if subscription.retainedFeed is not None:
                subscription.retainedFeed.before(message.topic)
            outbox = subscription.outbox
            outbox.offer(
                subscription, message, None if outbox.subscriber is publisher else publisher
            )

    def _routeOf(self, topic):
        """
        The subscriptions a message on C{topic} goes to, one per session:
        found in the tree, then remembered until the subscriptions change.
        """
        receivers = self._routes.get(topic)
        if receivers is None:
            shape = self._tree.shape(topic)
            receivers = self._routesByShape.get(shape)
            if receivers is None:
                receivers = list(self._tree.best(topic).values())
                _remember(self._routesByShape, shape, receivers)
            _remember(self._routes, topic, receivers)
        return receivers

    def _readers(self, receivers, topic):
        """
        The receiving subscriptions of a message on C{topic} whose session
        may read it.
        """
        sessions = self._sessions
        readers = []
        for subscription in receivers:
            # A share group (no session) asks its members' sessions itself.
            session = sessions.get(subscription.outbox.subscriber)
            permissions = None if session is None else session.permissions
            if permissions is None or permissions.mayRead(topic):
                readers.append(subscription)
        return readers

    # Health

    def pingMissed(self, subscriber, missed):
        """
        Record that a client let a ping go unanswered for an interval.
        """
        self._keepaliveEvent("ping_missed", "pings_missed", subscriber, missed)

    def clientDropped(self, subscriber, missed):
        """
        Record that a client is being dropped for not answering pings.
        """
        self._keepaliveEvent("client_dropped", "clients_dropped", subscriber, missed)

    def _keepaliveEvent(self, name, counter, subscriber, missed):
        self.counters[counter] += 1
        self.events.emit(
            name,
            LogLevel.warn,
            session=self.sessionId(subscriber),
            client=subscriber.peer,
            missed=missed,
        )

    def protocolError(self, subscriber, code, fatal, logged=True):
        """
        Record that a client sent something the broker refused, and log it
        unless too many were logged this second (L{RateLimitedLog}).

        @param logged: whether it may be logged (a datagram that named no
            session may not, beyond L{dallal.server.udp.StrangerErrorLog}'s rate).
        """
        self.counters["errors"] += 1
        session = self._sessions.get(subscriber)
        # A fatal error closes the client: it has no more to log.
        window = session.errorWindow if session is not None and not fatal else None
        if not (logged and self.errorLog.allow(window)):
            self.errorLog.suppressed(code)
            return
        self.events.emit(
            "protocol_error",
            LogLevel.warn,
            session=session.sid if session else 0,
            client=subscriber.peer,
            code=code,
            fatal=fatal,
        )
