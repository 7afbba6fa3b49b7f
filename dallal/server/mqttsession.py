"""
MQTT sessions: what the broker keeps of an MQTT client across its
connections (MQTT 3.1.1's Clean Session 0, MQTT 5's Session Expiry
Interval).

The broker core sees an L{MQTTSession}, not a connection: it is attached
for as long as the session lasts, with its subscriptions, whether a
connection (an L{dallal.server.mqtt.MQTTProtocol}) carries it or not.
While its client is away its QoS 1 and 2 messages wait, as a connected
client's do when it does not ack: those its in-flight window (the client's
Receive Maximum) holds wait here, the rest in the core's queue under the
same limits and slow-consumer policy.  QoS 0 messages for a client that is
away are dropped (counted as C{drop reason=disconnected}), as Mosquitto
does without C{queue_qos0_messages}.  A connection with the same client id
that does not ask for a clean start takes the session over: what was sent
and not acked is sent again with DUP, a QoS 2 message whose PUBREC came is
released again, and what waited follows.

A session ends when its expiry interval passes with no connection (never
for an MQTT 3.1.1 session, nor for an MQTT 5 interval of 0xFFFFFFFF), when
a connection with its client id asks for a clean start, or when its client
is a slow consumer under the C{disconnect} policy.  The broker keeps at
most C{--max-offline-sessions} sessions without a connection: one more
ends as its connection closes.

With a data directory, the sessions that outlive their connections are
written to an SQLite file (L{SessionStore}) when the broker stops, with
their subscriptions and what waits for them, and taken up again when it
starts.
"""

from collections import deque

from twisted.logger import Logger
from zope.interface import implementer

from dallal.broker.counters import DISCONNECTED, QUEUE_FULL
from dallal.broker.interfaces import IRunSubscriber
from dallal.broker.message import Message
from dallal.errors import BAD_TOPIC, NO_ID, RequestError
from dallal.limits import OFFLINE_BYTES, OFFLINE_SESSIONS, QUEUED_BYTES, QUEUED_MESSAGES
from dallal.modes import ALL, FIRE
from dallal.protocol.mqtt import (
    MQTT_5,
    NO_PROPERTIES,
    PacketType,
    Property,
    encodeProperties,
    encodeVariableByteInteger,
)
from dallal.security.auth import IBrokerUser
from dallal.server.mqttstore import StoredMessage, StoredSession, storedPublish
from dallal.topictree import SubscriptionTree

SHARED_SUBSCRIPTION_PREFIX = "$share/"
# Topic shapes, and topics, whose matching filters a session remembers,
# past which it starts again: a message is matched against the session's
# own filters only when they overlap.
TOPICS_REMEMBERED = 1000
# MQTT 5's Session Expiry Interval that means never (3.1.2.11.2).
NEVER_EXPIRES = 0xFFFFFFFF

# The properties of a PUBLISH (or will) that belong to one hop, or to the
# will, not to the message: not passed on to subscribers.
_NOT_PASSED_ON = frozenset(
    {Property.TOPIC_ALIAS, Property.SUBSCRIPTION_IDENTIFIER, Property.WILL_DELAY_INTERVAL}
)


