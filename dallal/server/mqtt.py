"""
The broker over MQTT 3.1.1 and 5.0: one L{MQTTProtocol} per connection.

The codec (L{dallal.protocol.mqtt}) turns bytes into packets; this protocol
keeps each connection's MQTT state (its version, topic aliases, the keep
alive, the client's limits) and hands publishes and subscriptions to the
L{Broker} core, as the Dallal TCP protocol does.  What outlives a
connection -- subscriptions, packet identifiers, QoS 1 and 2 exchanges,
the will -- is its session's (L{dallal.server.mqttsession.MQTTSession}),
which the core sees as an L{ISubscriber} like any other, with
C{transportName} C{mqtt}.

How MQTT maps onto the core:

 - A subscription's QoS 0 is the core's C{fire} mode, QoS 1 and 2 its
   C{all} mode.  A message goes out at the lower of its publish QoS and the
   subscription's (a message published over Dallal's own protocol or UDP
   goes out at the subscription's QoS).  The core's delivery of a QoS 1
   message is acked by its PUBACK, of a QoS 2 message by its PUBCOMP: the
   packet identifier, and the client's Receive Maximum, stay taken until
   then.  Nothing is resent within a connection (MQTT 5 forbids it,
   [MQTT-4.4.0-2]); what is unacked when it closes is dropped, unless its
   session outlives it: then it is sent again, with DUP, to the connection
   that resumes the session.
 - The in-flight window is the client's Receive Maximum (MQTT 5), at most
   C{--max-inflight}; the queue behind it is the core's, under the same
   limits and slow-consumer policy as every client.  (A session's window
   in the core is its first connection's; a later connection with a lower
   Receive Maximum is sent less at a time, the rest waiting in the
   session.)
 - An incoming QoS 2 packet identifier is held from PUBLISH to PUBREL, so a
   PUBLISH sent again is answered but not published twice.
 - The publisher's QoS, retain flag and MQTT 5 properties travel with the
   message as its opaque C{properties} (L{PublishAttributes}).
 - A session ends with its connection unless its CONNECT asked to keep
   it (Clean Session 0, a Session Expiry Interval): then it waits for its
   client (L{dallal.server.mqttsession}).
 - No topic aliases are sent to clients, as Mosquitto sends none by
   default; those clients set are taken, up to L{TOPIC_ALIAS_MAXIMUM}.

Where the specifications let a server choose, this does what Mosquitto
2.0 does, and the comments say so.
"""

import uuid

from twisted.internet.defer import CancelledError, succeed
from twisted.internet.protocol import Protocol, ServerFactory
from twisted.logger import Logger, LogLevel
from zope.interface import implementer

from dallal.broker.counters import EXPIRED, TOO_LARGE
from dallal.broker.interfaces import ISubscriber
from dallal.errors import (
    BAD_TOPIC,
    FORBIDDEN,
    LOGIN_TIMEOUT,
    NO_ID,
    NOT_AUTHORIZED,
    PAYLOAD_TOO_LARGE,
    TOO_MANY_SUBSCRIPTIONS,
    RequestError,
)
from dallal.limits import (
    DEFAULT_MAX_OFFLINE_BYTES,
    DEFAULT_MAX_OFFLINE_SESSIONS,
    FRAME_SECONDS,
    OFFLINE_SESSIONS,
    PAYLOAD,
    RECEIVE_MAXIMUM,
    ConnectionTable,
)
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
    PingReq,
    PingResp,
    Property,
    PubAck,
    PubComp,
    PubRec,
    PubRel,
    ReasonCode,
    SubAck,
    Subscribe,
    UnsubAck,
    Unsubscribe,
    encodeBareAcknowledgement,
    encodeBareAcknowledgements,
    encodePublishHeader,
)
from dallal.security.auth import LOGIN_TIMEOUT as CONNECT_TIMEOUT
from dallal.server.addresses import formatAddress
from dallal.server.login import (
    PASSWORD_NEEDED,
    WRONG_PASSWORD,
    LoginRefused,
    checkPassword,
    userWithoutPassword,
)
from dallal.server.mqttsession import (
    NEVER_EXPIRES,
    PLAIN,
    DelayedWill,
    Granted,
    MQTTSession,
    Outgoing,
    PublishAttributes,
    cancelDelayed,
    ignoreStoreFailure,
    publishAttributes,
    qosOf,
    sessionExpiry,
    sharing,
)
from dallal.server.streams import (
    CONGESTION,
    LOGIN_CHECK,
    OUTPUT_FULL,
    RUN_BYTES,
    BoundedOutput,
    ReadPause,
    WriteBatch,
)

# What a packet may carry beyond the largest payload the broker takes: its
# topic (at most 65,535 bytes) and properties.  A larger packet is refused
# as it arrives, before it is buffered.
PACKET_OVERHEAD = 64 * 1024
# The topic aliases a client may set (MQTT 5), as Mosquitto's default.
TOPIC_ALIAS_MAXIMUM = 10
# The error code a CONNECT is refused with (counted, logged) when its
# client id names another user's session.
CLIENT_ID_TAKEN = "CLIENT_ID_TAKEN"
# A client's Receive Maximum when it gives none (3.1.2.11.3).
DEFAULT_RECEIVE_MAXIMUM = 65535

