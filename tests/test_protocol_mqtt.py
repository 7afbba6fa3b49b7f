"""
Tests of dallal.protocol.mqtt, the MQTT 3.1.1 and 5.0 codec: byte vectors
from the specifications, every packet type's round trip in both versions,
the refusals of malformed input and their reason codes, streaming at any
byte boundary, properties checked with hypothesis, and the bytes of MQTT
clients Dallal did not write (paho-mqtt, mosquitto_pub), both ways.
"""

import os
import shutil
import socket
import subprocess
import time

import pytest
from helpers import splitAt
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dallal.protocol.mqtt import (
    MQTT_3_1_1,
    MQTT_5,
    NO_PROPERTIES,
    PROPERTIES_ALLOWED,
    PROPERTY_TYPES,
    WILL_PROPERTIES,
    Auth,
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
    PropertyType,
    PubAck,
    PubComp,
    Publish,
    PubRec,
    PubRel,
    ReasonCode,
    SubAck,
    Subscribe,
    Subscription,
    UnsubAck,
    Unsubscribe,
    Will,
    encodeBareAcknowledgement,
    encodeBareAcknowledgements,
    encodeProperties,
    encodePublishHeader,
    encodeVariableByteInteger,
)

VERSIONS = [MQTT_3_1_1, MQTT_5]