class PublishAttributes:
    """
    What an MQTT publisher said of a message beyond its topic and payload,
    carried by the core as the message's opaque C{properties}.

    @ivar qos: the QoS it was published with.
    @ivar retain: its RETAIN flag.
    @ivar properties: its MQTT 5 properties to pass on (no topic alias), or
        L{NO_PROPERTIES}.
    @ivar expiry: its Message Expiry Interval in seconds, or C{None}.
    """

    __slots__ = ("qos", "retain", "properties", "expiry", "_encoded")

    def __init__(self, qos, retain, properties=NO_PROPERTIES):
        self.qos = qos
        self.retain = retain
        self.properties = properties
        # Read once: every delivery asks.
        self.expiry = properties.get(Property.MESSAGE_EXPIRY_INTERVAL)
        self._encoded = None

    def encodedProperties(self, published, now, granted):
        """
        The properties as an MQTT 5 PUBLISH to a subscriber carries them,
        encoded once for every subscriber that adds none.  The Message
        Expiry Interval counts down from C{published} to C{now}
        [MQTT-3.3.2-6].

        @param granted: the L{Granted} of the subscriber's matching
            subscriptions, whose subscription identifiers it gets
            [MQTT-3.3.4-3], or C{None}.
        """
        properties = self.properties
        expiry = self.expiry
        identifiers = () if granted is None else granted.identifiers
        if expiry is None:
            if self._encoded is None:
                self._encoded = encodeProperties(properties, PacketType.PUBLISH)
            if not identifiers:
                return self._encoded
            # The message's own properties, then the subscriber's
            # identifiers, each encoded once.
            body = _withoutLength(self._encoded) + granted.encodedIdentifiers()
            return encodeVariableByteInteger(len(body)) + body
        properties = dict(properties)
        if expiry is not None:
            properties[Property.MESSAGE_EXPIRY_INTERVAL] = max(1, int(expiry - (now - published)))
        if identifiers:
            properties[Property.SUBSCRIPTION_IDENTIFIER] = identifiers
        return encodeProperties(properties, PacketType.PUBLISH)

    def expired(self, published, now):
        return self.expiry is not None and now - published >= self.expiry


def _withoutLength(encoded):
    """
    Encoded properties without the Variable Byte Integer of their length.
    """
    start = 1
    while encoded[start - 1] & 0x80:
        start += 1
    return encoded[start:]


# The attributes of messages without properties, shared: (qos, retain).
PLAIN = {
    (qos, retain): PublishAttributes(qos, retain) for qos in (0, 1, 2) for retain in (False, True)
}


def publishAttributes(qos, retain, properties):
    """
    The L{PublishAttributes} of a message published (or a will) with
    C{qos}, C{retain} and C{properties}.
    """
    if properties is NO_PROPERTIES or not properties:
        return PLAIN[qos, bool(retain)]
    passed = {key: value for key, value in properties.items() if key not in _NOT_PASSED_ON}
    return PublishAttributes(qos, bool(retain), passed or NO_PROPERTIES)


def qosOf(message, granted):
    """
    The QoS a message goes out at: the lower of its publish QoS and the
    subscription's (a message published over Dallal's own protocol or UDP
    goes out at the subscription's).

    @param granted: the L{Granted} of the subscriptions it matched, or
        C{None}.
    """
    grantedQos = 0 if granted is None else granted.qos
    if not grantedQos:
        return 0
    attributes = message.properties
    if isinstance(attributes, PublishAttributes) and attributes.qos < grantedQos:
        return attributes.qos
    return grantedQos


def cancelDelayed(owner, name):
    """
    Cancel the delayed call C{owner} keeps as its attribute C{name}, if it
    is still to come, and forget it.
    """
    call = getattr(owner, name)
    if call is not None and call.active():
        call.cancel()
    setattr(owner, name, None)


def ignoreStoreFailure(failure, topic):
    """
    A retained message was not stored: the core has logged it
    (C{store_failed}).
    """
    failure.trap(RequestError)


def sharing(topicFilter):
    """
    The share group and filter of a shared subscription's
    C{$share/<group>/<filter>} (4.8.2), or C{None} and the filter itself.

    @raise RequestError: C{BAD_TOPIC}, for a malformed one.
    """
    if not topicFilter.startswith(SHARED_SUBSCRIPTION_PREFIX):
        return None, topicFilter
    group, _, realFilter = topicFilter[len(SHARED_SUBSCRIPTION_PREFIX) :].partition("/")
    if not group or not realFilter or "+" in group or "#" in group:
        # [MQTT-4.8.2-1], [MQTT-4.8.2-2]
        raise RequestError(BAD_TOPIC, f"{topicFilter!r} is no $share/<group>/<filter>", topicFilter)
    return group, realFilter


