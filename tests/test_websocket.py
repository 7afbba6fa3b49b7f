"""
MQTT over WebSockets (L{dallal.server.websocket}) on in-memory
connections: the WebSocket handshake and frames are built by hand, as a
browser sends them, to the web listener's site, over L{StringTransport}s.
"""

import base64
import hashlib
import struct

import pytest
from helpers import BrokerHarness
from test_server_mqtt import MQTTClient, connected
from twisted.internet.testing import StringTransport

from dallal.broker.core import BrokerConfig
from dallal.protocol.mqtt import (
    MQTT_3_1_1,
    MQTT_5,
    ConnAck,
    Connect,
    Disconnect,
    MQTTDecoder,
    PingReq,
    PingResp,
    Publish,
    ReasonCode,
    SubAck,
    Subscribe,
    Subscription,
    Will,
)
from dallal.server.websocket import READ_PIECE

TEXT, BINARY, CLOSE = 1, 2, 8
KEY = base64.b64encode(b"sixteen byte key")
ACCEPT = base64.b64encode(hashlib.sha1(KEY + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest())
MASK = b"\x11\x22\x33\x44"


def upgradeRequest(protocols=("mqtt",), origin=None):
    lines = [
        b"GET /mqtt HTTP/1.1",
        b"Host: localhost",
        b"Upgrade: websocket",
        b"Connection: Upgrade",
        b"Sec-WebSocket-Key: " + KEY,
        b"Sec-WebSocket-Version: 13",
    ]
    if protocols:
        lines.append(b"Sec-WebSocket-Protocol: " + ", ".join(protocols).encode())
    if origin is not None:
        lines.append(b"Origin: " + origin)
    return b"\r\n".join(lines) + b"\r\n\r\n"


def clientFrame(payload, opcode=BINARY, final=True):
    """
    A frame as a browser sends it: masked.
    """
    header = bytes([(0x80 if final else 0) | opcode])
    size = len(payload)
    if size < 126:
        header += bytes([0x80 | size])
    elif size < 65536:
        header += bytes([0x80 | 126]) + struct.pack("!H", size)
    else:
        header += bytes([0x80 | 127]) + struct.pack("!Q", size)
    masked = bytes(byte ^ MASK[i % 4] for i, byte in enumerate(payload))
    return header + MASK + masked


def serverFrames(data):
    """
    The frames of what the server wrote: a list of (opcode, payload).
    """
    frames = []
    while data:
        opcode, size = data[0] & 0x0F, data[1] & 0x7F
        start = 2
        if size == 126:
            (size,) = struct.unpack("!H", data[2:4])
            start = 4
        elif size == 127:
            (size,) = struct.unpack("!Q", data[2:10])
            start = 10
        frames.append((opcode, data[start : start + size]))
        data = data[start + size :]
    return frames


class StreamTransport(StringTransport):
    """
    A L{StringTransport} as a TCP (or TLS) connection's: with a
    C{protocol}, which the WebSocket resource sets to the WebSocket
    protocol, and whose C{unregisterProducer} without a producer does
    nothing (autobahn unregisters one whenever it drops a connection).
    """

    protocol = None

    def unregisterProducer(self):
        if self.producer is not None:
            StringTransport.unregisterProducer(self)


class WebSocketMQTTClient(MQTTClient):
    """
    An MQTT client over a WebSocket to the web listener's C{/mqtt}: the
    L{MQTTClient} of the TCP tests, its packets in binary frames.

    @ivar response: the HTTP response to its upgrade request.
    """

    def __init__(self, harness, version=MQTT_3_1_1, protocols=("mqtt",), origin=None):
        self.harness = harness
        self.version = version
        self.decoder = MQTTDecoder(version)
        self.connection = harness.connect(transport=StreamTransport(), factory=harness.site)
        self.connection.send(upgradeRequest(protocols, origin))
        self.response, _, rest = self.connection.received().partition(b"\r\n\r\n")
        assert rest == b""
        if self.connection.transport.protocol is not None:
            # The WebSocket protocol took the connection over from HTTP's.
            self.connection.protocol = self.connection.transport.protocol

    def send(self, *packets):
        self.sendFrames(
            *(clientFrame(b"".join(packet.encode(self.version) for packet in packets)),)
        )

    @property
    def closing(self):
        """
        Whether the broker closed the connection, or began the WebSocket's
        closing handshake.
        """
        websocket = self.connection.transport.protocol
        closingHandshake = websocket is not None and websocket.state != websocket.STATE_OPEN
        return self.connection.transport.disconnecting or closingHandshake

    def sendFrames(self, *frames):
        self.connection.send(b"".join(frames))

    def frames(self):
        return serverFrames(self.connection.received())

    def received(self):
        """
        The MQTT packets of the binary messages since the last call (and
        not the close frame).
        """
        packets = []
        for opcode, payload in self.frames():
            assert opcode in (BINARY, CLOSE), (opcode, payload)
            if opcode == BINARY:
                packets.extend(self.decoder.feed(payload))
        return packets


def webHarness(**config):
    """
    A L{BrokerHarness} with its web listener's site as C{harness.site};
    autobahn's handshake timers, which run on the global reactor, are off.

    @param config: the L{BrokerConfig}'s, or C{users} for a broker that
        takes passwords.
    """
    users = config.pop("users", None)
    harness = BrokerHarness(BrokerConfig(messageEvents=True, **config), users=users)
    # (Not by setProtocolOptions, which puts back the defaults of the
    # options it is not given.)
    factory = harness.service.mqttWebSocketFactory
    factory.openHandshakeTimeout = factory.closeHandshakeTimeout = 0
    harness.site = harness.service.webSite()
    return harness


@pytest.fixture
def harness():
    return webHarness()


def test_theHandshakeNegotiatesTheMqttSubprotocol(harness):
    client = WebSocketMQTTClient(harness)
    assert client.response.startswith(b"HTTP/1.1 101 ")
    assert b"Sec-WebSocket-Protocol: mqtt" in client.response
    assert b"Sec-WebSocket-Accept: " + ACCEPT in client.response


@pytest.mark.parametrize("origin", [b"https://elsewhere.example", b"null"])
def test_pagesFromAnyOriginMayConnect(harness, origin):
    """
    As Mosquitto: the client logs in with MQTT, a page has no credentials
    of the broker's to lend; a local file's page has the origin C{null}.
    """
    client = WebSocketMQTTClient(harness, origin=origin)
    assert client.response.startswith(b"HTTP/1.1 101 ")


@pytest.mark.parametrize("protocols", [(), ("wamp.2.json",), ("mqttv3.1",)])
def test_otherSubprotocolsAreRefused(harness, protocols):
    client = WebSocketMQTTClient(harness, protocols=protocols)
    assert client.response.startswith(b"HTTP/1.1 400 ")
    assert b"takes the subprotocol 'mqtt'" in client.response
    assert client.closing
    assert harness.broker.stats()["connections"] == 0


def test_anMQTTSessionOverAWebSocketIsOneOfTheBrokers(harness):
    """
    The same MQTT session as over TCP, counted as an MQTT connection: a
    Dallal publish reaches it, and what it publishes reaches an MQTT
    client over TCP.
    """
    client = WebSocketMQTTClient(harness, MQTT_5)
    assert [p.reasonCode for p in client.connect("browser")] == [0]
    assert client.subscribe(("news/#", 1)) == [SubAck(1, [1])]
    assert harness.fields("connect")[-1]["transport"] == "mqtt"
    dallal = harness.connect()
    dallal.send(b"HELLO h d\r\nPUB p1 news/today 5\r\nhello\r\n")
    (message,) = client.received()
    assert (message.topic, message.payload, message.qos) == ("news/today", b"hello", 1)
    tcp = MQTTClient(harness)
    tcp.connect("tcp")
    tcp.subscribe(("from/browser", 0))
    client.send(Publish("from/browser", b"hi", qos=1, packetId=7))
    assert [p.payload for p in tcp.received()] == [b"hi"]


def test_aPacketMaySpanFramesAndAFrameHoldPackets(harness):
    client = WebSocketMQTTClient(harness)
    connect = Connect("c", MQTT_3_1_1).encode(MQTT_3_1_1)
    ping = PingReq().encode(MQTT_3_1_1)
    # A CONNECT cut across two messages, then one in two fragments of a
    # message, then two packets in one frame.
    client.sendFrames(clientFrame(connect[:3]), clientFrame(connect[3:]))
    assert client.received() == [ConnAck()]
    client.sendFrames(
        clientFrame(ping[:1], final=False),
        clientFrame(ping[1:], opcode=0),
        clientFrame(ping + ping),
    )
    assert client.received() == [PingResp()] * 3


def oneByteFrames(data):
    """
    One binary message of C{data}, cut into frames of one byte each.
    """
    return [clientFrame(data[:1], final=False)] + [
        clientFrame(data[index : index + 1], opcode=0, final=index == len(data) - 1)
        for index in range(1, len(data))
    ]


def test_aMessageInOneByteFramesIsTakenInPiecesOfARead(harness):
    """
    A message cut into frames of one byte, all in one read, reaches the
    MQTT protocol a piece of the read at a time (READ_PIECE), not a frame
    at a time: autobahn copies what is left of what it is given for each
    frame, so a whole read of tiny frames would cost its size times their
    number.
    """
    client = WebSocketMQTTClient(harness)
    client.send(Connect("c", MQTT_3_1_1))
    subscriber = connected(harness, "s")
    subscriber.subscribe(("t", 0))
    encoded = Publish("t", b"x" * 4000).encode(MQTT_3_1_1)
    frames = oneByteFrames(encoded)
    read = b"".join(frames)
    mqtt = client.connection.protocol.mqtt
    calls = []
    original = mqtt.dataReceived
    mqtt.dataReceived = lambda data: (calls.append(len(data)), original(data))
    client.connection.send(read)
    assert [p.payload for p in subscriber.received()] == [b"x" * 4000]
    assert sum(calls) == len(encoded)
    assert len(calls) <= len(read) // READ_PIECE + 1


def test_aReadOfTinyFramesTakesTurnsWithOtherConnections(harness):
    """
    A read whose frames take the broker longer than TURN_SECONDS is taken
    over several turns of the reactor: the rest waits, with the TCP
    connection not read, while the other connections have their turn, and
    the message arrives whole and in order.
    """
    client = WebSocketMQTTClient(harness)
    client.send(Connect("c", MQTT_3_1_1))
    subscriber = connected(harness, "s")
    subscriber.subscribe(("t", 0))
    encoded = Publish("t", b"x" * 4000).encode(MQTT_3_1_1)
    frames = oneByteFrames(encoded)
    clock = harness.clock
    # Each piece of the read takes the broker a millisecond.
    seconds = clock.seconds
    clock.seconds = lambda: seconds() + 0.001 * calls.count(True)
    calls = []
    mqtt = client.connection.protocol.mqtt
    original = mqtt.dataReceived
    mqtt.dataReceived = lambda data: (calls.append(True), original(data))
    transport = client.connection.transport
    pauses = []
    pause = transport.pauseProducing
    transport.pauseProducing = lambda: (pauses.append(True), pause())
    client.connection.send(b"".join(frames))
    assert transport.producerState == "paused"
    assert subscriber.received() == []
    clock.advance(0)
    (message,) = subscriber.received()
    assert message.payload == b"x" * 4000
    # 28 KiB of frames, three pieces a turn.
    assert len(pauses) >= 8
    assert transport.producerState == "producing"


def test_aTextMessageClosesTheConnection(harness):
    client = WebSocketMQTTClient(harness, MQTT_5)
    client.connect("c")
    # A PUBLISH, but in text messages (its bytes are valid UTF-8); the
    # second comes after the broker closed, and is not counted again.
    publish = Publish("t", b"x").encode(MQTT_5)
    publish.decode("utf-8")
    client.sendFrames(clientFrame(publish, opcode=TEXT), clientFrame(publish, opcode=TEXT))
    frames = client.frames()
    assert frames[0][0] == BINARY
    (disconnect,) = client.decoder.feed(frames[0][1])
    assert disconnect.reasonCode == ReasonCode.PROTOCOL_ERROR
    assert frames[1][0] == CLOSE
    assert harness.broker.counters["published"] == 0
    assert harness.broker.counters["errors"] == 1
    assert harness.fields("protocol_error")[-1]["code"] == "PROTOCOL_ERROR"


def test_aMessageOverTheLargestPacketIsRefusedFromItsHeader():
    harness = webHarness(maxPayload=1000)
    client = WebSocketMQTTClient(harness, MQTT_5)
    client.connect("c")
    largest = 1000 + 64 * 1024
    # Only the header of a frame one byte too large: refused before its
    # payload is read.
    client.sendFrames(bytes([0x82, 0x80 | 127]) + struct.pack("!Q", largest + 1) + MASK)
    frames = client.frames()
    (disconnect,) = client.decoder.feed(frames[0][1])
    assert disconnect.reasonCode == ReasonCode.PACKET_TOO_LARGE
    assert frames[1][0] == CLOSE
    assert harness.broker.counters["refused_payload"] == 1


def test_aBatchLargerThanTheLargestMessageIsCutIntoMessages():
    harness = webHarness(maxPayload=1000)
    client = WebSocketMQTTClient(harness)
    client.connect("c")
    client.subscribe(("t", 0))
    publisher = MQTTClient(harness)
    publisher.connect("p")
    # 80 messages of 1000 bytes, published in one read: written in one batch.
    publisher.send(*[Publish("t", b"x" * 1000)] * 80)
    frames = client.frames()
    largest = 1000 + 64 * 1024
    assert len(frames) == 2 and all(len(payload) <= largest for _, payload in frames)
    assert len(list(client.decoder.feed(b"".join(p for _, p in frames)))) == 80


def test_theConnectionLimitsCountWebSocketClients():
    harness = webHarness(maxConnections=1)
    first = WebSocketMQTTClient(harness)
    assert first.connect("a") == [ConnAck()]
    second = WebSocketMQTTClient(harness)
    assert second.response.startswith(b"HTTP/1.1 503 ")
    assert second.closing
    assert harness.broker.counters["refused_connections"] == 1
    assert harness.fields("limit_reached")[-1]["transport"] == "mqtt"
    first.connection.lose()
    third = WebSocketMQTTClient(harness)
    assert third.response.startswith(b"HTTP/1.1 101 ")


def test_noNewClientsWhileTheBrokerDrains(harness):
    harness.broker.drain(grace=5)
    client = WebSocketMQTTClient(harness)
    assert client.response.startswith(b"HTTP/1.1 503 ")
    assert client.closing


def test_aClosedWebSocketEndsTheSessionAndPublishesTheWill(harness):
    watcher = MQTTClient(harness)
    watcher.connect("w")
    watcher.subscribe(("wills/#", 0))
    client = WebSocketMQTTClient(harness)
    client.connect("c", will=Will("wills/c", b"gone"))
    client.connection.lose()
    assert [p.payload for p in watcher.received()] == [b"gone"]
    assert harness.fields("disconnect")[-1]["transport"] == "mqtt"
    assert harness.broker.stats()["connections"] == 1


def test_aFullOutputStopsReadingAndHoldsDeliveries(harness):
    """
    The MQTT protocol's output valve is the TCP connection's producer
    under the WebSocket: a full write buffer holds its messages in the
    broker and stops reading from it, until it drains.
    """
    client = WebSocketMQTTClient(harness)
    client.connect("s")
    client.subscribe(("t", 1))
    transport = client.connection.transport
    transport.producer.pauseProducing()
    assert transport.producerState == "paused"
    publisher = MQTTClient(harness)
    publisher.connect("p")
    publisher.send(Publish("t", b"waits", qos=1, packetId=1))
    assert client.received() == []
    transport.producer.resumeProducing()
    assert transport.producerState == "producing"
    assert [p.payload for p in client.received()] == [b"waits"]


def test_theMQTTLoginIsTheWebSocketsNotHTTPs():
    """
    With passwords, C{/mqtt} asks for no HTTP login (browsers cannot send
    one with a WebSocket): the CONNECT's user name and password are
    checked, as over TCP.
    """
    harness = webHarness(users={"alice": b"secret"})
    client = WebSocketMQTTClient(harness)
    assert client.response.startswith(b"HTTP/1.1 101 ")
    assert client.connect("c", username="alice", password=b"secret") == [ConnAck()]
    stranger = WebSocketMQTTClient(harness)
    stranger.send(Connect("x", MQTT_3_1_1, username="alice", password=b"wrong"))
    harness.clock.advance(2)
    assert [p.reasonCode for p in stranger.received()] == [5]
    assert stranger.closing


def test_aSubscribeOverAWebSocketIsTheSameSubscribe(harness):
    client = WebSocketMQTTClient(harness)
    client.connect("c")
    client.send(Subscribe(3, [Subscription("bad/#/x", 1)]))
    assert client.received() == [SubAck(3, [0x80])]
    client.send(Disconnect())
    assert client.frames()[0][0] == CLOSE
