"""
The broker over MQTT 3.1.1 and 5.0: one L{MQTTProtocol} per connection.

The codec (L{dallal.protocol.mqtt}) turns bytes into packets; this protocol
keeps each connection's MQTT state (its version, packet identifiers, the
QoS 2 exchanges, topic aliases, the keep alive, the will) and hands
publishes and subscriptions to the L{Broker} core, as the Dallal TCP
protocol does.  The core sees an L{ISubscriber} like any other, with
C{transportName} C{mqtt}.

How MQTT maps onto the core:

 - A subscription's QoS 0 is the core's C{fire} mode, QoS 1 and 2 its
   C{all} mode.  A message goes out at the lower of its publish QoS and the
   subscription's (a message published over Dallal's own protocol or UDP
   goes out at the subscription's QoS).  The core's delivery of a QoS 1
   message is acked by its PUBACK, of a QoS 2 message by its PUBCOMP: the
   packet identifier, and the client's Receive Maximum, stay taken until
   then.  Nothing is resent within a connection (MQTT 5 forbids it,
   [MQTT-4.4.0-2]); what is unacked when it closes is dropped.
 - The in-flight window is the client's Receive Maximum (MQTT 5), at most
   C{--max-inflight}; the queue behind it is the core's, under the same
   limits and slow-consumer policy as every client.
 - An incoming QoS 2 packet identifier is held from PUBLISH to PUBREL, so a
   PUBLISH sent again is answered but not published twice.
 - The publisher's QoS, retain flag and MQTT 5 properties travel with the
   message as its opaque C{properties} (L{PublishAttributes}).
 - Sessions end with their connection (no persistent sessions yet): a
   CONNECT asking to keep one is answered with no session present, and in
   MQTT 5 with a Session Expiry Interval of 0.

Where the specifications let a server choose, this does what Mosquitto
2.0 does, and the comments say so.
"""

import uuid

from twisted.internet.defer import CancelledError
from twisted.internet.protocol import Protocol, ServerFactory
from twisted.logger import Logger
from zope.interface import implementer

from dallal.broker.delivery import EXPIRED, TOO_LARGE
from dallal.broker.interfaces import ISubscriber
from dallal.errors import (
    BAD_TOPIC,
    FORBIDDEN,
    NO_ID,
    NOT_AUTHORIZED,
    PAYLOAD_TOO_LARGE,
    TOO_MANY_SUBSCRIPTIONS,
    RequestError,
)
from dallal.limits import PAYLOAD, ConnectionTable
from dallal.modes import ALL, FIRE
from dallal.protocol.mqtt import (
    MQTT_3_1_1,
    MQTT_5,
    NO_PROPERTIES,
    SUBACK_FAILURE,
    ConnAck,
    Connect,
    ConnectReturnCode,
    Disconnect,
    MalformedPacket,
    MQTTDecoder,
    PacketType,
    PingReq,
    PingResp,
    Property,
    PubAck,
    PubComp,
    Publish,
    PubRec,
    PubRel,
    ReasonCode,
    SubAck,
    Subscribe,
    UnsubAck,
    Unsubscribe,
    encodeProperties,
    encodePublishHeader,
)
from dallal.security.auth import LOGIN_TIMEOUT
from dallal.server.addresses import formatAddress
from dallal.server.login import (
    PASSWORD_NEEDED,
    WRONG_PASSWORD,
    LoginRefused,
    checkPassword,
    userWithoutPassword,
)
from dallal.server.streams import (
    CONGESTION,
    LOGIN_CHECK,
    OUTPUT_FULL,
    BoundedOutput,
    ReadPause,
    WriteBatch,
)
from dallal.topictree import SubscriptionTree

# What a packet may carry beyond the largest payload the broker takes: its
# topic (at most 65,535 bytes) and properties.  A larger packet is refused
# as it arrives, before it is buffered.
PACKET_OVERHEAD = 64 * 1024
# The topic aliases a client may set (MQTT 5), as Mosquitto's default.
TOPIC_ALIAS_MAXIMUM = 10
# A client's Receive Maximum when it gives none (3.1.2.11.3).
DEFAULT_RECEIVE_MAXIMUM = 65535
SHARED_SUBSCRIPTION_PREFIX = "$share/"
# Topics whose matching filters a connection remembers, past which it
# starts again: a message is matched against the connection's own filters
# only when they overlap.
TOPICS_REMEMBERED = 1000

# The properties of a PUBLISH (or will) that belong to one hop, or to the
# will, not to the message: not passed on to subscribers.
_NOT_PASSED_ON = frozenset(
    {Property.TOPIC_ALIAS, Property.SUBSCRIPTION_IDENTIFIER, Property.WILL_DELAY_INTERVAL}
)

