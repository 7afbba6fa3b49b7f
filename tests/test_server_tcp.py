"""
L{dallal.server.tcp.BrokerProtocol} over in-memory transports, with a real broker
core on a fake clock: what clients read, and what the broker logs.
"""

import re

import pytest
from helpers import PING_INTERVAL, REPO, BrokerHarness, decodeFrames, messages, splitAt
from test_auth import AUTH_ERRORS
from test_limits import TOO_MANY_CLIENTS_ERROR, TOO_MANY_SUBSCRIPTIONS_ERROR

from dallal.broker.core import BrokerConfig
from dallal.errors import CLOSING, FRAME_TIMEOUT, TOO_MANY_ERRORS, TOO_MANY_TOPICS

# A broker that refuses payloads over 16 bytes, for the tests of that limit.
SMALL_MAX_PAYLOAD_CONFIG = BrokerConfig(maxPayload=16, messageEvents=True)


def test_publishIsAcknowledged(harness):
    client = harness.connect()
    client.send(b"PUB 7 news 11\r\nhello world\r\n")
    assert client.received() == b"PUBACK 7\r\n"


def test_protocolSession(harness):
    """
    The session of PROTOCOL.md, byte for byte.
    """
    subscriber = harness.connect()
    subscriber.send(b"SUB 1 news\r\n")
    assert subscriber.received() == b"SUBACK 1\r\n"
    publisher = harness.connect()
    publisher.send(b"PUB 7 news 11\r\nhello world\r\n")
    assert publisher.received() == b"PUBACK 7\r\n"
    publisher.send(b"PUB 8 +bad 2\r\nhi\r\nPING\r\n")
    assert publisher.received() == (
        b"ERR 8 BAD_TOPIC '+' and '#' are reserved for subscription wildcards\r\nPONG\r\n"
    )
    assert subscriber.received() == b"MSG news 11 sub=1 seq=1 id=1\r\nhello world\r\n"
    subscriber.send(b"ACK 1\r\n")
    # Acked: when the ack timeout is over, nothing is sent again; the
    # client spoke during that interval, so the first ping comes one later.
    harness.clock.advance(PING_INTERVAL)
    assert subscriber.received() == b""
    harness.clock.advance(PING_INTERVAL)
    assert subscriber.received() == b"PING\r\n"


def test_typedIntoNetcat(harness):
    """
    Lower-case verbs, bare LF line ends and blank lines work, as a person
    typing into C{nc} sends them.
    """
    client = harness.connect()
    client.send(b"sub 1 news\n\n", b"pub 2 news 2\nhi\n", b"ping\n")
    frames = decodeFrames(client.received())
    assert [(frame.line, frame.payload) for frame in frames] == [
        (b"SUBACK 1", None),
        (frames[1].line, b"hi"),
        (b"PUBACK 2", None),
        (b"PONG", None),
    ]
    assert frames[1].arguments[:2] == [b"news", b"2"]


def test_fanOut(harness):
    """
    A message reaches every connection subscribed to its topic once,
    including the publisher's own, and no other connection.
    """
    subscribers = [harness.connect() for _ in range(3)]
    for subscriber in subscribers:
        subscriber.send(b"SUB 1 news\r\n")
    subscribers[0].send(b"SUB 2 news\r\n")  # twice: still one copy
    other = harness.connect()
    other.send(b"SUB 1 sport\r\n")
    publisher = harness.connect()
    publisher.send(b"SUB a news\r\n")
    for client in [*subscribers, other, publisher]:
        client.received()

    payload = b"line one\r\nline two\n\x00\xff"
    publisher.send(b"PUB p1 news %d\r\n%s\r\n" % (len(payload), payload))

    for subscriber in subscribers:
        assert messages(subscriber.received()) == [(b"news", payload)]
    assert other.received() == b""
    answer = publisher.received()
    assert messages(answer) == [(b"news", payload)]
    assert [frame.line for frame in decodeFrames(answer) if frame.verb != b"MSG"] == [b"PUBACK p1"]


