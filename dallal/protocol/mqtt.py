"""
MQTT 3.1.1 and 5.0 control packets to and from bytes, without I/O.

In the manner of h11 and wsproto: L{MQTTDecoder} takes the bytes a
connection reads, in pieces of any size, and gives back packet objects;
each packet object's C{encode(version)} gives the bytes to write.  Nothing
here touches a socket, a reactor or a clock, so the broker's protocol, a
client and the tests share it.

Both versions share one set of packet classes: the fields MQTT 3.1.1 lacks
(properties, most reason codes) keep their defaults there and are not
encoded.  Properties are a mapping from L{Property} to a value: an C{int}
for the integer types, C{str} for strings, C{bytes} for binary data; the
two properties that may appear more than once, L{Property.USER_PROPERTY}
(a list of C{(name, value)} pairs, in order) and
L{Property.SUBSCRIPTION_IDENTIFIER} (a list of C{int}), are always lists.

Decoding checks every normative rule that needs nothing but the packet and
the protocol version (reserved bits, lengths, UTF-8, packet identifiers,
property types, duplicates, placement and values, ...) and refuses a
packet that breaks one with L{MalformedPacket}, whose C{reasonCode} is the
MQTT 5 reason code a server sends before closing.  Comments name the
statement each check implements: [MQTT-x.y.z-n] numbers are MQTT 3.1.1's
when only that version is meant, MQTT 5.0's otherwise.  Where the spec
names no reason code, or leaves a value's meaning open, the codec does what
Mosquitto (2.0.11) does, and its tests check that against a running
Mosquitto.  Rules that need a session (topic alias mapping, packet
identifiers in use, Receive Maximum, which side sent a packet) are the
protocol's, as is topic filter syntax (MQTT 5 lets a server refuse one
filter of a SUBSCRIBE in its SUBACK).

Encoding validates what it builds (field ranges, string lengths, reason
codes and properties allowed for the packet) and raises C{ValueError}
otherwise: the broker's mistakes are not sent.  L{encodePublishHeader}
is the broker's fast path: the fixed and variable header of a PUBLISH,
to be written before a payload it never copies.
"""

import enum
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field

MQTT_3_1_1 = 4
MQTT_5 = 5
SUPPORTED_VERSIONS = (MQTT_3_1_1, MQTT_5)

# The largest Remaining Length four bytes of Variable Byte Integer encode
# (1.5.5), hence the largest packet: its first byte, four length bytes and
# that much more.
MAXIMUM_VARIABLE_BYTE_INTEGER = 268_435_455
MAXIMUM_PACKET_SIZE = 1 + 4 + MAXIMUM_VARIABLE_BYTE_INTEGER
_MAXIMUM_TWO_BYTE = 0xFFFF


class PacketType(enum.IntEnum):
    """
    The MQTT Control Packet types, the high nibble of a packet's first byte.
    """

    CONNECT = 1
    CONNACK = 2
    PUBLISH = 3
    PUBACK = 4
    PUBREC = 5
    PUBREL = 6
    PUBCOMP = 7
    SUBSCRIBE = 8
    SUBACK = 9
    UNSUBSCRIBE = 10
    UNSUBACK = 11
    PINGREQ = 12
    PINGRESP = 13
    DISCONNECT = 14
    AUTH = 15


class ReasonCode(enum.IntEnum):
    """
    MQTT 5 reason codes (2.4).  Values below 0x80 are successes; several
    names share a value (0x00 is Success, Normal disconnection and Granted
    QoS 0), so the first name stands for all.
    """

    SUCCESS = 0x00
    NORMAL_DISCONNECTION = 0x00
    GRANTED_QOS_0 = 0x00
    GRANTED_QOS_1 = 0x01
    GRANTED_QOS_2 = 0x02
    DISCONNECT_WITH_WILL_MESSAGE = 0x04
    NO_MATCHING_SUBSCRIBERS = 0x10
    NO_SUBSCRIPTION_EXISTED = 0x11
    CONTINUE_AUTHENTICATION = 0x18
    RE_AUTHENTICATE = 0x19
    UNSPECIFIED_ERROR = 0x80
    MALFORMED_PACKET = 0x81
    PROTOCOL_ERROR = 0x82
    IMPLEMENTATION_SPECIFIC_ERROR = 0x83
    UNSUPPORTED_PROTOCOL_VERSION = 0x84
    CLIENT_IDENTIFIER_NOT_VALID = 0x85
    BAD_USER_NAME_OR_PASSWORD = 0x86
    NOT_AUTHORIZED = 0x87
    SERVER_UNAVAILABLE = 0x88
    SERVER_BUSY = 0x89
    BANNED = 0x8A
    SERVER_SHUTTING_DOWN = 0x8B
    BAD_AUTHENTICATION_METHOD = 0x8C
    KEEP_ALIVE_TIMEOUT = 0x8D
    SESSION_TAKEN_OVER = 0x8E
    TOPIC_FILTER_INVALID = 0x8F
    TOPIC_NAME_INVALID = 0x90
    PACKET_IDENTIFIER_IN_USE = 0x91
    PACKET_IDENTIFIER_NOT_FOUND = 0x92
    RECEIVE_MAXIMUM_EXCEEDED = 0x93
    TOPIC_ALIAS_INVALID = 0x94
    PACKET_TOO_LARGE = 0x95
    MESSAGE_RATE_TOO_HIGH = 0x96
    QUOTA_EXCEEDED = 0x97
    ADMINISTRATIVE_ACTION = 0x98
    PAYLOAD_FORMAT_INVALID = 0x99
    RETAIN_NOT_SUPPORTED = 0x9A
    QOS_NOT_SUPPORTED = 0x9B
    USE_ANOTHER_SERVER = 0x9C
    SERVER_MOVED = 0x9D
    SHARED_SUBSCRIPTIONS_NOT_SUPPORTED = 0x9E
    CONNECTION_RATE_EXCEEDED = 0x9F
    MAXIMUM_CONNECT_TIME = 0xA0
    SUBSCRIPTION_IDENTIFIERS_NOT_SUPPORTED = 0xA1
    WILDCARD_SUBSCRIPTIONS_NOT_SUPPORTED = 0xA2


class ConnectReturnCode(enum.IntEnum):
    """
    MQTT 3.1.1's CONNACK return codes (3.2.2.3), in C{ConnAck.reasonCode}
    when the version is 3.1.1.
    """

    ACCEPTED = 0
    UNACCEPTABLE_PROTOCOL_VERSION = 1
    IDENTIFIER_REJECTED = 2
    SERVER_UNAVAILABLE = 3
    BAD_USER_NAME_OR_PASSWORD = 4
    NOT_AUTHORIZED = 5


# MQTT 3.1.1's one SUBACK failure code (3.9.3).
SUBACK_FAILURE = 0x80

# The reason codes each packet may carry (MQTT 5, 3.x.2.1 of each packet),
# and MQTT 3.1.1's return codes.
_CONNACK_REASONS = frozenset(
    (0x00, 0x80, 0x81, 0x82, 0x83, 0x84, 0x85, 0x86, 0x87, 0x88, 0x89, 0x8A, 0x8C)
    + (0x90, 0x95, 0x97, 0x99, 0x9A, 0x9B, 0x9C, 0x9D, 0x9F)
)
_CONNACK_RETURN_CODES = frozenset(ConnectReturnCode)
_PUBACK_REASONS = frozenset((0x00, 0x10, 0x80, 0x83, 0x87, 0x90, 0x91, 0x97, 0x99))
_PUBREL_REASONS = frozenset((0x00, 0x92))
_SUBACK_REASONS = frozenset(
    (0x00, 0x01, 0x02, 0x80, 0x83, 0x87, 0x8F, 0x91, 0x97, 0x9E, 0xA1, 0xA2)
)
_SUBACK_RETURN_CODES = frozenset((0x00, 0x01, 0x02, SUBACK_FAILURE))
_UNSUBACK_REASONS = frozenset((0x00, 0x11, 0x80, 0x83, 0x87, 0x8F, 0x91))
_DISCONNECT_REASONS = frozenset(
    (0x00, 0x04, 0x80, 0x81, 0x82, 0x83, 0x87, 0x89, 0x8B, 0x8D, 0x8E, 0x8F)
    + (0x90, 0x93, 0x94, 0x95, 0x96, 0x97, 0x98, 0x99, 0x9A, 0x9B, 0x9C, 0x9D)
    + (0x9E, 0x9F, 0xA0, 0xA1, 0xA2)
)
_AUTH_REASONS = frozenset((0x00, 0x18, 0x19))