BOUNDED = settings(
    derandomize=True,
    deadline=None,
    max_examples=200,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def decodeAll(data, version=None, maxPacketSize=None):
    """
    The packets C{data} holds, fed at once to a new decoder.
    """
    decoder = MQTTDecoder(version)
    if maxPacketSize is not None:
        decoder.maxPacketSize = maxPacketSize
    return list(decoder.feed(data))


def decodeOne(data, version=None):
    [packet] = decodeAll(data, version)
    return packet


def refusal(data, version=None):
    """
    The reason code with which a decoder refuses C{data}.
    """
    decoder = MQTTDecoder(version)
    with pytest.raises(MalformedPacket) as caught:
        list(decoder.feed(data))
    return caught.value.reasonCode


def outcome(pieces, version):
    """
    What a decoder makes of a stream read in C{pieces}: the packets, and the
    reason code it stopped with (None if it did not).
    """
    decoder = MQTTDecoder(version)
    packets = []
    try:
        for piece in pieces:
            packets.extend(decoder.feed(piece))
    except MalformedPacket as error:
        return packets, error.reasonCode
    return packets, None


def decoderFor(packet, version):
    # A CONNECT is the first packet of a server's decoder, which learns the
    # version from it; the rest need a decoder that knows it.
    return MQTTDecoder(None if isinstance(packet, Connect) else version)


# Known bytes: the specifications' examples and encodings worked by hand.


@pytest.mark.parametrize(
    "value, encoded",
    [
        # The boundaries of MQTT 5's table 1.5.5 (3.1.1's table 2.4).
        (0, b"\x00"),
        (127, b"\x7f"),
        (128, b"\x80\x01"),
        (16_383, b"\xff\x7f"),
        (16_384, b"\x80\x80\x01"),
        (2_097_151, b"\xff\xff\x7f"),
        (2_097_152, b"\x80\x80\x80\x01"),
        (268_435_455, b"\xff\xff\xff\x7f"),
    ],
)
def test_variableByteIntegers(value, encoded):
    assert encodeVariableByteInteger(value) == encoded
    if 3 <= value <= 2_097_152:
        # As a PUBLISH's remaining length: its topic "t" and a payload.
        packet = Publish("t", b"x" * (value - 3))
        data = packet.encode(MQTT_3_1_1)
        assert data[1 : 1 + len(encoded)] == encoded
        assert decodeOne(data, MQTT_3_1_1) == packet


def test_variableByteIntegerTooLarge():
    with pytest.raises(ValueError):
        encodeVariableByteInteger(268_435_456)


# fmt: off
KNOWN = [
    # MQTT 3.1.1
    (MQTT_3_1_1, PingReq(), b"\xc0\x00"),
    (MQTT_3_1_1, PingResp(), b"\xd0\x00"),
    (MQTT_3_1_1, Disconnect(), b"\xe0\x00"),
    (
        MQTT_3_1_1,
        Connect("test", MQTT_3_1_1, True, 60),
        b"\x10\x10\x00\x04MQTT\x04\x02\x00\x3c\x00\x04test",
    ),
    (
        MQTT_3_1_1,
        Connect(
            "c", MQTT_3_1_1, False, 10, "u", b"pw", Will("w", b"bye", 1, True)
        ),
        b"\x10\x1c\x00\x04MQTT\x04\xec\x00\x0a\x00\x01c\x00\x01w\x00\x03bye"
        b"\x00\x01u\x00\x02pw",
    ),
    (MQTT_3_1_1, ConnAck(True, 0), b"\x20\x02\x01\x00"),
    (MQTT_3_1_1, ConnAck(False, 5), b"\x20\x02\x00\x05"),
    (
        MQTT_3_1_1,
        Publish("a/b", b"hi", 1, False, False, 10),
        b"\x32\x09\x00\x03a/b\x00\x0ahi",
    ),
    (MQTT_3_1_1, Publish("a", b"", 0, True), b"\x31\x03\x00\x01a"),
    (
        MQTT_3_1_1,
        Publish("a", b"x", 2, False, True, 1),
        b"\x3c\x06\x00\x01a\x00\x01x",
    ),
    (MQTT_3_1_1, PubAck(10), b"\x40\x02\x00\x0a"),
    (MQTT_3_1_1, PubRec(10), b"\x50\x02\x00\x0a"),
    (MQTT_3_1_1, PubRel(10), b"\x62\x02\x00\x0a"),
    (MQTT_3_1_1, PubComp(10), b"\x70\x02\x00\x0a"),
    (
        MQTT_3_1_1,
        Subscribe(1, [Subscription("a/+", 1), Subscription("#", 2)]),
        b"\x82\x0c\x00\x01\x00\x03a/+\x01\x00\x01#\x02",
    ),
    (MQTT_3_1_1, SubAck(1, [1, 0x80]), b"\x90\x04\x00\x01\x01\x80"),
    (MQTT_3_1_1, Unsubscribe(2, ["a/+"]), b"\xa2\x07\x00\x02\x00\x03a/+"),
    (MQTT_3_1_1, UnsubAck(2), b"\xb0\x02\x00\x02"),
    # MQTT 5
    (MQTT_5, PingReq(), b"\xc0\x00"),
    (MQTT_5, Disconnect(), b"\xe0\x00"),
    (MQTT_5, Disconnect(ReasonCode.SESSION_TAKEN_OVER), b"\xe0\x01\x8e"),
    (
        MQTT_5,
        Disconnect(0x04, {Property.SESSION_EXPIRY_INTERVAL: 0}),
        b"\xe0\x07\x04\x05\x11\x00\x00\x00\x00",
    ),
    (
        MQTT_5,
        Connect("test", MQTT_5, True, 60),
        b"\x10\x11\x00\x04MQTT\x05\x02\x00\x3c\x00\x00\x04test",
    ),
    (
        MQTT_5,
        # A password without a user name is allowed from MQTT 5 on.
        Connect(
            "",
            MQTT_5,
            True,
            0,
            None,
            b"p",
            Will("w", b"", 2, False, {Property.WILL_DELAY_INTERVAL: 5}),
            {Property.RECEIVE_MAXIMUM: 10},
        ),
        b"\x10\x1e\x00\x04MQTT\x05\x56\x00\x00\x03\x21\x00\x0a\x00\x00"
        b"\x05\x18\x00\x00\x00\x05\x00\x01w\x00\x00\x00\x01p",
    ),
    (
        MQTT_5,
        ConnAck(False, 0, {Property.ASSIGNED_CLIENT_IDENTIFIER: "id"}),
        b"\x20\x08\x00\x00\x05\x12\x00\x02id",
    ),
    (MQTT_5, ConnAck(False, ReasonCode.NOT_AUTHORIZED), b"\x20\x03\x00\x87\x00"),
    (
        MQTT_5,
        Publish("a", b"x", 0, False, False, None, {Property.TOPIC_ALIAS: 1}),
        b"\x30\x08\x00\x01a\x03\x23\x00\x01x",
    ),
    (
        MQTT_5,
        # A topic alias stands for the topic once the alias is set.
        Publish("", b"x", 0, False, False, None, {Property.TOPIC_ALIAS: 1}),
        b"\x30\x07\x00\x00\x03\x23\x00\x01x",
    ),
    (
        MQTT_5,
        Publish(
            "a",
            b"",
            1,
            False,
            False,
            3,
            {Property.USER_PROPERTY: [("k", "1"), ("k", "2")]},
        ),
        b"\x32\x14\x00\x01a\x00\x03\x0e\x26\x00\x01k\x00\x011\x26\x00\x01k\x00\x012",
    ),
    # The short forms of the acknowledgements (3.4.2.1).
    (MQTT_5, PubAck(10), b"\x40\x02\x00\x0a"),
    (MQTT_5, PubAck(10, ReasonCode.NO_MATCHING_SUBSCRIBERS), b"\x40\x03\x00\x0a\x10"),
    (
        MQTT_5,
        PubRec(10, 0x80, {Property.REASON_STRING: "no"}),
        b"\x50\x09\x00\x0a\x80\x05\x1f\x00\x02no",
    ),
    (MQTT_5, PubRel(10, ReasonCode.PACKET_IDENTIFIER_NOT_FOUND), b"\x62\x03\x00\x0a\x92"),
    (MQTT_5, PubComp(10), b"\x70\x02\x00\x0a"),
    (
        MQTT_5,
        Subscribe(
            1,
            [Subscription("a", 2, True, True, 2)],
            {Property.SUBSCRIPTION_IDENTIFIER: [300]},
        ),
        b"\x82\x0a\x00\x01\x03\x0b\xac\x02\x00\x01a\x2e",
    ),
    (MQTT_5, SubAck(1, [2, 0x8F]), b"\x90\x05\x00\x01\x00\x02\x8f"),
    (MQTT_5, Unsubscribe(2, ["a"]), b"\xa2\x06\x00\x02\x00\x00\x01a"),
    (MQTT_5, UnsubAck(2, [0x11]), b"\xb0\x04\x00\x02\x00\x11"),
    (MQTT_5, Auth(), b"\xf0\x00"),
    (
        MQTT_5,
        Auth(0x18, {Property.AUTHENTICATION_METHOD: "m"}),
        b"\xf0\x06\x18\x04\x15\x00\x01m",
    ),
]
# fmt: on


@pytest.mark.parametrize("version, packet, encoded", KNOWN)
def test_knownBytes(version, packet, encoded):
    assert packet.encode(version) == encoded
    assert decodeOne(encoded, None if isinstance(packet, Connect) else version) == packet


@pytest.mark.parametrize("version", VERSIONS)
def test_everyPacketTypeHasAKnownVector(version):
    types = {
        type(packet).__name__ for packetVersion, packet, _ in KNOWN if packetVersion == version
    }
    expected = {
        "Connect", "ConnAck", "Publish", "PubAck", "PubRec", "PubRel", "PubComp",
        "Subscribe", "SubAck", "Unsubscribe", "UnsubAck", "PingReq", "Disconnect",
    }  # fmt: skip
    assert expected <= types


def test_publishHeaderIsThePublishBeforeItsPayload():
    for version, properties in [(MQTT_3_1_1, None), (MQTT_5, b"\x00")]:
        for payload in (b"", b"p" * 200, b"q" * 20_000):
            packet = Publish("t/\u00e9", payload, 1, True, True, 77)
            header = encodePublishHeader(
                "t/\u00e9".encode(), len(payload), 1, 77, True, True, properties
            )
            assert header + payload == packet.encode(version)


@given(st.sampled_from([PubAck, PubRec, PubRel, PubComp]), st.integers(1, 65535))
def test_aBareAcknowledgementIsThePacketsSuccessForm(packetClass, packetId):
    for version in VERSIONS:
        encoded = encodeBareAcknowledgement(packetClass, packetId)
        assert encoded == packetClass(packetId).encode(version)
        assert decodeOne(encoded, version) == packetClass(packetId)


@given(
    st.sampled_from([PubAck, PubRec, PubRel, PubComp]),
    st.lists(st.integers(1, 65535), max_size=20),
)
def test_bareAcknowledgementsAreEachOneInOrder(packetClass, packetIds):
    encoded = encodeBareAcknowledgements(packetClass, packetIds)
    assert encoded == b"".join(encodeBareAcknowledgement(packetClass, i) for i in packetIds)


@pytest.mark.parametrize(
    "version, packet, encoded",
    [known for known in KNOWN if isinstance(known[1], Publish)],
)
def test_aBrokersDecoderGivesAPublishAsItsFields(version, packet, encoded):
    decoder = MQTTDecoder(version, publishFields=True)
    [fields] = decoder.feed(encoded)
    assert type(fields) is tuple
    assert Publish(*fields) == packet


def test_aBrokersDecoderGivesARunOfBarePubAcksAsTheirPacketIds():
    """
    PUBACKs that are only their packet identifiers come together, up to
    the next other packet or one not complete yet; one with a reason code
    comes as a L{PubAck}, and a packet identifier 0 is refused.
    """
    decoder = MQTTDecoder(MQTT_5, publishFields=True)
    withReason = PubAck(4, 0x97).encode(MQTT_5)
    bare = [encodeBareAcknowledgement(PubAck, packetId) for packetId in (1, 2, 3, 5, 6)]
    ping = PingReq().encode(MQTT_5)
    stream = ping + b"".join(bare[:3]) + withReason + bare[3] + bare[4][:3]
    assert list(decoder.feed(stream)) == [PingReq(), [1, 2, 3], PubAck(4, 0x97), [5]]
    assert list(decoder.feed(bare[4][3:] + ping)) == [[6], PingReq()]
    with pytest.raises(MalformedPacket):
        list(decoder.feed(bare[0] + b"\x40\x02\x00\x00"))


def test_shortFormsDecode():
    # A reason code without the property length, and the reason code
    # omitted, in PUBACK and DISCONNECT (3.4.2.2, 3.14.2.2.1).
    assert decodeOne(b"\x40\x03\x00\x01\x97", MQTT_5) == PubAck(1, 0x97)
    assert decodeOne(b"\x40\x04\x00\x01\x97\x00", MQTT_5) == PubAck(1, 0x97)
    assert decodeOne(b"\xe0\x01\x00", MQTT_5) == Disconnect()
    assert decodeOne(b"\xe0\x02\x00\x00", MQTT_5) == Disconnect()


def test_byteOrderMarkIsKept():
    # [MQTT-1.5.4-3]: U+FEFF is not skipped or stripped.
    topic = "\ufefftopic"
    assert decodeOne(Publish(topic).encode(MQTT_5), MQTT_5).topic == topic


# Round trips: a sample of every packet type, both versions.


def samples(version):
    five = version == MQTT_5
    properties = (lambda mapping: mapping) if five else (lambda mapping: NO_PROPERTIES)
    users = [("b", "2"), ("a", "1"), ("a", "0")]
    return [
        Connect("device-1", version, False, 65535, "u\u00e9", b"\x00\xff", None),
        Connect(
            "",
            version,
            True,
            0,
            "user",
            b"",
            Will(
                "last/will",
                b"\x00gone",
                2,
                True,
                properties(
                    {
                        Property.PAYLOAD_FORMAT_INDICATOR: 1,
                        Property.MESSAGE_EXPIRY_INTERVAL: 3600,
                        Property.CONTENT_TYPE: "text/plain",
                        Property.RESPONSE_TOPIC: "r/t",
                        Property.CORRELATION_DATA: b"\x01\x02",
                        Property.WILL_DELAY_INTERVAL: 10,
                        Property.USER_PROPERTY: users,
                    }
                ),
            ),
            properties(
                {
                    Property.SESSION_EXPIRY_INTERVAL: 0xFFFFFFFF,
                    Property.RECEIVE_MAXIMUM: 100,
                    Property.MAXIMUM_PACKET_SIZE: 1 << 20,
                    Property.TOPIC_ALIAS_MAXIMUM: 10,
                    Property.REQUEST_RESPONSE_INFORMATION: 1,
                    Property.REQUEST_PROBLEM_INFORMATION: 0,
                    Property.USER_PROPERTY: users,
                    Property.AUTHENTICATION_METHOD: "SCRAM-SHA-1",
                    Property.AUTHENTICATION_DATA: b"client-first",
                }
            ),
        ),
        ConnAck(True, 0),
        ConnAck(
            False,
            ReasonCode.BAD_USER_NAME_OR_PASSWORD if five else 4,
            properties(
                {
                    Property.SESSION_EXPIRY_INTERVAL: 10,
                    Property.RECEIVE_MAXIMUM: 20,
                    Property.MAXIMUM_QOS: 1,
                    Property.RETAIN_AVAILABLE: 0,
                    Property.MAXIMUM_PACKET_SIZE: 1000,
                    Property.ASSIGNED_CLIENT_IDENTIFIER: "auto-1",
                    Property.TOPIC_ALIAS_MAXIMUM: 0,
                    Property.REASON_STRING: "go away",
                    Property.USER_PROPERTY: users,
                    Property.WILDCARD_SUBSCRIPTION_AVAILABLE: 1,
                    Property.SUBSCRIPTION_IDENTIFIER_AVAILABLE: 1,
                    Property.SHARED_SUBSCRIPTION_AVAILABLE: 0,
                    Property.SERVER_KEEP_ALIVE: 30,
                    Property.RESPONSE_INFORMATION: "resp/",
                    Property.SERVER_REFERENCE: "other:1883",
                    Property.AUTHENTICATION_METHOD: "m",
                    Property.AUTHENTICATION_DATA: b"d",
                }
            ),
        ),
        Publish("a/b/c", b"", 0),
        Publish("$SYS/x", b"\x00" * 300, 1, True, False, 1),
        Publish(
            "\u65e5\u672c/\U0001f600",
            b"payload",
            2,
            False,
            True,
            65535,
            properties(
                {
                    Property.PAYLOAD_FORMAT_INDICATOR: 0,
                    Property.MESSAGE_EXPIRY_INTERVAL: 1,
                    Property.TOPIC_ALIAS: 65535,
                    Property.RESPONSE_TOPIC: "reply/here",
                    Property.CORRELATION_DATA: b"id-9",
                    Property.USER_PROPERTY: users,
                    Property.SUBSCRIPTION_IDENTIFIER: [1, 268_435_455, 1],
                    Property.CONTENT_TYPE: "application/json",
                }
            ),
        ),
        PubAck(1),
        PubAck(2, *((0x99, {Property.REASON_STRING: "bad"}) if five else ())),
        PubRec(3),
        PubRec(4, *((0x10, {Property.USER_PROPERTY: users}) if five else ())),
        PubRel(5),
        PubRel(6, *((0x92, {}) if five else ())),
        PubComp(7),
        PubComp(8, *((0, {Property.REASON_STRING: "ok"}) if five else ())),
        Subscribe(9, [Subscription("+/#", 1)]),
        Subscribe(
            10,
            [
                Subscription("a", 0, *((True, False, 1) if five else ())),
                Subscription("$share/g/b/+", 2, *((False, True, 2) if five else ())),
            ],
            properties({Property.SUBSCRIPTION_IDENTIFIER: [5], Property.USER_PROPERTY: users}),
        ),
        SubAck(11, [0, 1, 2, 0x80]),
        SubAck(
            12,
            [0x97, 0xA2] if five else [0x80],
            properties({Property.REASON_STRING: "r"}),
        ),
        Unsubscribe(13, ["a", "b/#"], properties({Property.USER_PROPERTY: users})),
        UnsubAck(14, [0, 0x11] if five else [], properties({Property.REASON_STRING: "r"})),
        PingReq(),
        PingResp(),
        Disconnect(),
        *(
            [
                Disconnect(
                    ReasonCode.SERVER_MOVED,
                    {
                        Property.SERVER_REFERENCE: "elsewhere",
                        Property.REASON_STRING: "moved",
                        Property.SESSION_EXPIRY_INTERVAL: 0,
                        Property.USER_PROPERTY: users,
                    },
                ),
                Disconnect(ReasonCode.DISCONNECT_WITH_WILL_MESSAGE),
                Auth(),
                Auth(
                    ReasonCode.CONTINUE_AUTHENTICATION,
                    {
                        Property.AUTHENTICATION_METHOD: "SCRAM-SHA-1",
                        Property.AUTHENTICATION_DATA: b"\x00\x01",
                        Property.REASON_STRING: "more",
                        Property.USER_PROPERTY: users,
                    },
                ),
            ]
            if five
            else []
        ),
    ]


@pytest.mark.parametrize(
    "version, packet",
    [(version, packet) for version in VERSIONS for packet in samples(version)],
    ids=lambda value: type(value).__name__ if not isinstance(value, int) else str(value),
)
def test_roundTrip(version, packet):
    decoded = list(decoderFor(packet, version).feed(packet.encode(version)))
    assert decoded == [packet]


def test_userPropertiesKeepTheirOrder():
    users = [("z", "1"), ("a", "2"), ("z", "0"), ("a", "2")]
    packet = Publish("t", b"", 0, False, False, None, {Property.USER_PROPERTY: users})
    decoded = decodeOne(packet.encode(MQTT_5), MQTT_5)
    assert decoded.properties[Property.USER_PROPERTY] == users


def test_serverDecoderLearnsTheVersion():
    for version in VERSIONS:
        decoder = MQTTDecoder()
        assert decoder.version is None
        stream = Connect("c", version).encode() + Publish("t", b"x").encode(version)
        packets = list(decoder.feed(stream))
        assert decoder.version == version
        assert packets[1] == Publish("t", b"x")


def test_versionIsKnownWhenTheRestOfTheConnectIsRefused():
    # A server answers a refused MQTT 5 CONNECT with an MQTT 5 CONNACK.
    decoder = MQTTDecoder()
    bad = bytearray(Connect("c", MQTT_5).encode())
    bad[9] |= 0x01  # the reserved connect flag
    with pytest.raises(MalformedPacket):
        list(decoder.feed(bytes(bad)))
    assert decoder.version == MQTT_5


@pytest.mark.parametrize("version", VERSIONS)
def test_encoderRefusesWhatItMayNotSend(version):
    refused = [
        Publish("a/+"),
        Publish("a/#"),
        Publish("a", b"", 1),  # no packet identifier
        Publish("a", b"", 3, packetId=1),
        Publish("a", b"", 0, dup=True),
        Publish("a\x00"),
        Publish("\ud800"),
        Publish("x" * 65536),
        PubAck(0),
        PubAck(65536),
        Subscribe(1, []),
        Subscribe(1, [Subscription("")]),
        Subscribe(1, [Subscription("a", 3)]),
        Unsubscribe(1, []),
        SubAck(1, []),
        SubAck(1, [0x05]),
        ConnAck(True, 0x87 if version == MQTT_5 else 5),
        Connect("c", version, will=Will("w/+")),
        Connect("c", version, will=Will("")),
        Connect("c", version, keepAlive=70000),
    ]
    if version == MQTT_3_1_1:
        refused += [
            Connect("c", version, password=b"p"),
            PubAck(1, 0x10),
            Disconnect(0x04),
            Auth(),
            UnsubAck(1, [0]),
            Subscribe(1, [Subscription("a", 0, True)]),
            Publish("", b"", 0, properties={Property.TOPIC_ALIAS: 1}),
        ]
    else:
        refused += [
            PubAck(1, 0x92),
            PubRel(1, 0x10),
            Disconnect(0x01),
            Auth(0x80),
            UnsubAck(1, []),
            Publish("", b""),
            Publish("a", properties={Property.SESSION_EXPIRY_INTERVAL: 1}),
            Publish("a", properties={Property.TOPIC_ALIAS: 0}),
            Subscribe(1, [Subscription("a")], {Property.SUBSCRIPTION_IDENTIFIER: [1, 2]}),
            Subscribe(1, [Subscription("a", retainHandling=3)]),
        ]
    for packet in refused:
        with pytest.raises(ValueError):
            packet.encode(version)


def test_connectEncodesInItsOwnVersion():
    with pytest.raises(ValueError):
        Connect("c", MQTT_5).encode(MQTT_3_1_1)
    with pytest.raises(ValueError):
        Connect("c", 3).encode()


# Malformed input: each rule the codec checks, and its reason code.

MALFORMED = ReasonCode.MALFORMED_PACKET
PROTOCOL_ERROR = ReasonCode.PROTOCOL_ERROR


def connect(version, **overrides):
    return Connect("c", version, **overrides).encode()


def withPublishProperties(properties):
    """
    An MQTT 5 QoS 0 PUBLISH to "t" with the given raw property bytes.
    """
    body = b"\x00\x01t" + encodeVariableByteInteger(len(properties)) + properties
    return b"\x30" + encodeVariableByteInteger(len(body)) + body


def connectBytes(afterProtocolName):
    """
    A CONNECT of protocol name "MQTT" and then the given bytes.
    """
    body = b"\x00\x04MQTT" + afterProtocolName
    return b"\x10" + encodeVariableByteInteger(len(body)) + body


def patched(data, offset, value):
    patched = bytearray(data)
    patched[offset] = value
    return bytes(patched)


CONNECT_3 = connect(MQTT_3_1_1)
CONNECT_5 = connect(MQTT_5)
# Offsets in a CONNECT: protocol level, connect flags.
LEVEL, FLAGS = 8, 9

# fmt: off
MALFORMED_INPUTS = [
    # Fixed header: reserved types and flags [MQTT-2.2.2-1], [MQTT-2.1.3-1].
    ("packet type 0", MQTT_5, b"\x00\x00", MALFORMED),
    ("AUTH in 3.1.1", MQTT_3_1_1, b"\xf0\x00", MALFORMED),
    ("PUBREL flags 0000", MQTT_5, b"\x60\x02\x00\x01", MALFORMED),
    ("SUBSCRIBE flags 0000", MQTT_5, b"\x80\x07\x00\x01\x00\x00\x01a\x00", MALFORMED),
    ("PUBACK flags 0001", MQTT_3_1_1, b"\x41\x02\x00\x01", MALFORMED),
    ("PINGREQ flags", MQTT_5, b"\xc8\x00", MALFORMED),
    ("five length bytes", MQTT_5, b"\x30\xff\xff\xff\xff\x01", MALFORMED),
    ("non-minimal length", MQTT_5, b"\xc0\x80\x00", MALFORMED),
    ("PINGREQ with a body", MQTT_5, b"\xc0\x01\x00", MALFORMED),
    ("3.1.1 PUBACK of 3 bytes", MQTT_3_1_1, b"\x40\x03\x00\x01\x00", MALFORMED),
    ("3.1.1 DISCONNECT with a body", MQTT_3_1_1, b"\xe0\x01\x00", MALFORMED),
    # PUBLISH
    ("QoS 3", MQTT_5, b"\x36\x06\x00\x01a\x00\x01\x00", MALFORMED),
    ("QoS 0 duplicate", MQTT_3_1_1, b"\x38\x03\x00\x01a", MALFORMED),
    ("wildcard +", MQTT_3_1_1, b"\x30\x03\x00\x01+", PROTOCOL_ERROR),
    ("wildcard #", MQTT_5, b"\x30\x06\x00\x03a/#\x00", PROTOCOL_ERROR),
    ("empty topic 3.1.1", MQTT_3_1_1, b"\x30\x02\x00\x00", PROTOCOL_ERROR),
    ("empty topic, no alias", MQTT_5, b"\x30\x03\x00\x00\x00", PROTOCOL_ERROR),
    ("packet identifier 0", MQTT_3_1_1, b"\x32\x05\x00\x01a\x00\x00", PROTOCOL_ERROR),
    ("topic past the end", MQTT_3_1_1, b"\x30\x03\x00\x05a", MALFORMED),
    ("no packet identifier", MQTT_5, b"\x32\x03\x00\x01a", MALFORMED),
    ("no property length", MQTT_5, b"\x30\x03\x00\x01a", MALFORMED),
    ("invalid UTF-8", MQTT_3_1_1, b"\x30\x03\x00\x01\xff", MALFORMED),
    ("overlong UTF-8", MQTT_3_1_1, b"\x30\x04\x00\x02\xc0\xaf", MALFORMED),
    ("encoded surrogate", MQTT_3_1_1, b"\x30\x05\x00\x03\xed\xa0\x80", MALFORMED),
    ("U+0000", MQTT_5, b"\x30\x05\x00\x02a\x00\x00", MALFORMED),
    # Properties (2.2.2)
    ("property twice", MQTT_5, withPublishProperties(b"\x01\x00\x01\x01"), PROTOCOL_ERROR),
    ("property of another packet", MQTT_5, withPublishProperties(b"\x11\x00\x00\x00\x01"), MALFORMED),
    ("unknown property", MQTT_5, withPublishProperties(b"\x04\x00"), MALFORMED),
    ("topic alias 0", MQTT_5, withPublishProperties(b"\x23\x00\x00"), MALFORMED),
    ("subscription identifier 0", MQTT_5, withPublishProperties(b"\x0b\x00"), PROTOCOL_ERROR),
    ("property cut short", MQTT_5, withPublishProperties(b"\x02\x00\x00"), MALFORMED),
    ("properties past the end", MQTT_5, b"\x30\x05\x00\x01t\x05\x01", MALFORMED),
    ("invalid UTF-8 property", MQTT_5, withPublishProperties(b"\x03\x00\x01\x80"), MALFORMED),
    ("non-minimal identifier", MQTT_5, withPublishProperties(b"\x81\x00\x00"), MALFORMED),
    ("user property half a pair", MQTT_5, withPublishProperties(b"\x26\x00\x01a"), MALFORMED),
    # Acknowledgements
    ("PUBACK reason 0x05", MQTT_5, b"\x40\x03\x00\x01\x05", PROTOCOL_ERROR),
    ("PUBREL reason 0x10", MQTT_5, b"\x62\x03\x00\x01\x10", PROTOCOL_ERROR),
    ("PUBACK identifier 0", MQTT_3_1_1, b"\x40\x02\x00\x00", PROTOCOL_ERROR),
    ("PUBACK trailing bytes", MQTT_5, b"\x40\x05\x00\x01\x00\x00\x00", MALFORMED),
    ("DISCONNECT reason 0x05", MQTT_5, b"\xe0\x01\x05", PROTOCOL_ERROR),
    ("AUTH reason 0x80", MQTT_5, b"\xf0\x01\x80", PROTOCOL_ERROR),
    ("CONNACK flags", MQTT_3_1_1, b"\x20\x02\x02\x00", MALFORMED),
    ("CONNACK code 6", MQTT_3_1_1, b"\x20\x02\x00\x06", PROTOCOL_ERROR),
    ("CONNACK session on refusal", MQTT_5, b"\x20\x03\x01\x87\x00", PROTOCOL_ERROR),
    ("SUBACK code 3", MQTT_3_1_1, b"\x90\x03\x00\x01\x03", PROTOCOL_ERROR),
    ("SUBACK without codes", MQTT_5, b"\x90\x03\x00\x01\x00", PROTOCOL_ERROR),
    ("UNSUBACK reason 0x01", MQTT_5, b"\xb0\x04\x00\x01\x00\x01", PROTOCOL_ERROR),
    # SUBSCRIBE, UNSUBSCRIBE
    ("SUBSCRIBE without filters", MQTT_3_1_1, b"\x82\x02\x00\x01", PROTOCOL_ERROR),
    ("SUBSCRIBE without filters 5", MQTT_5, b"\x82\x03\x00\x01\x00", PROTOCOL_ERROR),
    ("SUBSCRIBE identifier 0", MQTT_3_1_1, b"\x82\x06\x00\x00\x00\x01a\x00", PROTOCOL_ERROR),
    ("subscription QoS 3", MQTT_3_1_1, b"\x82\x06\x00\x01\x00\x01a\x03", MALFORMED),
    ("3.1.1 option bits", MQTT_3_1_1, b"\x82\x06\x00\x01\x00\x01a\x04", MALFORMED),
    ("5 reserved option bits", MQTT_5, b"\x82\x07\x00\x01\x00\x00\x01a\x40", MALFORMED),
    ("retain handling 3", MQTT_5, b"\x82\x07\x00\x01\x00\x00\x01a\x30", PROTOCOL_ERROR),
    (
        "no local on a shared subscription",
        MQTT_5,
        b"\x82\x10\x00\x01\x00\x00\x0a$share/g/a\x04",
        PROTOCOL_ERROR,
    ),
    ("options missing", MQTT_5, b"\x82\x06\x00\x01\x00\x00\x01a", MALFORMED),
    ("empty topic filter", MQTT_5, b"\x82\x06\x00\x01\x00\x00\x00\x00", PROTOCOL_ERROR),
    (
        "two subscription identifiers",
        MQTT_5,
        b"\x82\x0b\x00\x01\x04\x0b\x01\x0b\x02\x00\x01a\x00",
        PROTOCOL_ERROR,
    ),
    ("UNSUBSCRIBE without filters", MQTT_5, b"\xa2\x03\x00\x01\x00", PROTOCOL_ERROR),
    ("UNSUBSCRIBE flags 0000", MQTT_5, b"\xa0\x06\x00\x01\x00\x00\x01a", MALFORMED),
    # CONNECT, for a server's decoder (version None).
    ("first packet not CONNECT", None, b"\xc0\x00", PROTOCOL_ERROR),
    ("second CONNECT", None, CONNECT_5 + CONNECT_5, PROTOCOL_ERROR),
    ("reserved connect flag", None, patched(CONNECT_3, FLAGS, 0x03), MALFORMED),
    ("will QoS without will", None, patched(CONNECT_5, FLAGS, 0x0A), MALFORMED),
    ("will retain without will", None, patched(CONNECT_3, FLAGS, 0x22), MALFORMED),
    (
        "will QoS 3",
        None,
        patched(connect(MQTT_3_1_1, will=Will("w")), FLAGS, 0x1E),
        MALFORMED,
    ),
    (
        "3.1.1 password without user name",
        None,
        connectBytes(b"\x04\x42\x00\x00\x00\x01c\x00\x01p"),
        MALFORMED,
    ),
    ("protocol name", None, CONNECT_3.replace(b"MQTT", b"MQTX"), PROTOCOL_ERROR),
    (
        "MQTT 3.1",
        None,
        b"\x10\x0f\x00\x06MQIsdp\x03\x02\x00\x00\x00\x01c",
        ReasonCode.UNSUPPORTED_PROTOCOL_VERSION,
    ),
    ("protocol level 6", None, patched(CONNECT_5, LEVEL, 6), ReasonCode.UNSUPPORTED_PROTOCOL_VERSION),
    ("protocol level 3", None, patched(CONNECT_3, LEVEL, 3), ReasonCode.UNSUPPORTED_PROTOCOL_VERSION),
    ("CONNECT trailing bytes", None, connectBytes(b"\x04\x02\x00\x00\x00\x00\x00"), MALFORMED),
    (
        "will topic with a wildcard",
        None,
        connect(MQTT_3_1_1, will=Will("w")).replace(b"\x00\x01w", b"\x00\x01#"),
        PROTOCOL_ERROR,
    ),
    (
        "authentication data without method",
        None,
        connectBytes(b"\x05\x02\x00\x00\x04\x16\x00\x01d\x00\x01c"),
        PROTOCOL_ERROR,
    ),
    (
        "will property in CONNECT",
        None,
        connectBytes(b"\x05\x02\x00\x00\x05\x18\x00\x00\x00\x01\x00\x01c"),
        MALFORMED,
    ),
    (
        "request problem information 2",
        None,
        connectBytes(b"\x05\x02\x00\x00\x02\x17\x02\x00\x01c"),
        PROTOCOL_ERROR,
    ),
    (
        "receive maximum 0",
        None,
        connectBytes(b"\x05\x02\x00\x00\x03\x21\x00\x00\x00\x01c"),
        PROTOCOL_ERROR,
    ),
]
# fmt: on


@pytest.mark.parametrize(
    "version, data, reasonCode",
    [case[1:] for case in MALFORMED_INPUTS],
    ids=[case[0] for case in MALFORMED_INPUTS],
)
def test_malformed(version, data, reasonCode):
    assert refusal(data, version) == reasonCode
    # The same refusal whatever the reads (here, one byte at a time).
    assert outcome(splitAt(data, range(1, len(data))), version)[1] == reasonCode


def test_malformedInputsAreMalformedOnlyForTheirReason():
    # Each MQTT 5 input above but the refused properties and reasons is
    # one fix away from valid: the vectors do not pass by accident of
    # another error.  Spot-check the fixed versions decode.
    assert decodeOne(b"\x62\x02\x00\x01", MQTT_5) == PubRel(1)
    assert decodeOne(withPublishProperties(b"\x23\x00\x01"), MQTT_5).properties == {
        Property.TOPIC_ALIAS: 1
    }
    assert decodeOne(b"\x82\x07\x00\x01\x00\x00\x01a\x20", MQTT_5) == Subscribe(
        1, [Subscription("a", retainHandling=2)]
    )
    assert decodeOne(connectBytes(b"\x05\x42\x00\x00\x00\x00\x01c\x00\x01p")) == (
        Connect("c", MQTT_5, True, 0, None, b"p")
    )


def test_tooLargeRefusedOnItsHeader():
    # A 100 MB PUBLISH is refused as soon as its length is read, before any
    # of its body arrives.
    decoder = MQTTDecoder(MQTT_5, maxPacketSize=1024)
    header = b"\x30" + encodeVariableByteInteger(100_000_000)
    with pytest.raises(MalformedPacket) as caught:
        list(decoder.feed(header))
    assert caught.value.reasonCode == ReasonCode.PACKET_TOO_LARGE


def test_packetSizeLimitBoundary():
    # The limit counts the whole packet: 1024 bytes pass, 1025 do not.
    payloadLength = 1024 - len(encodePublishHeader(b"t", 1000, properties=b"\x00"))
    fits = Publish("t", b"p" * payloadLength).encode(MQTT_5)
    assert len(fits) == 1024
    assert decodeAll(fits, MQTT_5, maxPacketSize=1024) == [Publish("t", b"p" * payloadLength)]
    tooLarge = Publish("t", b"p" * (payloadLength + 1)).encode(MQTT_5)
    decoder = MQTTDecoder(MQTT_5, maxPacketSize=1024)
    with pytest.raises(MalformedPacket) as caught:
        list(decoder.feed(tooLarge[:4]))
    assert caught.value.reasonCode == ReasonCode.PACKET_TOO_LARGE


def test_refusalIsFinal():
    decoder = MQTTDecoder(MQTT_5)
    with pytest.raises(MalformedPacket):
        list(decoder.feed(b"\x00\x00"))
    with pytest.raises(MalformedPacket):
        list(decoder.feed(PingReq().encode()))
    # Nor does it keep what a peer goes on sending.
    decoder.feed(b"x" * 1000)
    assert decoder._pendingSize == 0


def test_packetsBeforeARefusalAreYielded():
    decoder = MQTTDecoder(MQTT_3_1_1)
    received = []
    with pytest.raises(MalformedPacket):
        for packet in decoder.feed(b"\xc0\x00\xd0\x00\x00\x00"):
            received.append(packet)
    assert received == [PingReq(), PingResp()]


# Streaming


def test_byteByByte():
    stream = b"".join(packet.encode(MQTT_5) for packet in samples(MQTT_5)[2:])
    decoder = MQTTDecoder(MQTT_5)
    decoded = []
    for index in range(len(stream)):
        decoded.extend(decoder.feed(stream[index : index + 1]))
    assert decoded == samples(MQTT_5)[2:]


def test_aPacketFedAByteAtATimeCostsLittleMoreThanItsBytes():
    """
    A packet sent a byte a segment (slowloris) is held in about its own
    size, not as one object per byte; C{buffered} says how much is held.
    """
    import tracemalloc

    packet = Publish("t", b"x" * 200_000).encode(MQTT_3_1_1)
    decoder = MQTTDecoder(MQTT_3_1_1)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for index in range(100_000):
            assert list(decoder.feed(packet[index : index + 1])) == []
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert decoder.buffered == 100_000
    assert held < 2 * 100_000
    (decoded,) = decoder.feed(packet[100_000:])
    assert decoded.payload == b"x" * 200_000 and decoder.buffered == 0


def test_stoppingEarlyKeepsTheRest():
    decoder = MQTTDecoder(MQTT_3_1_1)
    stream = b"".join(Publish("t", bytes([index])).encode(MQTT_3_1_1) for index in range(5))
    iterator = decoder.feed(stream)
    assert next(iterator).payload == b"\x00"
    # Nothing is lost when the next read comes before the rest is taken.
    rest = list(decoder.feed(PingReq().encode()))
    assert [packet.payload for packet in rest[:4]] == [
        b"\x01",
        b"\x02",
        b"\x03",
        b"\x04",
    ]
    assert rest[4] == PingReq()


def test_largePacketInSmallReads():
    payload = bytes(range(256)) * 4096  # 1 MiB
    stream = Publish("big", payload, 1, packetId=9).encode(MQTT_5)
    decoder = MQTTDecoder(MQTT_5)
    decoded = []
    for start in range(0, len(stream), 1000):
        decoded.extend(decoder.feed(stream[start : start + 1000]))
    assert decoded == [Publish("big", payload, 1, packetId=9)]


def test_emptyFeedsAndMemoryviews():
    decoder = MQTTDecoder(MQTT_3_1_1)
    assert list(decoder.feed(b"")) == []
    assert list(decoder.feed(memoryview(b"\xc0"))) == []
    assert list(decoder.feed(bytearray(b"\x00"))) == [PingReq()]


# Hypothesis: generated packets and streams.

# UTF-8 strings MQTT allows: no U+0000 [MQTT-1.5.4-2], no surrogates
# [MQTT-1.5.4-1].
texts = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=8
)
topicNames = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00+#"),
    min_size=1,
    max_size=8,
)
topicFilters = texts.filter(bool)
binaries = st.binary(max_size=12)
packetIds = st.integers(1, 65535)
qualities = st.integers(0, 2)