def test_topicsAreSeparate(harness):
    """
    A connection subscribed to several topics gets each topic's message
    under its topic; topics are case-sensitive.
    """
    subscriber = harness.connect()
    subscriber.send(b"SUB 1 a\r\nSUB 2 b/c\r\nSUB 3 News\r\n")
    assert subscriber.received() == b"SUBACK 1\r\nSUBACK 2\r\nSUBACK 3\r\n"
    publisher = harness.connect()
    publisher.send(b"PUB 1 b/c 3\r\nbcb\r\nPUB 2 news 1\r\nn\r\nPUB 3 a 1\r\na\r\n")
    assert publisher.received() == b"PUBACK 1\r\nPUBACK 2\r\nPUBACK 3\r\n"
    assert messages(subscriber.received()) == [(b"b/c", b"bcb"), (b"a", b"a")]


def test_nothingFromBeforeTheSubscription(harness):
    publisher = harness.connect()
    publisher.send(b"PUB 1 news 6\r\nbefore\r\n")
    subscriber = harness.connect()
    subscriber.send(b"SUB 1 news\r\n")
    assert subscriber.received() == b"SUBACK 1\r\n"
    publisher.send(b"PUB 2 news 5\r\nafter\r\n")
    assert messages(subscriber.received()) == [(b"news", b"after")]


def test_subscriptionsDieWithTheConnection(harness):
    subscriber = harness.connect()
    subscriber.send(b"SUB 1 news\r\nSUB 2 sport\r\n")
    subscriber.received()
    subscriber.lose()
    publisher = harness.connect()
    publisher.send(b"PUB 1 news 2\r\nhi\r\n")
    assert publisher.received() == b"PUBACK 1\r\n"
    assert subscriber.received() == b""
    assert harness.fields("disconnect") == [
        {
            "session": 1,
            "client": subscriber.address,
            "transport": "tcp",
            "reason": "closed",
            "subscriptions": 2,
        }
    ]
    assert harness.fields("publish")[0]["subscribers"] == 0


def test_connectionLog(harness):
    """
    Connections and subscriptions are logged with the client's address.
    """
    client = harness.connect()
    client.send(b"SUB 1 news\r\n")
    client.lose()
    lines = [line.rsplit(" broker=", 1)[0] for line in harness.logLines()]
    assert lines[0] == f"event=connect session=1 client={client.address} transport=tcp"
    assert lines[1].startswith(f"event=subscribe session=1 client={client.address} topic=news")
    assert lines[-1] == (
        f"event=disconnect session=1 client={client.address} transport=tcp "
        "reason=closed subscriptions=1"
    )


def test_ping(harness):
    client = harness.connect()
    client.send(b"PING\r\n")
    assert client.received() == b"PONG\r\n"


def test_pipelined(harness):
    """
    Many requests in one read are answered in order.
    """
    client = harness.connect()
    client.send(b"".join(b"PUB %d t 1\r\n%d\r\n" % (i, i % 10) for i in range(1000)))
    assert client.received() == b"".join(b"PUBACK %d\r\n" % i for i in range(1000))


# Errors that keep the connection open: the ERR, then business as usual.

