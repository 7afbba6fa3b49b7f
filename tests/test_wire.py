"""
L{dallal.protocol.wire}: the frame codec, checked against PROTOCOL.md.
"""

import pytest
from hypothesis import given, settings, strategies

from dallal.broker.message import Message
from dallal.errors import BAD_ARGUMENTS, BAD_COMMAND, BAD_ID, NO_ID, RequestError
from dallal.protocol import wire

# Client to broker.


def described(frame, *fields):
    """
    A parsed frame as its type's name and the values of C{fields}: the
    frame classes may grow fields that these tests do not care about.
    """
    return (type(frame).__name__, *(getattr(frame, field) for field in fields))


def publishRequest(line):
    return described(wire.parseRequest(line), "id", "topic", "size", "options")


def subscribeRequest(line):
    return described(wire.parseRequest(line), "id", "topic", "options")


def test_publish():
    assert publishRequest(b"PUB 7 news 11") == ("Publish", "7", "news", 11, {})


def test_subscribe():
    assert subscribeRequest(b"SUB 1 news") == ("Subscribe", "1", "news", {})


@pytest.mark.parametrize("verb", [b"PING", b"ping", b"Ping"])
def test_ping(verb):
    assert described(wire.parseRequest(verb)) == ("Ping",)


def test_pong():
    assert described(wire.parseRequest(b"pong")) == ("Pong",)


def test_verbsAreCaseInsensitive():
    assert publishRequest(b"pub 7 news 11") == ("Publish", "7", "news", 11, {})
    assert subscribeRequest(b"sUb 1 news") == ("Subscribe", "1", "news", {})


def test_options():
    """
    C{key=value} options after the arguments are kept as text; a value may
    be empty or contain C{=}.
    """
    request = wire.parseRequest(b"SUB 1 news mode=all x= a=b=c")
    assert request.options == {"mode": "all", "x": "", "a": "b=c"}


def test_utf8Topic():
    request = wire.parseRequest("PUB 1 café/☕ 0".encode())
    assert request.topic == "café/☕"


def test_blankLineIsIgnored():
    assert wire.parseRequest(b"") is None
    assert wire.parseRequest(b"   ") is None


def refusal(line):
    """
    The L{RequestError} that parsing C{line} raises.
    """
    with pytest.raises(RequestError) as caught:
        wire.parseRequest(line)
    return caught.value


def test_unknownVerb():
    error = refusal(b"FROB 1 x")
    assert (error.code, error.requestId) == (BAD_COMMAND, NO_ID)
    assert "FROB" in error.reason


@pytest.mark.parametrize(
    "line, requestId",
    [
        (b"PUB", NO_ID),
        (b"PUB 1", "1"),
        (b"PUB 1 news", "1"),
        (b"PUB 1 news eleven", "1"),
        (b"PUB 1 news -1", "1"),
        (b"PUB 1 news 1e3", "1"),
        ("PUB 1 news \u00b2".encode(), "1"),
        ("PUB 1 news \u0661".encode(), "1"),
        (b"PUB 1 news +1", "1"),
        (b"SUB", NO_ID),
        (b"SUB 2", "2"),
        (b"SUB 2 news novalue", "2"),
        (b"SUB 2 news =value", "2"),
        (b"SUB 2 \xffnews", "2"),
        (b"PUB 3 news 1 \xff=1", "3"),
    ],
)
def test_badArguments(line, requestId):
    """
    Missing or malformed arguments are refused with the request's id when
    it could be read.
    """
    error = refusal(line)
    assert (error.code, error.requestId) == (BAD_ARGUMENTS, requestId)
    assert error.reason


@pytest.mark.parametrize(
    "line",
    [b"SUB " + b"i" * 65 + b" news", b"PUB \x01 news 1", b"SUB caf\xc3\xa9 news"],
    ids=["too long", "control character", "not ASCII"],
)
def test_badId(line):
    """
    An id that cannot be echoed back is refused, with C{-} as the id.
    """
    error = refusal(line)
    assert (error.code, error.requestId) == (BAD_ID, NO_ID)


def test_longestId():
    requestId = "i" * 64
    assert wire.parseRequest(b"SUB %s news" % requestId.encode()).id == requestId


# Broker to client.


def test_encodeAcks():
    assert wire.encodePubAck("7") == b"PUBACK 7\r\n"
    assert wire.encodeSubAck("1") == b"SUBACK 1\r\n"


def test_encodeError():
    assert (
        wire.encodeError("8", "BAD_TOPIC", "'+' and '#' are reserved")
        == b"ERR 8 BAD_TOPIC '+' and '#' are reserved\r\n"
    )


def test_encodeErrorKeepsOneLine():
    """
    A reason with line ends in it cannot break the frame into two.
    """
    frame = wire.encodeError("-", "BAD_COMMAND", "unknown\r\ncommand 'PUBACK 1'\n")
    assert frame.count(b"\n") == 1
    assert frame.endswith(b"\r\n")


def test_pingAndPongFrames():
    assert wire.PING_FRAME == b"PING\r\n"
    assert wire.PONG_FRAME == b"PONG\r\n"


# The client's side: encoding requests, parsing the broker's frames.


def test_encodePublish():
    frame = b"".join(wire.encodePublish("7", "news", b"hello world"))
    assert frame == b"PUB 7 news 11\r\nhello world\r\n"


