"""
The broker's facade: what its transports call to publish, subscribe, log
in and be counted.

It is transport-independent: clients reach it as L{ISubscriber} providers
(a TCP connection, a UDP client, an MQTT connection or session, a bridge),
it hands them L{dallal.broker.message.Message}s, and it knows nothing of
sockets, frames or ports.  Time comes from an injected C{IReactorTime}, so tests drive it
with C{task.Clock}.

L{Broker} is the facade the transports call.  It checks their requests
(topics, sizes, limits, the ACL) and composes the parts that each do one
job: the session table (L{dallal.broker.sessions}), the router
(L{dallal.broker.router}), the topic directory
(L{dallal.broker.directory}), bridging (L{dallal.broker.bridging}), the
broker's own topics (L{dallal.broker.owntopics}), the delivery ledger and
flow control (L{dallal.broker.delivery}), and the counters
(L{dallal.broker.counters}), which they all report to.
"""

from collections import Counter
from dataclasses import dataclass, field

from twisted.internet.task import LoopingCall
from twisted.logger import Logger, LogLevel

from dallal.broker.bridging import Bridging
from dallal.broker.counters import Counters
from dallal.broker.delivery import DeliveryConfig, FlowControl, Ledger, Subscription
from dallal.broker.directory import TopicDirectory
from dallal.broker.events import EventLog
from dallal.broker.origin import checkOrigin, generatedName
from dallal.broker.owntopics import OwnTopics
from dallal.broker.retained import StoreError
from dallal.broker.router import TOPICS_REMEMBERED, Router
from dallal.broker.sessions import SessionTable
from dallal.broker.sysstats import TopicTraffic
from dallal.errors import (
    BAD_ARGUMENTS,
    BAD_TOPIC,
    NO_ID,
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
    MATCHING_TOPICS,
    PAYLOAD,
    RETAINED,
    RETAINED_BYTES,
    SUBSCRIPTION_EVENTS_LOGGED,
    SUBSCRIPTIONS,
    LimitLog,
    RateLimitedLog,
)
from dallal.modes import LATEST, MODES
from dallal.security.acl import READ, WRITE
from dallal.topics import MAX_TOPIC_LENGTH, TopicError, checkTopic
from dallal.topictree import RESERVED_PREFIX, checkFilter

DEFAULT_MAX_PAYLOAD = 1024 * 1024
# How often a draining broker looks whether what was in flight has settled.
# Acks, drops and disk writes all settle things: polling while the broker
# stops keeps that check off the per-message path.
DRAIN_CHECK_INTERVAL = 0.05


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