NOT_ZERO = {
    Property.RECEIVE_MAXIMUM,
    Property.MAXIMUM_PACKET_SIZE,
    Property.TOPIC_ALIAS,
    Property.SUBSCRIPTION_IDENTIFIER,
}


def propertyValues(identifier, packetType):
    propertyType = PROPERTY_TYPES[identifier]
    least = 1 if identifier in NOT_ZERO else 0
    if identifier == Property.PAYLOAD_FORMAT_INDICATOR:
        # The spec defines 0 and 1 and refuses no other value.
        values = st.integers(0, 255)
    elif propertyType is PropertyType.BYTE:
        values = st.integers(0, 1)
    elif propertyType is PropertyType.TWO_BYTE_INTEGER:
        values = st.integers(least, 0xFFFF)
    elif propertyType is PropertyType.FOUR_BYTE_INTEGER:
        values = st.integers(least, 0xFFFFFFFF)
    elif propertyType is PropertyType.VARIABLE_BYTE_INTEGER:
        values = st.integers(least, 268_435_455)
    elif propertyType is PropertyType.UTF8_STRING:
        values = texts
    elif propertyType is PropertyType.BINARY_DATA:
        values = binaries
    else:
        values = st.tuples(texts, texts)
    if identifier == Property.USER_PROPERTY:
        return st.lists(values, min_size=1, max_size=3)
    if identifier == Property.SUBSCRIPTION_IDENTIFIER:
        return st.lists(values, min_size=1, max_size=3 if packetType == PacketType.PUBLISH else 1)
    return values


