"""
The Dallal wire format: parsing client requests and encoding server frames.

A frame is one control line -- a verb, positional arguments, then optional
C{key=value} options, separated by spaces -- and, for C{PUB} and C{MSG}, a
payload of exactly the announced number of bytes followed by a line end.
PROTOCOL.md is the reference; this module is its code.  Nothing here knows
about sockets: the TCP and UDP transports both call it.
"""

import base64
import binascii
import re
from dataclasses import dataclass, field

from dallal.errors import (
    BAD_ARGUMENTS,
    BAD_COMMAND,
    BAD_ID,
    NO_ID,
    RequestError,
)
from dallal.numbers import wholeNumber

CRLF = b"\r\n"

# Limits of the grammar itself (the broker's own limits live in its config).
MAX_ID_LENGTH = 64


# Publish and Ack are parsed once per message (and per delivery in modes
# that ack): they are not frozen, because a frozen dataclass sets each
# field through object.__setattr__, which made Publish's construction 4% of
# a 1 -> 1 message.  Nothing changes a request once it is parsed.


@dataclass(slots=True)
class Publish:
    id: str
    topic: str
    size: int
    options: dict


@dataclass(frozen=True, slots=True)
class Subscribe:
    id: str
    topic: str
    options: dict


@dataclass(frozen=True, slots=True)
class Unsubscribe:
    id: str
    topic: str


@dataclass(frozen=True, slots=True)
class ListSubscriptions:
    id: str


@dataclass(frozen=True, slots=True)
class Topics:
    id: str
    options: dict


@dataclass(slots=True)
class Ack:
    deliveryId: str


@dataclass(frozen=True, slots=True)
class Stats:
    id: str


@dataclass(frozen=True, slots=True)
class Ping:
    pass


@dataclass(frozen=True, slots=True)
class Pong:
    pass


_PING = Ping()
_PONG = Pong()


def _text(token, what, requestId):
    try:
        return token.decode("utf-8")
    except UnicodeDecodeError:
        raise RequestError(BAD_ARGUMENTS, f"{what} is not valid UTF-8", requestId) from None


def _requestId(token):
    if len(token) > MAX_ID_LENGTH:
        raise RequestError(BAD_ID, f"request id longer than {MAX_ID_LENGTH} bytes")
    try:
        requestId = token.decode("ascii")
    except UnicodeDecodeError:
        raise RequestError(BAD_ID, "request id must be printable ASCII") from None
    if not requestId.isprintable():
        raise RequestError(BAD_ID, "request id must be printable ASCII")
    return requestId


def _options(tokens, requestId):
    options = {}
    for token in tokens:
        key, equals, value = token.partition(b"=")
        if not equals or not key:
            raise RequestError(BAD_ARGUMENTS, f"expected key=value, got {token!r}", requestId)
        options[_text(key, "option name", requestId)] = _text(value, "option value", requestId)
    return options


# The most digits of a payload size.
_SIZE_DIGITS = 12


def _size(token, requestId):
    size = wholeNumber(token, _SIZE_DIGITS)
    if size is None:
        raise RequestError(
            BAD_ARGUMENTS, f"payload size must be a byte count, got {token!r}", requestId
        )
    return size


def _parsePub(tokens):
    if len(tokens) < 4:
        raise RequestError(
            BAD_ARGUMENTS,
            "usage: PUB <id> <topic> <size> [key=value ...]",
            _requestId(tokens[1]) if len(tokens) > 1 else NO_ID,
        )
    requestId = _requestId(tokens[1])
    # Once per message: the checks of _text and _size, inline.  (bytes'
    # isdigit is true of ASCII digits only, as wholeNumber wants.)
    try:
        topic = tokens[2].decode("utf-8")
    except UnicodeDecodeError:
        topic = _text(tokens[2], "topic", requestId)
    size = tokens[3]
    if 0 < len(size) <= _SIZE_DIGITS and size.isdigit():
        size = int(size)
    else:
        size = _size(size, requestId)
    return Publish(
        requestId,
        topic,
        size,
        _options(tokens[4:], requestId) if len(tokens) > 4 else {},
    )


def _parseSub(tokens):
    if len(tokens) < 3:
        raise RequestError(
            BAD_ARGUMENTS,
            "usage: SUB <id> <topic> [key=value ...]",
            _requestId(tokens[1]) if len(tokens) > 1 else NO_ID,
        )
    requestId = _requestId(tokens[1])
    return Subscribe(
        requestId,
        _text(tokens[2], "topic", requestId),
        _options(tokens[3:], requestId) if len(tokens) > 3 else {},
    )