class MalformedPacket(ValueError):
    """
    The bytes received are not a packet this codec may accept: the
    connection must be closed (4.8 of MQTT 3.1.1, 4.13 of MQTT 5).

    @ivar reasonCode: the MQTT 5 reason code for the refusal, which an MQTT 5
        server sends in its CONNACK or DISCONNECT before closing:
        L{ReasonCode.MALFORMED_PACKET}, L{ReasonCode.PROTOCOL_ERROR},
        L{ReasonCode.PACKET_TOO_LARGE} or
        L{ReasonCode.UNSUPPORTED_PROTOCOL_VERSION} (an MQTT 3.1.1 server
        answers that one with CONNACK return code 1, [MQTT-3.1.2-2]).
    """

    def __init__(self, message, reasonCode=ReasonCode.MALFORMED_PACKET):
        super().__init__(message)
        self.reasonCode = reasonCode


def _malformed(message):
    return MalformedPacket(message, ReasonCode.MALFORMED_PACKET)


def _protocolError(message):
    return MalformedPacket(message, ReasonCode.PROTOCOL_ERROR)


class Property(enum.IntEnum):
    """
    MQTT 5 property identifiers (2.2.2.2).
    """

    PAYLOAD_FORMAT_INDICATOR = 0x01
    MESSAGE_EXPIRY_INTERVAL = 0x02
    CONTENT_TYPE = 0x03
    RESPONSE_TOPIC = 0x08
    CORRELATION_DATA = 0x09
    SUBSCRIPTION_IDENTIFIER = 0x0B
    SESSION_EXPIRY_INTERVAL = 0x11
    ASSIGNED_CLIENT_IDENTIFIER = 0x12
    SERVER_KEEP_ALIVE = 0x13
    AUTHENTICATION_METHOD = 0x15
    AUTHENTICATION_DATA = 0x16
    REQUEST_PROBLEM_INFORMATION = 0x17
    WILL_DELAY_INTERVAL = 0x18
    REQUEST_RESPONSE_INFORMATION = 0x19
    RESPONSE_INFORMATION = 0x1A
    SERVER_REFERENCE = 0x1C
    REASON_STRING = 0x1F
    RECEIVE_MAXIMUM = 0x21
    TOPIC_ALIAS_MAXIMUM = 0x22
    TOPIC_ALIAS = 0x23
    MAXIMUM_QOS = 0x24
    RETAIN_AVAILABLE = 0x25
    USER_PROPERTY = 0x26
    MAXIMUM_PACKET_SIZE = 0x27
    WILDCARD_SUBSCRIPTION_AVAILABLE = 0x28
    SUBSCRIPTION_IDENTIFIER_AVAILABLE = 0x29
    SHARED_SUBSCRIPTION_AVAILABLE = 0x2A


class PropertyType(enum.Enum):
    """
    The data types of property values (1.5).
    """

    BYTE = "byte"
    TWO_BYTE_INTEGER = "two-byte integer"
    FOUR_BYTE_INTEGER = "four-byte integer"
    VARIABLE_BYTE_INTEGER = "variable byte integer"
    UTF8_STRING = "UTF-8 string"
    BINARY_DATA = "binary data"
    UTF8_STRING_PAIR = "UTF-8 string pair"


# The enum members used for every message, as plain ints: looking up an
# enum's attribute costs more than what is done with it.
_CONNECT = int(PacketType.CONNECT)
_PUBLISH = int(PacketType.PUBLISH)
_AUTH = int(PacketType.AUTH)
_TOPIC_ALIAS = int(Property.TOPIC_ALIAS)

# Properties travel in the packets named here and in the Will Properties of
# a CONNECT, which this key stands for (0 is no packet type).
WILL_PROPERTIES = 0

_P = PacketType
_PROPERTY_TYPES_AND_PACKETS = {
    Property.PAYLOAD_FORMAT_INDICATOR: (
        PropertyType.BYTE,
        (_P.PUBLISH, WILL_PROPERTIES),
    ),
    Property.MESSAGE_EXPIRY_INTERVAL: (
        PropertyType.FOUR_BYTE_INTEGER,
        (_P.PUBLISH, WILL_PROPERTIES),
    ),
    Property.CONTENT_TYPE: (PropertyType.UTF8_STRING, (_P.PUBLISH, WILL_PROPERTIES)),
    Property.RESPONSE_TOPIC: (PropertyType.UTF8_STRING, (_P.PUBLISH, WILL_PROPERTIES)),
    Property.CORRELATION_DATA: (
        PropertyType.BINARY_DATA,
        (_P.PUBLISH, WILL_PROPERTIES),
    ),
    Property.SUBSCRIPTION_IDENTIFIER: (
        PropertyType.VARIABLE_BYTE_INTEGER,
        (_P.PUBLISH, _P.SUBSCRIBE),
    ),
    Property.SESSION_EXPIRY_INTERVAL: (
        PropertyType.FOUR_BYTE_INTEGER,
        (_P.CONNECT, _P.CONNACK, _P.DISCONNECT),
    ),
    Property.ASSIGNED_CLIENT_IDENTIFIER: (PropertyType.UTF8_STRING, (_P.CONNACK,)),
    Property.SERVER_KEEP_ALIVE: (PropertyType.TWO_BYTE_INTEGER, (_P.CONNACK,)),
    Property.AUTHENTICATION_METHOD: (
        PropertyType.UTF8_STRING,
        (_P.CONNECT, _P.CONNACK, _P.AUTH),
    ),
    Property.AUTHENTICATION_DATA: (
        PropertyType.BINARY_DATA,
        (_P.CONNECT, _P.CONNACK, _P.AUTH),
    ),
    Property.REQUEST_PROBLEM_INFORMATION: (PropertyType.BYTE, (_P.CONNECT,)),
    Property.WILL_DELAY_INTERVAL: (PropertyType.FOUR_BYTE_INTEGER, (WILL_PROPERTIES,)),
    Property.REQUEST_RESPONSE_INFORMATION: (PropertyType.BYTE, (_P.CONNECT,)),
    Property.RESPONSE_INFORMATION: (PropertyType.UTF8_STRING, (_P.CONNACK,)),
    Property.SERVER_REFERENCE: (PropertyType.UTF8_STRING, (_P.CONNACK, _P.DISCONNECT)),
    Property.REASON_STRING: (
        PropertyType.UTF8_STRING,
        (_P.CONNACK, _P.PUBACK, _P.PUBREC, _P.PUBREL, _P.PUBCOMP, _P.SUBACK)
        + (_P.UNSUBACK, _P.DISCONNECT, _P.AUTH),
    ),
    Property.RECEIVE_MAXIMUM: (PropertyType.TWO_BYTE_INTEGER, (_P.CONNECT, _P.CONNACK)),
    Property.TOPIC_ALIAS_MAXIMUM: (
        PropertyType.TWO_BYTE_INTEGER,
        (_P.CONNECT, _P.CONNACK),
    ),
    Property.TOPIC_ALIAS: (PropertyType.TWO_BYTE_INTEGER, (_P.PUBLISH,)),
    Property.MAXIMUM_QOS: (PropertyType.BYTE, (_P.CONNACK,)),
    Property.RETAIN_AVAILABLE: (PropertyType.BYTE, (_P.CONNACK,)),
    Property.USER_PROPERTY: (
        PropertyType.UTF8_STRING_PAIR,
        (_P.CONNECT, _P.CONNACK, _P.PUBLISH, WILL_PROPERTIES, _P.PUBACK, _P.PUBREC)
        + (_P.PUBREL, _P.PUBCOMP, _P.SUBSCRIBE, _P.SUBACK, _P.UNSUBSCRIBE)
        + (_P.UNSUBACK, _P.DISCONNECT, _P.AUTH),
    ),
    Property.MAXIMUM_PACKET_SIZE: (
        PropertyType.FOUR_BYTE_INTEGER,
        (_P.CONNECT, _P.CONNACK),
    ),
    Property.WILDCARD_SUBSCRIPTION_AVAILABLE: (PropertyType.BYTE, (_P.CONNACK,)),
    Property.SUBSCRIPTION_IDENTIFIER_AVAILABLE: (PropertyType.BYTE, (_P.CONNACK,)),
    Property.SHARED_SUBSCRIPTION_AVAILABLE: (PropertyType.BYTE, (_P.CONNACK,)),
}
del _P

