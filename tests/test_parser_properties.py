"""
Property tests of everything that parses bytes from the network: the
broker's TCP protocol, the TCP client, and both sides of UDP.

The inputs are mostly frames of the protocol, whole, mutated or cut short
(random bytes alone almost never get past the first control line), mixed
with arbitrary bytes.  What is checked is what a peer would see: the bytes
written back, the log, whether the connection is closed, and that nothing
ever raises or logs a traceback.
"""

import json
from contextlib import contextmanager

from helpers import BrokerHarness, FakeDatagramTransport, splitAt
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.internet.error import ConnectionDone
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.logger import LogLevel, globalLogPublisher
from twisted.python.failure import Failure

from dallal.broker.core import BrokerConfig
from dallal.client import DallalClientProtocol, DallalDatagramClient
from dallal.protocol.framing import FrameReceiver
from dallal.server import udp

# Small limits make LINE_TOO_LONG and PAYLOAD_TOO_LARGE reachable by short
# inputs; the defaults are the broker's as shipped.
SMALL = BrokerConfig(maxControlLine=64, maxPayload=16, messageEvents=True)
DEFAULT = BrokerConfig(messageEvents=True)

# What the broker may send, and the codes of its ERR frames (PROTOCOL.md).
SERVER_VERBS = {
    b"PUBACK", b"SUBACK", b"UNSUBACK", b"ERR", b"MSG", b"STATS", b"LIST",
    b"TOPICS", b"PING", b"PONG", b"HELLO", b"BYE",
}  # fmt: skip
ERROR_CODES = {
    b"BAD_COMMAND", b"BAD_ARGUMENTS", b"BAD_ID", b"BAD_TOPIC", b"NOT_SUBSCRIBED",
    b"STORE_FAILED", b"PAYLOAD_TOO_LARGE", b"LINE_TOO_LONG", b"BAD_FRAMING",
    b"BAD_TOKEN", b"NO_SESSION", b"TOO_MANY_ERRORS",
}  # fmt: skip
FATAL_CODES = {b"LINE_TOO_LONG", b"BAD_FRAMING", b"TOO_MANY_ERRORS"}