def _parseAckRequest(tokens):
    if len(tokens) != 2:
        raise RequestError(BAD_ARGUMENTS, "usage: ACK <delivery-id>")
    return Ack(_requestId(tokens[1]))


def _parseStats(tokens):
    if len(tokens) != 2:
        raise RequestError(
            BAD_ARGUMENTS,
            "usage: STATS <id>",
            _requestId(tokens[1]) if len(tokens) > 1 else NO_ID,
        )
    return Stats(_requestId(tokens[1]))


def _parseUnsub(tokens):
    if len(tokens) != 3:
        raise RequestError(
            BAD_ARGUMENTS,
            "usage: UNSUB <id> <topic-filter>",
            _requestId(tokens[1]) if len(tokens) > 1 else NO_ID,
        )
    requestId = _requestId(tokens[1])
    return Unsubscribe(requestId, _text(tokens[2], "topic filter", requestId))


def _parseList(tokens):
    if len(tokens) != 2:
        raise RequestError(
            BAD_ARGUMENTS,
            "usage: LIST <id>",
            _requestId(tokens[1]) if len(tokens) > 1 else NO_ID,
        )
    return ListSubscriptions(_requestId(tokens[1]))


def _parseTopics(tokens):
    if len(tokens) < 2:
        raise RequestError(BAD_ARGUMENTS, "usage: TOPICS <id> [limit=N]")
    requestId = _requestId(tokens[1])
    return Topics(requestId, _options(tokens[2:], requestId))


def _parsePing(tokens):
    return _PING


def _parsePong(tokens):
    return _PONG


# A client's HELLO (required over UDP, optional over TCP) and its BYE.


@dataclass(frozen=True, slots=True)
class Hello:
    id: str
    clientId: str
    options: dict


@dataclass(frozen=True, slots=True)
class Bye:
    pass


_BYE = Bye()


def _clientId(token, requestId):
    if len(token) > MAX_ID_LENGTH or not token.isascii() or not token.decode("ascii").isprintable():
        raise RequestError(
            BAD_ID,
            f"client id must be 1 to {MAX_ID_LENGTH} printable ASCII characters",
            requestId,
        )
    return token.decode("ascii")


def _parseHello(tokens):
    if len(tokens) < 3:
        raise RequestError(
            BAD_ARGUMENTS,
            "usage: HELLO <id> <client-id> [key=value ...]",
            _requestId(tokens[1]) if len(tokens) > 1 else NO_ID,
        )
    requestId = _requestId(tokens[1])
    return Hello(
        requestId,
        _clientId(tokens[2], requestId),
        _options(tokens[3:], requestId) if len(tokens) > 3 else {},
    )


def _parseBye(tokens):
    return _BYE


# Credentials in a HELLO: user=<name> password=<the password's bytes in
# base64>, so that a password may hold spaces, '=' or any byte.


def encodeCredentials(user, password):
    """
    The HELLO options that carry a user name (text) and password (bytes).
    """
    return {"user": user, "password": base64.b64encode(password).decode("ascii")}


def credentialsOf(hello):
    """
    The credentials of a L{Hello}.

    @return: C{(user, password)} as text and bytes, or C{None} if it has
        none.
    @raise RequestError: only one of them, or a password that is not base64.
    """
    options = hello.options
    user, password = options.get("user"), options.get("password")
    if user is None and password is None:
        return None
    if not user or password is None:
        raise RequestError(
            BAD_ARGUMENTS, "a login needs both user=<name> and password=<base64>", hello.id
        )
    try:
        return user, base64.b64decode(password.encode("ascii"), validate=True)
    except (UnicodeEncodeError, binascii.Error):
        raise RequestError(
            BAD_ARGUMENTS, "password= must be the password's bytes in base64", hello.id
        ) from None


_PARSERS = {
    b"PUB": _parsePub,
    b"SUB": _parseSub,
    b"UNSUB": _parseUnsub,
    b"ACK": _parseAckRequest,
    b"LIST": _parseList,
    b"TOPICS": _parseTopics,
    b"STATS": _parseStats,
    b"PING": _parsePing,
    b"PONG": _parsePong,
    b"HELLO": _parseHello,
    b"BYE": _parseBye,
}