# Each property's type, and the properties each packet (or the will) allows.
PROPERTY_TYPES = {
    identifier: propertyType
    for identifier, (propertyType, _) in _PROPERTY_TYPES_AND_PACKETS.items()
}
PROPERTIES_ALLOWED = {
    packet: frozenset(
        identifier
        for identifier, (_, packets) in _PROPERTY_TYPES_AND_PACKETS.items()
        if packet in packets
    )
    for packet in (WILL_PROPERTIES, *PacketType)
}
# The spec makes a second occurrence of any property a Protocol Error except
# User Property, and Subscription Identifier in a PUBLISH (3.3.2.3.8: one
# for each matching subscription); those are always lists here.
REPEATABLE_PROPERTIES = frozenset((Property.USER_PROPERTY, Property.SUBSCRIPTION_IDENTIFIER))
# The properties that cannot be 0, and the reason code for a 0: "It is a
# Protocol Error to include ... a value of 0" for Receive Maximum
# (3.1.2.11.3, 3.2.2.3.3), Maximum Packet Size (3.1.2.11.4, 3.2.2.3.6) and
# Subscription Identifier (3.3.2.3.8, 3.8.2.1.2); for a Topic Alias of 0
# [MQTT-3.3.2-8] the spec names no code, and Mosquitto's is Malformed Packet.
_NOT_ZERO = {
    Property.RECEIVE_MAXIMUM: ReasonCode.PROTOCOL_ERROR,
    Property.MAXIMUM_PACKET_SIZE: ReasonCode.PROTOCOL_ERROR,
    Property.SUBSCRIPTION_IDENTIFIER: ReasonCode.PROTOCOL_ERROR,
    Property.TOPIC_ALIAS: ReasonCode.MALFORMED_PACKET,
}
# The byte properties whose only values are 0 and 1, "a Protocol Error"
# otherwise, as each one's section says.  Payload Format Indicator is not
# one of them: the spec defines 0 and 1 and says nothing of other values,
# which Mosquitto passes on.
_ZERO_OR_ONE = frozenset(
    identifier
    for identifier, propertyType in PROPERTY_TYPES.items()
    if propertyType is PropertyType.BYTE and identifier != Property.PAYLOAD_FORMAT_INDICATOR
)


class _NoProperties(Mapping):
    """
    An immutable empty mapping, equal to C{{}}: the properties of a packet
    that has none, and of every MQTT 3.1.1 packet.  It is hashable, so the
    packet classes can have it as a default.
    """

    def __getitem__(self, key):
        raise KeyError(key)

    # Mapping's own would raise and catch a KeyError.
    def __contains__(self, key):
        return False

    def get(self, key, default=None):
        return default

    def __iter__(self):
        return iter(())

    def __len__(self):
        return 0

    def __hash__(self):
        return 0

    def __repr__(self):
        return "NO_PROPERTIES"


NO_PROPERTIES = _NoProperties()


# Packet objects.  They are plain data: equal when their fields are, so a
# decoded packet compares equal to the one that was encoded.


@dataclass(slots=True)
class Will:
    """
    The Will Message of a CONNECT (3.1.2.5 to 3.1.2.7, 3.1.3.2 to 3.1.3.4).
    """

    topic: str
    payload: bytes = b""
    qos: int = 0
    retain: bool = False
    properties: Mapping = NO_PROPERTIES


@dataclass(slots=True)
class Connect:
    """
    CONNECT (3.1).  C{protocolLevel} is the version it speaks: 4 for MQTT
    3.1.1, 5 for MQTT 5.  C{cleanStart} is 3.1.1's Clean Session flag.
    """

    clientId: str = ""
    protocolLevel: int = MQTT_3_1_1
    cleanStart: bool = True
    keepAlive: int = 0
    username: str | None = None
    password: bytes | None = None
    will: Will | None = None
    properties: Mapping = NO_PROPERTIES

    def encode(self, version=None):
        """
        @param version: if given, the version the caller expects; the packet
            is encoded in its own C{protocolLevel}, which must match it.
        """
        if version is not None and version != self.protocolLevel:
            raise ValueError(f"CONNECT speaks protocol level {self.protocolLevel}, not {version}")
        version = _checkVersion(self.protocolLevel)
        will = self.will
        flags = (
            (self.username is not None) << 7
            | (self.password is not None) << 6
            | bool(self.cleanStart) << 1
        )
        if will is not None:
            flags |= 0x04 | _checkQos(will.qos) << 3 | bool(will.retain) << 5
        if self.password is not None and self.username is None and version == MQTT_3_1_1:
            raise ValueError("MQTT 3.1.1 sends no password without a username")
        parts = [
            b"\x00\x04MQTT",
            bytes((version, flags)),
            _encodeTwoByte(self.keepAlive, "keep alive"),
        ]
        if version == MQTT_5:
            parts.append(encodeProperties(self.properties, PacketType.CONNECT))
        parts.append(_encodeString(self.clientId))
        if will is not None:
            if version == MQTT_5:
                parts.append(encodeProperties(will.properties, WILL_PROPERTIES))
            parts.append(_encodeTopicName(will.topic))
            parts.append(_encodeBinary(will.payload))
        if self.username is not None:
            parts.append(_encodeString(self.username))
        if self.password is not None:
            parts.append(_encodeBinary(self.password))
        return _packet(0x10, b"".join(parts))


@dataclass(slots=True)
class ConnAck:
    """
    CONNACK (3.2).  C{reasonCode} is a L{ReasonCode} in MQTT 5, a
    L{ConnectReturnCode} in MQTT 3.1.1.
    """

    sessionPresent: bool = False
    reasonCode: int = 0
    properties: Mapping = NO_PROPERTIES

    def encode(self, version=MQTT_5):
        _checkVersion(version)
        allowed = _CONNACK_REASONS if version == MQTT_5 else _CONNACK_RETURN_CODES
        _checkReason(self.reasonCode, allowed, PacketType.CONNACK)
        if self.sessionPresent and self.reasonCode:
            # [MQTT-3.2.2-4] (3.1.1), [MQTT-3.2.2-6] (5).
            raise ValueError("a refusing CONNACK has no session present")
        body = bytes((bool(self.sessionPresent), self.reasonCode))
        if version == MQTT_5:
            body += encodeProperties(self.properties, PacketType.CONNACK)
        return _packet(0x20, body)


@dataclass(slots=True)
class Publish:
    """
    PUBLISH (3.3).  C{packetId} is None at QoS 0.  An MQTT 5 PUBLISH may
    carry an empty C{topic} and a L{Property.TOPIC_ALIAS}; mapping aliases
    is the connection's business.
    """

    topic: str
    payload: bytes = b""
    qos: int = 0
    retain: bool = False
    dup: bool = False
    packetId: int | None = None
    properties: Mapping = NO_PROPERTIES

    def encode(self, version=MQTT_5):
        if _checkVersion(version) == MQTT_5:
            properties = encodeProperties(self.properties, _PUBLISH)
        else:
            properties = None
        if not self.topic and not (properties and _TOPIC_ALIAS in self.properties):
            raise ValueError("a PUBLISH names its topic or, in MQTT 5, a topic alias")
        header = encodePublishHeader(
            _topicNameBytes(self.topic),
            len(self.payload),
            self.qos,
            self.packetId,
            self.retain,
            self.dup,
            properties,
        )
        return header + self.payload


@dataclass(slots=True)
class _Acknowledgement:
    """
    The packets that are a packet identifier, and in MQTT 5 a reason code
    and properties, both left out when they are Success and none (3.4.2.1).
    """

    packetId: int
    reasonCode: int = 0
    properties: Mapping = NO_PROPERTIES

    def encode(self, version=MQTT_5):
        return _packet(
            self._FIRST_BYTE,
            _encodePacketId(self.packetId) + _encodeOptionalReason(self, version),
        )


@dataclass(slots=True)
class PubAck(_Acknowledgement):
    """PUBACK (3.4): QoS 1 delivery."""

    _TYPE = PacketType.PUBACK
    _FIRST_BYTE = 0x40
    _REASONS = _PUBACK_REASONS


@dataclass(slots=True)
class PubRec(_Acknowledgement):
    """PUBREC (3.5): QoS 2 delivery, first part."""

    _TYPE = PacketType.PUBREC
    _FIRST_BYTE = 0x50
    _REASONS = _PUBACK_REASONS


