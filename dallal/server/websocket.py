"""
MQTT over WebSockets: C{/mqtt} on the web listener (C{twistd dallal
--http}), as Mosquitto's C{protocol websockets} serves it and browsers'
MQTT clients (MQTT.js, paho's JavaScript client) speak it.  The WebSocket
subprotocol is C{mqtt}; binary messages carry the MQTT byte stream, where
a packet may span messages and a message may hold several packets, up to
the largest packet the broker takes (C{--max-payload} and 64 KiB) in all:
browsers' clients send a packet a message.

Each WebSocket connection runs an L{MQTTProtocol} of the broker's
L{MQTTFactory}: the same sessions, logins, ACL, connection limits and
counters as C{--mqtt} (transport C{mqtt}).  Its transport is a
L{MessageTransport}, which turns the MQTT protocol's writes into binary
messages; the WebSocket protocol hands the MQTT protocol the frames' bytes
as they arrive, so a message is never buffered whole.  WebSockets come from
autobahn (C{autobahn.twisted}); L{dallal.server.service.DallalService.webSite}
puts them at C{/mqtt}.
"""

from autobahn.twisted.websocket import WebSocketServerFactory, WebSocketServerProtocol
from autobahn.websocket.types import ConnectionDeny
from twisted.internet.error import ConnectionDone
from twisted.internet.interfaces import IConsumer, IPushProducer, ITransport
from twisted.python.failure import Failure
from zope.interface import implementer

from dallal.protocol.mqtt import ReasonCode
from dallal.server.mqtt import PACKET_OVERHEAD
from dallal.server.streams import TURN_OVER, ReadPause

# The WebSocket subprotocol of MQTT (MQTT 3.1.1, 6; MQTT 5.0, 6).
SUBPROTOCOL = "mqtt"
# The WebSocket close code of a normal closure.
NORMAL_CLOSURE = 1000
# autobahn copies what is left of a read once for each frame it takes from
# it, so a read of many small frames costs its size times their number (a
# 64 KiB read of one-byte frames, 300 MB of copying): reads are handed to it
# in pieces of at most this size.
READ_PIECE = 1024
# The broker's time one WebSocket connection's frames may take before the
# other connections have their turn: autobahn takes each frame at a cost
# of its own, so a client that cuts its messages into one-byte frames
# spends that much time for a few hundred bytes.  Short, so that twenty
# such clients at once still let others through within tens of
# milliseconds.
TURN_SECONDS = 0.002
# Why a WebSocket connection is not read, beside TURN_OVER: its MQTT
# protocol paused its transport.
MQTT_PAUSED = "mqtt"


@implementer(ITransport, IConsumer, IPushProducer)
class MessageTransport:
    """
    The transport of an L{MQTTProtocol} over a WebSocket connection: what
    it writes goes out in binary messages, its producer (the output valve
    by which it learns that the connection's write buffer is full) and its
    pauses are the TCP connection's under the WebSocket.
    """

    def __init__(self, websocket):
        """
        @param websocket: the L{MQTTWebSocketProtocol}.
        """
        self._websocket = websocket
        self._closed = False

    @property
    def disconnecting(self):
        """
        Whether nothing more can be written: closed from this side, or the
        WebSocket is closing.
        """
        return self._closed or self._websocket.state != WebSocketServerProtocol.STATE_OPEN

    def write(self, data):
        if self.disconnecting:
            return
        # A batch of packets may be larger than the largest message the
        # connection takes: the MQTT stream is cut into messages that fit.
        largest = self._websocket.maxMessagePayloadSize
        for start in range(0, len(data), largest):
            self._websocket.sendMessage(data[start : start + largest], isBinary=True)

    def writeSequence(self, sequence):
        self.write(b"".join(sequence))

    def loseConnection(self):
        """
        Close the WebSocket once what was written is sent: the close
        handshake follows the messages.
        """
        if not self.disconnecting:
            self._closed = True
            self._websocket.sendClose(NORMAL_CLOSURE)

    def abortConnection(self):
        self._closed = True
        self._websocket.dropConnection(abort=True)

    def getPeer(self):
        return self._websocket.transport.getPeer()

    def getHost(self):
        return self._websocket.transport.getHost()

    def registerProducer(self, producer, streaming):
        self._websocket.transport.registerProducer(producer, streaming)

    def unregisterProducer(self):
        self._websocket.transport.unregisterProducer()

    def pauseProducing(self):
        self._websocket.pauseReading(MQTT_PAUSED)

    def resumeProducing(self):
        self._websocket.resumeReading(MQTT_PAUSED)

    def stopProducing(self):
        self.abortConnection()