def propertiesFor(packetType, version):
    if version != MQTT_5:
        return st.just(NO_PROPERTIES)
    optional = {
        identifier: propertyValues(identifier, packetType)
        for identifier in sorted(PROPERTIES_ALLOWED[packetType])
    }

    def authenticationDataNeedsAMethod(properties):
        # 3.1.2.11.10
        if Property.AUTHENTICATION_METHOD not in properties:
            properties.pop(Property.AUTHENTICATION_DATA, None)
        return properties or NO_PROPERTIES

    return st.fixed_dictionaries({}, optional=optional).map(authenticationDataNeedsAMethod)


def reasonCodes(packetType, version):
    """
    The codes each packet may carry, from the specifications' tables.
    """
    if version == MQTT_3_1_1:
        return st.sampled_from(
            {
                PacketType.CONNACK: [0, 1, 2, 3, 4, 5],
                PacketType.SUBACK: [0, 1, 2, 0x80],
            }.get(packetType, [0])
        )
    return st.sampled_from(
        {
            PacketType.CONNACK: [0x00, 0x80, 0x81, 0x82, 0x83, 0x84, 0x85, 0x86, 0x87, 0x88, 0x89, 0x8A, 0x8C, 0x90, 0x95, 0x97, 0x99, 0x9A, 0x9B, 0x9C, 0x9D, 0x9F],
            PacketType.PUBACK: [0x00, 0x10, 0x80, 0x83, 0x87, 0x90, 0x91, 0x97, 0x99],
            PacketType.PUBREC: [0x00, 0x10, 0x80, 0x83, 0x87, 0x90, 0x91, 0x97, 0x99],
            PacketType.PUBREL: [0x00, 0x92],
            PacketType.PUBCOMP: [0x00, 0x92],
            PacketType.SUBACK: [0x00, 0x01, 0x02, 0x80, 0x83, 0x87, 0x8F, 0x91, 0x97, 0x9E, 0xA1, 0xA2],
            PacketType.UNSUBACK: [0x00, 0x11, 0x80, 0x83, 0x87, 0x8F, 0x91],
            PacketType.DISCONNECT: [0x00, 0x04, 0x80, 0x81, 0x82, 0x83, 0x87, 0x89, 0x8B, 0x8D, 0x8E, 0x8F, 0x90, 0x93, 0x94, 0x95, 0x96, 0x97, 0x98, 0x99, 0x9A, 0x9B, 0x9C, 0x9D, 0x9E, 0x9F, 0xA0, 0xA1, 0xA2],
            PacketType.AUTH: [0x00, 0x18, 0x19],
        }[packetType]
    )  # fmt: skip