@dataclass(slots=True)
class PubRel(_Acknowledgement):
    """PUBREL (3.6): QoS 2 delivery, second part."""

    _TYPE = PacketType.PUBREL
    _FIRST_BYTE = 0x62
    _REASONS = _PUBREL_REASONS


@dataclass(slots=True)
class PubComp(_Acknowledgement):
    """PUBCOMP (3.7): QoS 2 delivery, third part."""

    _TYPE = PacketType.PUBCOMP
    _FIRST_BYTE = 0x70
    _REASONS = _PUBREL_REASONS


@dataclass(slots=True)
class Subscription:
    """
    A topic filter and its Subscription Options (3.8.3.1); MQTT 3.1.1 has
    only the QoS.  C{retainHandling}: 0 send retained messages at subscribe,
    1 only if the subscription is new, 2 never.
    """

    topicFilter: str
    qos: int = 0
    noLocal: bool = False
    retainAsPublished: bool = False
    retainHandling: int = 0


@dataclass(slots=True)
class Subscribe:
    """
    SUBSCRIBE (3.8).
    """

    packetId: int
    subscriptions: list
    properties: Mapping = NO_PROPERTIES

    def encode(self, version=MQTT_5):
        version = _checkVersion(version)
        if not self.subscriptions:
            raise ValueError("a SUBSCRIBE has at least one topic filter")
        parts = [_encodePacketId(self.packetId)]
        if version == MQTT_5:
            parts.append(encodeProperties(self.properties, PacketType.SUBSCRIBE))
        for subscription in self.subscriptions:
            options = _checkQos(subscription.qos)
            if version == MQTT_5:
                if subscription.retainHandling not in (0, 1, 2):
                    raise ValueError(f"retain handling {subscription.retainHandling!r}")
                options |= (
                    bool(subscription.noLocal) << 2
                    | bool(subscription.retainAsPublished) << 3
                    | subscription.retainHandling << 4
                )
            elif (
                subscription.noLocal
                or subscription.retainAsPublished
                or subscription.retainHandling
            ):
                raise ValueError("MQTT 3.1.1 subscriptions have a QoS only")
            parts.append(_encodeTopicFilter(subscription.topicFilter))
            parts.append(bytes((options,)))
        return _packet(0x82, b"".join(parts))


@dataclass(slots=True)
class SubAck:
    """
    SUBACK (3.9): one reason code (3.1.1: return code) per topic filter.
    """

    packetId: int
    reasonCodes: list
    properties: Mapping = NO_PROPERTIES

    def encode(self, version=MQTT_5):
        allowed = _SUBACK_REASONS if version == MQTT_5 else _SUBACK_RETURN_CODES
        return _encodeAcknowledgementList(self, version, 0x90, PacketType.SUBACK, allowed)


@dataclass(slots=True)
class Unsubscribe:
    """
    UNSUBSCRIBE (3.10).
    """

    packetId: int
    topicFilters: list
    properties: Mapping = NO_PROPERTIES

    def encode(self, version=MQTT_5):
        version = _checkVersion(version)
        if not self.topicFilters:
            raise ValueError("an UNSUBSCRIBE has at least one topic filter")
        parts = [_encodePacketId(self.packetId)]
        if version == MQTT_5:
            parts.append(encodeProperties(self.properties, PacketType.UNSUBSCRIBE))
        parts.extend(_encodeTopicFilter(topicFilter) for topicFilter in self.topicFilters)
        return _packet(0xA2, b"".join(parts))


@dataclass(slots=True)
class UnsubAck:
    """
    UNSUBACK (3.11): in MQTT 5, one reason code per topic filter; in MQTT
    3.1.1, the packet identifier only (C{reasonCodes} is empty).
    """

    packetId: int
    reasonCodes: list = field(default_factory=list)
    properties: Mapping = NO_PROPERTIES

    def encode(self, version=MQTT_5):
        if _checkVersion(version) == MQTT_3_1_1:
            if self.reasonCodes or self.properties:
                raise ValueError("MQTT 3.1.1's UNSUBACK is a packet identifier only")
            return _packet(0xB0, _encodePacketId(self.packetId))
        return _encodeAcknowledgementList(
            self, version, 0xB0, PacketType.UNSUBACK, _UNSUBACK_REASONS
        )


@dataclass(slots=True)
class PingReq:
    """PINGREQ (3.12)."""

    def encode(self, version=MQTT_5):
        return b"\xc0\x00"


@dataclass(slots=True)
class PingResp:
    """PINGRESP (3.13)."""

    def encode(self, version=MQTT_5):
        return b"\xd0\x00"


@dataclass(slots=True)
class _ReasonAndProperties:
    """
    The packets that are, in MQTT 5, a reason code and properties, both left
    out when they are Success and none (3.14.2.1, 3.15.2.1).
    """

    reasonCode: int = 0
    properties: Mapping = NO_PROPERTIES

    def encode(self, version=MQTT_5):
        if self._TYPE == PacketType.AUTH and version == MQTT_3_1_1:
            raise ValueError("MQTT 3.1.1 has no AUTH")
        return _packet(self._FIRST_BYTE, _encodeOptionalReason(self, version))


@dataclass(slots=True)
class Disconnect(_ReasonAndProperties):
    """DISCONNECT (3.14)."""

    _TYPE = PacketType.DISCONNECT
    _FIRST_BYTE = 0xE0
    _REASONS = _DISCONNECT_REASONS


@dataclass(slots=True)
class Auth(_ReasonAndProperties):
    """AUTH (3.15), MQTT 5 only."""

    _TYPE = PacketType.AUTH
    _FIRST_BYTE = 0xF0
    _REASONS = _AUTH_REASONS


# Encoding.


def _checkVersion(version):
    if version not in SUPPORTED_VERSIONS:
        raise ValueError(f"protocol level {version!r} is neither 4 (3.1.1) nor 5")
    return version


def _checkQos(qos):
    if qos not in (0, 1, 2):
        raise ValueError(f"QoS {qos!r}")
    return qos


def _checkReason(reasonCode, allowed, packetType):
    if reasonCode not in allowed:
        raise ValueError(f"{packetType.name} cannot carry reason code {reasonCode!r}")


def encodeVariableByteInteger(value):
    """
    The Variable Byte Integer encoding of C{value} (1.5.5): seven bits a
    byte, least significant first, in the fewest bytes [MQTT-1.5.5-1].
    """
    if value < 0x80:
        if value < 0:
            raise ValueError(f"variable byte integer {value}")
        return bytes((value,))
    if value > MAXIMUM_VARIABLE_BYTE_INTEGER:
        raise ValueError(f"variable byte integer {value} needs more than four bytes")
    encoded = bytearray()
    while value >= 0x80:
        encoded.append(value & 0x7F | 0x80)
        value >>= 7
    encoded.append(value)
    return bytes(encoded)


def _packet(firstByte, body):
    return bytes((firstByte,)) + encodeVariableByteInteger(len(body)) + body


def _encodeTwoByte(value, what):
    if not 0 <= value <= _MAXIMUM_TWO_BYTE:
        raise ValueError(f"{what} {value!r} does not fit two bytes")
    return value.to_bytes(2, "big")


def _encodePacketId(packetId):
    if packetId is None or not 0 < packetId <= _MAXIMUM_TWO_BYTE:
        raise ValueError(f"packet identifier {packetId!r} is not 1 to 65535")
    return packetId.to_bytes(2, "big")


def _encodeBinary(data):
    if len(data) > _MAXIMUM_TWO_BYTE:
        raise ValueError(f"{len(data)} bytes do not fit a two-byte length")
    return len(data).to_bytes(2, "big") + data


def _stringBytes(text):
    if "\x00" in text:
        # [MQTT-1.5.4-2]
        raise ValueError(f"{text!r} contains U+0000")
    # str.encode refuses lone surrogates [MQTT-1.5.4-1].
    encoded = text.encode("utf-8")
    if len(encoded) > _MAXIMUM_TWO_BYTE:
        raise ValueError(f"a {len(encoded)}-byte string does not fit a two-byte length")
    return encoded


def _encodeString(text):
    return _encodeBinary(_stringBytes(text))


def _topicNameBytes(topic):
    if "+" in topic or "#" in topic:
        raise ValueError(f"topic name {topic!r} has a wildcard")
    return _stringBytes(topic)


def _encodeTopicName(topic):
    if not topic:
        raise ValueError("an empty topic name")
    return _encodeBinary(_topicNameBytes(topic))


def _encodeTopicFilter(topicFilter):
    if not topicFilter:
        raise ValueError("an empty topic filter")
    return _encodeString(topicFilter)