# The control line of a PUB without options, as most are, and its line end:
# its request id, topic and payload size, as the grammar allows them, found
# in one step where a transport reads a run of pipelined PUBs together
# (L{dallal.server.tcp.BrokerProtocol.runReceived}).  A line it does not
# match is parsed by L{parseRequest}, which says what is wrong with it.
PLAIN_PUB = re.compile(rb"PUB ([!-~]{1,%d}) (\S+) (\d{1,%d})\r?\n" % (MAX_ID_LENGTH, _SIZE_DIGITS))


def parseRequest(line):
    """
    Parse one control line from a client.

    @param line: the line without its line end.
    @return: a L{Publish}, L{Subscribe}, L{Ack}, L{Stats}, L{Ping} or
        L{Pong}; C{None} for a
        blank line (ignored, so that a person typing into C{nc} may press
        enter twice).
    @raise RequestError: the line is not a valid request.
    """
    tokens = line.split()
    if not tokens:
        return None
    verb = tokens[0]
    parser = _PARSERS.get(verb) or _PARSERS.get(verb.upper())
    if parser is None:
        shown = verb[:32].decode("ascii", "replace")
        raise RequestError(BAD_COMMAND, f"unknown command {shown!r}")
    return parser(tokens)


# Server to client.

PING_FRAME = b"PING\r\n"
PONG_FRAME = b"PONG\r\n"


def encodeMessageHeader(
    topic, size, subscriptionId, seq, deliveryId, redelivered, retained=False, options=None
):
    """
    The control line of a C{MSG} frame; the payload and a CRLF follow it.

    @param topic: the topic, already encoded as UTF-8.
    @param deliveryId: the id the client acks, or C{None} in C{fire} mode.
    @param options: more C{key=value} options, as text (a bridged message's
        origin).
    """
    line = b"MSG %s %d sub=%s seq=%d" % (topic, size, subscriptionId.encode("ascii"), seq)
    if deliveryId is not None:
        line += b" id=" + deliveryId.encode("ascii")
    if redelivered:
        line += b" redelivered=1"
    if retained:
        line += b" retained=1"
    if options:
        line += _encodeOptions(options)
    return line + CRLF


# A payload up to this size is copied into each delivery's MSG frame, which
# is then one byte string; a larger one is written as it is after its header
# rather than copied once per subscriber.
COPIED_PAYLOAD_SIZE = 4096


# Tags what every MSG frame of a message shares, in the message's encoding.
_MSG_PARTS = "dallal.msg"


def encodeMessage(message, subscriptionId, seq, deliveryId, redelivered):
    """
    A whole C{MSG} frame for a L{dallal.broker.message.Message}, as the byte strings
    to write in order.

    What every delivery of the message shares (the topic, the size, the
    payload and the line ends) is encoded on its first delivery and kept as
    the message's C{encoding}; a delivery adds only its C{sub=}, C{seq=} and
    C{id=}.  A fan-out to many subscribers costs one formatting per
    subscriber instead of a header, a join and three buffered pieces.
    """
    if redelivered:
        # Rare (an ack timed out): the general encoder.
        return encodeMessageWithOptions(message, subscriptionId, seq, deliveryId, True, None)
    shared = message.encoding
    if shared is None or shared[0] is not _MSG_PARTS:
        shared = _sharedMessageParts(message)
        if message.encoding is None:
            message.encoding = shared
    _, start, end, uncopiedPayload = shared
    if deliveryId is None:
        line = b"%s%s seq=%d%s" % (start, subscriptionId.encode("ascii"), seq, end)
    else:
        line = b"%s%s seq=%d id=%s%s" % (
            start,
            subscriptionId.encode("ascii"),
            seq,
            deliveryId.encode("ascii"),
            end,
        )
    if uncopiedPayload is None:
        return (line,)
    return (line, uncopiedPayload, CRLF)


def encodeMessageRun(wireTopic, payloads, subscriptionId, firstSeq):
    """
    The C{MSG} frames, in one byte string, of a run of messages on one
    topic to one C{fire} subscription: what L{encodeMessage} makes of each
    (live, not retained; no delivery id), without a L{Message} for any.

    @param wireTopic: their topic, encoded as UTF-8.
    @param payloads: their payloads, in order.
    @param firstSeq: the C{seq} of the first; the others follow it.
    """
    # The topic and the subscription id go into the format as they are:
    # a '%' of theirs is not a conversion.
    frame = b"MSG %s %%d sub=%s seq=%%d\r\n%%s\r\n" % (
        wireTopic.replace(b"%", b"%%"),
        subscriptionId.encode("ascii").replace(b"%", b"%%"),
    )
    return b"".join(
        [
            frame % (len(payload), seq, payload)
            for seq, payload in zip(range(firstSeq, firstSeq + len(payloads)), payloads)
        ]
    )