@st.composite
def connects(draw, version):
    username = draw(st.none() | texts)
    password = draw(st.none() | binaries)
    if version == MQTT_3_1_1 and username is None:
        password = None  # [MQTT-3.1.2-22]
    will = draw(
        st.none()
        | st.builds(
            Will,
            topicNames,
            binaries,
            qualities,
            st.booleans(),
            propertiesFor(WILL_PROPERTIES, version),
        )
    )
    return Connect(
        draw(texts),
        version,
        draw(st.booleans()),
        draw(st.integers(0, 65535)),
        username,
        password,
        will,
        draw(propertiesFor(PacketType.CONNECT, version)),
    )


@st.composite
def publishes(draw, version):
    qos = draw(qualities)
    return Publish(
        draw(topicNames),
        draw(binaries),
        qos,
        draw(st.booleans()),
        bool(qos) and draw(st.booleans()),
        draw(packetIds) if qos else None,
        draw(propertiesFor(PacketType.PUBLISH, version)),
    )


@st.composite
def subscriptions(draw, version):
    if version == MQTT_3_1_1:
        return Subscription(draw(topicFilters), draw(qualities))
    topicFilter = draw(topicFilters | topicFilters.map("$share/g/".__add__))
    return Subscription(
        topicFilter,
        draw(qualities),
        not topicFilter.startswith("$share/") and draw(st.booleans()),
        draw(st.booleans()),
        draw(st.integers(0, 2)),
    )