# The tag of a message's encoding (L{dallal.broker.message.Message}) that
# holds the bytes of its QoS 1 or 2 PUBLISH before and after the packet
# identifier: (tag, (version, retain, qos), before, after).
_ACKED_HEADER = object()

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
        self._decoder = MQTTDecoder(
            maxPacketSize=self.broker.config.maxPayload + PACKET_OVERHEAD, publishFields=True
        )
        self.version = None
        self.clientId = None
        # The session this connection carries: its own from its CONNECT,
        # or the one it resumed.
        self.session = None
        self._accepted = False
        # Why reading is held: a password being checked, a full write
        # buffer (a client that does not read its acks is not read from).
        # Why reading from the client is paused.
        self.readPause = ReadPause()
        self._closing = False
        self._closeReason = "closed"
        self._receiveMaximum = DEFAULT_RECEIVE_MAXIMUM
        self._aliases = {}
        self._clientMaxPacket = None
        self._problemInformation = True
        self._keepAlive = 0.0
        self._lastHeard = 0.0
        self._keepAliveTimer = None
        self._connectDeadline = None
        self._frameDeadline = None
        # While a read's packets are handled, the packet identifiers of
        # the QoS 1 PUBLISHes acked with a bare PUBACK, written together
        # (L{_writePubAcks}); otherwise C{None}.
        self._pubAcks = None

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
        return CONNECT_TIMEOUT if self.gatekeeper is None else self.gatekeeper.loginTimeout

    def connectionLost(self, reason):
        # Nothing more is written, not even to this client's own will.
        self._closing = True
        self.dropOutput()
        cancelDelayed(self, "_connectDeadline")
        cancelDelayed(self, "_keepAliveTimer")
        cancelDelayed(self, "_frameDeadline")
        self.factory.connections.closed(self._host)
        if self._carriesSession():
            self.session.connectionEnded(self._closeReason)

    def _carriesSession(self):
        """
        Whether this connection carries its session: not before its
        CONNECT, nor once another took the session over or it ended.
        """
        session = self.session
        return session is not None and session.protocol is self and not session.ended

    @property
    def _subscriber(self):
        """
        Who the core counts this connection's doings against: its session,
        or before its CONNECT the connection itself.
        """
        return self if self.session is None else self.session

    def _close(self):
        """
        Close the connection once what was written is sent.
        """
        self._closing = True
        self.closeAfterOutput()

    def outputSubscriber(self):
        """
        Whose deliveries a full write buffer holds: its session's, while
        this connection carries it.
        """
        return self.session if self._carriesSession() else None

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
        decoder = self._decoder
        before = decoder.buffered + len(data)
        decoder.feed(data)
        self.batch.run(self._readPackets)
        self._watchPacket(decoder.buffered < before)

    def _watchPacket(self, progressed):
        """
        A packet begun must be complete within C{--max-frame-seconds}, from
        the read that completed the packet before it: a client that sends
        a few bytes now and then (keeping its keep alive) holds a
        connection and a buffer no longer.  Before its CONNECT is accepted,
        the connect timeout bounds it; while reading is paused, the packets
        waiting are the broker's doing.

        @param progressed: whether this read completed a packet.
        """
        waiting = self._accepted and not self.readPause and self._decoder.buffered
        if progressed or not waiting:
            cancelDelayed(self, "_frameDeadline")
        if waiting and self._frameDeadline is None and not self._closing:
            self._frameDeadline = self.clock.callLater(
                self.broker.config.maxFrameSeconds, self._packetTimedOut
            )

    def _packetTimedOut(self):
        self._frameDeadline = None
        seconds = self.broker.config.maxFrameSeconds
        why = f"a packet begun was not complete within {seconds} seconds"
        self.broker.refusedByLimit(self._subscriber, FRAME_SECONDS, seconds, why)
        self.refuseStream(ReasonCode.KEEP_ALIVE_TIMEOUT, why)

    def _readPackets(self):
        run = _PublishRun(self)
        # A read resumed while one is handled (reading paused and resumed
        # by what it did) gathers into the same list.
        gathering = self._pubAcks is None
        if gathering:
            self._pubAcks = []
        try:
            for packet in self._decoder:
                kind = type(packet)
                if kind is tuple:
                    # A PUBLISH's fields.
                    if run.takes(packet):
                        continue
                    run.publish()
                    if not self._publishedPlainQos1(packet):
                        self._publishReceived(*packet)
                elif kind is list:
                    # The packet identifiers of a run of PUBACKs.
                    self._pubAcksReceived(packet)
                else:
                    run.publish()
                    self._writePubAcks()
                    self._packetReceived(packet)
                if self.readPause or self._closing:
                    # The rest stays in the decoder.
                    return
        except MalformedPacket as error:
            run.publish()
            self._writePubAcks()
            self.refuseStream(error.reasonCode, str(error))
        except ProtocolViolation as error:
            self._writePubAcks()
            self.refuseStream(error.reasonCode, str(error))
        finally:
            run.publish()
            self._writePubAcks()
            if gathering:
                self._pubAcks = None

    def _writePubAcks(self):
        """
        Write the bare PUBACKs gathered in this read so far, in the order
        of their PUBLISHes [MQTT-4.6.0-2], before any other packet that
        answers the client.
        """
        acks = self._pubAcks
        if acks:
            self._writePacket(encodeBareAcknowledgements(PubAck, acks))
            acks.clear()

    def _packetReceived(self, packet):
        """
        Handle a packet other than PUBLISH.
        """
        kind = type(packet)
        if kind is Connect:
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
            self.broker.refusedByLimit(self._subscriber, PAYLOAD, maximum, why)
        self.broker.protocolError(self._subscriber, ReasonCode(reasonCode).name, True)
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

    def _receiveMaximumOfBroker(self):
        """
        The QoS 2 publishes a client may leave unreleased (PUBREC sent, no
        PUBREL yet): the broker's Receive Maximum, its in-flight window.
        """
        return min(self.broker.config.delivery.maxInflight, DEFAULT_RECEIVE_MAXIMUM)

    def _receiveMaximumExceeded(self):
        """
        One more QoS 2 publish than the Receive Maximum is unreleased: the
        connection closes [MQTT-3.3.4-9] (MQTT 3.1.1 has no word for it;
        closed alike rather than publish without holding its identifier, or
        hold identifiers, which the session keeps while its client is away,
        without bound).
        """
        maximum = self._receiveMaximumOfBroker()
        why = f"more than the Receive Maximum of {maximum} QoS 2 publishes await their PUBREL"
        self.broker.refusedByLimit(self.session, RECEIVE_MAXIMUM, maximum, why)
        raise ProtocolViolation(why, ReasonCode.RECEIVE_MAXIMUM_EXCEEDED)

    # CONNECT

    def _connectReceived(self, connect):
        cancelDelayed(self, "_connectDeadline")
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
        self._receiveMaximum = min(
            properties.get(Property.RECEIVE_MAXIMUM, DEFAULT_RECEIVE_MAXIMUM),
            config.delivery.maxInflight,
        )
        # Until the CONNECT is accepted, a session of its own: whether it
        # resumes one is known once it has logged in.  Its window is this
        # connection's Receive Maximum, as is that of a session it resumes.
        self.session = MQTTSession(self.factory, clientId, self.peer, self._receiveMaximum)
        self.session.protocol = self
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
        Who answers a refused login: this connection's session, unless the
        connection is gone.
        """
        return self.session if self._carriesSession() else None

    def _loginSucceeded(self, user, connect, clientId, assigned):
        if not self._carriesSession():
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
        The CONNECT is accepted: take the client id's session over, or
        start one, and answer CONNACK.  A session belongs to the user that
        started it: another user's CONNECT with its client id is refused,
        as the client id is no credential (it neither resumes the session
        nor closes its connection).
        """
        owner = self.factory.sessions.get(clientId)
        userName = None if user is None else user.name
        if owner is not None and owner is not self.session and owner.user != userName:
            self.broker.protocolError(self.session, CLIENT_ID_TAKEN, True)
            self._refuseConnect(
                ReasonCode.CLIENT_IDENTIFIER_NOT_VALID,
                ConnectReturnCode.IDENTIFIER_REJECTED,
                f"client id {clientId!r} belongs to another user's session",
            )
            return
        session = self._takeSession(connect, clientId)
        if user is not None:
            self.broker.login(session, user)
            session.user = user.name
        self.clientId = clientId
        self._accepted = True
        session.expiry = sessionExpiry(connect)
        session.will = None if connect.will is None else DelayedWill.of(connect.will)
        if connect.keepAlive:
            # [MQTT-3.1.2-24]: one and a half times the client's keep alive.
            self._keepAlive = connect.keepAlive * 1.5
            self._keepAliveTimer = self.clock.callLater(self._keepAlive, self._checkKeepAlive)
        properties = {}
        if self.version == MQTT_5:
            properties = {
                Property.MAXIMUM_PACKET_SIZE: self._decoder.maxPacketSize,
                Property.TOPIC_ALIAS_MAXIMUM: TOPIC_ALIAS_MAXIMUM,
                Property.RECEIVE_MAXIMUM: self._receiveMaximumOfBroker(),
            }
            if self.broker.retained is None:
                properties[Property.RETAIN_AVAILABLE] = 0
            if assigned:
                properties[Property.ASSIGNED_CLIENT_IDENTIFIER] = clientId
        present = session is not self.session
        self._send(ConnAck(sessionPresent=present, properties=properties))
        if present:
            fresh, self.session = self.session, session
            fresh.protocol = None
            fresh.end("resumed")
            self.broker.events.emit(
                "session_resumed",
                session=self.broker.sessionId(session),
                client=self.peer,
                client_id=clientId,
                queued=len(session.pending) + len(session.outgoing),
            )
            session.window = self._receiveMaximum
            session.resume(self)

    def _takeSession(self, connect, clientId):
        """
        The session this connection carries: the client id's, which the
        connection that has it loses, unless the CONNECT asks for a clean
        start [MQTT-3.1.2-4]; else its own.
        """
        factory = self.factory
        previous = factory.sessions.get(clientId)
        if previous is not None and previous is not self.session:
            previous.takenOver(connect.cleanStart)
            if not previous.ended:
                return previous
        factory.sessions[clientId] = self.session
        return self.session

    def _connectTimedOut(self):
        """
        No CONNECT in time (nothing, or a packet begun and not finished):
        counted and logged as Dallal's own protocol's login timeout, and
        closed, as Mosquitto closes it, without a CONNACK.
        """
        self._connectDeadline = None
        self.broker.protocolError(self, LOGIN_TIMEOUT, True)
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
        self.broker.clientDropped(self.session, 1)
        self._closeReason = "missed_pings"
        self.dropOutput()
        self.transport.abortConnection()

    def _pingReceived(self, packet):
        self._send(PingResp())

    # DISCONNECT

    def _disconnectReceived(self, packet):
        session = self.session
        expiry = packet.properties.get(Property.SESSION_EXPIRY_INTERVAL)
        if expiry is not None:
            if not session.persistent and expiry:
                # [MQTT-3.14.2-2]
                raise ProtocolViolation(
                    "a session that ends with its connection cannot be given an expiry"
                )
            session.expiry = None if expiry == NEVER_EXPIRES else expiry
        # Disconnect with Will Message (0x04) keeps the will [MQTT-3.14.4-3].
        if packet.reasonCode != ReasonCode.DISCONNECT_WITH_WILL_MESSAGE:
            session.will = None
        self._close()

    def disconnect(self, reason):
        """
        Close the connection for the session's end: the broker stops, or
        its client is a slow consumer.
        """
        self._closeReason = reason
        if reason == "shutdown":
            if self.version == MQTT_5:
                self._send(Disconnect(ReasonCode.SERVER_SHUTTING_DOWN))
            self._close()
        else:
            # A slow consumer's buffer may never drain: don't wait for it.
            self.dropOutput()
            self.transport.abortConnection()

    # PUBLISH from the client

    def _topicOf(self, topic, properties):
        """
        The topic of an incoming PUBLISH, through its MQTT 5 topic alias.
        """
        alias = properties.get(Property.TOPIC_ALIAS)
        if alias is None:
            return topic
        if alias > TOPIC_ALIAS_MAXIMUM:
            # [MQTT-3.3.2-9]
            raise ProtocolViolation(
                f"topic alias {alias} is over the maximum of {TOPIC_ALIAS_MAXIMUM}",
                ReasonCode.TOPIC_ALIAS_INVALID,
            )
        if topic:
            self._aliases[alias] = topic
            return topic
        topic = self._aliases.get(alias)
        if topic is None:
            raise ProtocolViolation(f"topic alias {alias} was never set")
        return topic

    def _publishedPlainQos1(self, fields):
        """
        Publish a QoS 1 PUBLISH without RETAIN or properties (its fields)
        that the broker accepts without a check
        (L{dallal.broker.core.Broker.acceptsRun}), and gather its PUBACK:
        what L{_publishReceived} does, in fewer steps.

        @return: whether it was published; if not, L{_publishReceived}
            handles it.
        """
        topic, payload, qos, retain, _, packetId, properties = fields
        if qos != 1 or retain or properties is not NO_PROPERTIES:
            return False
        broker = self.broker
        if len(payload) > broker.config.maxPayload or not broker.acceptsRun(self.session, topic):
            return False
        broker.publishAccepted(self.session, topic, payload, _PLAIN_QOS_1)
        self._pubAcks.append(packetId)
        return True

    def _publishReceived(self, topic, payload, qos, retain, dup, packetId, properties):
        """
        Publish what a client's PUBLISH carries (the fields of a L{Publish}),
        and ack it at QoS 1 and 2.
        """
        if retain and self.broker.retained is None and self.version == MQTT_5:
            # Its CONNACK said Retain Available 0 [MQTT-3.3.1-19].
            raise ProtocolViolation(
                "this broker keeps no retained messages", ReasonCode.RETAIN_NOT_SUPPORTED
            )
        if properties is not NO_PROPERTIES:
            # Every MQTT 3.1.1 PUBLISH has none, so no topic alias.
            topic = self._topicOf(topic, properties)
        if qos == 2 and packetId in self.session.unreleased:
            # Sent again before its PUBREL: published already [MQTT-4.3.3-10].
            self._send(PubRec(packetId))
            return
        if qos == 2 and len(self.session.unreleased) >= self._receiveMaximumOfBroker():
            self._receiveMaximumExceeded()
        requestId = NO_ID if packetId is None else str(packetId)
        try:
            self.broker.publish(
                self.session,
                topic,
                payload,
                requestId,
                publishAttributes(qos, retain, properties),
            )
            stored = self.broker.retain(topic, payload, requestId) if retain else None
        except RequestError as error:
            self._publishRefused(qos, packetId, error)
            return
        if stored is not None and qos:
            stored.addCallbacks(
                lambda _: self._acknowledgePublish(qos, packetId),
                lambda failure: self._storeRefused(failure, qos, packetId),
            )
        elif stored is not None:
            stored.addErrback(ignoreStoreFailure, topic)
        elif qos:
            self._acknowledgePublish(qos, packetId)

    def _acknowledgePublish(self, qos, packetId, reasonCode=0, properties=NO_PROPERTIES):
        if qos == 1 and not (reasonCode or properties):
            acks = self._pubAcks
            if acks is None:
                # Acked later than its read (its retained copy stored).
                self._writePacket(encodeBareAcknowledgement(PubAck, packetId))
            else:
                acks.append(packetId)
            return
        self._writePubAcks()
        if qos == 1:
            self._send(PubAck(packetId, reasonCode, properties))
        else:
            if reasonCode < 0x80:
                self.session.unreleased.add(packetId)
            self._send(PubRec(packetId, reasonCode, properties))

    def _storeRefused(self, failure, qos, packetId):
        failure.trap(RequestError)
        self._publishRefused(qos, packetId, failure.value)

    def _publishRefused(self, qos, packetId, error):
        """
        The core refused a publish (ACL, limits, shutting down): counted as
        an error.  An MQTT 5 client is told why in its PUBACK or PUBREC; an
        MQTT 3.1.1 client cannot be, and is acked as Mosquitto acks it
        [MQTT-3.3.5-2].
        """
        self.broker.protocolError(self.session, error.code, False)
        if not qos:
            return
        if self.version == MQTT_5:
            reasonCode = _PUBLISH_REASONS.get(error.code, ReasonCode.UNSPECIFIED_ERROR)
            self._acknowledgePublish(qos, packetId, reasonCode, self._reasonString(error.reason))
        else:
            self._acknowledgePublish(qos, packetId)

    def _pubRelReceived(self, packet):
        unreleased = self.session.unreleased
        if packet.packetId in unreleased:
            unreleased.discard(packet.packetId)
            self._send(PubComp(packet.packetId))
        elif self.version == MQTT_5:
            self._send(PubComp(packet.packetId, ReasonCode.PACKET_IDENTIFIER_NOT_FOUND))
        else:
            self._send(PubComp(packet.packetId))

    # Acknowledgements of what the broker sent

    def _pubAckReceived(self, packet):
        self._pubAcksReceived((packet.packetId,))

    def _pubAcksReceived(self, packetIds):
        """
        PUBACKs came, one after the other: their QoS 1 messages are acked
        together, and what they held back is sent once.
        """
        session = self.session
        outgoing = session.outgoing
        deliveryIds = []
        for packetId in packetIds:
            sent = outgoing.get(packetId)
            if sent is not None and sent.qos == 1:
                self._forgetOutgoing(packetId)
                deliveryIds.append(sent.deliveryId)
        session.acknowledgeAll(deliveryIds)
        session.sendPending()

    def _pubRecReceived(self, packet):
        outgoing = self.session.outgoing.get(packet.packetId)
        if outgoing is None or outgoing.qos != 2:
            if self.version == MQTT_5:
                self._send(PubRel(packet.packetId, ReasonCode.PACKET_IDENTIFIER_NOT_FOUND))
            return
        if packet.reasonCode >= 0x80:
            # The client refused it: the exchange ends here (4.3.3).
            self._acknowledged(packet.packetId, outgoing)
            return
        outgoing.released = True
        self._send(PubRel(packet.packetId))

    def _pubCompReceived(self, packet):
        outgoing = self.session.outgoing.get(packet.packetId)
        if outgoing is not None and outgoing.released:
            self._acknowledged(packet.packetId, outgoing)

    def _acknowledged(self, packetId, outgoing):
        """
        The last acknowledgement of an outgoing message came: its packet
        identifier, and its place in the window, are free.
        """
        self._forgetOutgoing(packetId)
        self.session.acknowledge(outgoing.deliveryId)
        self.session.sendPending()

    def _forgetOutgoing(self, packetId):
        """
        The last acknowledgement of an outgoing message came: free its
        packet identifier.
        """
        session = self.session
        del session.outgoing[packetId]
        if session.unresent and packetId in session.unresent:
            # Acked before it was sent again: it held no place in the window.
            session.unresent.remove(packetId)

    # SUBSCRIBE and UNSUBSCRIBE

    def _subscribeReceived(self, packet):
        identifiers = packet.properties.get(Property.SUBSCRIPTION_IDENTIFIER, ())
        codes, retainedFor = [], []
        for wanted in packet.subscriptions:
            topicFilter = wanted.topicFilter
            existed = topicFilter in self.session.granted
            try:
                group, realFilter = sharing(topicFilter)
                if group is not None and wanted.noLocal:
                    # [MQTT-3.8.3-4]
                    raise ProtocolViolation("a shared subscription with No Local")
                subscription = self.broker.subscribe(
                    self.session,
                    realFilter,
                    topicFilter,
                    FIRE if wanted.qos == 0 else ALL,
                    group=group,
                )
            except RequestError as error:
                self.broker.protocolError(self.session, error.code, False)
                codes.append(
                    self._subscribeFailure(
                        _SUBSCRIBE_REASONS.get(error.code, ReasonCode.UNSPECIFIED_ERROR)
                    )
                )
                continue
            self.session.grant(
                topicFilter,
                Granted(wanted.qos, wanted.noLocal, wanted.retainAsPublished, identifiers),
            )
            codes.append(wanted.qos)
            if group is not None:
                # A shared subscription gets no retained messages (4.8.2).
                continue
            # Retain Handling (3.8.3.1): 0 always, 1 if new, 2 never.
            if wanted.retainHandling == 0 or (wanted.retainHandling == 1 and not existed):
                retainedFor.append(subscription)
        self._send(SubAck(packet.packetId, codes))
        for subscription in retainedFor:
            self.broker.sendRetained(self.session, subscription)

    def _subscribeFailure(self, reasonCode):
        return reasonCode if self.version == MQTT_5 else SUBACK_FAILURE

    def _unsubscribeReceived(self, packet):
        codes = []
        for topicFilter in packet.topicFilters:
            try:
                group, realFilter = sharing(topicFilter)
                self.broker.unsubscribe(self.session, realFilter, topicFilter, group)
            except RequestError:
                codes.append(ReasonCode.NO_SUBSCRIPTION_EXISTED)
            else:
                self.session.forget(topicFilter)
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

    # Messages to the client

    def hasRoom(self):
        """
        Whether the client's Receive Maximum lets one more QoS 1 or 2
        message go out now.
        """
        session = self.session
        return (
            not (self._closing or self.transport.disconnecting)
            and len(session.outgoing) - len(session.unresent) < self._receiveMaximum
        )

    @property
    def takesRuns(self):
        """
        Whether runs of C{fire} messages may be written at once
        (L{deliverRun}): to an MQTT 3.1.1 client, whose QoS 0 PUBLISH of a
        live message carries nothing but its topic and payload.
        """
        return self.version == MQTT_3_1_1 and not (self._closing or self.transport.disconnecting)

    def deliverRun(self, wireTopic, payloads):
        """
        Write a run of live messages on one topic (C{wireTopic}, as UTF-8)
        that the core delivered to a QoS 0 subscription of this MQTT 3.1.1
        client together (L{dallal.broker.router.Router.publishRun}): what
        L{deliver} would write for each.
        """
        if self._closing or self.transport.disconnecting:
            return
        # Messages of one size have one header.
        headers = {}
        packets = []
        for payload in payloads:
            size = len(payload)
            header = headers.get(size)
            if header is None:
                header = headers[size] = encodePublishHeader(wireTopic, size)
            packets.append(header)
            packets.append(payload)
        self._write((b"".join(packets),))

    def deliver(self, message, subscriptionId, deliveryId):
        """
        Send a message the core delivered to the session (see
        L{dallal.broker.interfaces.ISubscriber.sendMessage}).
        """
        if self._closing or self.transport.disconnecting:
            return
        session = self.session
        granted = session.grantedFor(message.topic, subscriptionId)
        if granted is not None and granted.noLocal and message.publishedBy(session):
            # No Local [MQTT-3.8.3-3]: not for this client, and never sent.
            session.settleLater(deliveryId, None)
            return
        attributes = message.properties
        if not isinstance(attributes, PublishAttributes):
            attributes = None
        elif attributes.expiry is not None and attributes.expired(
            message.published, self.clock.seconds()
        ):
            session.settleLater(deliveryId, EXPIRED)
            return
        qos = qosOf(message, granted)
        if not qos:
            if not self._writeShared(message, attributes, granted):
                session.settleLater(deliveryId, TOO_LARGE)
            elif deliveryId is not None:
                # Delivered at QoS 0 for a QoS 1 or 2 subscription: no ack
                # comes.
                session.settleLater(deliveryId, None)
            return
        packetId = session.allocatePacketId()
        if self._writeAcked(message, attributes, granted, qos, packetId):
            session.outgoing[packetId] = Outgoing(deliveryId, qos, message, subscriptionId)
        else:
            # [MQTT-3.1.2-25]: never sent, as if it had been.
            session.settleLater(deliveryId, TOO_LARGE)

    def resend(self, packetId, outgoing):
        """
        Send again, to a connection that resumed the session, a message an
        earlier one was sent and did not ack: its PUBLISH with DUP, or the
        PUBREL of a QoS 2 message whose PUBREC came [MQTT-4.4.0-1].
        """
        if outgoing.released:
            self._send(PubRel(packetId))
            return
        message = outgoing.message
        granted = self.session.grantedFor(message.topic, outgoing.subscriptionId)
        attributes = message.properties
        if not isinstance(attributes, PublishAttributes):
            attributes = None
        if not self._writePublish(message, attributes, granted, outgoing.qos, packetId, True):
            # Larger than this connection's Maximum Packet Size.
            del self.session.outgoing[packetId]
            self.session.settleLater(outgoing.deliveryId, TOO_LARGE)

    def _writePublish(self, message, attributes, granted, qos, packetId, dup):
        """
        Write the PUBLISH of a message, encoded for this client.

        @param attributes: its L{PublishAttributes}, or C{None} for a
            message published over another protocol.
        @param granted: the L{Granted} of the subscriptions it matched.
        @return: whether it was written: not if it is larger than the
            client's Maximum Packet Size.
        """
        retain = self._retainFlag(message, attributes, granted)
        header = self._publishHeader(message, attributes, granted, qos, packetId, retain, dup)
        if (
            self._clientMaxPacket is not None
            and len(header) + len(message.payload) > self._clientMaxPacket
        ):
            return False
        self._write((header, message.payload))
        return True

    def _writeShared(self, message, attributes, granted):
        """
        Write the QoS 0 PUBLISH of a message: the bytes encoded for its
        first subscriber of the same protocol version and RETAIN flag, when
        this client's copy carries nothing of its own (L{LastPublish}).

        @return: whether it was written (see L{_writePublish}).
        """
        if self._carriesItsOwn(attributes, granted):
            # Its own Subscription Identifiers, or expiry count-down.
            return self._writePublish(message, attributes, granted, 0, None, False)
        retain = self._retainFlag(message, attributes, granted)
        encoding = message.encoding
        if (
            self.version == MQTT_3_1_1
            and not retain
            and encoding is not None
            and encoding[0] is _PLAIN_PUBLISH
        ):
            packet = encoding[1]
        else:
            packets = self.factory.lastPublish.packetsOf(message)
            key = (self.version, retain)
            packet = packets.get(key)
            if packet is None:
                header = self._publishHeader(message, attributes, granted, 0, None, retain, False)
                packet = packets[key] = header + message.payload
                if key == _PLAIN_PUBLISH_KEY and encoding is None:
                    message.encoding = (_PLAIN_PUBLISH, packet)
        if self._clientMaxPacket is not None and len(packet) > self._clientMaxPacket:
            return False
        self._write((packet,))
        return True

    def _writeAcked(self, message, attributes, granted, qos, packetId):
        """
        Write the QoS 1 or 2 PUBLISH of a message, first sent.  When this
        client's copy carries nothing of its own but its packet identifier,
        the bytes before and after the identifier are encoded once per
        message, for every subscriber of the same protocol version, RETAIN
        flag and QoS, and kept as the message's C{encoding}: the queues of
        its subscribers are sent from at different times, as each acks, so
        the message's own slot keeps them, not L{LastPublish}.

        @return: whether it was written (see L{_writePublish}).
        """
        version = self.version
        if version == MQTT_5 and self._carriesItsOwn(attributes, granted):
            return self._writePublish(message, attributes, granted, qos, packetId, False)
        # Without Retain As Published, only a retained message's PUBLISH
        # carries RETAIN.
        retain = message.retained or (
            granted is not None
            and granted.retainAsPublished
            and self._retainFlag(message, attributes, granted)
        )
        form = (version, retain, qos)
        encoding = message.encoding
        if encoding is not None and encoding[0] is _ACKED_HEADER and encoding[1] == form:
            _, _, before, after = encoding
        else:
            header = self._publishHeader(message, attributes, granted, qos, packetId, retain, False)
            # The packet identifier follows the fixed header (its Remaining
            # Length one to four bytes) and the topic.
            end = 2
            while header[end - 1] & 0x80:
                end += 1
            end += 2 + len(message.wireTopic)
            before, after = header[:end], header[end + 2 :]
            if encoding is None:
                # The first transport to encode the message keeps its slot.
                message.encoding = (_ACKED_HEADER, form, before, after)
        payload = message.payload
        if self._clientMaxPacket is not None and len(before) + 2 + len(after) + len(payload) > (
            self._clientMaxPacket
        ):
            return False
        self._write((before, packetId.to_bytes(2, "big"), after, payload))
        return True

    def _carriesItsOwn(self, attributes, granted):
        """
        Whether a PUBLISH to this client carries properties of its own: its
        Subscription Identifiers, or the expiry count-down (MQTT 5).
        """
        return self.version == MQTT_5 and (
            (granted is not None and granted.identifiers)
            or (attributes is not None and attributes.expiry is not None)
        )

    def _retainFlag(self, message, attributes, granted):
        """
        The RETAIN flag of a message sent to this client: set on a retained
        message, and on one published with it to a subscription with
        Retain As Published (3.8.3.1).
        """
        return message.retained or (
            granted is not None
            and granted.retainAsPublished
            and attributes is not None
            and attributes.retain
        )

    def _publishHeader(self, message, attributes, granted, qos, packetId, retain, dup):
        """
        The bytes of a message's PUBLISH to this client before its payload.
        """
        if self.version == MQTT_5:
            if attributes is None:
                attributes = PLAIN[qos, False]
            properties = attributes.encodedProperties(
                message.published, self.clock.seconds(), granted
            )
        else:
            properties = None
        return encodePublishHeader(
            message.wireTopic,
            len(message.payload),
            qos,
            packetId,
            retain,
            dup,
            properties,
        )

    def subscriptionRevoked(self, subscriptionId, reason):
        """
        The ACL read again no longer lets this client read what one of its
        filters matches: MQTT cannot say that of one subscription, so the
        connection closes (MQTT 5: Administrative action) and the client
        learns the ACL when it subscribes again.
        """
        self._closeReason = "revoked"
        if self.version == MQTT_5:
            self._send(Disconnect(ReasonCode.ADMINISTRATIVE_ACTION, self._reasonString(reason)))
        self._close()