def _sharedMessageParts(message):
    """
    The parts of a message's C{MSG} frame that are the same for every
    delivery, tagged as the codec's: C{(_MSG_PARTS, start, end, payload)},
    where the delivery's C{sub=}, C{seq=} and C{id=} go between C{start}
    and C{end}; C{end} holds a small payload and its line end, and
    C{payload} is then C{None}.
    """
    payload = message.payload
    start = b"MSG %s %d sub=" % (message.wireTopic, len(payload))
    end = (b" retained=1" if message.retained else b"") + CRLF
    if len(payload) <= COPIED_PAYLOAD_SIZE:
        return _MSG_PARTS, start, end + payload + CRLF, None
    return _MSG_PARTS, start, end, payload


def encodeMessageWithOptions(message, subscriptionId, seq, deliveryId, redelivered, options):
    """
    A whole C{MSG} frame with more C{key=value} options (a bridged
    message's origin, as text), as the byte strings to write: the general
    encoder, for the few deliveries that need it.
    """
    payload = message.payload
    header = encodeMessageHeader(
        message.wireTopic,
        len(payload),
        subscriptionId,
        seq,
        deliveryId,
        redelivered,
        message.retained,
        options,
    )
    return (header, payload, CRLF)


def encodeData(verb, requestId, payload):
    """
    The answer to C{STATS}, C{LIST} or C{TOPICS}: C{<verb> <id> <size>}
    and a JSON payload.
    """
    return (b"%s %s %d\r\n" % (verb, requestId.encode("ascii"), len(payload)), payload, CRLF)


def encodePubAck(requestId, options=None):
    """
    @param options: C{key=value} options, as text (C{topics=} for a publish
        to every matching topic).
    """
    if not options:
        # The common case, once per publish: no options to join, and
        # formatting text then encoding it costs half what formatting bytes
        # does.
        return f"PUBACK {requestId}\r\n".encode("ascii")
    return b"PUBACK %s%s\r\n" % (requestId.encode("ascii"), _encodeOptions(options))


def encodePubAcks(requestIds):
    """
    The C{PUBACK}s, without options, of a run of publishes, in one byte
    string.

    @param requestIds: their request ids, as bytes.
    """
    return b"PUBACK " + b"\r\nPUBACK ".join(requestIds) + CRLF


def encodeSubAck(requestId):
    return b"SUBACK %s\r\n" % (requestId.encode("ascii"),)


def encodeUnsubAck(requestId):
    return b"UNSUBACK %s\r\n" % (requestId.encode("ascii"),)


def encodeError(requestId, code, reason):
    """
    An C{ERR} frame.  The reason is free text for people; line ends in it
    are flattened so that it cannot break framing.
    """
    reason = " ".join(reason.split())
    return b"ERR %s %s %s\r\n" % (
        requestId.encode("ascii"),
        code.encode("ascii"),
        reason.encode("utf-8", "replace"),
    )


# Parsing what the server sends, for clients.


@dataclass(frozen=True, slots=True)
class MessageHeader:
    topic: str
    size: int
    options: dict


@dataclass(frozen=True, slots=True)
class DataHeader:
    verb: str
    id: str
    size: int


@dataclass(frozen=True, slots=True)
class PubAck:
    id: str
    options: dict = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class SubAck:
    id: str
    options: dict = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class UnsubAck:
    id: str
    options: dict = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ByeReply:
    pass


@dataclass(frozen=True, slots=True)
class Error:
    id: str
    code: str
    reason: str


def _parseMsg(tokens):
    if len(tokens) < 3:
        raise RequestError(BAD_ARGUMENTS, "usage: MSG <topic> <size> [key=value ...]")
    return MessageHeader(
        _text(tokens[1], "topic", NO_ID),
        _size(tokens[2], NO_ID),
        _options(tokens[3:], NO_ID) if len(tokens) > 3 else {},
    )


def _parseDataReply(tokens):
    if len(tokens) != 3:
        verb = tokens[0].decode("ascii")
        raise RequestError(BAD_ARGUMENTS, f"usage: {verb} <id> <size>")
    return DataHeader(tokens[0].decode("ascii"), _requestId(tokens[1]), _size(tokens[2], NO_ID))


def _parseAck(kind):
    def parse(tokens):
        if len(tokens) < 2:
            raise RequestError(
                BAD_ARGUMENTS, f"usage: {kind.__name__.upper()} <id> [key=value ...]"
            )
        return kind(_requestId(tokens[1]), _options(tokens[2:], NO_ID))

    return parse


