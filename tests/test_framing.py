"""
L{dallal.protocol.framing.FrameReceiver}: control lines and counted payloads, however
the stream is cut into reads.
"""

import itertools

import pytest
from helpers import splitAt
from hypothesis import given, settings, strategies
from twisted.internet.testing import StringTransport

from dallal.protocol.framing import FrameReceiver


class RecordingReceiver(FrameReceiver):
    """
    Records what it receives.  A line C{PAYLOAD <n>} announces an n-byte
    payload, C{SKIP <n>} one to discard, C{PAUSE} pauses the receiver and
    C{CLOSE} closes the connection.
    """

    MAX_LENGTH = 64

    def __init__(self):
        self.received = []

    def lineReceived(self, line):
        self.received.append(("line", line))
        verb, _, argument = line.partition(b" ")
        if verb == b"PAYLOAD":
            self.expectPayload(int(argument))
        elif verb == b"SKIP":
            self.expectPayload(int(argument), discard=True)
        elif verb == b"PAUSE":
            self.pauseProducing()
        elif verb == b"CLOSE":
            self.transport.loseConnection()

    def payloadReceived(self, payload):
        self.received.append(("payload", payload))

    def payloadDiscarded(self, size):
        self.received.append(("discarded", size))

    def lineLengthExceeded(self, line):
        self.received.append(("too long", len(line)))
        self.transport.loseConnection()

    def payloadTerminatorMissing(self):
        self.received.append(("terminator missing",))
        FrameReceiver.payloadTerminatorMissing(self)


def receive(chunks):
    """
    Feed C{chunks} to a new L{RecordingReceiver}, one read each.
    """
    receiver = RecordingReceiver()
    transport = StringTransport()
    receiver.makeConnection(transport)
    for chunk in chunks:
        receiver.dataReceived(chunk)
    return receiver, transport


# Frames whose payloads hold what a line parser would trip on: line ends of
# both kinds, a CR just before the terminator, a lone CR, NUL, every byte
# value; with CRLF and bare LF line ends, an empty payload and a skipped one.
STREAM = b"".join(
    [
        b"hello\r\n",
        b"PAYLOAD 12\r\nline1\r\nline2\r\n",
        b"bare\n",
        b"PAYLOAD 3\nab\r\n",
        b"PAYLOAD 2\r\n\r\n\r\n",
        b"PAYLOAD 1\r\n\n\n",
        b"PAYLOAD 0\r\n\r\n",
        b"\r\n",
        b"SKIP 5\r\n\r\n\r\nx\r\n",
        b"PAYLOAD 256\r\n" + bytes(range(256)) + b"\r\n",
        b"PAYLOAD 4\r\na\rb\x00\n",
        b"last line\r\n",
    ]
)

EXPECTED = [
    ("line", b"hello"),
    ("line", b"PAYLOAD 12"),
    ("payload", b"line1\r\nline2"),
    ("line", b"bare"),
    ("line", b"PAYLOAD 3"),
    ("payload", b"ab\r"),
    ("line", b"PAYLOAD 2"),
    ("payload", b"\r\n"),
    ("line", b"PAYLOAD 1"),
    ("payload", b"\n"),
    ("line", b"PAYLOAD 0"),
    ("payload", b""),
    ("line", b""),
    ("line", b"SKIP 5"),
    ("discarded", 5),
    ("line", b"PAYLOAD 256"),
    ("payload", bytes(range(256))),
    ("line", b"PAYLOAD 4"),
    ("payload", b"a\rb\x00"),
    ("line", b"last line"),
]


def test_wholeStream():
    receiver, transport = receive([STREAM])
    assert receiver.received == EXPECTED
    assert not transport.disconnecting


def test_splitAnywhere():
    """
    The stream cut in two at any byte gives the same lines and payloads.
    """
    for position in range(1, len(STREAM)):
        receiver, _ = receive(splitAt(STREAM, [position]))
        assert receiver.received == EXPECTED, f"split at {position}"


def test_oneByteAtATime():
    receiver, _ = receive(STREAM[i : i + 1] for i in range(len(STREAM)))
    assert receiver.received == EXPECTED


@settings(derandomize=True, max_examples=300, deadline=None)
@given(
    strategies.lists(
        strategies.integers(min_value=1, max_value=len(STREAM) - 1),
        max_size=40,
        unique=True,
    ).map(sorted)
)
def test_splitManyTimes(positions):
    receiver, _ = receive(splitAt(STREAM, positions))
    assert receiver.received == EXPECTED


def test_longestLineAccepted():
    """
    A line of exactly C{MAX_LENGTH} bytes is accepted, even when its CRLF
    arrives in pieces after it.
    """
    line = b"x" * RecordingReceiver.MAX_LENGTH
    receiver, transport = receive([line, b"\r", b"\nnext\n"])
    assert receiver.received == [("line", line), ("line", b"next")]
    assert not transport.disconnecting