NON_FATAL_ERRORS = [
    (b"FROB 1 news\r\n", b"ERR - BAD_COMMAND "),
    (b"PUB 1 news\r\n", b"ERR 1 BAD_ARGUMENTS "),
    (b"PUB 1 news eleven\r\n", b"ERR 1 BAD_ARGUMENTS "),
    (b"SUB\r\n", b"ERR - BAD_ARGUMENTS "),
    (b"SUB 2 news novalue\r\n", b"ERR 2 BAD_ARGUMENTS "),
    (b"SUB 3 caf\xff\r\n", b"ERR 3 BAD_ARGUMENTS "),
    (b"SUB " + b"i" * 65 + b" news\r\n", b"ERR - BAD_ID "),
    (b"SUB \x01 news\r\n", b"ERR - BAD_ID "),
    (b"SUB 4 a+\r\n", b"ERR 4 BAD_TOPIC "),
    (b"SUB 4 a/#/b\r\n", b"ERR 4 BAD_TOPIC "),
    (b"SUB 4 a/b#\r\n", b"ERR 4 BAD_TOPIC "),
    (b"SUB 4 a\x7fb\r\n", b"ERR 4 BAD_TOPIC "),
    (b"SUB 4 " + b"t" * 257 + b"\r\n", b"ERR 4 BAD_TOPIC "),
    # A refused PUB has its payload read and skipped: what looks like
    # frames inside it is not obeyed.
    (b"PUB 5 +bad 6\r\nPING\r\n\r\n", b"ERR 5 BAD_TOPIC "),
    (
        b"PUB 6 news 17\r\nSUB 9 x\r\nPING\r\n12\r\n",
        b"ERR 6 PAYLOAD_TOO_LARGE ",
    ),
    (b"UNSUB 7 news\r\n", b"ERR 7 NOT_SUBSCRIBED "),
    # This broker has no store for retained messages.
    (b"PUB 8 news 2 retain=1\r\nhi\r\n", b"ERR 8 STORE_FAILED "),
]


@pytest.mark.parametrize(
    "request_, error", NON_FATAL_ERRORS, ids=[error.decode() for _, error in NON_FATAL_ERRORS]
)
def test_errorKeepsConnectionOpen(request_, error):
    harness = BrokerHarness(SMALL_MAX_PAYLOAD_CONFIG)
    client = harness.connect()
    client.send(request_)
    answer = client.received()
    assert answer.startswith(error) and answer.endswith(b"\r\n")
    assert answer.count(b"\r\n") == 1
    assert len(answer) > len(error) + 2, "the reason is missing"
    assert not client.closing
    code = error.split()[2].decode()
    assert harness.fields("protocol_error") == [
        {"session": 1, "client": client.address, "code": code, "fatal": False}
    ]
    client.send(b"SUB 10 news\r\nPUB 11 news 2\r\nok\r\n")
    frames = decodeFrames(client.received())
    assert [frame.verb for frame in frames] == [b"SUBACK", b"MSG", b"PUBACK"]
    assert frames[1].payload == b"ok"


def test_payloadTooLargeAcrossReads():
    """
    A too-large payload is skipped however it arrives, and the frame after
    it is read normally.
    """
    harness = BrokerHarness(SMALL_MAX_PAYLOAD_CONFIG)
    client = harness.connect()
    skipped = b"PUB 9 news 1\r\nx\r\n" * 1000
    client.send(b"PUB 1 news %d\r\n" % len(skipped))
    assert client.received().startswith(b"ERR 1 PAYLOAD_TOO_LARGE ")
    for start in range(0, len(skipped), 777):
        client.send(skipped[start : start + 777])
    client.send(b"\r\nPUB 2 news ", b"16\r\n", b"x" * 16, b"\r\n")
    assert client.received() == b"PUBACK 2\r\n"
    assert harness.fields("publish")[0]["bytes"] == 16


def test_hugeAnnouncedSize():
    """
    An absurd size is refused at once, without waiting for the bytes, and
    the connection stays open (PROTOCOL.md: the bytes are skipped).
    """
    harness = BrokerHarness(SMALL_MAX_PAYLOAD_CONFIG)
    client = harness.connect()
    client.send(b"PUB 6 news 999999999999\r\n")
    assert client.received().startswith(b"ERR 6 PAYLOAD_TOO_LARGE ")
    client.send(b"PING\r\n" * 1000)
    assert client.received() == b""
    assert not client.closing