def test_encodeSubscribe():
    assert wire.encodeSubscribe("1", "news") == b"SUB 1 news\r\n"


@pytest.mark.parametrize(
    "line, reply",
    [
        (b"MSG news 11", ("MessageHeader", "news", 11)),
        (b"PUBACK 7", ("PubAck", "7")),
        (b"SUBACK 1", ("SubAck", "1")),
        (b"PING", ("Ping",)),
        (b"PONG", ("Pong",)),
        (b"ERR 8 BAD_TOPIC no such  topic", ("Error", "8", "BAD_TOPIC", "no such  topic")),
        (b"ERR - BAD_COMMAND", ("Error", "-", "BAD_COMMAND", "")),
    ],
)
def test_parseReply(line, reply):
    fields = {
        "MessageHeader": ["topic", "size"],
        "PubAck": ["id"],
        "SubAck": ["id"],
        "Error": ["id", "code", "reason"],
    }
    parsed = wire.parseReply(line)
    assert described(parsed, *fields.get(type(parsed).__name__, [])) == reply


def test_messageOptions():
    assert wire.parseReply(b"MSG news 0 seq=4").options == {"seq": "4"}


def test_blankReply():
    assert wire.parseReply(b"") is None


@pytest.mark.parametrize("line", [b"HELLO", b"MSG news", b"PUBACK", b"ERR 1"])
def test_unexpectedReply(line):
    with pytest.raises(RequestError):
        wire.parseReply(line)


@settings(derandomize=True, max_examples=200, deadline=None)
@given(
    requestId=strategies.text(
        strategies.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=64
    ),
    topic=strategies.text(
        strategies.characters(categories=["L", "N", "P", "S"], exclude_characters="+#"),
        min_size=1,
        max_size=64,
    ).filter(lambda topic: not topic.startswith("$")),
    payload=strategies.binary(max_size=64),
)
def test_publishRoundTrip(requestId, topic, payload):
    """
    What the client encodes, the broker parses back: the control line gives
    the id, the topic and exactly the payload's size.
    """
    header, body, end = wire.encodePublish(requestId, topic, payload)
    assert header.endswith(b"\r\n")
    assert publishRequest(header[:-2]) == ("Publish", requestId, topic, len(payload), {})
    assert (body, end) == (payload, b"\r\n")


@pytest.mark.parametrize("size", [0, 5, wire.COPIED_PAYLOAD_SIZE, wire.COPIED_PAYLOAD_SIZE + 1])
@pytest.mark.parametrize(
    "deliveryId, redelivered, retained",
    [
        (None, False, False),
        ("41", False, False),
        ("41", True, False),
        ("41", True, True),
        (None, False, True),
    ],
)
def test_encodeMessage(size, deliveryId, redelivered, retained):
    """
    A C{MSG} frame is its header, then its payload and a CRLF, whether the
    payload is copied into one string (small payloads) or written after it;
    a second delivery of the message, which reuses what the first encoded,
    differs only in its own options.
    """
    payload = bytes(range(256)) * (size // 256) + b"p" * (size % 256)
    message = Message(1, "a/b", payload, "127.0.0.1:1", 0.0, retained)
    options = [b"sub=s1", b"seq=7"]
    if deliveryId is not None:
        options.append(b"id=" + deliveryId.encode("ascii"))
    if redelivered:
        options.append(b"redelivered=1")
    if retained:
        options.append(b"retained=1")
    header = b"MSG a/b %d %s\r\n" % (size, b" ".join(options))
    for _ in range(2):
        frame = wire.encodeMessage(message, "s1", 7, deliveryId, redelivered)
        assert b"".join(frame) == header + payload + b"\r\n"
    other = wire.encodeMessage(message, "s2", 8, deliveryId, redelivered)
    assert b"".join(other) == header.replace(b"sub=s1 seq=7", b"sub=s2 seq=8") + payload + b"\r\n"
    if size > wire.COPIED_PAYLOAD_SIZE:
        # Written as it is, never copied per subscriber.
        assert frame[1] is payload


def test_encodeMessageKeepsWhatDeliveriesShareAsTheMessagesEncoding():
    """
    The parts every C{MSG} frame of a message shares are encoded once, on
    its first delivery, and kept as the message's C{encoding}.
    """
    message = Message(1, "a/b", b"hello", "127.0.0.1:1", 0.0)
    wire.encodeMessage(message, "s1", 1, None, False)
    shared = message.encoding
    assert shared is not None
    second = wire.encodeMessage(message, "s2", 2, "5", False)
    assert message.encoding is shared
    assert second == (b"MSG a/b 5 sub=s2 seq=2 id=5\r\nhello\r\n",)


def test_encodeMessageLeavesAnotherTransportsEncodingAlone():
    """
    A message another transport encoded first is encoded all the same, and
    what that transport kept stays.
    """
    message = Message(1, "a/b", b"hello", "127.0.0.1:1", 0.0)
    message.encoding = ("another transport's",)
    for _ in range(2):
        frame = wire.encodeMessage(message, "s1", 1, None, False)
        assert frame == (b"MSG a/b 5 sub=s1 seq=1\r\nhello\r\n",)
    assert message.encoding == ("another transport's",)