@pytest.mark.parametrize("ending", [b"\r\n", b"\n"])
def test_lineTooLong(ending):
    """
    A line over C{MAX_LENGTH} is refused and nothing after it is delivered.
    """
    line = b"x" * (RecordingReceiver.MAX_LENGTH + 1)
    receiver, transport = receive([b"first\r\n" + line + ending + b"after\r\n"])
    assert receiver.received == [("line", b"first"), ("too long", len(line))]
    assert transport.disconnecting


def test_lineTooLongWithoutLineEnd():
    """
    A peer that never sends a line end cannot make the receiver buffer much
    more than a line: the line is refused as soon as it cannot fit.
    """
    receiver, transport = receive([])
    limit = RecordingReceiver.MAX_LENGTH + 2  # the line, its CR, one more
    for sent in range(1, 2 * limit):
        receiver.dataReceived(b"y")
        if receiver.received:
            break
    assert receiver.received == [("too long", sent)]
    assert sent <= limit
    assert transport.disconnecting


def test_longPayloadIsNotALine():
    """
    A payload may be far longer than a control line.
    """
    payload = b"z" * (RecordingReceiver.MAX_LENGTH * 100)
    receiver, transport = receive(
        [b"PAYLOAD %d\r\n" % len(payload), payload[:1000], payload[1000:] + b"\r\n"]
    )
    assert receiver.received == [("line", b"PAYLOAD %d" % len(payload)), ("payload", payload)]
    assert not transport.disconnecting


@pytest.mark.parametrize(
    "after",
    [b"X\r\n", b"\rX\n", b"abcd\r\n"],
    ids=["other byte", "CR then other byte", "more bytes than announced"],
)
def test_payloadTerminatorMissing(after):
    """
    When the payload is not followed by a line end its size was wrong:
    framing is lost, the connection closes and nothing more is delivered.
    """
    receiver, transport = receive([b"PAYLOAD 3\r\nabc" + after + b"later\r\n"])
    assert receiver.received == [("line", b"PAYLOAD 3"), ("terminator missing",)]
    assert transport.disconnecting


def test_payloadWaitsForTerminator():
    """
    A payload is delivered only once its line end has arrived.
    """
    receiver, _ = receive([b"PAYLOAD 3\r\nabc\r"])
    assert receiver.received == [("line", b"PAYLOAD 3")]
    receiver.dataReceived(b"\n")
    assert receiver.received == [("line", b"PAYLOAD 3"), ("payload", b"abc")]


def test_nothingAfterClose():
    """
    Once a callback closes the connection, the rest of the read is dropped.
    """
    receiver, _ = receive([b"one\r\nCLOSE\r\ntwo\r\nPAYLOAD 1\r\nx\r\n"])
    assert receiver.received == [("line", b"one"), ("line", b"CLOSE")]


def test_pauseAndResume():
    """
    While paused, frames already received wait; resuming delivers them in
    order, payloads included.
    """
    receiver, transport = receive([b"PAUSE\r\nPAYLOAD 2\r\nhi\r\nafter\r\n"])
    assert receiver.received == [("line", b"PAUSE")]
    assert transport.producerState == "paused"
    receiver.dataReceived(b"more\r\n")
    assert receiver.received == [("line", b"PAUSE")]
    receiver.resumeProducing()
    assert transport.producerState == "producing"
    assert receiver.received == [
        ("line", b"PAUSE"),
        ("line", b"PAYLOAD 2"),
        ("payload", b"hi"),
        ("line", b"after"),
        ("line", b"more"),
    ]


def test_payloadArrivingWhilePaused():
    """
    A payload that arrives in pieces while the receiver is paused is
    delivered whole on resume, and what looks like a command inside it is
    not obeyed.
    """
    receiver, _ = receive([b"PAUSE\r\nPAYLOAD 8\r\nPA", b"USE\r\n", b"x\r\nend\n"])
    assert receiver.received == [("line", b"PAUSE")]
    receiver.resumeProducing()
    assert receiver.received == [
        ("line", b"PAUSE"),
        ("line", b"PAYLOAD 8"),
        ("payload", b"PAUSE\r\nx"),
        ("line", b"end"),
    ]


def test_manySmallFrames():
    """
    Thousands of pipelined frames in one read are all delivered.
    """
    frames = [(b"PAYLOAD 1\r\n%d\r\n" % (i % 10)) for i in range(5000)]
    receiver, _ = receive([b"".join(frames)])
    payloads = [item for kind, item in receiver.received if kind == "payload"]
    assert payloads == [b"%d" % (i % 10) for i in range(5000)]


def test_everySplitOfTwoFrames():
    """
    Every way of cutting a short stream in three reads gives the same result.
    """
    stream = b"PAYLOAD 3\r\n\r\n\n\r\nok\n"
    expected = [("line", b"PAYLOAD 3"), ("payload", b"\r\n\n"), ("line", b"ok")]
    for first, second in itertools.combinations(range(1, len(stream)), 2):
        receiver, _ = receive(splitAt(stream, [first, second]))
        assert receiver.received == expected, (first, second)