def test_largestPayloadAccepted():
    harness = BrokerHarness(SMALL_MAX_PAYLOAD_CONFIG)
    client = harness.connect()
    client.send(b"PUB 1 news 16\r\n" + b"y" * 16 + b"\r\n")
    assert client.received() == b"PUBACK 1\r\n"


# Refused while the broker drains before stopping (tests/test_shutdown.py):
# the connection stays open until the broker closes it.

SHUTDOWN_ERRORS = [
    (b"PUB 1 news 2\r\nhi\r\n", b"ERR 1 SHUTTING_DOWN "),
    (b"PUB 2 news 2 retain=1\r\nhi\r\n", b"ERR 2 SHUTTING_DOWN "),
    (b"PUB 3 # 2 to-matching=1\r\nhi\r\n", b"ERR 3 SHUTTING_DOWN "),
    (b"SUB 4 other\r\n", b"ERR 4 SHUTTING_DOWN "),
]


@pytest.mark.parametrize(
    "request_, error", SHUTDOWN_ERRORS, ids=["PUB", "PUB-retain", "PUB-to-matching", "SUB"]
)
def test_errorWhileStopping(harness, request_, error):
    """
    While an unacked message holds the broker's drain, new work is refused
    and nothing of it is published; the connection stays open.
    """
    holder = harness.connect()
    holder.send(b"SUB 1 news mode=all\r\n")
    client = harness.connect()
    client.send(b"PUB 0 news 4\r\nheld\r\n")
    client.received()
    harness.service.stopService()
    client.send(request_)
    answer = client.received()
    assert answer.startswith(error) and answer.count(b"\r\n") == 1
    assert not client.closing
    assert harness.broker.counters["published"] == 1
    assert harness.fields("protocol_error") == [
        {"session": 2, "client": client.address, "code": "SHUTTING_DOWN", "fatal": False}
    ]


# Errors that close the connection: the ERR, and nothing after it, not even
# an answer to what followed in the same read.

FATAL_ERRORS = [
    (b"SUB 1 " + b"t" * 4091 + b"\r\nPING\r\n", b"ERR - LINE_TOO_LONG "),
    # A payload longer than announced: framing is lost.
    (b"PUB 3 news 2\r\nabc\r\nPING\r\n", b"ERR 3 BAD_FRAMING "),
]


def assertClosedFor(harness, client, code):
    assert client.closing
    assert harness.fields("protocol_error") == [
        {"session": 1, "client": client.address, "code": code, "fatal": True}
    ]
    client.lose()
    assert harness.fields("disconnect")[0]["reason"] == "protocol_error"


@pytest.mark.parametrize(
    "request_, error", FATAL_ERRORS, ids=[error.decode() for _, error in FATAL_ERRORS]
)
def test_errorClosesConnection(harness, request_, error):
    client = harness.connect()
    client.send(request_)
    answer = client.received()
    assert answer.startswith(error)
    assert answer.count(b"\r\n") == 1
    assert len(answer) > len(error) + 2, "the reason is missing"
    assertClosedFor(harness, client, error.split()[2].decode())


def test_everyDocumentedErrorIsTested():
    """
    Each error code PROTOCOL.md lists for TCP is among the cases above, on
    the side (open or closed) the document gives it.
    """
    protocol = (REPO / "PROTOCOL.md").read_text()
    documented = {
        code: connection
        for code, connection in re.findall(
            r"^\| `([A-Z_]+)` \|.*\| (stays open|\*\*closed\*\*|-)[^|]* \|$", protocol, re.MULTILINE
        )
        if connection != "-"  # UDP only
    }
    tested = {error.split()[2].decode(): "stays open" for _, error in NON_FATAL_ERRORS}
    tested.update({error.split()[2].decode(): "**closed**" for _, error in FATAL_ERRORS})
    tested.update(
        {
            error.split()[2].decode(): "**closed**" if closes else "stays open"
            for *_, error, closes in AUTH_ERRORS
        }
    )
    # The limits' errors need a broker at its limits: tests/test_limits.py.
    tested[TOO_MANY_CLIENTS_ERROR.split()[2].decode()] = "**closed**"
    tested[TOO_MANY_SUBSCRIPTIONS_ERROR.split()[2].decode()] = "stays open"
    # tests/test_bounds.py.
    tested[TOO_MANY_ERRORS] = "**closed**"
    tested[FRAME_TIMEOUT] = "**closed**"
    tested[TOO_MANY_TOPICS] = "stays open"
    tested.update({error.split()[2].decode(): "stays open" for _, error in SHUTDOWN_ERRORS})
    assert documented == tested
    assert {code for code, connection in documented.items() if connection == "**closed**"} == (
        CLOSING
    )