class MQTTWebSocketProtocol(WebSocketServerProtocol):
    """
    One MQTT client over a WebSocket: negotiates the C{mqtt} subprotocol,
    then runs an L{MQTTProtocol} over a L{MessageTransport}.

    @ivar mqtt: the L{MQTTProtocol}, once the WebSocket is open.
    """

    mqtt = None
    _admitted = None

    def connectionMade(self):
        WebSocketServerProtocol.connectionMade(self)
        # The frames' bytes of the piece of a read being taken, handed to
        # the MQTT protocol at once (L{_handOver}), not frame by frame.
        self._frameData = []
        # Why the TCP connection is not read: the MQTT protocol's pause,
        # this connection's turn being over.
        self._readPause = ReadPause()
        # What was read and waits for this connection's next turn.
        self._unread = b""

    def pauseReading(self, reason):
        if self._readPause.add(reason):
            self.transport.pauseProducing()

    def resumeReading(self, reason):
        if self._readPause.discard(reason):
            self.transport.resumeProducing()

    def dataReceived(self, data):
        if TURN_OVER in self._readPause:
            # Read before the pause took effect: after what waits.
            self._unread += data
            return
        clock = self.factory.mqttFactory.broker.clock
        started = clock.seconds()
        for start in range(0, len(data), READ_PIECE):
            WebSocketServerProtocol.dataReceived(self, data[start : start + READ_PIECE])
            self._handOver()
            rest = start + READ_PIECE
            if rest < len(data) and clock.seconds() - started > TURN_SECONDS:
                self._unread = data[rest:]
                self.pauseReading(TURN_OVER)
                clock.callLater(0, self._nextTurn)
                return

    def _nextTurn(self):
        """
        Take what waited for this connection's turn, then read again.
        """
        unread, self._unread = self._unread, b""
        self.resumeReading(TURN_OVER)
        if unread and self.state != WebSocketServerProtocol.STATE_CLOSED:
            self.dataReceived(unread)

    def _handOver(self):
        """
        Give the MQTT protocol the bytes of the frames taken so far.
        """
        if self._frameData:
            data = b"".join(self._frameData)
            self._frameData = []
            if self.mqtt is not None:
                self.mqtt.dataReceived(data)

    def onConnect(self, request):
        if SUBPROTOCOL not in request.protocols:
            raise ConnectionDeny(
                ConnectionDeny.BAD_REQUEST,
                f"MQTT over WebSockets takes the subprotocol {SUBPROTOCOL!r}, "
                f"not {', '.join(request.protocols) or 'none'}",
            )
        if self.factory.mqttFactory.broker.shuttingDown:
            # As /health says: --mqtt listeners are closed by now.
            raise ConnectionDeny(ConnectionDeny.SERVICE_UNAVAILABLE, "the broker is shutting down")
        # Within the broker's connection limits, counted and logged by the
        # MQTT factory as a refused MQTT connection.
        self._admitted = self.factory.mqttFactory.buildProtocol(self.transport.getPeer())
        if self._admitted is None:
            raise ConnectionDeny(
                ConnectionDeny.SERVICE_UNAVAILABLE, "the broker has its maximum of connections"
            )
        return SUBPROTOCOL

    def onOpen(self):
        # The web listener's HTTP channel was the connection's producer
        # until this request took the connection over; the MQTT protocol
        # registers its own.
        self.transport.unregisterProducer()
        self.mqtt = self._admitted
        self.mqtt.makeConnection(MessageTransport(self))

    def _refuse(self, reasonCode, why):
        """
        Close the MQTT connection as for a packet it refuses, once: autobahn
        still reads the frames that follow its close frame.
        """
        if not self.mqtt.transport.disconnecting:
            self.mqtt.refuseStream(reasonCode, why)

    def onMessageBegin(self, isBinary):
        WebSocketServerProtocol.onMessageBegin(self, isBinary)
        if not isBinary:
            # What came before it is the client's, and read first.
            self._handOver()
            self._refuse(
                ReasonCode.PROTOCOL_ERROR, "MQTT over WebSockets is carried in binary messages"
            )

    def onMessageFrameData(self, payload):
        # Streamed into the MQTT decoder, which bounds the packets; the
        # MQTT protocol ignores what comes after it closed.
        self._frameData.append(payload)

    def onMessageFrameEnd(self):
        pass

    def onMessageEnd(self):
        pass

    def _max_message_size_exceeded(self, size, maximum, reason):
        # autobahn's hook for a frame or message over the factory's
        # bounds, which are the largest MQTT packet's: refused as one.
        self._refuse(ReasonCode.PACKET_TOO_LARGE, reason)

    def onClose(self, wasClean, code, reason):
        self._handOver()
        if self.mqtt is not None:
            mqtt, self.mqtt = self.mqtt, None
            mqtt.connectionLost(Failure(ConnectionDone(reason)))


class MQTTWebSocketFactory(WebSocketServerFactory):
    """
    Builds an L{MQTTWebSocketProtocol} for each WebSocket connection to
    C{/mqtt}, whose MQTT sessions are C{mqttFactory}'s.

    Its frames and messages are bounded by the largest MQTT packet the
    broker takes (C{--max-payload} and L{PACKET_OVERHEAD}).  autobahn's
    own timers (the handshakes' timeouts) run on txaio's reactor, the
    global one.

    @ivar mqttFactory: the broker's L{MQTTFactory}.
    """

    protocol = MQTTWebSocketProtocol

    def __init__(self, mqttFactory, reactor):
        WebSocketServerFactory.__init__(self, reactor=reactor)
        self.mqttFactory = mqttFactory
        self.followConfig()
        self.setProtocolOptions(
            # No autobahn status page (with its version) for a plain GET.
            webStatus=False,
            # Pages from any origin, a local file's ("null") too, as
            # Mosquitto: a browser sends no credentials of its own over
            # it (no cookies, and /mqtt is outside the HTTP passwords), so
            # a page elsewhere gains nothing it could not have from any
            # other MQTT client.
            allowNullOrigin=True,
        )

    def followConfig(self):
        """
        Bound the frames and messages of the connections that open from now
        on by the broker's C{--max-payload} as it is now (a SIGHUP may have
        changed it): autobahn gives each connection the factory's options
        when it opens.
        """
        largest = self.mqttFactory.broker.config.maxPayload + PACKET_OVERHEAD
        self.setProtocolOptions(maxFramePayloadSize=largest, maxMessagePayloadSize=largest)