class Broker:
    """
    Routes published messages to the subscribers of their topic.

    Its transports call its methods, and read its C{clock}, C{config},
    C{events}, C{counters} and C{shuttingDown}; the parts it composes are
    its own (tests/test_architecture.py checks that C{dallal/server/}
    reaches no further).

    @ivar counters: the running totals (L{dallal.broker.counters.Counters};
        docs/EVENTS.md gives their meaning).
    @ivar sessions: the L{dallal.broker.sessions.SessionTable}.
    @ivar router: the L{dallal.broker.router.Router}.
    @ivar directory: the L{dallal.broker.directory.TopicDirectory}.
    @ivar bridging: the broker's L{dallal.broker.bridging.Bridging}.
    @ivar ownTopics: the broker's L{dallal.broker.owntopics.OwnTopics}.
    @ivar retained: the L{dallal.broker.retained.RetainedStore}, or C{None} for a
        broker that keeps no retained messages.
    @ivar shuttingDown: whether L{drain} has begun: new publishes and
        subscriptions are refused.
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
        name = config.name or generatedName()
        # Every event names the broker that logged it (docs/EVENTS.md).
        self.events.broker = name
        self.shuttingDown = False
        self.started = clock.seconds()
        # Publishers repeat their topics: each is checked once.
        self._validTopics = set()
        self.counters = Counters()
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
        self.sessions = SessionTable(
            clock, self.events, self.counters, self.ledger, self.flow, config.delivery
        )
        self.directory = TopicDirectory()
        self.router = Router(
            clock,
            self.events,
            self.counters,
            self.sessions,
            self.directory,
            self.topicTraffic,
            name,
        )
        self.bridging = Bridging(
            clock, self.events, self.counters, self.sessions, self.router, name
        )
        self.ownTopics = OwnTopics(self.counters, self.router)
        self.retained = retained

    @property
    def name(self):
        """
        The broker's name among bridged brokers, the C{origin} of the
        messages published here.
        """
        return self.bridging.name

    @property
    def bridges(self):
        """
        This broker's bridges to others by name
        (L{dallal.broker.bridging.Bridging.bridges}).
        """
        return self.bridging.bridges

    @property
    def retained(self):
        """
        The retained store (a L{dallal.broker.retained.RetainedStore}), or
        C{None} without one.
        """
        return self.directory.retained

    @retained.setter
    def retained(self, store):
        self.directory.retained = store

    # Sessions

    def attach(self, subscriber, delivery=None):
        """
        A client has arrived.  Nothing is sent to it before it subscribes.

        @param delivery: the L{DeliveryConfig} of the client's transport, if
            not the broker's (UDP resends sooner, and carries less).
        """
        self.sessions.attach(subscriber, delivery)

    def detach(self, subscriber, reason):
        """
        A client has gone; its subscriptions and everything queued for it go
        with it.

        @param reason: a one-word reason for the log (C{closed},
            C{missed_pings}, C{protocol_error}, ...).
        """
        session = self.sessions.pop(subscriber, None)
        if session is None:
            return
        for key in session.subscriptions:
            self.router.remove(subscriber, key)
        self.sessions.close(session, reason)

    def sessionId(self, subscriber):
        """
        The session id of a client, as the log shows it
        (L{dallal.broker.sessions.SessionTable.sessionId}).
        """
        return self.sessions.sessionId(subscriber)

    def login(self, subscriber, user):
        """
        A client logged in, or goes on anonymously under the ACL: from now
        on its requests and deliveries are those of C{user}.

        @param user: its L{dallal.security.auth.IBrokerUser}.
        """
        self.sessions.login(subscriber, user)

    def loginFailed(self, subscriber, shownUser):
        """
        Record a refused login (L{dallal.broker.sessions.SessionTable.loginFailed}).
        """
        self.sessions.loginFailed(subscriber, shownUser)

    def revisePermissions(self, permissionsFor):
        """
        The ACL has changed (SIGHUP): give every session under it its new
        permissions, and end each subscription whose filter can no longer
        match a topic the session may read, telling its client.

        @param permissionsFor: returns the
            L{dallal.security.acl.Permissions} of a user name (C{None} for
            an anonymous client) and a client id.
        """
        for session, key, subscription in self.sessions.revisePermissions(permissionsFor):
            self._endSubscription(session, key, subscription)
            topicFilter = subscription.topic
            who = self.sessions.logAclEvent("subscription_revoked", session, topic=topicFilter)
            session.subscriber.subscriptionRevoked(
                subscription.id,
                f"{who} may no longer read {topicFilter}: the subscription has ended",
            )

    def checkBridging(self, subscriber, topic, requestId):
        """
        Refuse a bridge frame from a client that is no bridge
        (L{dallal.broker.bridging.Bridging.checkBridging}).
        """
        self.bridging.checkBridging(subscriber, topic, requestId)

    def acknowledge(self, subscriber, deliveryId):
        """
        The client acked a delivery; late and unknown acks are ignored.
        """
        self.sessions[subscriber].outbox.acknowledge(deliveryId)

    def acknowledgeAll(self, subscriber, deliveryIds):
        """
        The client acked deliveries one after the other: as many
        L{acknowledge}s, what they held back sent once.
        """
        self.sessions[subscriber].outbox.acknowledgeAll(deliveryIds)

    def reject(self, subscriber, deliveryId, reason):
        """
        The client can never take a delivery (a bridge's remote refused
        it): drop it for C{reason}; unknown ids are ignored.
        """
        self.sessions[subscriber].outbox.reject(deliveryId, reason)

    def setInflightWindow(self, subscriber, window):
        """
        A client's window is now C{window}: at most that many C{all}-mode
        messages await its acks (an MQTT client's Receive Maximum, which
        each connection to a session may change); what waited for room in
        a wider window is sent at once.
        """
        self.sessions[subscriber].outbox.setWindow(window)

    def pauseDelivery(self, subscriber):
        """
        The client's transport is full: hold its messages in the broker.
        """
        self.sessions[subscriber].outbox.pause()

    def resumeDelivery(self, subscriber):
        self.sessions[subscriber].outbox.resume()

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
            sessions=len(self.sessions),
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
        for session in list(self.sessions.values()):
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
        return Counter(session.subscriber.transportName for session in self.sessions.values())

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
        return self.limits.refused(
            limit,
            maximum,
            subscriber.peer,
            subscriber.transportName,
            self.sessions.sessionId(subscriber),
            reason,
            requestId,
        )

    def refusedPeer(self, limit, maximum, peer, transportName, reason=None):
        """
        Count and log the refusal by one of the limits of L{dallal.limits}
        of what is no client of the broker yet: a connection over the
        connection limits, a stored session over the offline ones.

        @param peer: its address, C{host:port}.
        @return: the L{RequestError} to answer with, or C{None} for a limit
            whose refusals are not answered.
        """
        return self.limits.refused(limit, maximum, peer, transportName, reason=reason)

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
        session = self.sessions[subscriber]
        permissions = session.permissions
        if permissions is not None and not permissions.mayMatch(topicFilter, READ):
            self.sessions.forbid(session, "subscribe", topicFilter, requestId)
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
            self.router.add(subscriber, key, subscription)
            self.counters.count("subscriptions")
        else:
            subscription.id = requestId
            subscription.mode = mode
            subscription.bridge = bridge
            self.router.changed(subscriber, key, subscription)
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
        Offer a new subscription the retained messages its filter matches
        (L{dallal.broker.router.Router.offerRetained}): the broker's own
        topics' last values, and the store's.
        """
        found = self.ownTopics.match(subscription.topic)
        if self.retained is not None:
            found += self.retained.match(subscription.topic)
        self.router.offerRetained(self.sessions[subscriber], subscription, found)

    def unsubscribe(self, subscriber, topicFilter, requestId, group=None):
        """
        End one of a client's subscriptions (with C{group}, its shared
        subscription in that group).  What waits for it in C{latest} mode
        is dropped; what is in flight may still be acked.

        @raise RequestError: the client has no subscription with that filter.
        """
        session = self.sessions[subscriber]
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
        self.router.remove(session.subscriber, key)
        session.outbox.unsubscribe(subscription)
        self.counters.count("subscriptions", -1)

    def subscriptions(self, subscriber):
        """
        A client's subscriptions, as C{(filter, mode)} pairs in the order
        they were made.
        """
        return [
            (subscription.topic, subscription.mode)
            for subscription in self.sessions[subscriber].subscriptions.values()
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
        return self.directory.rows(limit)

    def publishedByTopic(self):
        """
        How many messages were published on each topic since the start (or
        since the count began again past
        L{dallal.broker.sysstats.TOPICS_PUBLISHED} topics).

        @return: a new C{dict}, topic -> messages.
        """
        return dict(self.topicTraffic.published)

    # Publishing

    def publish(self, subscriber, topic, payload, requestId, properties=None):
        """
        Publish a message and hand it to every subscription matching its
        topic.

        @param properties: the transport's own attributes of the message
            (L{dallal.broker.message.Message.properties}), passed through to
            the subscribers'.
        @return: the L{dallal.broker.message.Message}.
        @raise RequestError: the topic or the payload is refused, or the
            broker is shutting down.
        """
        if self.shuttingDown:
            self._checkAccepting(requestId)
        self._checkPublish(subscriber, topic, payload, requestId)
        return self.router.publish(topic, payload, subscriber, properties=properties)

    def acceptsRun(self, subscriber, topic):
        """
        Whether messages from C{subscriber} on C{topic}, each within
        C{maxPayload}, are accepted without a check each: nothing about
        the broker (shutting down), the topic (checked before) or an ACL
        can refuse one.  They are then published by L{publishRun} or
        L{publishAccepted}.
        """
        return not (self.shuttingDown or self.sessions.restricted or topic not in self._validTopics)

    def runReceivers(self, subscriber, topic):
        """
        The subscriptions a run of accepted messages from C{subscriber} on
        C{topic} goes to, if they can be published together
        (L{dallal.broker.router.Router.runReceivers}); else C{None}.
        """
        return self.router.runReceivers(topic, subscriber)

    def publishRun(self, topic, wireTopic, payloads, receivers):
        """
        Publish a run of accepted messages on one topic together, as many
        L{publish} would, to the C{receivers} L{runReceivers} gave just
        before.

        @param wireTopic: C{topic} encoded as UTF-8.
        """
        self.router.publishRun(topic, wireTopic, payloads, receivers)

    def publishAccepted(self, subscriber, topic, payload, properties=None):
        """
        Publish a message L{acceptsRun} accepted, as L{publish} would.
        """
        self.router.publish(topic, payload, subscriber, properties=properties)

    def _checkPublish(self, subscriber, topic, payload, requestId):
        """
        Refuse a message its topic, its size or the ACL refuses.
        """
        # Once per message: what passes (a topic already checked, a size
        # within the broker's maximum) costs no call.
        if topic not in self._validTopics:
            self.checkTopic(subscriber, topic, requestId)
        if len(payload) > self.config.maxPayload:
            self.checkPayloadSize(subscriber, len(payload), requestId)
        if self.sessions.restricted:
            session = self.sessions[subscriber]
            if session.permissions is not None and not session.permissions.mayWrite(topic):
                self.sessions.forbid(session, "publish", topic, requestId)

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
        session = self.sessions[subscriber]
        permissions = session.permissions
        if permissions is not None and not permissions.mayMatch(topicFilter, WRITE):
            self.sessions.forbid(session, "publish", topicFilter, requestId)
        maximum = self.config.maxMatchingTopics
        topics = {topic for topic, _ in self.directory.namedTopics.match(topicFilter, maximum)}
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
            self.router.publish(topic, payload, subscriber)
        return len(topics)

    def publishBridged(self, subscriber, topic, payload, sent, requestId):
        """
        Publish a message that came over a bridge (PROTOCOL.md, "Bridges"),
        unless this broker has routed it already
        (L{dallal.broker.bridging.Bridging.received}).

        @param subscriber: the session it came on: another broker's bridge
            connected to this one, or this broker's own bridge to another.
        @param sent: the L{dallal.broker.origin.Origin} it was sent with,
            as received (L{dallal.server.origins.originFromOptions}).
        @return: the L{dallal.broker.message.Message}, or C{None} if it was
            discarded (counted, and logged with the per-message events).
        @raise RequestError: refused: a bad origin, topic or payload size, or
            a topic the session may not write (counted in
            C{bridged_refused}); or the broker is shutting down (the bridge
            sends it again to the broker's next run).
        """
        self._checkAccepting(requestId)
        try:
            checkOrigin(sent, requestId)
            self._checkPublish(subscriber, topic, payload, requestId)
        except RequestError:
            self.counters.count("bridged_refused")
            raise
        return self.bridging.received(subscriber, topic, payload, sent)

    def originOf(self, message):
        """
        The L{dallal.broker.origin.Origin} a message carries over a bridge.
        """
        return self.bridging.originOf(message)

    def publishOwn(self, topic, payload):
        """
        Set the value of one of the broker's own topics (C{$SYS/...})
        (L{dallal.broker.owntopics.OwnTopics.publish}).
        """
        self.ownTopics.publish(topic, payload)

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
        self.counters.count(counter)
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
        self.counters.count("errors")
        session = self.sessions.get(subscriber)
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