def test_lineTooLongWithoutLineEnd(harness):
    """
    A client cannot make the broker buffer an endless line.
    """
    client = harness.connect()
    for sent in range(1, 10):  # noqa: B007 (how many it took, checked after)
        client.send(b"x" * 1000)
        if client.closing:
            break
    assert sent == 5
    assert client.received().startswith(b"ERR - LINE_TOO_LONG ")
    assertClosedFor(harness, client, "LINE_TOO_LONG")


def test_longestLineAccepted(harness):
    client = harness.connect()
    client.send(b"PING" + b" " * 4092 + b"\r\n")
    assert client.received() == b"PONG\r\n"
    assert not client.closing


def test_nothingWrittenAfterConnectionLost(harness):
    """
    A connection that is gone gets no message, ping or answer.
    """
    gone = harness.connect()
    gone.send(b"SUB 1 news\r\n")
    gone.received()
    gone.lose()
    publisher = harness.connect()
    publisher.send(b"PUB 1 news 2\r\nhi\r\n")
    for _ in range(5):
        harness.clock.advance(PING_INTERVAL)
    assert gone.received() == b""


def test_nothingWrittenWhileClosing(harness):
    """
    Once the broker has started closing a connection (here for a bad frame),
    messages published before it is gone are not written to it.
    """
    closing = harness.connect()
    closing.send(b"SUB 1 news\r\n" + b"x" * 5000)
    assert closing.closing
    closing.received()
    publisher = harness.connect()
    publisher.send(b"PUB 1 news 2\r\nhi\r\n")
    harness.clock.advance(PING_INTERVAL)
    assert closing.received() == b""


def logLinesWithoutTime(harness, name):
    """
    The events C{name} as logged, without the broker's name and the time
    that end every one.
    """
    return [line.rsplit(" broker=", 1)[0] for line in harness.logLines(name)]


def test_pingsAnswered(harness):
    """
    A client that answers each ping is never reported; its PONG proves it
    alive for the next interval, so it is pinged every other one.
    """
    client = harness.connect()
    for interval in range(1, 7):
        harness.clock.advance(PING_INTERVAL)
        if interval % 2:
            assert client.received() == b"PING\r\n"
            client.send(b"PONG\r\n")
        else:
            assert client.received() == b""
    assert harness.logLines("ping_missed") == []
    assert not client.closing


def test_aClientThatSpeaksIsNotPinged(harness):
    """
    Any frame proves a client alive: one that publishes in every interval
    is never pinged, and one that falls silent is pinged one interval after
    it last spoke.
    """
    client = harness.connect()
    for _ in range(3):
        client.send(b"PUB 1 news 2\r\nhi\r\n")
        harness.clock.advance(PING_INTERVAL)
        assert client.received() == b"PUBACK 1\r\n"
    harness.clock.advance(PING_INTERVAL)
    assert client.received() == b"PING\r\n"
    assert harness.logLines("ping_missed") == []