class _PublishRun:
    """
    The QoS 0 PUBLISHes without properties or RETAIN on one topic that one
    read of a client brings in a row, taken together: when the broker
    accepts them without a check each and its router publishes them
    together (L{dallal.broker.core.Broker.runReceivers}), they are
    published as one run, up to L{RUN_BYTES} of payload.  Any other packet
    ends the run, and is handled once the run is published.
    """

    __slots__ = ("protocol", "topic", "wireTopic", "payloads", "receivers", "size", "maxPayload")

    def __init__(self, protocol):
        self.protocol = protocol
        self.topic = None
        self.payloads = []

    def takes(self, fields):
        """
        Take a PUBLISH's fields into the run, if it belongs to it or starts
        one.

        @return: whether it was taken.
        """
        topic, payload, qos, retain, _, _, properties = fields
        if qos or retain or properties is not NO_PROPERTIES:
            return False
        if self.topic is not None:
            # Each within the broker's limit: one over it is refused, as on
            # its own.
            if topic != self.topic or self.size >= RUN_BYTES or len(payload) > self.maxPayload:
                return False
            self.payloads.append(payload)
            self.size += len(payload)
            return True
        protocol = self.protocol
        broker = protocol.broker
        maxPayload = broker.config.maxPayload
        if len(payload) > maxPayload or not broker.acceptsRun(protocol.session, topic):
            return False
        receivers = broker.runReceivers(protocol.session, topic)
        if receivers is None:
            return False
        self.maxPayload = maxPayload
        self.topic = topic
        self.wireTopic = topic.encode("utf-8")
        self.receivers = receivers
        self.payloads = [payload]
        self.size = len(payload)
        return True

    def publish(self):
        """
        Publish the run taken so far, if any, and start afresh.
        """
        if self.topic is None:
            return
        payloads, self.payloads = self.payloads, []
        topic, self.topic = self.topic, None
        self.protocol.broker.publishRun(topic, self.wireTopic, payloads, self.receivers)