# A refused request's Dallal error code -> the MQTT 5 reason code of a
# PUBACK/PUBREC, and of a SUBACK.
_PUBLISH_REASONS = {
    BAD_TOPIC: ReasonCode.TOPIC_NAME_INVALID,
    FORBIDDEN: ReasonCode.NOT_AUTHORIZED,
    NOT_AUTHORIZED: ReasonCode.NOT_AUTHORIZED,
    PAYLOAD_TOO_LARGE: ReasonCode.QUOTA_EXCEEDED,
}
_SUBSCRIBE_REASONS = {
    BAD_TOPIC: ReasonCode.TOPIC_FILTER_INVALID,
    FORBIDDEN: ReasonCode.NOT_AUTHORIZED,
    NOT_AUTHORIZED: ReasonCode.NOT_AUTHORIZED,
    TOO_MANY_SUBSCRIPTIONS: ReasonCode.QUOTA_EXCEEDED,
}


class PublishAttributes:
    """
    What an MQTT publisher said of a message beyond its topic and payload,
    carried by the core as the message's opaque C{properties}.

    @ivar qos: the QoS it was published with.
    @ivar retain: its RETAIN flag.
    @ivar properties: its MQTT 5 properties to pass on (no topic alias), or
        L{NO_PROPERTIES}.
    """

    __slots__ = ("qos", "retain", "properties", "_encoded")

    def __init__(self, qos, retain, properties=NO_PROPERTIES):
        self.qos = qos
        self.retain = retain
        self.properties = properties
        self._encoded = None

    def encodedProperties(self, published, now, identifiers):
        """
        The properties as an MQTT 5 PUBLISH to a subscriber carries them,
        encoded once for every subscriber that adds none.  The Message
        Expiry Interval counts down from C{published} to C{now}
        [MQTT-3.3.2-6].

        @param identifiers: the subscription identifiers of the
            subscriber's matching subscriptions [MQTT-3.3.4-3].
        """
        properties = self.properties
        expiry = properties.get(Property.MESSAGE_EXPIRY_INTERVAL)
        if expiry is None and not identifiers:
            if self._encoded is None:
                self._encoded = encodeProperties(properties, PacketType.PUBLISH)
            return self._encoded
        properties = dict(properties)
        if expiry is not None:
            properties[Property.MESSAGE_EXPIRY_INTERVAL] = max(1, int(expiry - (now - published)))
        if identifiers:
            properties[Property.SUBSCRIPTION_IDENTIFIER] = identifiers
        return encodeProperties(properties, PacketType.PUBLISH)

    def expired(self, published, now):
        expiry = self.properties.get(Property.MESSAGE_EXPIRY_INTERVAL)
        return expiry is not None and now - published >= expiry


# The attributes of messages without properties, shared: (qos, retain).
_PLAIN = {
    (qos, retain): PublishAttributes(qos, retain) for qos in (0, 1, 2) for retain in (False, True)
}


def _sharing(topicFilter):
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


class _Granted:
    """
    A subscription as its client asked for it: the QoS granted and the
    MQTT 5 subscription options the protocol applies, and its subscription
    identifiers (none, or the one its SUBSCRIBE gave).
    """

    __slots__ = ("qos", "noLocal", "retainAsPublished", "identifiers")

    def __init__(self, qos, noLocal=False, retainAsPublished=False, identifiers=()):
        self.qos = qos
        self.noLocal = noLocal
        self.retainAsPublished = retainAsPublished
        self.identifiers = identifiers

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


class _Outgoing:
    """
    A QoS 1 or 2 PUBLISH sent to the client, until its last acknowledgement.

    @ivar released: for QoS 2, whether its PUBREC came (and PUBREL went).
    """

    __slots__ = ("deliveryId", "qos", "released")

    def __init__(self, deliveryId, qos):
        self.deliveryId = deliveryId
        self.qos = qos
        self.released = False


class ProtocolViolation(Exception):
    """
    The client broke a rule of the session (not of a packet's form): the
    connection closes, in MQTT 5 after a DISCONNECT with C{reasonCode}.
    """

    def __init__(self, message, reasonCode=ReasonCode.PROTOCOL_ERROR):
        Exception.__init__(self, message)
        self.reasonCode = reasonCode