def acknowledgements(packetClass, packetType, version):
    if version == MQTT_3_1_1:
        return st.builds(packetClass, packetIds)
    return st.builds(
        packetClass,
        packetIds,
        reasonCodes(packetType, version),
        propertiesFor(packetType, version),
    )


def reasonsAndProperties(packetClass, packetType, version):
    if version == MQTT_3_1_1:
        return st.builds(packetClass)
    return st.builds(
        packetClass,
        reasonCodes(packetType, version),
        propertiesFor(packetType, version),
    )


def connAcks(version):
    return st.builds(
        ConnAck,
        st.booleans(),
        reasonCodes(PacketType.CONNACK, version),
        propertiesFor(PacketType.CONNACK, version),
    ).map(
        # [MQTT-3.2.2-4] (3.1.1), [MQTT-3.2.2-6] (5)
        lambda packet: (
            ConnAck(False, packet.reasonCode, packet.properties) if packet.reasonCode else packet
        )
    )


def unsubAcks(version):
    if version == MQTT_3_1_1:
        return st.builds(UnsubAck, packetIds)
    return st.builds(
        UnsubAck,
        packetIds,
        st.lists(reasonCodes(PacketType.UNSUBACK, version), min_size=1, max_size=4),
        propertiesFor(PacketType.UNSUBACK, version),
    )


def packetsAfterConnect(version):
    """
    Every packet type but CONNECT, in C{version}.
    """
    strategies = [
        connAcks(version),
        publishes(version),
        acknowledgements(PubAck, PacketType.PUBACK, version),
        acknowledgements(PubRec, PacketType.PUBREC, version),
        acknowledgements(PubRel, PacketType.PUBREL, version),
        acknowledgements(PubComp, PacketType.PUBCOMP, version),
        st.builds(
            Subscribe,
            packetIds,
            st.lists(subscriptions(version), min_size=1, max_size=4),
            propertiesFor(PacketType.SUBSCRIBE, version),
        ),
        st.builds(
            SubAck,
            packetIds,
            st.lists(reasonCodes(PacketType.SUBACK, version), min_size=1, max_size=4),
            propertiesFor(PacketType.SUBACK, version),
        ),
        st.builds(
            Unsubscribe,
            packetIds,
            st.lists(topicFilters, min_size=1, max_size=4),
            propertiesFor(PacketType.UNSUBSCRIBE, version),
        ),
        unsubAcks(version),
        st.just(PingReq()),
        st.just(PingResp()),
        reasonsAndProperties(Disconnect, PacketType.DISCONNECT, version),
    ]
    if version == MQTT_5:
        strategies.append(reasonsAndProperties(Auth, PacketType.AUTH, version))
    return st.one_of(strategies)


versions = st.sampled_from(VERSIONS)


@st.composite
def streams(draw):
    """
    A version, and the packets of a connection in it: a CONNECT, then any.
    """
    version = draw(versions)
    return version, [
        draw(connects(version)),
        *draw(st.lists(packetsAfterConnect(version), max_size=6)),
    ]


@BOUNDED
@given(streams())
def test_generatedPacketsRoundTrip(stream):
    version, packets = stream
    encoded = b"".join(packet.encode(version) for packet in packets)
    assert list(MQTTDecoder().feed(encoded)) == packets


def cuts(data):
    return st.lists(st.integers(0, len(data)), max_size=8).map(sorted)


@BOUNDED
@given(streams(), binaries, st.data())
def test_splitPointInvariance(stream, garbage, data):
    # Whatever the reads, the same packets, and the same refusal if any.
    version, packets = stream
    encoded = b"".join(packet.encode(version) for packet in packets) + garbage
    whole = outcome([encoded], None)
    assert outcome(splitAt(encoded, data.draw(cuts(encoded))), None) == whole
    if not garbage:
        assert whole == (packets, None)


def checkDecodedPacketsReEncode(packets, version):
    # What the decoder accepts, the encoder can send: the two agree on the
    # rules.
    for packet in packets:
        again = list(decoderFor(packet, version).feed(packet.encode(version)))
        assert again == [packet]


@BOUNDED
@given(versions, st.binary(max_size=64), st.data())
def test_arbitraryBytes(version, garbage, data):
    # Only packets or MalformedPacket (outcome lets any other exception out).
    packets, _ = outcome(splitAt(garbage, data.draw(cuts(garbage))), version)
    checkDecodedPacketsReEncode(packets, version)


@BOUNDED
@given(streams(), st.data())
def test_mutatedStreams(stream, data):
    # Valid streams with bytes changed, inserted or removed reach deeper
    # than random bytes do.
    version, packets = stream
    encoded = bytearray(b"".join(packet.encode(version) for packet in packets))
    for _ in range(data.draw(st.integers(1, 4))):
        position = data.draw(st.integers(0, len(encoded)))
        action = data.draw(st.sampled_from(["replace", "insert", "delete"]))
        byte = data.draw(st.integers(0, 255))
        if action == "insert" or position == len(encoded):
            encoded.insert(position, byte)
        elif action == "replace":
            encoded[position] = byte
        else:
            del encoded[position]
    mutated = bytes(encoded)
    decoded, _ = outcome(splitAt(mutated, data.draw(cuts(mutated))), None)
    assert outcome([mutated], None)[0] == decoded
    checkDecodedPacketsReEncode(decoded, version)


@BOUNDED
@given(st.sampled_from(sorted(PROPERTIES_ALLOWED[PacketType.PUBLISH])), st.data())
def test_propertiesAllowedOnlyWhereTheSpecSays(identifier, data):
    value = data.draw(propertyValues(identifier, PacketType.PUBLISH))
    assert encodeProperties({identifier: value}, PacketType.PUBLISH)
    for packetType in PacketType:
        if identifier not in PROPERTIES_ALLOWED[packetType]:
            with pytest.raises(ValueError):
                encodeProperties({identifier: value}, packetType)


# Clients and a broker Dallal did not write: what they send decodes, and
# what this codec sends, they understand.

PEER_TIMEOUT = 10


class PacketPeer:
    """
    Our end of a TCP connection to an MQTT program: it decodes what the
    program sends and encodes what it is sent, in the version of the
    conversation.

    @ivar pump: called while waiting, to let a client that runs in this
        thread (paho without its thread) read and write.
    """

    def __init__(self, connection, version=None, pump=None):
        self.connection = connection
        self.decoder = MQTTDecoder(version)
        self.version = version
        self.pump = pump
        connection.settimeout(0.05 if pump else PEER_TIMEOUT)

    def send(self, *packets):
        version = self.decoder.version or self.version
        self.connection.sendall(b"".join(packet.encode(version) for packet in packets))

    def receive(self, count):
        packets = []
        deadline = time.monotonic() + PEER_TIMEOUT
        while len(packets) < count:
            packet = self.decoder.nextPacket()
            if packet is not None:
                packets.append(packet)
                continue
            assert time.monotonic() < deadline, f"only {packets} in {PEER_TIMEOUT} s"
            if self.pump:
                self.pump()
            try:
                data = self.connection.recv(65536)
            except TimeoutError:
                continue
            assert data, f"the connection closed after {packets}"
            self.decoder.feed(data)
        return packets

    def until(self, condition):
        deadline = time.monotonic() + PEER_TIMEOUT
        while not condition():
            assert time.monotonic() < deadline, "the client never got there"
            self.pump()


def pahoProperties(packetType, **values):
    from paho.mqtt.properties import Properties

    properties = Properties(packetType)
    for name, value in values.items():
        setattr(properties, name, value)
    return properties


def pahoConnection(client, properties=None):
    """
    Connect a paho client to a listening socket of ours: our end.
    """
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(PEER_TIMEOUT)
        client.connect("127.0.0.1", listener.getsockname()[1], keepalive=30, properties=properties)
        connection, _ = listener.accept()
    return connection


def pahoClient(version, events):
    """
    A paho client of C{version} whose connects and disconnects are logged in
    C{events} as (name, reason code value, properties).
    """
    mqtt = pytest.importorskip("paho.mqtt.client")
    client = mqtt.Client(
        mqtt.CallbackAPIVersion.VERSION2,
        client_id="paho-1",
        protocol=mqtt.MQTTv5 if version == MQTT_5 else mqtt.MQTTv311,
    )
    client.on_connect = lambda c, u, flags, reason, properties: events.append(
        ("connect", reason.value, properties)
    )
    client.on_disconnect = lambda c, u, flags, reason, properties: events.append(
        ("disconnect", reason.value, properties)
    )
    return client