def _encodeOptionalReason(packet, version):
    """
    The end of a packet whose MQTT 5 reason code and properties are left out
    when they are Success and none (3.4.2.1, 3.14.2.1, 3.15.2.1); MQTT 3.1.1
    has neither.
    """
    packetType = packet._TYPE
    if _checkVersion(version) == MQTT_3_1_1:
        if packet.reasonCode or packet.properties:
            raise ValueError(f"MQTT 3.1.1's {packetType.name} has no reason or properties")
        return b""
    _checkReason(packet.reasonCode, packet._REASONS, packetType)
    if packet.properties:
        return bytes((packet.reasonCode,)) + encodeProperties(packet.properties, packetType)
    if packet.reasonCode:
        return bytes((packet.reasonCode,))
    return b""


def _encodeAcknowledgementList(packet, version, firstByte, packetType, allowed):
    version = _checkVersion(version)
    if not packet.reasonCodes:
        raise ValueError(f"a {packetType.name} has a code for each topic filter")
    for reasonCode in packet.reasonCodes:
        _checkReason(reasonCode, allowed, packetType)
    parts = [_encodePacketId(packet.packetId)]
    if version == MQTT_5:
        parts.append(encodeProperties(packet.properties, packetType))
    elif packet.properties:
        raise ValueError(f"MQTT 3.1.1's {packetType.name} has no properties")
    parts.append(bytes(packet.reasonCodes))
    return _packet(firstByte, b"".join(parts))


def _encodePropertyValue(identifier, propertyType, value):
    if propertyType is PropertyType.BYTE:
        if not 0 <= value <= 0xFF:
            raise ValueError(f"{identifier.name} {value!r} does not fit a byte")
        return bytes((value,))
    if propertyType is PropertyType.TWO_BYTE_INTEGER:
        return _encodeTwoByte(value, identifier.name)
    if propertyType is PropertyType.FOUR_BYTE_INTEGER:
        if not 0 <= value <= 0xFFFFFFFF:
            raise ValueError(f"{identifier.name} {value!r} does not fit four bytes")
        return value.to_bytes(4, "big")
    if propertyType is PropertyType.VARIABLE_BYTE_INTEGER:
        return encodeVariableByteInteger(value)
    if propertyType is PropertyType.UTF8_STRING:
        return _encodeString(value)
    if propertyType is PropertyType.BINARY_DATA:
        return _encodeBinary(value)
    name, text = value
    return _encodeString(name) + _encodeString(text)


def encodeProperties(properties, packetType):
    """
    The Properties of an MQTT 5 packet (2.2.2): their length, then each
    property's identifier and value.

    @param properties: a mapping from L{Property} to its value; the values
        of L{REPEATABLE_PROPERTIES} are lists.
    @param packetType: the L{PacketType} that carries them, or
        L{WILL_PROPERTIES}.
    @raise ValueError: for a property the packet does not allow, or a value
        its type cannot hold.
    """
    if properties is NO_PROPERTIES or not properties:
        return b"\x00"
    allowed = PROPERTIES_ALLOWED[packetType]
    parts = []
    for identifier, value in properties.items():
        if identifier not in allowed:
            raise ValueError(f"{packetType!r} cannot carry property {identifier!r}")
        identifier = Property(identifier)
        propertyType = PROPERTY_TYPES[identifier]
        if identifier in REPEATABLE_PROPERTIES:
            values = value
            if (
                identifier == Property.SUBSCRIPTION_IDENTIFIER
                and packetType != PacketType.PUBLISH
                and len(values) != 1
            ):
                raise ValueError("a SUBSCRIBE carries one subscription identifier")
        else:
            values = (value,)
        for one in values:
            if identifier in _NOT_ZERO and one == 0:
                raise ValueError(f"{identifier.name} cannot be 0")
            if identifier in _ZERO_OR_ONE and one not in (0, 1):
                raise ValueError(f"{identifier.name} is 0 or 1, not {one!r}")
            parts.append(bytes((identifier,)))
            parts.append(_encodePropertyValue(identifier, propertyType, one))
    body = b"".join(parts)
    return encodeVariableByteInteger(len(body)) + body


def encodeBareAcknowledgement(packetClass, packetId):
    """
    The bytes of a PUBACK, PUBREC, PUBREL or PUBCOMP that is only its packet
    identifier (Success, no properties), the same in MQTT 3.1.1 and 5, for
    a sender that acks every message without building a packet.

    @param packetClass: L{PubAck}, L{PubRec}, L{PubRel} or L{PubComp}.
    """
    return bytes((packetClass._FIRST_BYTE, 2)) + _encodePacketId(packetId)


def encodeBareAcknowledgements(packetClass, packetIds):
    """
    The bytes of bare acknowledgements (see L{encodeBareAcknowledgement})
    of several packet identifiers, in their order: four bytes each, its
    first byte, its Remaining Length 2 and its identifier.
    """
    tag = packetClass._FIRST_BYTE << 24 | 2 << 16
    return struct.pack(f">{len(packetIds)}I", *[tag | packetId for packetId in packetIds])


def encodePublishHeader(
    topic, payloadLength, qos=0, packetId=None, retain=False, dup=False, properties=None
):
    """
    The bytes of a PUBLISH before its payload, for a sender that writes the
    payload it already has after them, without building a L{Publish}.

    @param topic: the topic name, UTF-8 encoded and valid (the caller
        checked it once, not for every subscriber).
    @param payloadLength: the length of the payload that follows.
    @param packetId: the packet identifier, for QoS 1 and 2.
    @param properties: None for MQTT 3.1.1; for MQTT 5, the encoded
        properties (L{encodeProperties}, or C{b"\\x00"} for none).
    """
    variable = len(topic).to_bytes(2, "big") + topic
    if qos:
        if qos not in (1, 2):
            raise ValueError(f"QoS {qos!r}")
        variable += _encodePacketId(packetId)
    elif dup:
        # [MQTT-3.3.1-2]
        raise ValueError("a QoS 0 PUBLISH is never a duplicate")
    if properties is not None:
        variable += properties
    remaining = len(variable) + payloadLength
    firstByte = 0x30 | dup << 3 | qos << 1 | retain
    if remaining < 0x80:
        return bytes((firstByte, remaining)) + variable
    return bytes((firstByte,)) + encodeVariableByteInteger(remaining) + variable


# Decoding.