def test_missedPingsThenDropped(harness):
    """
    Each missed ping is logged with the client's address; after three in a
    row the connection is aborted and its subscriptions are forgotten,
    while a client that answers stays.  (Their SUBs proved both alive for
    the first interval: the first ping comes at the second.)
    """
    silent = harness.connect()
    silent.send(b"SUB 1 news\r\n")
    healthy = harness.connect()
    healthy.send(b"SUB 1 news\r\n")
    for client in (silent, healthy):
        client.received()

    for interval in range(1, 6):
        harness.clock.advance(PING_INTERVAL)
        if interval % 2:
            assert healthy.received() == b""
        else:
            assert healthy.received() == b"PING\r\n"
            healthy.send(b"PONG\r\n")

    assert silent.received() == b"PING\r\n" * 3
    assert logLinesWithoutTime(harness, "ping_missed") == [
        f"event=ping_missed session=1 client={silent.address} missed=1",
        f"event=ping_missed session=1 client={silent.address} missed=2",
    ]
    assert logLinesWithoutTime(harness, "client_dropped") == [
        f"event=client_dropped session=1 client={silent.address} missed=3"
    ]
    # Aborted, not closed gracefully: a silent peer may not be reading.
    assert silent.transport.disconnected
    silent.lose()
    assert harness.fields("disconnect") == [
        {
            "session": 1,
            "client": silent.address,
            "transport": "tcp",
            "reason": "missed_pings",
            "subscriptions": 1,
        }
    ]
    publisher = harness.connect()
    publisher.send(b"PUB 1 news 2\r\nhi\r\n")
    assert harness.fields("publish")[0]["subscribers"] == 1
    assert messages(healthy.received()) == [(b"news", b"hi")]
    assert silent.received() == b""
    assert not healthy.closing


def test_pongResetsMissedPings(harness):
    client = harness.connect()
    for _ in range(3):
        harness.clock.advance(PING_INTERVAL)
    client.send(b"PONG\r\n")
    # Heard from: not pinged at the next sweep, pinged at the one after.
    for _ in range(4):
        harness.clock.advance(PING_INTERVAL)
    assert [fields["missed"] for fields in harness.fields("ping_missed")] == [1, 2, 1, 2]
    assert not client.closing


SESSION = b"".join(
    [
        b"SUB 1 news\r\n",
        b"PUB 2 news 12\r\nline\r\nline\r\n\r\n",
        b"FROB\r\n",
        b"PUB 3 +bad 4\r\nPING\r\n",
        b"PUB 4 news 17\r\n" + b"\n" * 17 + b"\r\n",
        b"ping\n",
        b"SUB 5 sport\n",
        b"PUB 6 sport 0\r\n\r\n",
    ]
)


def sessionOutput(chunks):
    client = BrokerHarness(SMALL_MAX_PAYLOAD_CONFIG).connect()
    client.send(*chunks)
    assert not client.closing
    return client.received()


def test_sessionSplitAnywhere():
    """
    However the client's bytes are cut into reads, the broker answers the
    same.
    """
    expected = sessionOutput([SESSION])
    assert [frame.verb for frame in decodeFrames(expected)] == [
        b"SUBACK",
        b"MSG",
        b"PUBACK",
        b"ERR",
        b"ERR",
        b"ERR",
        b"PONG",
        b"SUBACK",
        b"MSG",
        b"PUBACK",
    ]
    for position in range(1, len(SESSION)):
        assert sessionOutput(splitAt(SESSION, [position])) == expected, position
    assert sessionOutput(SESSION[i : i + 1] for i in range(len(SESSION))) == expected


@pytest.mark.parametrize(
    "request_",
    [
        b"PUB 6 a/# 2 to-matching=1 retain=1\r\nhi\r\n",
        b"TOPICS 6 limit=-1\r\n",
        b"TOPICS 6 limit=many\r\n",
        # Digits to str.isdigit, not to int(), or not ASCII.
        "TOPICS 6 limit=\u00b2\r\n".encode(),
        "TOPICS 6 limit=\u0661\r\n".encode(),
        b"TOPICS 6 limit=+5\r\n",
        b"TOPICS 6 limit=1_0\r\n",
    ],
)
def test_conflictingOrMalformedOptionsAreRefused(request_):
    """
    Options that contradict each other, or a limit that is not a whole
    number, get a clear BAD_ARGUMENTS instead of being half obeyed.
    """
    client = BrokerHarness().connect()
    client.send(request_)
    assert client.received().startswith(b"ERR 6 BAD_ARGUMENTS ")