@pytest.mark.parametrize("version", VERSIONS)
def test_pahoHearsARefusedConnect(version):
    events = []
    client = pahoClient(version, events)
    connection = pahoConnection(client)
    try:
        peer = PacketPeer(connection, pump=lambda: client.loop(timeout=0.01))
        assert type(peer.receive(1)[0]) is Connect
        if version == MQTT_5:
            peer.send(
                ConnAck(
                    False,
                    ReasonCode.BAD_USER_NAME_OR_PASSWORD,
                    {Property.REASON_STRING: "who are you?"},
                )
            )
        else:
            peer.send(ConnAck(False, ConnectReturnCode.BAD_USER_NAME_OR_PASSWORD))
        peer.until(lambda: events)
        name, reason, properties = events[0]
        # paho reports 3.1.1's return code 4 as MQTT 5's 0x86 too.
        assert (name, reason) == ("connect", ReasonCode.BAD_USER_NAME_OR_PASSWORD)
        if version == MQTT_5:
            assert properties.ReasonString == "who are you?"
    finally:
        connection.close()
        client.loop(timeout=0.01)


def test_pahoHearsAServerDisconnect():
    events = []
    client = pahoClient(MQTT_5, events)
    connection = pahoConnection(client)
    try:
        peer = PacketPeer(connection, pump=lambda: client.loop(timeout=0.01))
        assert type(peer.receive(1)[0]) is Connect
        peer.send(ConnAck(), PingResp())
        peer.until(lambda: events)
        peer.send(
            Disconnect(
                ReasonCode.SERVER_SHUTTING_DOWN,
                {
                    Property.REASON_STRING: "maintenance",
                    Property.SERVER_REFERENCE: "other:1883",
                },
            )
        )
        peer.until(lambda: len(events) == 2)
        name, reason, properties = events[1]
        assert (name, reason) == ("disconnect", ReasonCode.SERVER_SHUTTING_DOWN)
        assert properties.ReasonString == "maintenance"
        assert properties.ServerReference == "other:1883"
    finally:
        connection.close()
        client.loop(timeout=0.01)


@pytest.mark.parametrize("version", VERSIONS)
def test_pahoClient(version):
    """
    A paho-mqtt client through a whole session: what it sends decodes to
    the packets its calls asked for; what we answer, its callbacks report.
    """
    mqtt = pytest.importorskip("paho.mqtt.client")
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.reasoncodes import ReasonCode as PahoReasonCode
    from paho.mqtt.subscribeoptions import SubscribeOptions

    five = version == MQTT_5
    events = []
    client = mqtt.Client(
        mqtt.CallbackAPIVersion.VERSION2,
        client_id="paho-1",
        protocol=mqtt.MQTTv5 if five else mqtt.MQTTv311,
        clean_session=None if five else False,
    )
    client.on_connect = lambda c, u, flags, reason, properties: events.append(
        ("connect", reason.value, properties)
    )
    client.on_subscribe = lambda c, u, mid, reasons, properties: events.append(
        ("subscribe", mid, [reason.value for reason in reasons])
    )
    client.on_unsubscribe = lambda c, u, mid, reasons, properties: events.append(
        ("unsubscribe", mid, [reason.value for reason in reasons])
    )
    client.on_message = lambda c, u, message: events.append(("message", message))
    client.username_pw_set("user", "secret")
    client.will_set(
        "wills/paho",
        b"gone",
        qos=1,
        retain=True,
        properties=(
            pahoProperties(PacketTypes.WILLMESSAGE, WillDelayInterval=30, UserProperty=[("w", "1")])
            if five
            else None
        ),
    )
    users = [("k", "v"), ("k", "w"), ("a", "z")]

    connection = pahoConnection(
        client,
        (
            pahoProperties(
                PacketTypes.CONNECT,
                SessionExpiryInterval=120,
                ReceiveMaximum=10,
                UserProperty=users,
            )
            if five
            else None
        ),
    )
    try:
        peer = PacketPeer(connection, pump=lambda: client.loop(timeout=0.01))
        [connect] = peer.receive(1)
        assert connect == Connect(
            "paho-1",
            version,
            five,  # paho's MQTT 5 default: a clean start the first time
            30,
            "user",
            b"secret",
            Will(
                "wills/paho",
                b"gone",
                1,
                True,
                (
                    {
                        Property.WILL_DELAY_INTERVAL: 30,
                        Property.USER_PROPERTY: [("w", "1")],
                    }
                    if five
                    else NO_PROPERTIES
                ),
            ),
            (
                {
                    Property.SESSION_EXPIRY_INTERVAL: 120,
                    Property.RECEIVE_MAXIMUM: 10,
                    Property.USER_PROPERTY: users,
                }
                if five
                else NO_PROPERTIES
            ),
        )

        peer.send(
            ConnAck(
                False,
                0,
                (
                    {
                        Property.RECEIVE_MAXIMUM: 5,
                        Property.REASON_STRING: "welcome",
                        Property.USER_PROPERTY: [("s", "1")],
                    }
                    if five
                    else NO_PROPERTIES
                ),
            )
        )
        peer.until(lambda: events)
        [(name, reason, properties)] = events
        assert (name, reason) == ("connect", 0)
        if five:
            assert properties.UserProperty == [("s", "1")]
            assert properties.ReasonString == "welcome"
        events.clear()

        if five:
            _, mid = client.subscribe(
                [
                    (
                        "a/+",
                        SubscribeOptions(
                            qos=2,
                            noLocal=True,
                            retainAsPublished=True,
                            retainHandling=2,
                        ),
                    ),
                    ("$share/g/b/#", SubscribeOptions(qos=0)),
                ],
                properties=pahoProperties(PacketTypes.SUBSCRIBE, SubscriptionIdentifier=7),
            )
        else:
            _, mid = client.subscribe([("a/+", 2), ("$share/g/b/#", 0)])
        [subscribe] = peer.receive(1)
        assert subscribe == Subscribe(
            mid,
            [
                (Subscription("a/+", 2, True, True, 2) if five else Subscription("a/+", 2)),
                Subscription("$share/g/b/#", 0),
            ],
            {Property.SUBSCRIPTION_IDENTIFIER: [7]} if five else NO_PROPERTIES,
        )
        refused = ReasonCode.SHARED_SUBSCRIPTIONS_NOT_SUPPORTED if five else 0x80
        peer.send(SubAck(mid, [2, refused]))
        peer.until(lambda: events)
        assert events.pop() == ("subscribe", mid, [2, refused])

        publishProperties = {
            Property.PAYLOAD_FORMAT_INDICATOR: 1,
            Property.MESSAGE_EXPIRY_INTERVAL: 60,
            Property.CONTENT_TYPE: "text/plain",
            Property.RESPONSE_TOPIC: "replies/1",
            Property.CORRELATION_DATA: b"\x01\x02",
            Property.USER_PROPERTY: users,
        }
        client.publish("t/0", b"zero", 0)
        first = client.publish(
            "t/1",
            b"one",
            1,
            retain=True,
            properties=(
                pahoProperties(
                    PacketTypes.PUBLISH,
                    PayloadFormatIndicator=1,
                    MessageExpiryInterval=60,
                    ContentType="text/plain",
                    ResponseTopic="replies/1",
                    CorrelationData=b"\x01\x02",
                    UserProperty=users,
                )
                if five
                else None
            ),
        )
        second = client.publish("t/2", b"two", 2)
        assert peer.receive(3) == [
            Publish("t/0", b"zero"),
            Publish(
                "t/1",
                b"one",
                1,
                True,
                False,
                first.mid,
                publishProperties if five else NO_PROPERTIES,
            ),
            Publish("t/2", b"two", 2, False, False, second.mid),
        ]
        peer.send(PubAck(first.mid), PubRec(second.mid))
        assert peer.receive(1) == [PubRel(second.mid)]
        peer.send(PubComp(second.mid))
        peer.until(lambda: first.is_published() and second.is_published())

        # Messages to the client, at QoS 1 and 2 (whose four steps complete
        # before paho hands it over).
        peer.send(
            Publish(
                "a/x",
                b"to paho",
                1,
                False,
                False,
                100,
                (
                    {
                        Property.SUBSCRIPTION_IDENTIFIER: [7],
                        Property.USER_PROPERTY: [("from", "dallal")],
                        Property.CONTENT_TYPE: "text/plain",
                    }
                    if five
                    else NO_PROPERTIES
                ),
            ),
            Publish("a/y", b"exactly once", 2, True, False, 101),
        )
        assert peer.receive(2) == [PubAck(100), PubRec(101)]
        peer.send(PubRel(101))
        assert peer.receive(1) == [PubComp(101)]
        peer.until(lambda: len(events) == 2)
        messages = [event[1] for event in events]
        assert [
            (message.topic, message.payload, message.qos, message.retain) for message in messages
        ] == [("a/x", b"to paho", 1, False), ("a/y", b"exactly once", 2, True)]
        if five:
            assert messages[0].properties.UserProperty == [("from", "dallal")]
            assert messages[0].properties.SubscriptionIdentifier == [7]
            assert messages[0].properties.ContentType == "text/plain"
        events.clear()

        _, mid = client.unsubscribe(["a/+", "$share/g/b/#"])
        assert peer.receive(1) == [Unsubscribe(mid, ["a/+", "$share/g/b/#"])]
        peer.send(UnsubAck(mid, [0, ReasonCode.NO_SUBSCRIPTION_EXISTED] if five else []))
        peer.until(lambda: events)
        if five:
            assert events.pop() == ("unsubscribe", mid, [0, 0x11])

        client.disconnect(
            reasoncode=(PahoReasonCode(PacketTypes.DISCONNECT, identifier=4) if five else None)
        )
        assert peer.receive(1) == [Disconnect(4 if five else 0)]
    finally:
        connection.close()
        client.loop(timeout=0.01)