class Granted:
    """
    A subscription as its client asked for it: the QoS granted and the
    MQTT 5 subscription options the protocol applies, and its subscription
    identifiers (none, or the one its SUBSCRIBE gave).
    """

    __slots__ = ("qos", "noLocal", "retainAsPublished", "identifiers", "_encodedIdentifiers")

    def __init__(self, qos, noLocal=False, retainAsPublished=False, identifiers=()):
        self.qos = qos
        self.noLocal = noLocal
        self.retainAsPublished = retainAsPublished
        self.identifiers = identifiers
        self._encodedIdentifiers = None

    def encodedIdentifiers(self):
        """
        Its subscription identifiers as the properties of a PUBLISH carry
        them, without the properties' length: encoded once, however many
        messages they go with (a client's overlapping subscriptions may
        give a message a thousand).
        """
        if self._encodedIdentifiers is None:
            encoded = encodeProperties(
                {Property.SUBSCRIPTION_IDENTIFIER: self.identifiers}, PacketType.PUBLISH
            )
            self._encodedIdentifiers = _withoutLength(encoded)
        return self._encodedIdentifiers

    @classmethod
    def combined(cls, matching):
        """
        What a message matching several subscriptions of one client gets,
        sent once: the highest QoS [MQTT-3.3.4-2], every identifier; it is
        not sent back to its publisher only if no matching subscription
        wants it back.
        """
        return cls(
            max(granted.qos for granted in matching),
            all(granted.noLocal for granted in matching),
            any(granted.retainAsPublished for granted in matching),
            [identifier for granted in matching for identifier in granted.identifiers],
        )


class Outgoing:
    """
    A QoS 1 or 2 PUBLISH sent to the client, until its last acknowledgement.

    @ivar deliveryId: the core's id of the delivery, or C{None} for a
        message the session took up from its store.
    @ivar released: for QoS 2, whether its PUBREC came (and PUBREL went).
    @ivar message: the L{Message}, sent again if the client reconnects
        before it acks it.
    @ivar subscriptionId: the subscription it was sent through.
    """

    __slots__ = ("deliveryId", "qos", "released", "message", "subscriptionId")

    def __init__(self, deliveryId, qos, message, subscriptionId):
        self.deliveryId = deliveryId
        self.qos = qos
        self.released = False
        self.message = message
        self.subscriptionId = subscriptionId


class DelayedWill:
    """
    A connection's will, as its session publishes it.

    @ivar attributes: its L{PublishAttributes}.
    @ivar delay: its MQTT 5 Will Delay Interval, in seconds.
    """

    __slots__ = ("topic", "payload", "attributes", "delay")

    def __init__(self, topic, payload, attributes, delay):
        self.topic = topic
        self.payload = payload
        self.attributes = attributes
        self.delay = delay

    @classmethod
    def of(cls, will, delay=None):
        """
        The will of a CONNECT (a L{dallal.protocol.mqtt.Will}), or one kept
        as a L{Publish} by the store with its C{delay}.
        """
        if delay is None:
            delay = will.properties.get(Property.WILL_DELAY_INTERVAL, 0)
        attributes = publishAttributes(will.qos, will.retain, will.properties)
        return cls(will.topic, will.payload, attributes, delay)


def sessionExpiry(connect):
    """
    How long the session of a CONNECT outlives its connection, in seconds,
    or C{None} for ever: an MQTT 3.1.1 Clean Session 0 session never
    expires.
    """
    if connect.protocolLevel != MQTT_5:
        return 0 if connect.cleanStart else None
    interval = connect.properties.get(Property.SESSION_EXPIRY_INTERVAL, 0)
    return None if interval == NEVER_EXPIRES else interval