def countWrites(client):
    """
    Count the writes the broker makes to C{client}'s transport, a
    C{writeSequence} as one.
    """
    writes = []
    transport = client.transport
    for name in ("write", "writeSequence"):
        original = getattr(transport, name)

        def counted(data, original=original):
            writes.append(data)
            original(data)

        setattr(transport, name, counted)
    return writes


def test_oneWritePerReadAndConnection(harness):
    """
    What one read of pipelined PUBs makes the broker send is written with
    one write per connection, in order: every PUBACK to the publisher, every
    MSG to each subscriber.
    """
    subscribers = [harness.connect() for _ in range(2)]
    for subscriber in subscribers:
        subscriber.send(b"SUB s news mode=fire\r\n")
        subscriber.received()
    publisher = harness.connect()
    writes = {client: countWrites(client) for client in [publisher, *subscribers]}
    publisher.send(b"".join(b"PUB %d news 2\r\nm%d\r\n" % (n, n) for n in range(1, 6)))
    assert publisher.received() == b"".join(b"PUBACK %d\r\n" % n for n in range(1, 6))
    for subscriber in subscribers:
        assert subscriber.received() == b"".join(
            b"MSG news 2 sub=s seq=%d\r\nm%d\r\n" % (n, n) for n in range(1, 6)
        )
    assert [len(written) for written in writes.values()] == [1, 1, 1]


def test_framesOfTheReadGoOutBeforeAClose(harness):
    """
    A frame held for the end of a read still reaches the client when the
    broker closes the connection during that read (after a BYE).
    """
    client = harness.connect()
    client.send(b"PUB 1 news 2\r\nhi\r\nBYE\r\nPUB 2 news 2\r\nhi\r\n")
    assert client.received() == b"PUBACK 1\r\nBYE\r\n"
    assert client.closing


# Runs of plain PUBs (BrokerProtocol.runReceived): published together when
# per-message events are off, with what one by one would give.

# A read of pipelined frames: runs of plain PUBs on one topic, broken by
# what is not one (another topic, a topic with '%', options, a lower-case
# verb, a refused topic, a blank line, an oversized payload), and a PUB cut
# between two reads.
MIXED_READS = (
    b"PUB 1 news 2\r\nm1\r\nPUB 2 news 3\r\nm-2\r\nPUB 3 news 0\r\n\r\n"
    b"PUB 4 news%d 2\r\nm4\r\nPUB 5 news%d 2\r\nm5\r\nPUB 6 news 2\r\nm6\r\n"
    b"PUB 7 news 2 to-matching=1\r\nm7\r\npub 8 news 2\r\nm8\r\nPUB 9 +bad 2\r\nm9\r\n"
    b"\r\nPUB 10 news 17\r\n0123456789abcdefg\r\nPUB 11 news 3\r\nm11\r\nPUB 12 ne",
    b"ws 3\r\nm12\r\nPUB 13 news 3\r\nm13\r\n",
)


def mixedPublishes(messageEvents, runs=True):
    """
    A subscriber in C{fire} mode to C{news} and C{news%d}, another in C{all}
    mode to C{other}, and a publisher sending L{MIXED_READS}.

    @param runs: whether the broker takes runs of PUBs (else each is read
        as a frame).
    @return: what the publisher and the C{fire} subscriber read, and the
        broker's counters.
    """
    harness = BrokerHarness(BrokerConfig(maxPayload=16, messageEvents=messageEvents))
    if not runs:
        harness.broker.acceptsRun = lambda subscriber, topic: False
    subscriber = harness.connect()
    subscriber.send(b"SUB s1 news mode=fire\r\nSUB s%2 news%d mode=fire\r\n")
    other = harness.connect()
    other.send(b"SUB o other mode=all\r\n")
    subscriber.received()
    publisher = harness.connect()
    publisher.send(*MIXED_READS)
    return publisher.received(), subscriber.received(), dict(harness.broker.counters)