@pytest.mark.e2e
@pytest.mark.skipif(shutil.which("mosquitto_pub") is None, reason="no mosquitto_pub")
@pytest.mark.parametrize("version", VERSIONS)
def test_mosquittoPub(version):
    """
    What Debian's mosquitto_pub sends for a QoS 2 retained message with a
    will, a user name and, in MQTT 5, properties.
    """
    five = version == MQTT_5
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(PEER_TIMEOUT)
        arguments = [
            "mosquitto_pub", "-h", "127.0.0.1", "-p", str(listener.getsockname()[1]),
            "-V", "mqttv5" if five else "mqttv311", "-i", "mosquitto-1", "-k", "45",
            "-t", "sensors/1", "-m", "21.5", "-q", "2", "-r", "-u", "user", "-P", "pw",
            "--will-topic", "wills/m", "--will-payload", "bye", "--will-qos", "1",
        ]  # fmt: skip
        if five:
            arguments += [
                "-D", "publish", "user-property", "unit", "celsius",
                "-D", "publish", "content-type", "text/plain",
                "-D", "connect", "session-expiry-interval", "60",
            ]  # fmt: skip
        process = subprocess.Popen(arguments, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            connection, _ = listener.accept()
            with connection:
                peer = PacketPeer(connection)
                [connect] = peer.receive(1)
                assert connect == Connect(
                    "mosquitto-1",
                    version,
                    True,
                    45,
                    "user",
                    b"pw",
                    Will("wills/m", b"bye", 1),
                    # mosquitto_pub asks for 20 messages in flight at most.
                    (
                        {
                            Property.SESSION_EXPIRY_INTERVAL: 60,
                            Property.RECEIVE_MAXIMUM: 20,
                        }
                        if five
                        else NO_PROPERTIES
                    ),
                )
                peer.send(ConnAck())
                [publish] = peer.receive(1)
                assert publish == Publish(
                    "sensors/1",
                    b"21.5",
                    2,
                    True,
                    False,
                    publish.packetId,
                    (
                        {
                            Property.USER_PROPERTY: [("unit", "celsius")],
                            Property.CONTENT_TYPE: "text/plain",
                        }
                        if five
                        else NO_PROPERTIES
                    ),
                )
                peer.send(PubRec(publish.packetId))
                assert peer.receive(1) == [PubRel(publish.packetId)]
                peer.send(PubComp(publish.packetId))
                assert peer.receive(1) == [Disconnect()]
            assert process.wait(timeout=PEER_TIMEOUT) == 0, process.stderr.read()
        finally:
            process.kill()
            process.wait()


@pytest.fixture
def mosquittoBroker(tmp_path):
    """
    A Mosquitto broker on a free local port, or a skip where none is installed.
    """
    # Debian installs the broker in /usr/sbin, not on every user's PATH.
    executable = shutil.which("mosquitto", path=f"{os.defpath}:/usr/sbin:/usr/local/sbin")
    if executable is None:
        pytest.skip("no mosquitto")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = open(tmp_path / "mosquitto.log", "wb")
    process = subprocess.Popen([executable, "-p", str(port)], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + PEER_TIMEOUT
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert process.poll() is None, (tmp_path / "mosquitto.log").read_text()
                assert time.monotonic() < deadline, "mosquitto did not listen"
                time.sleep(0.05)
        yield port
    finally:
        process.terminate()
        process.wait(timeout=PEER_TIMEOUT)
        log.close()


def byType(packets):
    return {type(packet): packet for packet in packets}


@pytest.mark.e2e
@pytest.mark.parametrize("version", VERSIONS)
def test_mosquittoBroker(mosquittoBroker, version):
    """
    A session with Mosquitto in this codec's packets: Mosquitto accepts
    them, and what it answers decodes to what the specification says.
    """
    five = version == MQTT_5
    users = [("k", "1"), ("k", "2")]

    def properties(mapping):
        return mapping if five else NO_PROPERTIES

    with socket.create_connection(
        ("127.0.0.1", mosquittoBroker), timeout=PEER_TIMEOUT
    ) as connection:
        peer = PacketPeer(connection, version)
        peer.send(
            Connect(
                "codec",
                version,
                True,
                60,
                properties=properties(
                    {
                        Property.RECEIVE_MAXIMUM: 10,
                        Property.REQUEST_PROBLEM_INFORMATION: 1,
                        Property.USER_PROPERTY: users,
                    }
                ),
            )
        )
        [connAck] = peer.receive(1)
        assert (type(connAck), connAck.sessionPresent, connAck.reasonCode) == (
            ConnAck,
            False,
            0,
        )

        peer.send(
            Subscribe(
                1,
                [Subscription("cross/#", 2)],
                properties({Property.SUBSCRIPTION_IDENTIFIER: [3]}),
            )
        )
        assert peer.receive(1) == [SubAck(1, [2])]

        # QoS 2 in and out: Mosquitto releases the message at our PUBREL.
        messageProperties = properties(
            {
                Property.USER_PROPERTY: users,
                Property.CORRELATION_DATA: b"\x00c",
                Property.RESPONSE_TOPIC: "replies",
                Property.CONTENT_TYPE: "text/plain",
            }
        )
        peer.send(Publish("cross/a", b"hello", 2, False, False, 2, messageProperties))
        assert peer.receive(1) == [PubRec(2)]
        peer.send(PubRel(2))
        received = byType(peer.receive(2))
        assert received[PubComp] == PubComp(2)
        delivered = received[Publish]
        assert (delivered.topic, delivered.payload, delivered.qos, delivered.retain) == (
            "cross/a", b"hello", 2, False
        )  # fmt: skip
        if five:
            assert delivered.properties == {
                **messageProperties,
                Property.SUBSCRIPTION_IDENTIFIER: [3],
            }
        peer.send(PubRec(delivered.packetId))
        assert peer.receive(1) == [PubRel(delivered.packetId)]
        peer.send(PubComp(delivered.packetId))

        # QoS 1, then (MQTT 5) a topic alias set and used.
        peer.send(
            Publish(
                "cross/b",
                b"one",
                1,
                False,
                False,
                3,
                properties({Property.TOPIC_ALIAS: 1}),
            )
        )
        if five:
            peer.send(Publish("", b"two", 1, False, False, 4, {Property.TOPIC_ALIAS: 1}))
        else:
            peer.send(Publish("cross/b", b"two", 1, False, False, 4))
        packets = peer.receive(4)
        assert [packet for packet in packets if isinstance(packet, PubAck)] == [
            PubAck(3),
            PubAck(4),
        ]
        forwarded = [packet for packet in packets if isinstance(packet, Publish)]
        assert [(packet.topic, packet.payload, packet.qos) for packet in forwarded] == [
            ("cross/b", b"one", 1),
            ("cross/b", b"two", 1),
        ]
        peer.send(*(PubAck(packet.packetId) for packet in forwarded))

        # A retained message comes to a new subscription with RETAIN set.
        peer.send(Publish("cross/r", b"kept", 0, True))
        [live] = peer.receive(1)
        assert (live.topic, live.retain) == ("cross/r", False)
        peer.send(Subscribe(5, [Subscription("cross/r", 0)]))
        received = byType(peer.receive(2))
        assert received[SubAck] == SubAck(5, [0])
        assert (received[Publish].payload, received[Publish].retain) == (b"kept", True)

        peer.send(Unsubscribe(6, ["cross/#", "never/subscribed"]))
        assert peer.receive(1) == [UnsubAck(6, [0, 0x11] if five else [])]
        peer.send(PingReq())
        assert peer.receive(1) == [PingResp()]

        peer.send(Disconnect())
        assert connection.recv(1) == b""


@pytest.mark.e2e
@pytest.mark.parametrize(
    "data, accepted",
    [
        (b"\x30\x06\x00\x03a/#\x00", False),  # a wildcard in a topic name
        (withPublishProperties(b"\x23\x00\x00"), False),  # topic alias 0
        (withPublishProperties(b"\x01\x02"), True),  # payload format 2
    ],
    ids=["wildcard topic", "topic alias 0", "payload format 2"],
)
def test_mosquittoDecidesWhereTheSpecDoesNot(mosquittoBroker, data, accepted):
    """
    Where MQTT 5 names no reason code or leaves a value open, this codec
    accepts what Mosquitto accepts and refuses with the code Mosquitto sends.
    """
    with socket.create_connection(
        ("127.0.0.1", mosquittoBroker), timeout=PEER_TIMEOUT
    ) as connection:
        peer = PacketPeer(connection, MQTT_5)
        peer.send(Connect("judge", MQTT_5))
        assert peer.receive(1)[0].reasonCode == 0
        connection.sendall(data + PingReq().encode())
        if accepted:
            assert decodeAll(data, MQTT_5)
            assert peer.receive(1) == [PingResp()]
        else:
            assert peer.receive(1) == [Disconnect(refusal(data, MQTT_5))]