class _Reader:
    """
    Reads the fields of one packet's body, refusing to read past its end.
    """

    __slots__ = ("data", "position", "end")

    def __init__(self, data, position, end):
        self.data = data
        self.position = position
        self.end = end

    def left(self):
        return self.end - self.position

    def byte(self):
        position = self.position
        if position >= self.end:
            raise _malformed("the packet ends inside a field")
        self.position = position + 1
        return self.data[position]

    def twoByteInteger(self):
        position = self.position
        if position + 2 > self.end:
            raise _malformed("the packet ends inside a two-byte integer")
        self.position = position + 2
        return self.data[position] << 8 | self.data[position + 1]

    def fourByteInteger(self):
        position = self.position
        if position + 4 > self.end:
            raise _malformed("the packet ends inside a four-byte integer")
        self.position = position + 4
        return int.from_bytes(self.data[position : position + 4], "big")

    def variableByteInteger(self):
        value = 0
        for shift in (0, 7, 14, 21):
            byte = self.byte()
            value |= (byte & 0x7F) << shift
            if not byte & 0x80:
                if byte == 0 and shift:
                    # [MQTT-1.5.5-1]: the fewest bytes.
                    raise _malformed("a variable byte integer has a useless byte")
                return value
        raise _malformed("a variable byte integer longer than four bytes")

    def packetId(self):
        packetId = self.twoByteInteger()
        if not packetId:
            # [MQTT-2.3.1-1] (3.1.1), [MQTT-2.2.1-3] (5).
            raise _protocolError("packet identifier 0")
        return packetId

    def binary(self):
        length = self.twoByteInteger()
        position = self.position
        if position + length > self.end:
            raise _malformed("the packet ends inside a string or binary field")
        self.position = position + length
        return self.data[position : position + length]

    def string(self):
        return _decodeString(self.binary())

    def topicName(self):
        return _checkTopicName(self.string())

    def topicFilter(self):
        topicFilter = self.string()
        if not topicFilter:
            # [MQTT-4.7.3-1]
            raise _protocolError("an empty topic filter")
        return topicFilter

    def rest(self):
        data = self.data[self.position : self.end]
        self.position = self.end
        return data

    def properties(self, packetType):
        """
        Read the Properties of an MQTT 5 packet (2.2.2).
        """
        length = self.variableByteInteger()
        if not length:
            return NO_PROPERTIES
        packetEnd = self.end
        propertiesEnd = self.position + length
        if propertiesEnd > packetEnd:
            raise _malformed("the properties run past the packet")
        self.end = propertiesEnd
        allowed = PROPERTIES_ALLOWED[packetType]
        properties = {}
        while self.position < propertiesEnd:
            identifier = self.variableByteInteger()
            if identifier not in allowed:
                # 2.2.2.2: an identifier not valid for its packet type.
                raise _malformed(f"property 0x{identifier:02x} in a {_packetName(packetType)}")
            identifier = Property(identifier)
            value = self._propertyValue(PROPERTY_TYPES[identifier])
            if value == 0 and identifier in _NOT_ZERO:
                raise MalformedPacket(f"{identifier.name} 0", _NOT_ZERO[identifier])
            if identifier in _ZERO_OR_ONE and value > 1:
                raise _protocolError(f"{identifier.name} {value}")
            if identifier in REPEATABLE_PROPERTIES:
                properties.setdefault(identifier, []).append(value)
            elif identifier in properties:
                raise _protocolError(f"{identifier.name} twice")
            else:
                properties[identifier] = value
        if (
            packetType != PacketType.PUBLISH
            and len(properties.get(Property.SUBSCRIPTION_IDENTIFIER, ())) > 1
        ):
            # 3.8.2.1.2
            raise _protocolError("SUBSCRIPTION_IDENTIFIER twice")
        self.end = packetEnd
        return properties

    def _propertyValue(self, propertyType):
        if propertyType is PropertyType.BYTE:
            return self.byte()
        if propertyType is PropertyType.TWO_BYTE_INTEGER:
            return self.twoByteInteger()
        if propertyType is PropertyType.FOUR_BYTE_INTEGER:
            return self.fourByteInteger()
        if propertyType is PropertyType.VARIABLE_BYTE_INTEGER:
            return self.variableByteInteger()
        if propertyType is PropertyType.UTF8_STRING:
            return self.string()
        if propertyType is PropertyType.BINARY_DATA:
            return self.binary()
        # [MQTT-1.5.7-1]: both strings of a pair are UTF-8 strings.
        return (self.string(), self.string())

    def expectEnd(self, what):
        if self.position != self.end:
            raise _malformed(f"{self.end - self.position} bytes after the {what}")


def _packetName(packetType):
    return "will" if packetType == WILL_PROPERTIES else PacketType(packetType).name