def _parseByeReply(tokens):
    return ByeReply()


def _parseErr(line):
    tokens = line.split(None, 3)
    if len(tokens) < 3:
        raise RequestError(BAD_ARGUMENTS, "usage: ERR <id> <code> <reason>")
    reason = tokens[3].decode("utf-8", "replace") if len(tokens) == 4 else ""
    return Error(tokens[1].decode("ascii", "replace"), tokens[2].decode("ascii", "replace"), reason)


def encodePublish(requestId, topic, payload):
    """
    A C{PUB} frame, as a sequence of byte strings to write.
    """
    return (
        b"PUB %s %s %d\r\n" % (requestId.encode("ascii"), topic.encode("utf-8"), len(payload)),
        payload,
        CRLF,
    )


def encodePublishOptions(requestId, topic, payload, options):
    """
    A C{PUB} frame with C{key=value} options (C{retain=1},
    C{to-matching=1}), as a sequence of byte strings to write.
    """
    return (
        b"PUB %s %s %d%s\r\n"
        % (
            requestId.encode("ascii"),
            topic.encode("utf-8"),
            len(payload),
            _encodeOptions(options),
        ),
        payload,
        CRLF,
    )


def encodeSubscribe(requestId, topic, mode=None, options=None):
    """
    @param options: more C{key=value} options, as text (C{bridge=1}).
    """
    line = b"SUB %s %s" % (requestId.encode("ascii"), topic.encode("utf-8"))
    if mode is not None:
        line += b" mode=" + mode.encode("ascii")
    if options:
        line += _encodeOptions(options)
    return line + CRLF


def encodeAck(deliveryId):
    return b"ACK %s\r\n" % (deliveryId.encode("ascii"),)


def encodeDataRequest(verb, requestId, options=None):
    """
    C{STATS}, C{LIST} or C{TOPICS}, with C{key=value} options as text.
    """
    return b"%s %s%s\r\n" % (verb, requestId.encode("ascii"), _encodeOptions(options or {}))


def encodeUnsubscribe(requestId, topicFilter):
    return b"UNSUB %s %s\r\n" % (requestId.encode("ascii"), topicFilter.encode("utf-8"))


def _encodeOptions(options):
    return b"".join(
        b" %s=%s" % (key.encode("ascii"), value.encode("ascii")) for key, value in options.items()
    )


def encodeHello(requestId, clientId, options):
    return b"HELLO %s %s%s\r\n" % (
        requestId.encode("ascii"),
        clientId.encode("ascii"),
        _encodeOptions(options),
    )


BYE_FRAME = b"BYE\r\n"


def encodeHelloReply(requestId, options):
    return b"HELLO %s%s\r\n" % (requestId.encode("ascii"), _encodeOptions(options))


@dataclass(frozen=True, slots=True)
class HelloReply:
    id: str
    options: dict


def _parseHelloReply(tokens):
    if len(tokens) < 2:
        raise RequestError(BAD_ARGUMENTS, "usage: HELLO <id> [key=value ...]")
    return HelloReply(_requestId(tokens[1]), _options(tokens[2:], NO_ID))


_REPLY_PARSERS = {
    b"MSG": _parseMsg,
    b"PUBACK": _parseAck(PubAck),
    b"SUBACK": _parseAck(SubAck),
    b"UNSUBACK": _parseAck(UnsubAck),
    b"STATS": _parseDataReply,
    b"LIST": _parseDataReply,
    b"TOPICS": _parseDataReply,
    b"BYE": _parseByeReply,
    b"HELLO": _parseHelloReply,
    b"PING": _parsePing,
    b"PONG": _parsePong,
}


def parseReply(line):
    """
    Parse one control line from the server.

    @return: a L{MessageHeader} or L{DataHeader} (a payload follows),
        L{PubAck}, L{SubAck}, L{UnsubAck}, L{HelloReply}, L{ByeReply},
        L{Error}, L{Ping} or L{Pong}; C{None} for a blank line.
    @raise RequestError: the line is not a frame this client understands.
    """
    tokens = line.split()
    if not tokens:
        return None
    if tokens[0] == b"ERR":
        return _parseErr(line)
    parser = _REPLY_PARSERS.get(tokens[0])
    if parser is None:
        shown = tokens[0][:32].decode("ascii", "replace")
        raise RequestError(BAD_COMMAND, f"unknown frame {shown!r} from the server")
    return parser(tokens)