@implementer(ISubscriber)
class MQTTProtocol(Protocol, BoundedOutput):
    """
    One MQTT client of the broker.

    @ivar version: 4 (MQTT 3.1.1) or 5, once the CONNECT said.
    @ivar clientId: the client identifier it connected with (or was
        assigned), once its CONNECT is accepted.
    """

    transportName = "mqtt"
    peer = "?"
    _log = Logger()

    def __init__(self, factory, host=None):
        self.factory = factory
        self.broker = factory.broker
        self.gatekeeper = factory.gatekeeper
        self.batch = factory.batch
        self.clock = self.broker.clock
        self._host = host
        self._decoder = MQTTDecoder(maxPacketSize=self.broker.config.maxPayload + PACKET_OVERHEAD)
        self.version = None
        self.clientId = None
        self._attached = False
        self._accepted = False
        # Why reading is held: a password being checked, a full write
        # buffer (a client that does not read its acks is not read from).
        # Why reading from the client is paused.
        self.readPause = ReadPause()
        self._closing = False
        self._closeReason = "closed"
        self._will = None
        self._granted = {}
        # The same subscriptions by filter, and what a topic's message gets
        # from those that match it, when they overlap.
        self._filters = SubscriptionTree()
        self._combined = {}
        # Outgoing QoS 1 and 2 messages by packet identifier.
        self._outgoing = {}
        self._nextPacketId = 1
        # Incoming QoS 2 packet identifiers, from PUBLISH to PUBREL.
        self._unreleased = set()
        self._aliases = {}
        self._clientMaxPacket = None
        self._problemInformation = True
        self._keepAlive = 0.0
        self._lastHeard = 0.0
        self._keepAliveTimer = None
        self._connectDeadline = None
        # Deliveries to settle once this turn's writes are done: (delivery
        # id, None to ack it or the reason it is dropped).
        self._toSettle = []
        self._settleCall = None

    # Connection

    def connectionMade(self):
        self.factory.connections.opened(self._host)
        self.peer = formatAddress(self.transport.getPeer())
        self._lastHeard = self.clock.seconds()
        self.startOutput()
        # The spec asks a server to close a connection that sends no
        # CONNECT in a reasonable time (3.1.4).
        self._connectDeadline = self.clock.callLater(self._connectTimeout(), self._connectTimedOut)

    def _connectTimeout(self):
        return LOGIN_TIMEOUT if self.gatekeeper is None else self.gatekeeper.loginTimeout

    def connectionLost(self, reason):
        # Nothing more is written, not even to this client's own will.
        self._closing = True
        self.dropOutput()
        self._cancel("_connectDeadline")
        self._cancel("_keepAliveTimer")
        self._cancel("_settleCall")
        self.factory.connections.closed(self._host)
        clients = self.factory.clients
        if clients.get(self.clientId) is self:
            del clients[self.clientId]
        if self._attached:
            if self._will is not None:
                self._publishWill()
            self._attached = False
            self.broker.detach(self, self._closeReason)

    def _cancel(self, name):
        call = getattr(self, name)
        if call is not None and call.active():
            call.cancel()
        setattr(self, name, None)

    def _close(self):
        """
        Close the connection once what was written is sent.
        """
        self._closing = True
        self.closeAfterOutput()

    def pauseReading(self, reason):
        """
        Read nothing more for C{reason}: neither from the transport nor the
        packets already read (they wait in the decoder).
        """
        if self.readPause.add(reason):
            self.transport.pauseProducing()

    def resumeReading(self, reason):
        """
        C{reason} is gone: read again if it was the last.
        """
        if self.readPause.discard(reason) and not self._closing:
            self.transport.resumeProducing()
            # Packets read before reading was paused wait in the decoder.
            self.batch.run(self._readPackets)

    def pausePublishing(self):
        self.pauseReading(CONGESTION)

    def resumePublishing(self):
        self.resumeReading(CONGESTION)

    def _writePacket(self, data):
        if not (self._closing or self.transport.disconnecting):
            self._write((data,))

    def _send(self, packet):
        encoded = packet.encode(self.version)
        maximum = self._clientMaxPacket
        if maximum is not None and len(encoded) > maximum and packet.properties:
            # Without its Reason String and User Properties, which must not
            # make it larger than the client takes [MQTT-3.1.2-25].
            packet.properties = NO_PROPERTIES
            encoded = packet.encode(self.version)
        self._writePacket(encoded)

    # Incoming packets

    def dataReceived(self, data):
        if self._closing or self.transport.disconnecting:
            # Whatever follows a DISCONNECT or a refusal is not read.
            return
        self._lastHeard = self.clock.seconds()
        self._decoder.feed(data)
        self.batch.run(self._readPackets)

    def _readPackets(self):
        try:
            for packet in self._decoder:
                self._packetReceived(packet)
                if self.readPause or self._closing:
                    # The rest stays in the decoder.
                    return
        except MalformedPacket as error:
            self.refuseStream(error.reasonCode, str(error))
        except ProtocolViolation as error:
            self.refuseStream(error.reasonCode, str(error))

    def _packetReceived(self, packet):
        kind = type(packet)
        if kind is Publish:
            self._publishReceived(packet)
        elif kind is Connect:
            self._connectReceived(packet)
        else:
            handler = self._handlers.get(kind)
            if handler is None:
                # A packet only a server sends, or AUTH (no authentication
                # method was agreed).
                raise ProtocolViolation(f"a client does not send {kind.__name__.upper()}")
            handler(self, packet)

    def refuseStream(self, reasonCode, why):
        """
        Close the connection for a malformed packet or a protocol error:
        count and log it, and tell the client why if it speaks MQTT 5
        (before its CONNECT is answered, in a CONNACK).
        """
        self._closeReason = "protocol_error"
        if reasonCode == ReasonCode.PACKET_TOO_LARGE:
            maximum = self.broker.config.maxPayload
            self.broker.refusedByLimit(self, PAYLOAD, maximum, why)
        self.broker.protocolError(self, ReasonCode(reasonCode).name, True)
        self._log.debug("closing MQTT connection from {peer}: {why}", peer=self.peer, why=why)
        if not self._accepted:
            if reasonCode == ReasonCode.UNSUPPORTED_PROTOCOL_VERSION:
                # [MQTT-3.1.2-2]: in the 3.1.1 form, which every client reads.
                self._writePacket(
                    ConnAck(reasonCode=ConnectReturnCode.UNACCEPTABLE_PROTOCOL_VERSION).encode(
                        MQTT_3_1_1
                    )
                )
            elif self._decoder.version == MQTT_5:
                self.version = MQTT_5
                self._send(ConnAck(reasonCode=reasonCode, properties=self._reasonString(why)))
        elif self.version == MQTT_5:
            self._send(Disconnect(reasonCode, self._reasonString(why)))
        self._close()

    def _reasonString(self, why):
        """
        The Reason String property of an MQTT 5 answer, unless the client
        asked for none [MQTT-3.1.2-29].
        """
        if not self._problemInformation:
            return NO_PROPERTIES
        return {Property.REASON_STRING: why}

    # CONNECT

    def _connectReceived(self, connect):
        self._cancel("_connectDeadline")
        self.version = version = connect.protocolLevel
        properties = connect.properties
        self._problemInformation = properties.get(Property.REQUEST_PROBLEM_INFORMATION, 1) == 1
        self._clientMaxPacket = properties.get(Property.MAXIMUM_PACKET_SIZE)
        if Property.AUTHENTICATION_METHOD in properties:
            self._refuseConnect(
                ReasonCode.BAD_AUTHENTICATION_METHOD,
                ConnectReturnCode.NOT_AUTHORIZED,
                "this broker knows no authentication method: log in with a user name and password",
            )
            return
        clientId, assigned = connect.clientId, False
        if not clientId:
            if version == MQTT_3_1_1 and not connect.cleanStart:
                # [MQTT-3.1.3-8]
                self._refuseConnect(
                    ReasonCode.CLIENT_IDENTIFIER_NOT_VALID,
                    ConnectReturnCode.IDENTIFIER_REJECTED,
                    "a client without an identifier has no session to resume",
                )
                return
            # As Mosquitto names them [MQTT-3.1.3-6].
            clientId, assigned = f"auto-{uuid.uuid4()}", True
        config = self.broker.config
        window = min(
            properties.get(Property.RECEIVE_MAXIMUM, DEFAULT_RECEIVE_MAXIMUM),
            config.delivery.maxInflight,
        )
        self._attached = True
        self.broker.attach(self, config.delivery.replace(maxInflight=window, ackTimeout=None))
        user = userWithoutPassword(self.gatekeeper, clientId)
        if user is not PASSWORD_NEEDED:
            self._accept(connect, clientId, assigned, user)
        elif connect.username is None:
            # As Mosquitto without allow_anonymous.
            self._refuseConnect(
                ReasonCode.NOT_AUTHORIZED,
                ConnectReturnCode.NOT_AUTHORIZED,
                "this broker requires a user name and password",
            )
        else:
            # Read nothing more until the password is checked.
            self.pauseReading(LOGIN_CHECK)
            checkPassword(
                self.broker,
                self.gatekeeper,
                (connect.username, connect.password or b""),
                clientId,
                self._host,
                NO_ID,
                self._answering,
            ).addCallbacks(
                self._loginSucceeded,
                self._loginFailed,
                callbackArgs=(connect, clientId, assigned),
            )

    def _answering(self):
        """
        Who answers a refused login: this connection, unless it is gone.
        """
        return self if self._attached else None

    def _loginSucceeded(self, user, connect, clientId, assigned):
        if not self._attached:
            return
        self.batch.run(self._accept, connect, clientId, assigned, user)
        # What the client sent after its CONNECT is read now.
        self.resumeReading(LOGIN_CHECK)

    def _loginFailed(self, failure):
        if failure.check(CancelledError):
            # The connection was lost while its check waited.
            return
        failure.trap(LoginRefused)
        refused = failure.value
        if refused.cause == WRONG_PASSWORD:
            # Mosquitto (2.0) answers a wrong password as "not authorized",
            # which tells a guesser nothing more.
            self._refuseConnect(
                ReasonCode.NOT_AUTHORIZED, ConnectReturnCode.NOT_AUTHORIZED, refused.error.reason
            )
        else:
            self._refuseConnect(
                ReasonCode.SERVER_UNAVAILABLE,
                ConnectReturnCode.SERVER_UNAVAILABLE,
                refused.error.reason,
            )

    def _refuseConnect(self, reasonCode, returnCode, why):
        """
        Answer a CONNECT with a refusing CONNACK and close [MQTT-3.2.2-5].
        """
        self._closeReason = "protocol_error"
        code = reasonCode if self.version == MQTT_5 else returnCode
        self._send(
            ConnAck(reasonCode=code, properties=self._connAckProperties(self._reasonString(why)))
        )
        self._close()

    def _connAckProperties(self, properties):
        if self.version != MQTT_5:
            return NO_PROPERTIES
        return properties

    def _accept(self, connect, clientId, assigned, user):
        """
        The CONNECT is accepted: take the client id over from a connection
        that has it, and answer CONNACK.
        """
        if user is not None:
            self.broker.login(self, user)
        clients = self.factory.clients
        previous = clients.get(clientId)
        if previous is not None and previous is not self:
            previous.sessionTakenOver()
        clients[clientId] = self
        self.clientId = clientId
        self._accepted = True
        self._will = connect.will
        if connect.keepAlive:
            # [MQTT-3.1.2-24]: one and a half times the client's keep alive.
            self._keepAlive = connect.keepAlive * 1.5
            self._keepAliveTimer = self.clock.callLater(self._keepAlive, self._checkKeepAlive)
        properties = {}
        if self.version == MQTT_5:
            properties = {
                Property.MAXIMUM_PACKET_SIZE: self._decoder.maxPacketSize,
                Property.TOPIC_ALIAS_MAXIMUM: TOPIC_ALIAS_MAXIMUM,
            }
            if self.broker.retained is None:
                properties[Property.RETAIN_AVAILABLE] = 0
            if assigned:
                properties[Property.ASSIGNED_CLIENT_IDENTIFIER] = clientId
            if connect.properties.get(Property.SESSION_EXPIRY_INTERVAL):
                # The session ends with the connection (3.2.2.3.2).
                properties[Property.SESSION_EXPIRY_INTERVAL] = 0
        self._send(ConnAck(sessionPresent=False, properties=properties))

    def _connectTimedOut(self):
        self._connectDeadline = None
        self._close()

    def sessionTakenOver(self):
        """
        Another connection connected with this one's client id: close this
        one [MQTT-3.1.4-2], telling an MQTT 5 client why.  Its will is
        published, as it did not disconnect.
        """
        self._closeReason = "taken_over"
        if self.version == MQTT_5:
            self._send(Disconnect(ReasonCode.SESSION_TAKEN_OVER))
        self._close()

    # Keep alive

    def _checkKeepAlive(self):
        if OUTPUT_FULL in self.readPause or CONGESTION in self.readPause:
            # Not read from while it catches up, or while a subscriber it
            # publishes to does: it may well be talking.
            self._lastHeard = self.clock.seconds()
        idle = self.clock.seconds() - self._lastHeard
        if idle < self._keepAlive:
            self._keepAliveTimer = self.clock.callLater(
                self._keepAlive - idle, self._checkKeepAlive
            )
            return
        self._keepAliveTimer = None
        # [MQTT-3.1.2-24]: as if the network failed, so the will goes out.
        self.broker.clientDropped(self, 1)
        self._closeReason = "missed_pings"
        self.dropOutput()
        self.transport.abortConnection()

    def _pingReceived(self, packet):
        self._send(PingResp())

    # DISCONNECT

    def _disconnectReceived(self, packet):
        # Disconnect with Will Message (0x04) keeps the will [MQTT-3.14.4-3].
        if packet.reasonCode != ReasonCode.DISCONNECT_WITH_WILL_MESSAGE:
            self._will = None
        self._close()

    def disconnect(self, reason):
        self._closeReason = reason
        if reason == "shutdown":
            # The broker has already detached this session.
            self._attached = False
            if self.version == MQTT_5:
                self._send(Disconnect(ReasonCode.SERVER_SHUTTING_DOWN))
            self._close()
        else:
            # A slow consumer's buffer may never drain: don't wait for it.
            self.dropOutput()
            self.transport.abortConnection()

    def _publishWill(self):
        will, self._will = self._will, None
        attributes = self._attributes(will.qos, will.retain, will.properties)
        try:
            self.broker.publish(self, will.topic, will.payload, NO_ID, attributes)
            if will.retain:
                self.broker.retain(will.topic, will.payload, NO_ID).addErrback(
                    self._storeFailed, will.topic
                )
        except RequestError as error:
            # The core has counted and logged an ACL or limit refusal.
            self._log.debug("will of {peer} refused: {error}", peer=self.peer, error=error)

    def _storeFailed(self, failure, topic):
        # The core has logged it (store_failed).
        failure.trap(RequestError)

    # PUBLISH from the client

    def _attributes(self, qos, retain, properties):
        if not properties:
            return _PLAIN[qos, bool(retain)]
        passed = {key: value for key, value in properties.items() if key not in _NOT_PASSED_ON}
        return PublishAttributes(qos, bool(retain), passed or NO_PROPERTIES)

    def _topicOf(self, packet):
        """
        The topic of an incoming PUBLISH, through its MQTT 5 topic alias.
        """
        alias = packet.properties.get(Property.TOPIC_ALIAS)
        if alias is None:
            return packet.topic
        if alias > TOPIC_ALIAS_MAXIMUM:
            # [MQTT-3.3.2-9]
            raise ProtocolViolation(
                f"topic alias {alias} is over the maximum of {TOPIC_ALIAS_MAXIMUM}",
                ReasonCode.TOPIC_ALIAS_INVALID,
            )
        if packet.topic:
            self._aliases[alias] = packet.topic
            return packet.topic
        topic = self._aliases.get(alias)
        if topic is None:
            raise ProtocolViolation(f"topic alias {alias} was never set")
        return topic

    def _publishReceived(self, packet):
        if packet.retain and self.broker.retained is None and self.version == MQTT_5:
            # Its CONNACK said Retain Available 0 [MQTT-3.3.1-19].
            raise ProtocolViolation(
                "this broker keeps no retained messages", ReasonCode.RETAIN_NOT_SUPPORTED
            )
        topic = self._topicOf(packet)
        qos = packet.qos
        packetId = packet.packetId
        if qos == 2 and packetId in self._unreleased:
            # Sent again before its PUBREL: published already [MQTT-4.3.3-10].
            self._send(PubRec(packetId))
            return
        requestId = NO_ID if packetId is None else str(packetId)
        try:
            self.broker.publish(
                self,
                topic,
                packet.payload,
                requestId,
                self._attributes(qos, packet.retain, packet.properties),
            )
            stored = self.broker.retain(topic, packet.payload, requestId) if packet.retain else None
        except RequestError as error:
            self._publishRefused(packet, error)
            return
        if stored is not None and qos:
            stored.addCallbacks(
                lambda _: self._acknowledgePublish(packet),
                lambda failure: self._storeRefused(failure, packet),
            )
        elif stored is not None:
            stored.addErrback(self._storeFailed, topic)
        elif qos:
            self._acknowledgePublish(packet)

    def _acknowledgePublish(self, packet, reasonCode=0, properties=NO_PROPERTIES):
        if packet.qos == 1:
            self._send(PubAck(packet.packetId, reasonCode, properties))
        else:
            if reasonCode < 0x80:
                self._unreleased.add(packet.packetId)
            self._send(PubRec(packet.packetId, reasonCode, properties))

    def _storeRefused(self, failure, packet):
        failure.trap(RequestError)
        self._publishRefused(packet, failure.value)

    def _publishRefused(self, packet, error):
        """
        The core refused a publish (ACL, limits, shutting down): counted as
        an error.  An MQTT 5 client is told why in its PUBACK or PUBREC; an
        MQTT 3.1.1 client cannot be, and is acked as Mosquitto acks it
        [MQTT-3.3.5-2].
        """
        self.broker.protocolError(self, error.code, False)
        if not packet.qos:
            return
        if self.version == MQTT_5:
            reasonCode = _PUBLISH_REASONS.get(error.code, ReasonCode.UNSPECIFIED_ERROR)
            self._acknowledgePublish(packet, reasonCode, self._reasonString(error.reason))
        else:
            self._acknowledgePublish(packet)

    def _pubRelReceived(self, packet):
        if packet.packetId in self._unreleased:
            self._unreleased.discard(packet.packetId)
            self._send(PubComp(packet.packetId))
        elif self.version == MQTT_5:
            self._send(PubComp(packet.packetId, ReasonCode.PACKET_IDENTIFIER_NOT_FOUND))
        else:
            self._send(PubComp(packet.packetId))

    # Acknowledgements of what the broker sent

    def _pubAckReceived(self, packet):
        outgoing = self._outgoing.get(packet.packetId)
        if outgoing is not None and outgoing.qos == 1:
            del self._outgoing[packet.packetId]
            self.broker.acknowledge(self, outgoing.deliveryId)

    def _pubRecReceived(self, packet):
        outgoing = self._outgoing.get(packet.packetId)
        if outgoing is None or outgoing.qos != 2:
            if self.version == MQTT_5:
                self._send(PubRel(packet.packetId, ReasonCode.PACKET_IDENTIFIER_NOT_FOUND))
            return
        if packet.reasonCode >= 0x80:
            # The client refused it: the exchange ends here (4.3.3).
            del self._outgoing[packet.packetId]
            self.broker.acknowledge(self, outgoing.deliveryId)
            return
        outgoing.released = True
        self._send(PubRel(packet.packetId))

    def _pubCompReceived(self, packet):
        outgoing = self._outgoing.get(packet.packetId)
        if outgoing is not None and outgoing.released:
            del self._outgoing[packet.packetId]
            self.broker.acknowledge(self, outgoing.deliveryId)

    # SUBSCRIBE and UNSUBSCRIBE

    def _subscribeReceived(self, packet):
        identifiers = packet.properties.get(Property.SUBSCRIPTION_IDENTIFIER, ())
        codes, retainedFor = [], []
        for wanted in packet.subscriptions:
            topicFilter = wanted.topicFilter
            existed = topicFilter in self._granted
            try:
                group, realFilter = _sharing(topicFilter)
                if group is not None and wanted.noLocal:
                    # [MQTT-3.8.3-4]
                    raise ProtocolViolation("a shared subscription with No Local")
                subscription = self.broker.subscribe(
                    self,
                    realFilter,
                    topicFilter,
                    FIRE if wanted.qos == 0 else ALL,
                    group=group,
                )
            except RequestError as error:
                self.broker.protocolError(self, error.code, False)
                codes.append(
                    self._subscribeFailure(
                        _SUBSCRIBE_REASONS.get(error.code, ReasonCode.UNSPECIFIED_ERROR)
                    )
                )
                continue
            granted = _Granted(wanted.qos, wanted.noLocal, wanted.retainAsPublished, identifiers)
            self._granted[topicFilter] = granted
            codes.append(wanted.qos)
            if group is not None:
                # A shared subscription gets no retained messages
                # (4.8.2), and stands apart from the client's own.
                continue
            self._filters.add(topicFilter, self, granted)
            self._combined.clear()
            # Retain Handling (3.8.3.1): 0 always, 1 if new, 2 never.
            if wanted.retainHandling == 0 or (wanted.retainHandling == 1 and not existed):
                retainedFor.append(subscription)
        self._send(SubAck(packet.packetId, codes))
        for subscription in retainedFor:
            self.broker.sendRetained(self, subscription)

    def _subscribeFailure(self, reasonCode):
        return reasonCode if self.version == MQTT_5 else SUBACK_FAILURE

    def _unsubscribeReceived(self, packet):
        codes = []
        for topicFilter in packet.topicFilters:
            try:
                group, realFilter = _sharing(topicFilter)
                self.broker.unsubscribe(self, realFilter, topicFilter, group)
            except RequestError:
                codes.append(ReasonCode.NO_SUBSCRIPTION_EXISTED)
            else:
                self._forget(topicFilter)
                codes.append(ReasonCode.SUCCESS)
        self._send(UnsubAck(packet.packetId, codes if self.version == MQTT_5 else []))

    _handlers = {
        PubAck: _pubAckReceived,
        PubRec: _pubRecReceived,
        PubRel: _pubRelReceived,
        PubComp: _pubCompReceived,
        Subscribe: _subscribeReceived,
        Unsubscribe: _unsubscribeReceived,
        PingReq: _pingReceived,
        Disconnect: _disconnectReceived,
    }

    # ISubscriber

    def sendMessage(self, message, subscriptionId, seq, deliveryId, redelivered):
        if self._closing or self.transport.disconnecting:
            return
        granted = self._grantedFor(message.topic, subscriptionId)
        attributes = message.properties
        if not isinstance(attributes, PublishAttributes):
            attributes = None
        now = self.clock.seconds()
        if granted is not None and granted.noLocal and message.source is self:
            # No Local [MQTT-3.8.3-3]: not for this client, and never sent.
            self._settleLater(deliveryId, None)
            return
        if attributes is not None and attributes.expired(message.published, now):
            self._settleLater(deliveryId, EXPIRED)
            return
        grantedQos = 0 if granted is None else granted.qos
        qos = grantedQos if attributes is None else min(attributes.qos, grantedQos)
        retain = message.retained or (
            granted is not None
            and granted.retainAsPublished
            and attributes is not None
            and attributes.retain
        )
        if self.version == MQTT_5:
            identifiers = () if granted is None else granted.identifiers
            if attributes is None:
                attributes = _PLAIN[qos, False]
            properties = attributes.encodedProperties(message.published, now, identifiers)
        else:
            properties = None
        packetId = self._allocatePacketId() if qos else None
        header = encodePublishHeader(
            message.wireTopic, len(message.payload), qos, packetId, retain, False, properties
        )
        if (
            self._clientMaxPacket is not None
            and len(header) + len(message.payload) > self._clientMaxPacket
        ):
            # [MQTT-3.1.2-25]: never sent, as if it had been.
            self._settleLater(deliveryId, TOO_LARGE)
            return
        if qos:
            self._outgoing[packetId] = _Outgoing(deliveryId, qos)
        elif deliveryId is not None:
            # Delivered at QoS 0 for a QoS 1 or 2 subscription: no ack comes.
            self._settleLater(deliveryId, None)
        self._write((header, message.payload))

    def _grantedFor(self, topic, subscriptionId):
        """
        What a message on C{topic} gets from this client's subscriptions:
        that of the subscription the core delivers it through, or, when
        several of the client's filters match it, their combination.
        """
        granted = self._granted
        if len(granted) < 2 or subscriptionId.startswith(SHARED_SUBSCRIPTION_PREFIX):
            return granted.get(subscriptionId)
        combined = self._combined.get(topic)
        if combined is None:
            matching = self._filters.match(topic).get(self)
            if not matching:
                # A message still queued for a subscription since ended.
                return granted.get(subscriptionId)
            combined = matching[0] if len(matching) == 1 else _Granted.combined(matching)
            if len(self._combined) >= TOPICS_REMEMBERED:
                self._combined.clear()
            self._combined[topic] = combined
        return combined

    def _forget(self, topicFilter):
        if self._granted.pop(topicFilter, None) is not None and not topicFilter.startswith(
            SHARED_SUBSCRIPTION_PREFIX
        ):
            self._filters.remove(topicFilter, self)
            self._combined.clear()

    def _allocatePacketId(self):
        """
        A packet identifier no outgoing message holds.  The window is far
        below 65,535, so one is always free.
        """
        packetId = self._nextPacketId
        while packetId in self._outgoing:
            packetId = packetId % 65535 + 1
        self._nextPacketId = packetId % 65535 + 1
        return packetId

    def _settleLater(self, deliveryId, dropReason):
        """
        Ack (or, with C{dropReason}, drop) a delivery the client will not
        ack, once the broker is done sending: settling it at once would
        send the next one from inside this send.
        """
        if deliveryId is None:
            return
        self._toSettle.append((deliveryId, dropReason))
        if self._settleCall is None:
            self._settleCall = self.clock.callLater(0, self.batch.run, self._settle)

    def _settle(self):
        self._settleCall = None
        settling, self._toSettle = self._toSettle, []
        if not self._attached:
            return
        for deliveryId, dropReason in settling:
            if dropReason is None:
                self.broker.acknowledge(self, deliveryId)
            else:
                self.broker.reject(self, deliveryId, dropReason)

    def subscriptionRevoked(self, subscriptionId, reason):
        """
        The ACL read again no longer lets this client read what one of its
        filters matches: MQTT cannot say that of one subscription, so the
        connection closes (MQTT 5: Administrative action) and the client
        learns the ACL when it subscribes again.
        """
        self._forget(subscriptionId)
        self._closeReason = "revoked"
        if self.version == MQTT_5:
            self._send(Disconnect(ReasonCode.ADMINISTRATIVE_ACTION, self._reasonString(reason)))
        self._close()


class MQTTFactory(ServerFactory):
    """
    Builds an L{MQTTProtocol} for each connection to one broker, within
    the broker's connection limits.

    @param batch: the L{WriteBatch} shared with the broker's other stream
        connections, so that a message read from one is written to each
        once.
    @param connections: the L{dallal.limits.ConnectionTable} shared with
        them: the connection limits count every stream connection.
    @ivar clients: client id -> the connection that has it.
    """

    noisy = False

    def __init__(self, broker, gatekeeper=None, batch=None, connections=None):
        self.broker = broker
        self.gatekeeper = gatekeeper
        self.batch = batch if batch is not None else WriteBatch()
        if connections is None:
            config = broker.config
            connections = ConnectionTable(config.maxConnections, config.maxConnectionsPerIp)
        self.connections = connections
        self.clients = {}

    def buildProtocol(self, addr):
        host = getattr(addr, "host", None)
        refusal = self.connections.refusal(host)
        if refusal is not None:
            # Closed at once, as Mosquitto over its max_connections.
            limit, maximum, reason = refusal
            self.broker.limits.refused(
                limit, maximum, formatAddress(addr), MQTTProtocol.transportName, reason=reason
            )
            return None
        return MQTTProtocol(self, host)