def _decodeString(raw):
    """
    A UTF-8 Encoded String's text (1.5.4).  Python's strict UTF-8 decoder
    refuses ill-formed UTF-8, encoded surrogates and overlong forms
    [MQTT-1.5.4-1] and keeps a leading U+FEFF [MQTT-1.5.4-3].
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise _malformed("a string is not well-formed UTF-8") from None
    if "\x00" in text:
        # [MQTT-1.5.4-2]
        raise _malformed("a string contains U+0000")
    return text


def _checkTopicName(topic):
    if "+" in topic or "#" in topic:
        # [MQTT-3.3.2-2], [MQTT-4.7.1-1] (3.1.1).  The spec names no reason
        # code for it; Mosquitto's is Protocol Error.
        raise _protocolError(f"topic name {topic!r} has a wildcard")
    if not topic:
        # [MQTT-4.7.3-1]
        raise _protocolError("an empty topic name")
    return topic


# Pieces of a stream shorter than this are gathered in one buffer as they
# are fed to an MQTTDecoder.
_SMALL_PIECE = 512


class MQTTDecoder:
    """
    Packets from a byte stream, read in pieces of any size.

    C{feed(data)} buffers C{data} and returns the decoder itself, an
    iterator over the packets complete so far::

        for packet in decoder.feed(data):
            handle(packet)

    Iteration raises L{MalformedPacket} when it reaches a packet it cannot
    accept, after yielding those before it; the decoder then refuses
    everything (the connection must close).  Stopping an iteration early
    keeps the rest buffered for the next one.

    A server's decoder is made without a version: the first packet must be
    a CONNECT [MQTT-3.1.0-1], whose protocol level sets C{version}, and a
    second CONNECT is a Protocol Error [MQTT-3.1.0-2].  A client's decoder is
    told the version it asked for.

    @ivar version: 4 (MQTT 3.1.1), 5 (MQTT 5), or None until a CONNECT said.
        It is set as soon as the CONNECT's protocol level is read, so a
        server can answer a refused CONNECT in the client's version.
    @ivar maxPacketSize: the largest packet accepted, in bytes, all headers
        included (MQTT 5's Maximum Packet Size, 3.1.2.11.4); a larger one is
        refused with L{ReasonCode.PACKET_TOO_LARGE} as soon as its fixed
        header is read, before its body is buffered.
    @ivar publishFields: whether a PUBLISH comes as the tuple of its
        L{Publish}'s fields, in their order, rather than a L{Publish}, and a
        run of PUBACKs that are only their packet identifiers as the list
        of those identifiers: for a broker, which reads one for every
        message and keeps no packet.
    """

    def __init__(self, version=None, maxPacketSize=MAXIMUM_PACKET_SIZE, publishFields=False):
        if version is not None:
            _checkVersion(version)
        self.version = version
        self.maxPacketSize = maxPacketSize
        self.publishFields = publishFields
        self._connectExpected = version is None
        self._connectAllowed = True
        # The bytes being parsed and where parsing is in them; bytes that
        # arrived since are kept apart in _pending and joined only once a
        # packet can be complete, so that a large packet read in many small
        # pieces is copied once, not once a piece.
        self._buffer = b""
        self._position = 0
        self._pending = []
        self._pendingSize = 0
        self._needed = 1
        self._error = None

    def feed(self, data):
        """
        Buffer C{data}, the next bytes of the stream.

        @return: this decoder, to iterate over the packets now complete.
        """
        # A refused stream is over: what follows is not kept.
        if data and self._error is None:
            pending = self._pending
            if len(data) >= _SMALL_PIECE:
                pending.append(data)
            elif pending and type(pending[-1]) is bytearray:
                # Small pieces (a packet sent a few bytes a segment) are
                # gathered into one: kept apart, each would cost some 40
                # bytes of memory beyond its own.
                pending[-1] += data
            else:
                pending.append(bytearray(data))
            self._pendingSize += len(data)
        return self

    @property
    def buffered(self):
        """
        The bytes fed and not yet read as packets: those of a packet not
        complete yet (or of packets not read yet).
        """
        return len(self._buffer) - self._position + self._pendingSize

    def __iter__(self):
        return self

    def __next__(self):
        if self._error is not None:
            raise self._error
        try:
            packet = self._nextPacket()
        except MalformedPacket as error:
            self._error = error
            self._buffer = b""
            self._pending = []
            self._pendingSize = 0
            raise
        if packet is None:
            raise StopIteration
        return packet

    def nextPacket(self):
        """
        The next complete packet, or None until more bytes are fed.

        @raise MalformedPacket: the stream's next packet breaks the spec.
        """
        return next(self, None)

    def _nextPacket(self):
        buffer = self._buffer
        position = self._position
        available = len(buffer) - position
        if available + self._pendingSize < self._needed:
            if not available:
                # Let go of the last read's bytes, all parsed.
                self._buffer = b""
                self._position = 0
            return None
        if self._pending:
            if available:
                self._pending.insert(0, buffer[position:])
            buffer = self._buffer = b"".join(self._pending)
            position = self._position = 0
            available = len(buffer)
            self._pending = []
            self._pendingSize = 0

        firstByte = buffer[position]
        if firstByte == _PUBACK_FIRST_BYTE and self.publishFields and not self._connectAllowed:
            packetIds = self._barePubAcks(buffer, position)
            if packetIds:
                return packetIds
        packetType = firstByte >> 4
        flags = firstByte & 0x0F
        if self._connectAllowed:
            if self._connectExpected and packetType != _CONNECT:
                # [MQTT-3.1.0-1]
                raise _protocolError("the first packet is not a CONNECT")
        elif packetType == _CONNECT:
            # [MQTT-3.1.0-2]
            raise _protocolError("a second CONNECT")
        if packetType != _PUBLISH:
            # PUBLISH's flags are its DUP, QoS and RETAIN, checked with its body.
            self._checkFixedHeader(packetType, flags)

        # The Remaining Length (2.2.3), one to four bytes; most often one.
        if available < 2:
            self._needed = 2
            return None
        remaining = buffer[position + 1]
        index = position + 2
        if remaining & 0x80:
            remaining &= 0x7F
            for shift in (7, 14, 21):
                if index - position >= available:
                    self._needed = available + 1
                    return None
                byte = buffer[index]
                index += 1
                remaining |= (byte & 0x7F) << shift
                if not byte & 0x80:
                    break
            else:
                raise _malformed("a remaining length longer than four bytes")
            if byte == 0 and self.version == MQTT_5:
                # [MQTT-1.5.5-1]
                raise _malformed("a remaining length with a useless byte")
        size = index - position + remaining
        if size > self.maxPacketSize:
            raise MalformedPacket(
                f"a {size}-byte packet, over the {self.maxPacketSize}-byte limit",
                ReasonCode.PACKET_TOO_LARGE,
            )
        if packetType in _FIXED_REMAINING_LENGTH_TYPES:
            self._checkFixedLength(packetType, remaining)
        if size > available:
            self._needed = size
            return None

        end = position + size
        self._position = end
        self._needed = 1
        if self._connectAllowed:
            self._connectExpected = self._connectAllowed = False
        if packetType == _PUBLISH:
            return self._publish(flags, buffer, index, end)
        if remaining == 2 and packetType in _ACKNOWLEDGEMENTS:
            # Only a packet identifier: how a client acks most messages.
            packetId = buffer[index] << 8 | buffer[index + 1]
            if not packetId:
                # [MQTT-2.3.1-1] (3.1.1), [MQTT-2.2.1-3] (5).
                raise _protocolError("packet identifier 0")
            return _ACKNOWLEDGEMENTS[packetType](packetId)
        return _DECODERS[packetType](self, flags, _Reader(buffer, index, end))

    def _checkFixedHeader(self, packetType, flags):
        expected = _FLAGS.get(packetType)
        if expected is None or (packetType == _AUTH and self.version != MQTT_5):
            # 2.1.2: 0 is reserved, and so is 15 in MQTT 3.1.1.
            raise _malformed(f"reserved packet type {packetType}")
        if flags != expected:
            # [MQTT-2.2.2-1] and [MQTT-2.2.2-2] (3.1.1), [MQTT-2.1.3-1] (5)
            raise _malformed(f"reserved flags 0x{flags:x} of packet type {packetType}")

    def _barePubAcks(self, buffer, position):
        """
        Read the run of PUBACKs that are only their packet identifiers from
        C{position} on, as a client acks most messages: four bytes each.

        @return: their packet identifiers; none if the packet at
            C{position} is another (or not complete, or of identifier 0:
            L{_nextPacket} reads it, or refuses it).
        """
        packetIds = []
        end = len(buffer) - 3
        while (
            position < end and buffer[position] == _PUBACK_FIRST_BYTE and buffer[position + 1] == 2
        ):
            packetId = buffer[position + 2] << 8 | buffer[position + 3]
            if not packetId:
                break
            packetIds.append(packetId)
            position += 4
        if packetIds:
            self._position = position
            self._needed = 1
        return packetIds

    def _checkFixedLength(self, packetType, remaining):
        fixedLengths = (
            _FIXED_REMAINING_LENGTHS_5 if self.version == MQTT_5 else _FIXED_REMAINING_LENGTHS_3_1_1
        )
        expected = fixedLengths.get(packetType)
        if expected is not None and remaining != expected:
            raise _malformed(f"packet type {packetType} with remaining length {remaining}")

    def _publish(self, flags, data, start, end):
        """
        PUBLISH (3.3), the packet a broker decodes most, without a reader.
        """
        qos = flags >> 1 & 0x03
        if qos == 3:
            # [MQTT-3.3.1-4]
            raise _malformed("QoS 3")
        dup = flags & 0x08
        if dup and not qos:
            # [MQTT-3.3.1-2]
            raise _malformed("a QoS 0 PUBLISH marked duplicate")
        if end - start < 2:
            raise _malformed("the packet ends inside the topic name")
        position = start + 2 + (data[start] << 8 | data[start + 1])
        if position > end:
            raise _malformed("the packet ends inside the topic name")
        # The checks of _decodeString and _checkTopicName, inline: this runs
        # for every message the broker receives.  When one fails, those
        # functions say why.
        try:
            topic = data[start + 2 : position].decode("utf-8")
        except UnicodeDecodeError:
            topic = None
        if topic is None or "+" in topic or "#" in topic or "\x00" in topic:
            _checkTopicName(_decodeString(data[start + 2 : position]))
        packetId = None
        if qos:
            if position + 2 > end:
                raise _malformed("the packet ends inside the packet identifier")
            packetId = data[position] << 8 | data[position + 1]
            if not packetId:
                # [MQTT-2.3.1-1] (3.1.1), [MQTT-2.2.1-3] (5)
                raise _protocolError("packet identifier 0")
            position += 2
        properties = NO_PROPERTIES
        if self.version == MQTT_5:
            if position < end and data[position] == 0:
                position += 1
            else:
                reader = _Reader(data, position, end)
                properties = reader.properties(_PUBLISH)
                position = reader.position
            if not topic and _TOPIC_ALIAS not in properties:
                # 3.3.2.1: a zero-length topic needs a Topic Alias.
                raise _protocolError("an empty topic name without a topic alias")
        elif not topic:
            # [MQTT-4.7.3-1]
            raise _protocolError("an empty topic name")
        fields = (topic, data[position:end], qos, flags & 0x01 == 1, dup != 0, packetId, properties)
        return fields if self.publishFields else Publish(*fields)

    def _connect(self, flags, reader):
        """
        CONNECT (3.1).
        """
        protocolName = reader.string()
        protocolLevel = reader.byte()
        if protocolName != "MQTT":
            if protocolName == "MQIsdp":
                # MQTT 3.1, which this codec does not speak.
                raise MalformedPacket("MQTT 3.1 (MQIsdp)", ReasonCode.UNSUPPORTED_PROTOCOL_VERSION)
            # [MQTT-3.1.2-1]
            raise _protocolError(f"protocol name {protocolName!r}")
        if protocolLevel not in SUPPORTED_VERSIONS:
            # [MQTT-3.1.2-2]
            raise MalformedPacket(
                f"protocol level {protocolLevel}",
                ReasonCode.UNSUPPORTED_PROTOCOL_VERSION,
            )
        version = self.version = protocolLevel
        connectFlags = reader.byte()
        if connectFlags & 0x01:
            # [MQTT-3.1.2-3]
            raise _malformed("the reserved CONNECT flag is set")
        willFlag = connectFlags & 0x04
        willQos = connectFlags >> 3 & 0x03
        willRetain = connectFlags & 0x20
        if not willFlag and (willQos or willRetain):
            # [MQTT-3.1.2-11], [MQTT-3.1.2-13] (5); [MQTT-3.1.2-13],
            # [MQTT-3.1.2-15] (3.1.1)
            raise _malformed("will QoS or retain without a will")
        if willQos == 3:
            # [MQTT-3.1.2-12] (5), [MQTT-3.1.2-14] (3.1.1)
            raise _malformed("will QoS 3")
        hasUsername = connectFlags & 0x80
        hasPassword = connectFlags & 0x40
        if hasPassword and not hasUsername and version == MQTT_3_1_1:
            # [MQTT-3.1.2-22]
            raise _malformed("a password without a user name")
        keepAlive = reader.twoByteInteger()
        properties = NO_PROPERTIES
        if version == MQTT_5:
            properties = reader.properties(PacketType.CONNECT)
            if (
                Property.AUTHENTICATION_DATA in properties
                and Property.AUTHENTICATION_METHOD not in properties
            ):
                # 3.1.2.11.10
                raise _protocolError("authentication data without a method")
        # [MQTT-3.1.3-1]: the payload's fields in this order.
        clientId = reader.string()
        will = None
        if willFlag:
            willProperties = NO_PROPERTIES
            if version == MQTT_5:
                willProperties = reader.properties(WILL_PROPERTIES)
            will = Will(
                reader.topicName(),
                reader.binary(),
                willQos,
                bool(willRetain),
                willProperties,
            )
        username = reader.string() if hasUsername else None
        password = reader.binary() if hasPassword else None
        reader.expectEnd("CONNECT payload")
        return Connect(
            clientId,
            protocolLevel,
            bool(connectFlags & 0x02),
            keepAlive,
            username,
            password,
            will,
            properties,
        )

    def _connAck(self, flags, reader):
        """
        CONNACK (3.2).
        """
        acknowledgeFlags = reader.byte()
        if acknowledgeFlags & 0xFE:
            # 3.2.2.1: bits 7-1 are reserved.
            raise _malformed("reserved CONNACK flags set")
        reasonCode = reader.byte()
        properties = NO_PROPERTIES
        if self.version == MQTT_5:
            allowed = _CONNACK_REASONS
            properties = reader.properties(PacketType.CONNACK)
        else:
            allowed = _CONNACK_RETURN_CODES
        reader.expectEnd("CONNACK")
        if reasonCode not in allowed:
            raise _protocolError(f"CONNACK code 0x{reasonCode:02x}")
        if acknowledgeFlags and reasonCode:
            # [MQTT-3.2.2-4] (3.1.1), [MQTT-3.2.2-6] (5)
            raise _protocolError("a session present with a refusal")
        return ConnAck(bool(acknowledgeFlags), reasonCode, properties)

    def _acknowledgement(self, packetClass, reader):
        """
        PUBACK, PUBREC, PUBREL, PUBCOMP (3.4 to 3.7).
        """
        packetId = reader.packetId()
        return packetClass(packetId, *self._optionalReason(packetClass, reader))

    def _subscribe(self, flags, reader):
        """
        SUBSCRIBE (3.8).
        """
        packetId = reader.packetId()
        version = self.version
        properties = NO_PROPERTIES
        if version == MQTT_5:
            properties = reader.properties(PacketType.SUBSCRIBE)
        subscriptions = []
        while reader.left():
            topicFilter = reader.topicFilter()
            options = reader.byte()
            qos = options & 0x03
            if qos == 3:
                # [MQTT-3-8.3-4] (3.1.1); 3.8.3.1 (5)
                raise _malformed("a subscription with QoS 3")
            if version == MQTT_5:
                if options & 0xC0:
                    # [MQTT-3.8.3-5]
                    raise _malformed("reserved subscription option bits set")
                retainHandling = options >> 4 & 0x03
                if retainHandling == 3:
                    # 3.8.3.1
                    raise _protocolError("retain handling 3")
                noLocal = bool(options & 0x04)
                if noLocal and topicFilter.startswith("$share/"):
                    # [MQTT-3.8.3-4]
                    raise _protocolError("no local on a shared subscription")
                subscriptions.append(
                    Subscription(topicFilter, qos, noLocal, bool(options & 0x08), retainHandling)
                )
            else:
                if options & 0xFC:
                    # [MQTT-3-8.3-4]
                    raise _malformed("reserved subscription option bits set")
                subscriptions.append(Subscription(topicFilter, qos))
        if not subscriptions:
            # [MQTT-3.8.3-3] (3.1.1), [MQTT-3.8.3-2] (5)
            raise _protocolError("a SUBSCRIBE without topic filters")
        return Subscribe(packetId, subscriptions, properties)

    def _acknowledgementList(self, reader, packetType, allowed):
        packetId = reader.packetId()
        properties = NO_PROPERTIES
        if self.version == MQTT_5:
            properties = reader.properties(packetType)
        reasonCodes = list(reader.rest())
        if not reasonCodes:
            raise _protocolError(f"a {packetType.name} without reason codes")
        for reasonCode in reasonCodes:
            if reasonCode not in allowed:
                # [MQTT-3.9.3-2] (3.1.1)
                raise _protocolError(f"{packetType.name} code 0x{reasonCode:02x}")
        return packetId, reasonCodes, properties

    def _subAck(self, flags, reader):
        """
        SUBACK (3.9).
        """
        allowed = _SUBACK_REASONS if self.version == MQTT_5 else _SUBACK_RETURN_CODES
        return SubAck(*self._acknowledgementList(reader, PacketType.SUBACK, allowed))

    def _unsubscribe(self, flags, reader):
        """
        UNSUBSCRIBE (3.10).
        """
        packetId = reader.packetId()
        properties = NO_PROPERTIES
        if self.version == MQTT_5:
            properties = reader.properties(PacketType.UNSUBSCRIBE)
        topicFilters = []
        while reader.left():
            topicFilters.append(reader.topicFilter())
        if not topicFilters:
            # [MQTT-3.10.3-2]
            raise _protocolError("an UNSUBSCRIBE without topic filters")
        return Unsubscribe(packetId, topicFilters, properties)

    def _unsubAck(self, flags, reader):
        """
        UNSUBACK (3.11).
        """
        if self.version != MQTT_5:
            return UnsubAck(reader.packetId())
        return UnsubAck(*self._acknowledgementList(reader, PacketType.UNSUBACK, _UNSUBACK_REASONS))

    def _reasonAndProperties(self, packetClass, reader):
        """
        DISCONNECT and AUTH (3.14, 3.15).
        """
        return packetClass(*self._optionalReason(packetClass, reader))

    def _optionalReason(self, packetClass, reader):
        """
        The reason code and properties that end an MQTT 5 acknowledgement,
        DISCONNECT or AUTH, each left out when Success and none; MQTT 3.1.1's
        packets have neither (their length is checked with the fixed header).
        """
        reasonCode = 0
        properties = NO_PROPERTIES
        if reader.left():
            reasonCode = reader.byte()
            if reasonCode not in packetClass._REASONS:
                raise _protocolError(f"{packetClass._TYPE.name} reason code 0x{reasonCode:02x}")
            if reader.left():
                properties = reader.properties(packetClass._TYPE)
                reader.expectEnd(packetClass._TYPE.name)
        return reasonCode, properties


_DECODERS = {
    PacketType.CONNECT: MQTTDecoder._connect,
    PacketType.CONNACK: MQTTDecoder._connAck,
    PacketType.PUBACK: lambda self, flags, reader: self._acknowledgement(PubAck, reader),
    PacketType.PUBREC: lambda self, flags, reader: self._acknowledgement(PubRec, reader),
    PacketType.PUBREL: lambda self, flags, reader: self._acknowledgement(PubRel, reader),
    PacketType.PUBCOMP: lambda self, flags, reader: self._acknowledgement(PubComp, reader),
    PacketType.SUBSCRIBE: MQTTDecoder._subscribe,
    PacketType.SUBACK: MQTTDecoder._subAck,
    PacketType.UNSUBSCRIBE: MQTTDecoder._unsubscribe,
    PacketType.UNSUBACK: MQTTDecoder._unsubAck,
    PacketType.PINGREQ: lambda self, flags, reader: PingReq(),
    PacketType.PINGRESP: lambda self, flags, reader: PingResp(),
    PacketType.DISCONNECT: lambda self, flags, reader: self._reasonAndProperties(
        Disconnect, reader
    ),
    PacketType.AUTH: lambda self, flags, reader: self._reasonAndProperties(Auth, reader),
}

# The packets that may be only a packet identifier (and are, for Success
# without properties), by type.
_PUBACK_FIRST_BYTE = PubAck._FIRST_BYTE
_ACKNOWLEDGEMENTS = {
    packetClass._TYPE: packetClass for packetClass in (PubAck, PubRec, PubRel, PubComp)
}

# The fixed header flags each packet type but PUBLISH must have
# [MQTT-2.2.2-1]; type 0 is reserved.
_FLAGS = {packetType: 0 for packetType in PacketType if packetType != PacketType.PUBLISH}
_FLAGS.update({PacketType.PUBREL: 0x02, PacketType.SUBSCRIBE: 0x02, PacketType.UNSUBSCRIBE: 0x02})

# The packets whose remaining length is fixed, refused on their fixed header
# alone when it is wrong (3.12.1, 3.13.1; in MQTT 3.1.1 also 3.2.1, 3.4.1 to
# 3.7.1, 3.11.1, 3.14.1).
_FIXED_REMAINING_LENGTHS_5 = {PacketType.PINGREQ: 0, PacketType.PINGRESP: 0}
_FIXED_REMAINING_LENGTHS_3_1_1 = {
    **_FIXED_REMAINING_LENGTHS_5,
    PacketType.CONNACK: 2,
    PacketType.PUBACK: 2,
    PacketType.PUBREC: 2,
    PacketType.PUBREL: 2,
    PacketType.PUBCOMP: 2,
    PacketType.UNSUBACK: 2,
    PacketType.DISCONNECT: 0,
}
_FIXED_REMAINING_LENGTH_TYPES = frozenset(_FIXED_REMAINING_LENGTHS_3_1_1)