# Tags an MQTT 3.1.1 QoS 0 PUBLISH without RETAIN kept as a message's
# encoding (L{dallal.broker.message.Message.encoding}): when the message
# waits in several subscribers' queues, each is written the packet encoded
# for the first, as L{LastPublish} does for a message sent to all at once.
_PLAIN_PUBLISH = "dallal.mqtt.publish"
# The attributes of a QoS 1 PUBLISH without RETAIN or properties.
_PLAIN_QOS_1 = PLAIN[1, False]
_PLAIN_PUBLISH_KEY = (MQTT_3_1_1, False)


class LastPublish:
    """
    The QoS 0 PUBLISH packets, payload included, of the message the broker
    delivered last, by protocol version and RETAIN flag: the core hands a
    message to all of its subscribers in one go, so those whose copy
    carries nothing of their own (no packet identifier, Subscription
    Identifier or expiry count-down) are all written the bytes encoded for
    the first.  Only the last message is kept, and with it its packets.
    """

    __slots__ = ("_message", "_packets")

    def __init__(self):
        self._message = None
        self._packets = {}

    def packetsOf(self, message):
        """
        The packets of C{message} encoded so far, C{(version, retain)} ->
        bytes, to look up and add to.
        """
        if message is not self._message:
            self._message = message
            self._packets = {}
        return self._packets