@implementer(IRunSubscriber)
class MQTTSession:
    """
    One MQTT client's session, as the broker core sees it.

    @ivar protocol: the L{dallal.server.mqtt.MQTTProtocol} that carries it,
        or C{None} while its client is away.
    @ivar expiry: seconds it outlives its connection, or C{None} for ever.
    @ivar granted: topic filter -> its L{Granted}.
    @ivar outgoing: packet identifier -> the L{Outgoing} message sent and
        not yet acked.
    @ivar pending: what the core delivered that no connection has been
        sent yet, oldest first: C{(message, subscriptionId, deliveryId)}
        (no delivery id for what came from the store).
    @ivar unreleased: incoming QoS 2 packet identifiers, from PUBLISH to
        PUBREL.
    @ivar unresent: the packet identifiers of the L{outgoing} messages to
        send again to the connection that resumed the session, as its
        window allows.
    @ivar will: the L{DelayedWill} of its connection, or C{None}.
    @ivar user: the name its client logged in with, or C{None}.
    @ivar ended: whether it has ended (it is detached from the core).
    @ivar window: its in-flight window in the core.
    """

    transportName = "mqtt"
    _log = Logger()

    def __init__(self, factory, clientId, peer, window):
        """
        Attach a new session to the core.
        """
        self.factory = factory
        self.broker = factory.broker
        self.clock = self.broker.clock
        self.clientId = clientId
        self.peer = peer
        self.window = window
        self.protocol = None
        self.expiry = 0
        self.granted = {}
        # The same subscriptions by filter, and what a message gets from
        # those that match its topic, when they overlap, by topic shape and
        # by topic (a topic seen before costs no shape).
        self.filters = SubscriptionTree()
        self.combined = {}
        self.combinedByTopic = {}
        self.outgoing = {}
        self.nextPacketId = 1
        self.pending = deque()
        self.unresent = deque()
        self.unreleased = set()
        self.will = None
        self.user = None
        self.ended = False
        # The payload bytes of the messages that came to pending while the
        # client was away (or from the store), and of a will kept for its
        # delay, counted in the factory's offlineBytes until a connection
        # resumes the session.
        self.heldBytes = 0
        # Set while the session hands what it holds to the store: what the
        # core delivers meanwhile waits here.
        self.saving = False
        self._expiryCall = None
        self._willCall = None
        # Deliveries to settle once this turn's writes are done: (delivery
        # id, None to ack it or the reason it is dropped).
        self._toSettle = []
        self._settleCall = None
        self.broker.attach(
            self, self.broker.config.delivery.replace(maxInflight=window, ackTimeout=None)
        )

    @property
    def persistent(self):
        return self.expiry != 0

    # Subscriptions

    def grant(self, topicFilter, granted):
        self.granted[topicFilter] = granted
        if not topicFilter.startswith(SHARED_SUBSCRIPTION_PREFIX):
            # A shared subscription stands apart from the client's own.
            self.filters.add(topicFilter, self, granted)
            self._forgetCombined()

    def forget(self, topicFilter):
        if self.granted.pop(topicFilter, None) is not None and not topicFilter.startswith(
            SHARED_SUBSCRIPTION_PREFIX
        ):
            self.filters.remove(topicFilter, self)
            self._forgetCombined()

    def _forgetCombined(self):
        self.combined.clear()
        self.combinedByTopic.clear()

    def grantedFor(self, topic, subscriptionId):
        """
        What a message on C{topic} gets from this client's subscriptions:
        that of the subscription the core delivers it through, or, when
        several of the client's filters match it, their combination.
        """
        granted = self.granted
        if len(granted) < 2 or subscriptionId.startswith(SHARED_SUBSCRIPTION_PREFIX):
            return granted.get(subscriptionId)
        combined = self.combinedByTopic.get(topic)
        if combined is not None:
            return combined
        # Topics of one shape match the same filters (SubscriptionTree.shape):
        # a new topic of a known shape costs no match.
        shape = self.filters.shape(topic)
        combined = self.combined.get(shape)
        if combined is None:
            matching = self.filters.match(topic).get(self)
            if not matching:
                # A message still queued for a subscription since ended.
                return granted.get(subscriptionId)
            combined = matching[0] if len(matching) == 1 else Granted.combined(matching)
            if len(self.combined) >= TOPICS_REMEMBERED:
                self.combined.clear()
            self.combined[shape] = combined
        if len(self.combinedByTopic) >= TOPICS_REMEMBERED:
            self.combinedByTopic.clear()
        self.combinedByTopic[topic] = combined
        return combined

    def allocatePacketId(self):
        """
        A packet identifier no outgoing message holds.  The window is far
        below 65,535, so one is always free.
        """
        packetId = self.nextPacketId
        while packetId in self.outgoing:
            packetId = packetId % 65535 + 1
        self.nextPacketId = packetId % 65535 + 1
        return packetId

    # ISubscriber

    @property
    def takesRuns(self):
        """
        Whether runs of C{fire} messages may be written with
        L{sendMessageRun}: to a connection that takes them
        (L{dallal.server.mqtt.MQTTProtocol.takesRuns}).
        """
        protocol = None if self.saving else self.protocol
        return protocol is not None and protocol.takesRuns

    def sendMessageRun(self, topic, wireTopic, payloads, subscriptionId, firstSeq):
        protocol = None if self.saving else self.protocol
        if protocol is not None:
            protocol.deliverRun(wireTopic, payloads)

    def sendMessage(self, message, subscriptionId, seq, deliveryId, redelivered):
        protocol = None if self.saving else self.protocol
        if deliveryId is None:
            # QoS 0 waits for nothing, and for no one who is away.
            if protocol is not None:
                protocol.deliver(message, subscriptionId, None)
            return
        if protocol is None and qosOf(message, self.grantedFor(message.topic, subscriptionId)) == 0:
            self.settleLater(deliveryId, DISCONNECTED)
            return
        if protocol is None and not self.saving:
            self._holdWhileAway(message, subscriptionId, deliveryId)
            return
        if protocol is not None and not (self.pending or self.unresent) and protocol.hasRoom():
            protocol.deliver(message, subscriptionId, deliveryId)
        else:
            self.pending.append((message, subscriptionId, deliveryId))

    def _holdWhileAway(self, message, subscriptionId, deliveryId):
        """
        Keep a message for the client while it is away.  The core sends
        the session all it has meanwhile (L{_awayWindow}), so nothing waits
        in its queue, nor holds a publisher back: what the session holds
        counts against a client's queue limits (C{--max-queued},
        C{--max-queued-bytes}) and, with what every other session whose
        client is away holds, against C{--max-offline-bytes}, so that it
        does not grow with the number of sessions.  Over them the message
        is dropped (C{queue_full}), as Mosquitto drops what comes for an
        offline client whose queue is full.
        """
        size = len(message.payload)
        factory, delivery = self.factory, self.broker.config.delivery
        if len(self.pending) >= delivery.maxQueued:
            limit, maximum = QUEUED_MESSAGES, delivery.maxQueued
        elif self.heldBytes + size > delivery.maxQueuedBytes:
            limit, maximum = QUEUED_BYTES, delivery.maxQueuedBytes
        elif factory.offlineBytes + size > factory.maxOfflineBytes:
            limit, maximum = OFFLINE_BYTES, factory.maxOfflineBytes
        else:
            self._hold(size)
            self.pending.append((message, subscriptionId, deliveryId))
            return
        self.broker.refusedByLimit(self, limit, maximum)
        self.settleLater(deliveryId, QUEUE_FULL)

    def _hold(self, size):
        self.heldBytes += size
        self.factory.offlineBytes += size

    def _release(self, size):
        size = min(size, self.heldBytes)
        self.heldBytes -= size
        self.factory.offlineBytes -= size

    def _releaseHeld(self):
        self._release(self.heldBytes)

    def _awayWindow(self, away):
        """
        Set the session's window in the core: while its client is away,
        wide enough for all a session may hold (its window and
        C{--max-queued}), so that the core sends it everything and queues
        nothing (L{_holdWhileAway} bounds it); with a connection, its own.
        """
        delivery = self.broker.config.delivery
        window = self.window + delivery.maxQueued if away else self.window
        self.broker.setInflightWindow(self, window)

    def sendPending(self):
        """
        Send what waits, as far as the connection's window allows: first
        what an earlier connection was sent and did not ack, then what the
        core delivered meanwhile.
        """
        protocol = self.protocol
        unresent, pending = self.unresent, self.pending
        while unresent and protocol is not None and protocol.hasRoom():
            packetId = unresent.popleft()
            outgoing = self.outgoing.get(packetId)
            if outgoing is not None:
                protocol.resend(packetId, outgoing)
        while pending and protocol is not None and protocol.hasRoom():
            message, subscriptionId, deliveryId = pending.popleft()
            protocol.deliver(message, subscriptionId, deliveryId)

    def subscriptionRevoked(self, subscriptionId, reason):
        self.forget(subscriptionId)
        if self.protocol is not None:
            self.protocol.subscriptionRevoked(subscriptionId, reason)

    def disconnect(self, reason):
        """
        The core ends the session: the broker stops (it has detached it
        already), or its client is a slow consumer (C{disconnect} policy).
        """
        if reason == "shutdown":
            # The broker is stopping: no will, and no end of its own.
            self.will = None
            self._ended()
        else:
            self.expiry = 0
        if self.protocol is not None:
            self.protocol.disconnect(reason)
        elif not self.ended:
            self.end(reason)

    def pausePublishing(self):
        if self.protocol is not None:
            self.protocol.pausePublishing()

    def resumePublishing(self):
        if self.protocol is not None:
            self.protocol.resumePublishing()

    # Acknowledgements

    def acknowledge(self, deliveryId):
        if deliveryId is not None and not self.ended:
            self.broker.acknowledge(self, deliveryId)

    def acknowledgeAll(self, deliveryIds):
        """
        Ack deliveries together.  C{None}, the delivery id of a message
        taken up from the store, acks nothing.
        """
        if deliveryIds and not self.ended:
            self.broker.acknowledgeAll(self, deliveryIds)

    def settleLater(self, deliveryId, dropReason):
        """
        Ack (or, with C{dropReason}, drop) a delivery the client will not
        ack, once the broker is done sending: settling it at once would
        send the next one from inside this send.
        """
        if deliveryId is None:
            return
        self._toSettle.append((deliveryId, dropReason))
        if self._settleCall is None:
            self._settleCall = self.clock.callLater(0, self.factory.batch.run, self._settle)

    def _settle(self):
        self._settleCall = None
        settling, self._toSettle = self._toSettle, []
        if self.ended:
            return
        for deliveryId, dropReason in settling:
            if dropReason is None:
                self.broker.acknowledge(self, deliveryId)
            else:
                self.broker.reject(self, deliveryId, dropReason)

    # Connections

    def resume(self, protocol):
        """
        A connection takes the session over, after its CONNACK: what was
        sent and not acked goes again (DUP), then what waited
        [MQTT-4.4.0-1].  A delayed will is not published [MQTT-3.1.3-9].
        """
        self.protocol = protocol
        self.peer = protocol.peer
        cancelDelayed(self, "_expiryCall")
        cancelDelayed(self, "_willCall")
        self.factory.offline.discard(self)
        self._releaseHeld()
        self._awayWindow(False)
        # Within the Receive Maximum of this connection, which may be less
        # than the one they were sent under.
        self.unresent = deque(self.outgoing)
        self.sendPending()
        # The connection taken over may have paused the core's delivery.
        self.broker.resumeDelivery(self)

    def takenOver(self, cleanStart):
        """
        A connection with this session's client id was accepted: the one
        that has it, if any, closes [MQTT-3.1.4-3]; with a clean start, the
        session ends.  The will of the connection closed is published
        unless the new connection comes within its delay.
        """
        protocol, self.protocol = self.protocol, None
        if protocol is not None:
            protocol.sessionTakenOver()
        if cleanStart:
            self.end("taken_over")
        elif self.will is not None and not self.will.delay:
            self.publishWill()
        self.will = None

    def connectionEnded(self, reason):
        """
        The connection that carried the session closed: the session ends,
        or waits for its client, its will published now or after its
        delay (or when the session ends, if sooner) [MQTT-3.1.3-9].
        """
        self.protocol = None
        if self.ended:
            return
        if not self.persistent:
            self.end(reason)
            return
        factory = self.factory
        will = self.will
        # A will kept for its delay is held as the messages are.
        willBytes = 0 if will is None or not will.delay else len(will.payload)
        if len(factory.offline) >= factory.maxOfflineSessions:
            limit, maximum = OFFLINE_SESSIONS, factory.maxOfflineSessions
        elif factory.offlineBytes + willBytes > factory.maxOfflineBytes:
            limit, maximum = OFFLINE_BYTES, factory.maxOfflineBytes
        else:
            limit = None
        if limit is not None:
            self.broker.refusedByLimit(self, limit, maximum)
            self.end(reason)
            return
        factory.offline.add(self)
        if will is not None:
            if not will.delay:
                self.publishWill()
            else:
                self._hold(willBytes)
                if self.expiry is None or will.delay < self.expiry:
                    self._willCall = self.clock.callLater(will.delay, self._willDelayPassed)
        # After the delayed will is held: what the wider window sends at once
        # counts against the offline bounds with it.
        self._awayWindow(True)
        self._awaitClient()
        # A transport that was full paused the core's delivery: the session
        # takes what its window holds.
        self.broker.resumeDelivery(self)

    def _awaitClient(self):
        if self.expiry is not None:
            self._expiryCall = self.clock.callLater(self.expiry, self.expire)

    def _willDelayPassed(self):
        self._willCall = None
        self.publishWill()

    def expire(self):
        """
        The session's expiry interval passed without a connection.
        """
        self._expiryCall = None
        self.broker.events.emit(
            "session_expired",
            session=self.broker.sessionId(self),
            client_id=self.clientId,
            queued=len(self.pending) + len(self.outgoing),
        )
        self.end("session_expired")

    def end(self, reason):
        """
        The session ends: its will goes out if it has not, and the core
        drops its subscriptions and what waits for it.
        """
        if self.will is not None:
            self.publishWill()
        self._ended()
        self.broker.detach(self, reason)

    def _ended(self):
        self.ended = True
        self._releaseHeld()
        cancelDelayed(self, "_expiryCall")
        cancelDelayed(self, "_willCall")
        self.factory.forget(self)

    def publishWill(self):
        will, self.will = self.will, None
        if self.protocol is None:
            # Held while its client was away, if it waited for its delay.
            self._release(len(will.payload))
        broker = self.broker
        try:
            broker.publish(self, will.topic, will.payload, NO_ID, will.attributes)
            if will.attributes.retain:
                broker.retain(will.topic, will.payload, NO_ID).addErrback(
                    ignoreStoreFailure, will.topic
                )
        except RequestError as error:
            # The core has counted and logged an ACL or limit refusal.
            self._log.debug("will of {peer} refused: {error}", peer=self.peer, error=error)

    # The store

    def takeFromCore(self):
        """
        The broker stops: take what the core holds for this session, acked
        to the core as the store takes it over, so that the core's drain
        does not wait for a client that is away.
        """
        self.saving = True
        broker = self.broker
        broker.resumeDelivery(self)
        while True:
            # Each ack lets the core send what it queued: it waits here.
            held = [o.deliveryId for o in self.outgoing.values() if o.deliveryId is not None]
            held += [deliveryId for _, _, deliveryId in self.pending if deliveryId is not None]
            if not held:
                break
            for outgoing in self.outgoing.values():
                outgoing.deliveryId = None
            self.pending = deque((message, sid, None) for message, sid, _ in self.pending)
            for deliveryId in held:
                broker.acknowledge(self, deliveryId)

    def snapshot(self):
        """
        The broker stops: take what the core holds for this session, and
        return it all as a L{StoredSession}.
        """
        self.takeFromCore()
        expiry = self.expiry
        if self._expiryCall is not None:
            expiry = self._expiryCall.getTime() - self.clock.seconds()
        messages = [
            _storedMessage(
                packetId,
                outgoing.qos,
                outgoing.released,
                outgoing.message,
                outgoing.subscriptionId,
            )
            for packetId, outgoing in self.outgoing.items()
        ]
        messages += [
            _storedMessage(None, None, False, message, sid) for message, sid, _ in self.pending
        ]
        will, willDelay, willDue = self.will, 0, None
        if will is not None and self.protocol is None:
            # Away, its will waits for its delay (or the session's end): the
            # store keeps it with the time it has left.
            willDelay = will.delay
            if self._willCall is not None:
                willDue = self._willCall.getTime() - self.clock.seconds()
            will = storedPublish(will.topic, will.payload, will.attributes)
        else:
            # A connection's will: none goes out as the broker stops.
            will = None
        return StoredSession(
            self.clientId,
            self.user,
            self.peer,
            expiry,
            self.window,
            self.nextPacketId,
            self.unreleased,
            [
                (topicFilter, g.qos, g.noLocal, g.retainAsPublished, list(g.identifiers))
                for topicFilter, g in self.granted.items()
            ],
            messages,
            will,
            willDelay,
            willDue,
        )

    @classmethod
    def restore(cls, factory, stored):
        """
        Take up a session from the store, without a connection.

        @param stored: its L{StoredSession}.
        """
        session = cls(factory, stored.clientId, stored.peer, stored.window)
        session.expiry = stored.expiry
        broker = factory.broker
        gatekeeper = factory.gatekeeper
        if gatekeeper is not None:
            if stored.user is None:
                user = gatekeeper.anonymous(stored.clientId)
            else:
                user = gatekeeper.realm.requestAvatar(stored.user, stored.clientId, IBrokerUser)[1]
            broker.login(session, user)
            session.user = user.name
        for topicFilter, qos, noLocal, retainAsPublished, identifiers in stored.subscriptions:
            try:
                group, realFilter = sharing(topicFilter)
                broker.subscribe(
                    session, realFilter, topicFilter, FIRE if qos == 0 else ALL, group=group
                )
            except RequestError as error:
                # The ACL or the limits changed while the broker was stopped.
                broker.protocolError(session, error.code, False)
                continue
            session.grant(topicFilter, Granted(qos, noLocal, retainAsPublished, identifiers))
        for kept in stored.messages:
            publish = kept.publish
            message = Message(
                0,
                publish.topic,
                publish.payload,
                stored.peer,
                kept.published,
                kept.retained,
                properties=publishAttributes(publish.qos, publish.retain, publish.properties),
            )
            if kept.packetId is None:
                session._hold(len(message.payload))
                session.pending.append((message, kept.subscription, None))
            else:
                outgoing = Outgoing(None, kept.qos, message, kept.subscription)
                outgoing.released = kept.released
                session.outgoing[kept.packetId] = outgoing
        session.unreleased = set(stored.unreleased)
        session.nextPacketId = stored.nextPacketId
        factory.sessions[session.clientId] = session
        factory.offline.add(session)
        if stored.will is not None:
            session.will = DelayedWill.of(stored.will, stored.willDelay)
            session._hold(len(stored.will.payload))
            if stored.willDue is not None:
                session._willCall = session.clock.callLater(
                    stored.willDue, session._willDelayPassed
                )
        session._awayWindow(True)
        session._awaitClient()
        return session


def _storedMessage(packetId, qos, released, message, subscriptionId):
    attributes = message.properties
    if not isinstance(attributes, PublishAttributes):
        # Published over Dallal's protocol or UDP: it goes out at the
        # subscription's QoS.
        attributes = PLAIN[2, False]
    return StoredMessage(
        packetId,
        qos,
        released,
        subscriptionId,
        message.published,
        message.retained,
        storedPublish(message.topic, message.payload, attributes),
    )