def test_runsAsOneByOne():
    """
    Pipelined PUBs published as runs, together (per-message events off)
    or one by one (on), give the publisher, the subscriber and the counters
    exactly what reading each frame on its own gives.
    """
    byFrame = mixedPublishes(messageEvents=False, runs=False)
    assert mixedPublishes(messageEvents=False) == byFrame
    assert mixedPublishes(messageEvents=True) == byFrame
    acks, delivered, counters = mixedPublishes(messageEvents=False)
    assert acks.split(b"\r\n") == [
        *(b"PUBACK %d" % n for n in range(1, 7)),
        b"PUBACK 7 topics=1",
        b"PUBACK 8",
        b"ERR 9 BAD_TOPIC '+' and '#' are reserved for subscription wildcards",
        b"ERR 10 PAYLOAD_TOO_LARGE payload of 17 bytes is larger than the maximum of 16",
        *(b"PUBACK %d" % n for n in range(11, 14)),
        b"",
    ]
    assert delivered.startswith(
        b"MSG news 2 sub=s1 seq=1\r\nm1\r\nMSG news 3 sub=s1 seq=2\r\nm-2\r\n"
        b"MSG news 0 sub=s1 seq=3\r\n\r\nMSG news%d 2 sub=s%2 seq=1\r\nm4\r\n"
    )
    assert (counters["published"], counters["delivered"], counters["fired"]) == (11, 11, 11)
    assert delivered.endswith(b"MSG news 3 sub=s1 seq=9\r\nm13\r\n")


def test_runsPublishedTogether(monkeypatch):
    """
    With per-message events off, a read of plain PUBs on one topic to
    C{fire} subscribers is published as one run: the first PUB on a topic
    on its own (its topic is checked), the others together.
    """
    harness = BrokerHarness(BrokerConfig(messageEvents=False))
    publishes = []
    original = harness.broker.router.publish
    monkeypatch.setattr(
        harness.broker.router,
        "publish",
        lambda *arguments, **options: (
            publishes.append(arguments) or original(*arguments, **options)
        ),
    )
    subscriber = harness.connect()
    subscriber.send(b"SUB s news mode=fire\r\n")
    subscriber.received()
    publisher = harness.connect()
    publisher.send(b"".join(b"PUB %d news 3\r\n%03d\r\n" % (n, n) for n in range(1, 101)))
    assert publisher.received() == b"".join(b"PUBACK %d\r\n" % n for n in range(1, 101))
    assert subscriber.received() == b"".join(
        b"MSG news 3 sub=s seq=%d\r\n%03d\r\n" % (n, n) for n in range(1, 101)
    )
    assert len(publishes) == 1
    counters = harness.broker.counters
    assert (counters["published"], counters["fired"], counters["bytes_out"]) == (100, 100, 300)


def test_ownMessagesOneByOne():
    """
    A publisher subscribed to its own topic reads each of its messages
    before the PUBACK of its PUB, pipelined or not: a run to it is
    published one by one.
    """
    harness = BrokerHarness(BrokerConfig(messageEvents=False))
    client = harness.connect()
    client.send(b"SUB s news mode=fire\r\n")
    client.received()
    client.send(b"".join(b"PUB %d news 2\r\nm%d\r\n" % (n, n) for n in range(1, 4)))
    assert client.received() == b"".join(
        b"MSG news 2 sub=s seq=%d\r\nm%d\r\nPUBACK %d\r\n" % (n, n, n) for n in range(1, 4)
    )