class MQTTFactory(ServerFactory):
    """
    Builds an L{MQTTProtocol} for each connection to one broker, within
    the broker's connection limits.

    @param batch: the L{WriteBatch} shared with the broker's other stream
        connections, so that a message read from one is written to each
        once.
    @param connections: the L{dallal.limits.ConnectionTable} shared with
        them: the connection limits count every stream connection.
    @param maxOfflineSessions: the most sessions kept without a
        connection (C{--max-offline-sessions}).
    @param store: the L{dallal.server.mqttstore.SessionStore} that keeps
        sessions across restarts, or C{None}.
    @param maxOfflineBytes: the most payload bytes the sessions without a
        connection hold together (C{--max-offline-bytes}).
    @ivar offlineBytes: the payload bytes they hold now.
    @ivar sessions: client id -> its L{MQTTSession}, with a connection or
        not.
    @ivar offline: the sessions without a connection.
    @ivar lastPublish: the L{LastPublish} its connections share.
    """

    noisy = False

    def __init__(
        self,
        broker,
        gatekeeper=None,
        batch=None,
        connections=None,
        maxOfflineSessions=DEFAULT_MAX_OFFLINE_SESSIONS,
        store=None,
        maxOfflineBytes=DEFAULT_MAX_OFFLINE_BYTES,
    ):
        self.broker = broker
        self.gatekeeper = gatekeeper
        self.batch = batch if batch is not None else WriteBatch()
        if connections is None:
            config = broker.config
            connections = ConnectionTable(config.maxConnections, config.maxConnectionsPerIp)
        self.connections = connections
        self.maxOfflineSessions = maxOfflineSessions
        self.maxOfflineBytes = maxOfflineBytes
        self.offlineBytes = 0
        self.store = store
        self.sessions = {}
        self.offline = set()
        self.lastPublish = LastPublish()

    def restoreSessions(self):
        """
        Take up the sessions of the store, as the broker starts.

        @raise dallal.broker.retained.StoreError: the store cannot be read.
        """
        if self.store is None:
            return
        restored = 0
        for stored in self.store.load():
            if len(self.offline) >= self.maxOfflineSessions:
                self.broker.refusedPeer(
                    OFFLINE_SESSIONS, self.maxOfflineSessions, stored.peer, "mqtt"
                )
                continue
            MQTTSession.restore(self, stored)
            restored += 1
        self.broker.events.emit("sessions_restored", count=restored, path=self.store.path)

    def stopping(self):
        """
        The broker begins to stop: the sessions without a connection take
        what the core holds for them, for the store, or end (with no will)
        if there is none: their messages would never be acked before it
        stops, and its drain would wait for them.
        """
        for session in list(self.offline):
            if self.store is not None:
                session.takeFromCore()
            else:
                session.will = None
                session.end("shutdown")

    def saveSessions(self):
        """
        Write the sessions that outlive their connections to the store, as
        the broker stops, before it ends every session.

        @return: a Deferred that fires once they are written (or could not
            be: then it is logged).
        """
        if self.store is None:
            return succeed(None)
        stored = [
            session.snapshot()
            for session in self.sessions.values()
            if session.persistent and not session.ended
        ]
        events = self.broker.events
        return self.store.save(stored).addCallbacks(
            lambda count: events.emit("sessions_saved", count=count, path=self.store.path),
            lambda failure: events.emit(
                "sessions_not_saved",
                LogLevel.error,
                count=len(stored),
                path=self.store.path,
                error=str(failure.value),
            ),
        )

    def forget(self, session):
        """
        A session ended.
        """
        self.offline.discard(session)
        if self.sessions.get(session.clientId) is session:
            del self.sessions[session.clientId]

    def buildProtocol(self, addr):
        host = getattr(addr, "host", None)
        refusal = self.connections.refusal(host)
        if refusal is not None:
            # Closed at once, as Mosquitto over its max_connections.
            limit, maximum, reason = refusal
            self.broker.refusedPeer(
                limit, maximum, formatAddress(addr), MQTTProtocol.transportName, reason=reason
            )
            return None
        return MQTTProtocol(self, host)