# Hypothesis: derandomized so that a run is repeatable, and bounded so that
# the whole file runs in well under 20 seconds.
BOUNDED = settings(
    derandomize=True,
    deadline=None,
    max_examples=150,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# Inputs


# Any token at all: any bytes, and any Unicode text in UTF-8, weighted
# towards what trips parsers written for ASCII: digits of other scripts,
# superscripts, signs, and non-ASCII letters in base64.
anyTokens = st.binary(min_size=1, max_size=12) | st.text(
    st.characters() | st.sampled_from("\u00b2\u0661\U0001d7d9\u00bd+_-=\u00e9"),
    min_size=1,
    max_size=6,
).map(lambda text: text.encode("utf-8", "surrogatepass"))
ids = st.sampled_from([b"1", b"2", b"3", b"7", b"a", b"-", b"x" * 65, b"\xff", b"\x01"]) | anyTokens
topics = st.sampled_from(
    [
        b"news", b"a/b", b"a/+", b"a/#", b"#", b"+", b"$SYS/x", b"+bad", b"a/b#",
        b"\xc3\xa9", b"\xff", b"t" * 257, b"a//b", b"news\x00",
    ]
) | anyTokens  # fmt: skip
# Every option a request may carry, with any value.
OPTION_NAMES = [
    b"mode", b"retain", b"to-matching", b"limit", b"hops", b"origin", b"oid", b"bridge",
    b"user", b"password", b"token", b"client", b"id", b"seq",
]  # fmt: skip
anyOptions = st.tuples(st.sampled_from(OPTION_NAMES) | anyTokens, st.just(b"") | anyTokens).map(
    b"=".join
)
options = st.lists(
    st.sampled_from(
        [
            b"mode=all", b"mode=fire", b"mode=latest", b"mode=bogus", b"retain=1",
            b"to-matching=1", b"limit=2", b"limit=-1", b"limit=", b"=x", b"k",
            b"k=\xff", b"client=me", b"token=AAAA", b"id=1", b"seq=2", b"sub=1",
            b"redelivered=1", b"retained=1",
        ]
    ) | anyOptions,
    max_size=3,
).map(b" ".join)  # fmt: skip
lineEnds = st.sampled_from([b"\r\n", b"\r\n", b"\r\n", b"\n", b"\r", b""])
payloads = st.binary(max_size=24) | st.sampled_from([b"\r\n", b"\n\r", b"x\r", b"PUB 1 a 1"])


@st.composite
def publishFrames(draw):
    payload = draw(payloads)
    size = len(payload) + draw(st.sampled_from([0, 0, 0, 0, 1, -1, 5, 10**12]))
    sizeToken = draw(
        st.sampled_from([b"%d" % max(size, 0), b"%d" % max(size, 0), b"-1", b"x"]) | anyTokens
    )
    line = b" ".join(
        part for part in [b"PUB", draw(ids), draw(topics), sizeToken, draw(options)] if part
    )
    terminator = draw(st.sampled_from([b"\r\n", b"\r\n", b"\n", b"\r", b"x", b""]))
    return line + draw(lineEnds) + payload + terminator


def line(verb, *parts):
    return st.tuples(*parts).map(lambda drawn: b" ".join(p for p in (verb, *drawn) if p))


requestLines = st.one_of(
    line(b"SUB", ids, topics, options),
    line(b"SUB", ids, topics),
    line(b"UNSUB", ids, topics),
    line(b"ACK", ids),
    line(b"LIST", ids),
    line(b"TOPICS", ids, options),
    line(b"STATS", ids),
    line(b"HELLO", ids, st.sampled_from([b"me", b"you", b"\xff", b"c" * 65]) | anyTokens, options),
    st.sampled_from([b"PING", b"PONG", b"BYE", b"ping", b"", b"  ", b"NOPE 1", b"MSG a 1"]),
    line(b"SUB"),
    line(b"PUB", ids),
)

# Bytes a client sends: frames whole or broken, long lines, anything.
clientPieces = st.one_of(
    publishFrames(),
    st.tuples(requestLines, lineEnds).map(b"".join),
    st.binary(max_size=40),
    st.tuples(st.sampled_from([60, 63, 64, 65, 66, 200, 4095, 4096, 4097, 4098]), lineEnds).map(
        lambda drawn: b"L" * drawn[0] + drawn[1]
    ),
)


def mutate(data, edits):
    """
    Apply C{edits}, each C{(position, kind, byte)}: flip a byte, insert one
    or delete one.
    """
    data = bytearray(data)
    for position, kind, byte in edits:
        if not data:
            break
        position %= len(data)
        if kind == 0:
            data[position] = byte
        elif kind == 1:
            data.insert(position, byte)
        else:
            del data[position]
    return bytes(data)


edits = st.lists(
    st.tuples(
        st.integers(min_value=0, max_value=10**6),
        st.integers(min_value=0, max_value=2),
        st.sampled_from([0x0A, 0x0D, 0x20, 0x00, 0xFF, ord("1"), ord("=")]) | st.integers(0, 255),
    ),
    max_size=3,
)


@st.composite
def streams(draw, pieces=clientPieces):
    """
    A byte stream, and where to cut it into reads.
    """
    data = b"".join(draw(st.lists(pieces, min_size=1, max_size=12)))
    data = mutate(data, draw(edits))
    positions = sorted(
        set(draw(st.lists(st.integers(min_value=1, max_value=max(len(data) - 1, 1)), max_size=8)))
    )
    positions = [position for position in positions if position < len(data)]
    return data, positions


def everyByte(data, limit=1500):
    """
    C{data} one byte per read, or for a long stream in reads of a few bytes.
    """
    step = 1 if len(data) <= limit else 7
    return [data[i : i + step] for i in range(0, len(data), step)]


# Watching for what must never happen


@contextmanager
def noTracebacks(allowed=()):
    """
    Collect the events logged to Twisted's global log publisher (where
    unhandled errors, failures in Deferreds and the client's own log go),
    and fail if any is a failure or of level error or worse, except those
    whose format is in C{allowed}.
    """
    bad = []

    def observe(event):
        level = event.get("log_level")
        if "log_failure" in event or level in (LogLevel.error, LogLevel.critical):
            if event.get("log_format") not in allowed:
                bad.append(event)

    globalLogPublisher.addObserver(observe)
    try:
        yield bad
    finally:
        globalLogPublisher.removeObserver(observe)
    assert not bad, bad


def serverFrames(data, dataVerbs=(b"STATS", b"LIST", b"TOPICS")):
    """
    Cut what the broker wrote into C{(line, payload)}s, strictly: every
    control line ends with CRLF, and C{MSG} and data replies carry exactly
    the payload they announce and a CRLF.
    """
    frames = []
    position = 0
    while position < len(data):
        end = data.index(b"\r\n", position)
        frameLine = data[position:end]
        position = end + 2
        tokens = frameLine.split(b" ")
        payload = None
        if tokens[0] == b"MSG" or tokens[0] in dataVerbs:
            size = int(tokens[2])
            payload = data[position : position + size]
            assert data[position + size : position + size + 2] == b"\r\n", data
            position += size + 2
        frames.append((frameLine, payload))
    return frames


# The broker over TCP


def runBroker(config, chunks):
    """
    Feed C{chunks} to a new connection of a broker, one read each, all of
    them even once the broker has closed the connection: a TCP transport
    stops reading then, but TLS goes on delivering what it decrypts until
    the peer's close_notify.

    @return: what the peer sees: the bytes written, whether the connection
        was closed, and the broker's log.
    """
    harness = BrokerHarness(config)
    client = harness.connect()
    for chunk in chunks:
        client.send(chunk)
    written = client.received()
    closing = client.closing
    client.lose()
    return written, closing, harness


def errorsInTheLog(harness):
    """
    The refusals the broker's log accounts for: each logged, or counted in
    a report of those it did not log.
    """
    harness.broker.errorLog.reportSuppressed()
    suppressed = sum(event["count"] for event in harness.fields("protocol_errors_suppressed"))
    return len(harness.fields("protocol_error")) + suppressed


def checkBrokerOutput(written, closing, harness):
    frames = serverFrames(written)
    errors = []
    for frameLine, payload in frames:
        verb = frameLine.split(b" ")[0]
        assert verb in SERVER_VERBS, frameLine
        if verb == b"ERR":
            code = frameLine.split(b" ")[2]
            assert code in ERROR_CODES, frameLine
            errors.append(code)
        if payload is not None and verb != b"MSG":
            json.loads(payload)
    # Every refusal is answered, and counted in the log.
    assert len(errors) == errorsInTheLog(harness)
    assert harness.broker.stats()["errors"] == len(errors)
    fatal = [event["fatal"] for event in harness.fields("protocol_error")]
    if closing:
        # Closed only after saying why: a fatal ERR, or BYE to a client's BYE.
        lastLine = frames[-1][0]
        assert lastLine == b"BYE" or lastLine.split(b" ")[2] in FATAL_CODES, frames[-3:]
        assert fatal.count(True) == (lastLine != b"BYE")
    else:
        assert not any(code in FATAL_CODES for code in errors)
        assert not any(fatal)
    for event in harness.events:
        assert event["log_level"] in (LogLevel.info, LogLevel.warn), event
    [disconnect] = harness.fields("disconnect")
    assert harness.broker.stats()["connections"] == 0
    return disconnect


@BOUNDED
@given(config=st.sampled_from([SMALL, DEFAULT]), stream=streams())
def test_brokerAnswersTheSameHoweverTheStreamIsCut(config, stream):
    """
    Whatever a client sends, however it is cut into reads: the broker
    writes the same bytes, logs the same events and closes the connection
    (or not) the same way as for one read (so what arrives after it closed
    is ignored); it never raises; what it writes is well-formed frames;
    every refusal is an ERR that is logged; and it closes a connection only
    after a fatal ERR, or a BYE.
    """
    data, positions = stream
    with noTracebacks():
        whole = runBroker(config, [data])
        cut = runBroker(config, splitAt(data, positions))
        byteByByte = runBroker(config, everyByte(data))
    for result in (cut, byteByByte):
        assert result[:2] == whole[:2]
        assert result[2].logLines() == whole[2].logLines()
    disconnect = checkBrokerOutput(*whole)
    expectedReason = "closed"
    if whole[1] and not whole[0].endswith(b"BYE\r\n"):
        expectedReason = "protocol_error"
    assert disconnect["reason"] == expectedReason


@BOUNDED
@given(
    request_=st.sampled_from(
        [b"PUB 1 a 2 %s\r\nhi\r\n", b"PUB 1 a 2 origin=b oid=c %s\r\nhi\r\n", b"SUB 1 a %s\r\n",
         b"TOPICS 1 %s\r\n", b"HELLO 1 c user=u %s\r\n", b"LIST 1 %s\r\n"]
    ),
    name=st.sampled_from(OPTION_NAMES),
    value=anyTokens,
)  # fmt: skip
def test_brokerTakesAnyValueOfAnyOption(request_, name, value):
    """
    Every option of every request, with any value at all (a number in
    another script's digits, a password that is not ASCII...): the broker
    answers it, and never raises.
    """
    with noTracebacks():
        result = runBroker(DEFAULT, [request_ % (name + b"=" + value)])
    checkBrokerOutput(*result)


def test_brokerStreamRegression():
    """
    The frames the property above is built from, in one stream, with a known
    answer: a check that the inputs reach the broker's features.
    """
    data = (
        b"SUB 1 a/+ mode=all\r\n"
        b"PUB 2 a/b 2\r\nhi\r\n"
        b"ACK 1\r\n"
        b"PUB 3 +bad 2\r\nhi\r\n"
        b"PUB 4 a 99 \r\n" + b"x" * 99 + b"\r\n"
        b"STATS 5\r\n"
        b"PUB 6 a 1\r\nxy\r\n"
        b"PING\r\n"
    )
    written, closing, harness = runBroker(SMALL, [data])
    verbs = [frameLine.split(b" ")[0] for frameLine, _ in serverFrames(written)]
    assert verbs == [b"SUBACK", b"MSG", b"PUBACK", b"ERR", b"ERR", b"STATS", b"ERR"]
    assert closing
    assert written.endswith(
        b"ERR 6 BAD_FRAMING payload not followed by a line end: its size was wrong\r\n"
    )
    checkBrokerOutput(written, closing, harness)


def test_brokerIgnoresWhatArrivesAfterItClosed():
    """
    Once the broker has closed a connection for a framing error, later
    reads (which TLS delivers until the client's close_notify) are not
    acted upon: no subscription, no publish, nothing written.  Before the
    fix a SUB in a later read was carried out, and a PUB whose payload came
    in the read after its line was published (seen over a real TLS
    connection).
    """
    harness = BrokerHarness(SMALL)
    watcher = harness.connect()
    watcher.send(b"SUB 1 x mode=fire\r\n")
    client = harness.connect()
    client.send(b"L" * 100 + b"\r\n")
    assert client.received() == b"ERR - LINE_TOO_LONG control line longer than 64 bytes\r\n"
    assert client.closing
    client.send(b"SUB 10 x\r\n")
    client.send(b"PUB 11 x 2\r\n")
    client.send(b"hi\r\n")
    assert client.received() == b""
    assert watcher.received() == b"SUBACK 1\r\n"
    stats = harness.broker.stats()
    assert (stats["subscriptions"], stats["published"]) == (1, 0)


# FrameReceiver on its own: every callback, in order.


class Recorder(FrameReceiver):
    """
    Records its callbacks; C{P<n>} announces an n-byte payload, C{D<n>} one
    to discard.
    """

    MAX_LENGTH = 32

    def __init__(self):
        self.calls = []

    def lineReceived(self, line):
        self.calls.append(("line", line))
        if line[:1] in (b"P", b"D") and line[1:].isdigit():
            self.expectPayload(int(line[1:]), discard=line[:1] == b"D")

    def payloadReceived(self, payload):
        self.calls.append(("payload", payload))

    def payloadDiscarded(self, size):
        self.calls.append(("discarded", size))

    def lineLengthExceeded(self, line):
        self.calls.append(("too long",))
        self.transport.loseConnection()

    def payloadTerminatorMissing(self):
        self.calls.append(("terminator missing",))
        FrameReceiver.payloadTerminatorMissing(self)


def record(chunks):
    receiver = Recorder()
    transport = StringTransport()
    receiver.makeConnection(transport)
    for chunk in chunks:
        receiver.dataReceived(chunk)
    return receiver.calls, transport.disconnecting


receiverPieces = st.one_of(
    st.tuples(st.sampled_from([b"P", b"D"]), st.integers(0, 40), lineEnds, st.binary(max_size=40), lineEnds).map(
        lambda d: b"%s%d%s%s%s" % d
    ),
    st.binary(max_size=40),
    st.tuples(st.integers(28, 40), lineEnds).map(lambda d: b"x" * d[0] + d[1]),
)  # fmt: skip


@BOUNDED
@given(stream=streams(receiverPieces))
def test_frameReceiverCallbacksDoNotDependOnReads(stream):
    """
    The sequence of lines, payloads and errors is the same whatever the
    reads, and only a too-long line or a missing terminator closes.
    """
    data, positions = stream
    whole = record([data])
    assert record(splitAt(data, positions)) == whole
    assert record(everyByte(data)) == whole
    calls, closed = whole
    assert closed == (calls[-1:] in ([("too long",)], [("terminator missing",)]))
    for call in calls:
        if call[0] == "line":
            assert len(call[1]) <= Recorder.MAX_LENGTH and b"\n" not in call[1]


# The client over TCP


serverLines = st.one_of(
    line(b"MSG", topics, st.sampled_from([b"0", b"1", b"2", b"5", b"x", b"10000000000"]), options),
    st.sampled_from(
        [
            b"MSG news 2 sub=2 seq=1 id=1", b"MSG news 2 sub=2 seq=1 id=\xc3\xa9",
            b"MSG news 2 sub=2 seq=3 id=2 redelivered=1", b"MSG news 2 sub=2 seq=x",
            b"MSG news 2 sub=2 seq=-1 id=9", b"MSG news 2 sub=2 seq=1 id=",
            b"STATS 3 2", b"TOPICS 4 2", b"LIST 9 2", b"STATS 3 7",
        ]
    ),
    line(b"PUBACK", ids, options),
    line(b"SUBACK", ids),
    line(b"UNSUBACK", ids),
    line(b"HELLO", ids, options),
    line(b"ERR", ids, st.sampled_from([b"BAD_TOPIC", b"X", b""]), st.sampled_from([b"why", b"", b"\xff"])),
    st.sampled_from([b"PING", b"PONG", b"BYE", b"", b"WHAT 1", b"ERR", b"PUBACK"]),
)  # fmt: skip
jsonPayloads = st.sampled_from(
    [b"{}", b"[" * 5000, b"\xff\xfe", b"null", b'{"a": 1}', b"[]", b"1e999999", b'"\\ud800"', b""]
)


@st.composite
def dataReplies(draw):
    """
    A data reply or a message whose size is right, so that its payload is
    read.
    """
    payload = draw(jsonPayloads | payloads)
    head = draw(
        st.sampled_from([b"STATS 3", b"TOPICS 4", b"LIST 3", b"STATS 9", b"MSG news", b"MSG news"])
    )
    extra = draw(
        st.sampled_from(
            [b"", b" sub=2 seq=1 id=1", b" sub=2 seq=2", b" sub=9", b" sub=2 seq=1 id=\xc3\xa9"]
        )
    )
    if not head.startswith(b"MSG"):
        extra = b""
    return b"%s %d%s\r\n%s\r\n" % (head, len(payload), extra, payload)


serverPieces = st.one_of(
    dataReplies(),
    dataReplies(),
    dataReplies(),
    st.tuples(serverLines, lineEnds).map(b"".join),
    st.tuples(serverLines, lineEnds, payloads, lineEnds).map(b"".join),
    jsonPayloads,
    st.binary(max_size=30),
)


def runClient(chunks):
    """
    A client with requests of each kind waiting for their answers, fed the
    broker's side of the conversation.

    @return: what its user sees: messages handed over, how each request
        ended, and what it wrote to the broker.
    """
    client = DallalClientProtocol()
    transport = StringTransport()
    client.makeConnection(transport)
    seen = []
    outcomes = []

    def watch(name, deferred):
        deferred.addBoth(lambda result: outcomes.append((name, describeOutcome(result))))

    watch("publish", client.publish("news", b"x"))  # 1
    watch("subscribe", client.subscribe(["news"], lambda m: seen.append(m)))  # 2
    watch("stats", client.stats())  # 3
    watch("topics", client.topics())  # 4
    watch("matching", client.publishToMatching("a/#", b"y"))  # 5
    watch("hello", client.hello("me"))  # 6
    watch("ping", client.ping())
    for chunk in chunks:
        if transport.disconnecting:
            break
        client.dataReceived(chunk)
    written = transport.value()
    closing = transport.disconnecting
    client.connectionLost(Failure(ConnectionDone()))
    return seen, outcomes, written, closing


def describeOutcome(result):
    if isinstance(result, Failure):
        return (result.type.__name__, str(result.value))
    return repr(result)


UNEXPECTED_FRAME = "closing: unexpected frame from the broker: {reason}"


@settings(BOUNDED, max_examples=300)
@given(stream=streams(serverPieces))
def test_clientSurvivesAnythingFromTheServer(stream):
    """
    Whatever the server sends, however it is cut into reads: the client
    never raises or logs a traceback (a frame it cannot read is reported
    and closes the connection), and its user sees the same messages and
    request outcomes.
    """
    data, positions = stream
    with noTracebacks(allowed=(UNEXPECTED_FRAME,)):
        whole = runClient([data])
        assert runClient(splitAt(data, positions)) == whole
        assert runClient(everyByte(data)) == whole


def test_clientSurvivesDeeplyNestedJson():
    """
    A data reply nested too deeply for the JSON parser fails the request
    that asked for it, instead of raising out of the protocol (found by
    the property above).
    """
    payload = b"[" * 100_000
    with noTracebacks():
        seen, outcomes, written, closing = runClient(
            [b"STATS 3 %d\r\n%s\r\n" % (len(payload), payload)]
        )
    [(name, (error, reason))] = [outcome for outcome in outcomes if outcome[0] == "stats"]
    assert error == "ClientProtocolError"
    assert reason.startswith("unreadable STATS payload: maximum recursion depth exceeded")
    assert not closing


def test_clientDropsAMessageItCannotAck():
    """
    A message whose delivery id is not printable ASCII cannot be acked:
    the client drops it (with a warning) instead of raising out of the
    protocol when it tries to ack it (found by the property above), and
    goes on with the next.
    """
    with noTracebacks():
        seen, outcomes, written, closing = runClient(
            [
                b"SUBACK 2\r\n",
                b"MSG news 2 sub=2 seq=1 id=\xc3\xa9\r\nhi\r\n" * 2,
                b"MSG news 3 sub=2 seq=2 id=\r\nbye\r\n",
                b"MSG news 2 sub=2 seq=3 id=7\r\nok\r\n",
            ]
        )
    assert [message.payload for message in seen] == [b"ok"]
    assert written.endswith(b"ACK 7\r\n")
    assert written.count(b"ACK") == 1
    assert not closing


# The broker over UDP


SECRET = b"a fixed secret for the tests...."
ADDRESSES = [("127.0.0.1", 40001), ("127.0.0.1", 40002), ("10.0.0.9", 7), ("::1", 40001)]


def withToken(protocol, clientId, address):
    return b"client=%s token=%s" % (clientId, protocol.token(clientId, address))


@st.composite
def datagramSteps(draw):
    """
    A list of C{(address index, what to send, seconds to wait after)}.
    What to send is a description: the datagram needs the broker's tokens.
    """
    steps = []
    for _ in range(draw(st.integers(min_value=1, max_value=15))):
        kind = draw(st.sampled_from(["hello", "hello2", "request", "publish", "raw"]))
        if kind == "raw":
            spec = (kind, draw(st.binary(max_size=120)))
        else:
            spec = (
                kind,
                draw(st.sampled_from([b"me", b"you"])),
                # Whose token: this address's, another's, or none.
                draw(st.sampled_from(["own", "own", "other", "none"])),
                draw(
                    {
                        "hello": st.sampled_from([b"", b" pad=" + b"x" * 40]),
                        "hello2": st.just(b"") | options.map(lambda drawn: b" " + drawn),
                        "request": requestLines,
                        "publish": publishFrames(),
                    }[kind]
                ),
                draw(edits),
            )
        steps.append(
            (
                draw(st.integers(0, len(ADDRESSES) - 1)),
                spec,
                draw(st.sampled_from([0, 0, 0, 0.5, 1.0, 10.0])),
            )
        )
    return steps


def buildDatagram(protocol, address, spec):
    if spec[0] == "raw":
        return spec[1]
    kind, clientId, tokenFrom, frame, mutation = spec
    if tokenFrom == "own":
        tokenAddress = address
    else:
        tokenAddress = ADDRESSES[(ADDRESSES.index(address) + 1) % len(ADDRESSES)]
    identity = withToken(protocol, clientId, tokenAddress) if tokenFrom != "none" else b""
    if kind == "hello":
        data = b"HELLO 1 %s%s\r\n" % (clientId, frame)
    elif kind == "hello2":
        token = protocol.token(clientId, tokenAddress)
        data = b"HELLO 2 %s token=%s%s\r\n" % (clientId, token, frame)
    elif kind == "request":
        data = frame + b" " + identity + b"\r\n"
    else:
        line, _, rest = frame.partition(b"\n")
        data = line.rstrip(b"\r") + b" " + identity + b"\r\n" + rest
    return mutate(data, mutation)


@BOUNDED
@given(steps=datagramSteps())
def test_udpBrokerSurvivesAnyDatagrams(steps):
    """
    Whatever datagrams arrive, from whichever addresses, with or without
    valid tokens: the broker never raises or logs a traceback, and an
    address that never echoed its token is sent at most three times the
    bytes it sent, whatever sessions others have.
    """
    harness = BrokerHarness(SMALL)
    protocol = udp.BrokerDatagramProtocol(harness.broker, harness.sweep, secret=SECRET)
    transport = FakeDatagramTransport()
    protocol.makeConnection(transport)
    received = dict.fromkeys(ADDRESSES, 0)
    proven = set()
    with noTracebacks():
        for index, spec, wait in steps:
            address = ADDRESSES[index]
            data = buildDatagram(protocol, address, spec)
            received[address] += len(data)
            tokens = [protocol.token(clientId, address) for clientId in (b"me", b"you")]
            if any(token in data for token in tokens):
                proven.add(address)
            protocol.datagramReceived(data, address)
            harness.clock.advance(wait)
        # Resends and expiry, until every session has expired.
        for _ in range(20):
            harness.clock.advance(4)
    for address in ADDRESSES:
        if address not in proven:
            sent = sum(len(data) for data, to in transport.written if to == address)
            assert sent <= 3 * received[address], (address, sent, received[address])
    for event in harness.events:
        assert event["log_level"] in (LogLevel.info, LogLevel.warn), event
    assert harness.broker.stats()["connections"] == 0
    assert harness.broker.stats()["errors"] == errorsInTheLog(harness)


# The client over UDP


@BOUNDED
@given(datagrams=st.lists(st.one_of(serverPieces, st.binary(max_size=60)), max_size=10))
def test_udpClientSurvivesAnyDatagrams(datagrams):
    """
    A UDP client in session is handed arbitrary datagrams from the broker's
    address: it never raises or logs a traceback.
    """
    clock = Clock()
    broker = ("127.0.0.1", 1234)
    client = DallalDatagramClient(clock, broker, clientId="me")
    transport = FakeDatagramTransport()
    client.makeConnection(transport)
    with noTracebacks():
        started = []
        client.handshake().addBoth(started.append)
        client.datagramReceived(b"HELLO 1 token=T\r\n", broker)
        client.datagramReceived(b"HELLO 2 token=T ping=10 max-payload=100 session=new\r\n", broker)
        assert started == [client]
        outcomes = []
        client.subscribe(["news"], lambda m: None).addBoth(outcomes.append)
        client.stats().addBoth(outcomes.append)
        for data in datagrams:
            client.datagramReceived(data, broker)
            clock.advance(0.5)
        client.close().addBoth(outcomes.append)
        clock.advance(60)
