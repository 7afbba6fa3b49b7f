"""
L{dallal.client.DallalClientProtocol} over an in-memory transport: what it
sends, and how its Deferreds answer what the broker sends back.
"""

import re

import pytest
from helpers import splitAt
from twisted.internet.defer import TimeoutError
from twisted.internet.error import ConnectionDone, ConnectionLost
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure

from dallal.client import ClosedUnanswered, DallalClientProtocol, ServerError


class Outcome:
    """
    Where a Deferred got to: C{result} once it fired, C{failure} if it
    failed, neither while it waits.
    """

    def __init__(self, deferred):
        self.fired = False
        self.result = None
        self.failure = None
        deferred.addCallbacks(self._succeeded, self._failed)

    def _succeeded(self, result):
        self.fired = True
        self.result = result

    def _failed(self, failure):
        self.fired = True
        self.failure = failure


@pytest.fixture
def connection():
    """
    A connected client and its transport.
    """
    client = DallalClientProtocol()
    transport = StringTransport()
    client.makeConnection(transport)
    return client, transport


def sentIds(transport, verb):
    """
    The request ids of the C{verb} frames written so far, in order.
    """
    return re.findall(rb"^" + verb + rb" (\S+)", transport.value(), re.MULTILINE)


def test_publishFrame(connection):
    client, transport = connection
    client.publish("news", b"hello\r\nworld")
    (requestId,) = sentIds(transport, b"PUB")
    assert transport.value() == b"PUB %s news 12\r\nhello\r\nworld\r\n" % requestId


def test_publishFiresOnPubAck(connection):
    client, transport = connection
    outcome = Outcome(client.publish("news", b"hi"))
    assert not outcome.fired
    (requestId,) = sentIds(transport, b"PUB")
    client.dataReceived(b"PUBACK %s\r\n" % requestId)
    assert outcome.fired and outcome.failure is None


def test_pipelinedAcksMatchById(connection):
    """
    Acks are matched to their request by id, whatever their order.
    """
    client, transport = connection
    outcomes = [Outcome(client.publish("news", b"%d" % i)) for i in range(3)]
    first, second, third = sentIds(transport, b"PUB")
    assert len({first, second, third}) == 3
    client.dataReceived(b"PUBACK %s\r\n" % third)
    assert [outcome.fired for outcome in outcomes] == [False, False, True]
    client.dataReceived(b"PUBACK %s\r\nPUBACK %s\r\n" % (first, second))
    assert [outcome.fired for outcome in outcomes] == [True, True, True]


def test_errorFailsWithServerError(connection):
    client, transport = connection
    outcome = Outcome(client.publish("news", b"hi"))
    (requestId,) = sentIds(transport, b"PUB")
    client.dataReceived(b"ERR %s BAD_TOPIC no such topic, really\r\n" % requestId)
    error = outcome.failure.value
    assert isinstance(error, ServerError)
    assert (error.code, error.reason) == ("BAD_TOPIC", "no such topic, really")
    assert client.connected and not transport.disconnecting


def test_subscribeFiresWhenEveryTopicIsAcknowledged(connection):
    client, transport = connection
    outcome = Outcome(client.subscribe(["a", "b"], lambda message: None))
    assert re.findall(rb"^SUB \S+ (\S+)\r$", transport.value(), re.MULTILINE) == [b"a", b"b"]
    first, second = sentIds(transport, b"SUB")
    client.dataReceived(b"SUBACK %s\r\n" % second)
    assert not outcome.fired
    client.dataReceived(b"SUBACK %s\r\n" % first)
    assert outcome.fired and outcome.failure is None


def test_subscribeFailsOnRefusal(connection):
    client, transport = connection
    outcome = Outcome(client.subscribe(["a", "b"], lambda message: None))
    first, second = sentIds(transport, b"SUB")
    client.dataReceived(b"SUBACK %s\r\nERR %s BAD_TOPIC no\r\n" % (first, second))
    assert isinstance(outcome.failure.value, ServerError)
    assert outcome.failure.value.code == "BAD_TOPIC"


def test_pendingRequestsFailWhenConnectionIsLost(connection):
    client, transport = connection
    published = Outcome(client.publish("news", b"hi"))
    subscribed = Outcome(client.subscribe(["news"], lambda message: None))
    pinged = Outcome(client.ping())
    client.connectionLost(Failure(ConnectionLost("gone")))
    for outcome in (published, subscribed, pinged):
        assert outcome.failure is not None
        assert outcome.failure.check(ConnectionLost)


def test_closedBeforeAnyAnswer(connection):
    """
    A broker that closes the connection before it sent a single frame (a
    TLS port does so to a plain client) fails what waits with
    L{ClosedUnanswered}, still a C{ConnectionDone}.
    """
    client, transport = connection
    published = Outcome(client.publish("news", b"hi"))
    client.connectionLost(Failure(ConnectionDone()))
    assert published.failure.check(ClosedUnanswered)
    assert published.failure.check(ConnectionDone)


def test_closedAfterAnAnswer(connection):
    client, transport = connection
    client.ping()
    client.dataReceived(b"PONG\r\n")
    published = Outcome(client.publish("news", b"hi"))
    client.connectionLost(Failure(ConnectionDone()))
    assert published.failure.type is ConnectionDone


def test_lateAndUnknownAcksAreIgnored(connection):
    """
    An ack for a request that is already answered, or that never existed,
    changes nothing and does not close the connection.
    """
    client, transport = connection
    outcome = Outcome(client.publish("news", b"hi"))
    (requestId,) = sentIds(transport, b"PUB")
    client.dataReceived(b"PUBACK %s\r\n" % requestId)
    client.dataReceived(b"PUBACK %s\r\nSUBACK 999\r\nPUBACK nope\r\n" % requestId)
    assert outcome.fired and outcome.failure is None
    assert not transport.disconnecting
    after = Outcome(client.publish("news", b"again"))
    client.dataReceived(b"PUBACK %s\r\n" % sentIds(transport, b"PUB")[-1])
    assert after.fired and after.failure is None


def test_ackTimeout(connection):
    """
    A request given a timeout fails with C{TimeoutError} when it expires,
    and its ack arriving afterwards is ignored.
    """
    client, transport = connection
    clock = Clock()
    outcome = Outcome(client.publish("news", b"hi").addTimeout(10, clock))
    clock.advance(9.9)
    assert not outcome.fired
    clock.advance(0.1)
    assert outcome.failure.check(TimeoutError)
    (requestId,) = sentIds(transport, b"PUB")
    client.dataReceived(b"PUBACK %s\r\n" % requestId)
    assert not transport.disconnecting
    assert clock.getDelayedCalls() == []


def test_answersPing(connection):
    client, transport = connection
    client.dataReceived(b"PING\r\n")
    assert transport.value() == b"PONG\r\n"


def test_pingFiresOnPong(connection):
    client, transport = connection
    outcome = Outcome(client.ping())
    assert transport.value() == b"PING\r\n"
    assert not outcome.fired
    client.dataReceived(b"PONG\r\n")
    assert outcome.fired and outcome.failure is None


# The first SUB's id is 1 (news), the second's 2 (a/b).
MESSAGES = (
    b"MSG news 12 sub=1 seq=1\r\nline\r\nline\r\n\r\n"
    b"MSG a/b 0 sub=2 seq=1\r\n\r\n"
    b"MSG news 3 sub=1 seq=2\r\n\x00\xff\n\r\n"
)


def receivedBy(chunks):
    client = DallalClientProtocol()
    transport = StringTransport()
    client.makeConnection(transport)
    received = []
    client.subscribe(["news", "a/b"], received.append)
    for requestId in sentIds(transport, b"SUB"):
        client.dataReceived(b"SUBACK %s\r\n" % requestId)
    for chunk in chunks:
        client.dataReceived(chunk)
    return [(message.topic, message.payload) for message in received]


def test_messagesReachTheHandler():
    """
    Each C{MSG} reaches the handler with its topic and its payload intact,
    however the stream is cut.
    """
    expected = [("news", b"line\r\nline\r\n"), ("a/b", b""), ("news", b"\x00\xff\n")]
    assert receivedBy([MESSAGES]) == expected
    for position in range(1, len(MESSAGES)):
        assert receivedBy(splitAt(MESSAGES, [position])) == expected, position


def subscribed(client, transport, topic, onMessage, onGap=None):
    """
    Subscribe C{client} to C{topic} and answer its SubAck.

    @return: the subscription's id, the broker's C{sub=}.
    """
    client.subscribe(topic, onMessage, onGap=onGap)
    subscriptionId = sentIds(transport, b"SUB")[-1]
    client.dataReceived(b"SUBACK %s\r\n" % subscriptionId)
    return subscriptionId


def test_eachSubscriptionHasItsOwnHandlers(connection):
    """
    Subscribing to another topic with other handlers leaves the first
    subscription's in place: each gets its own messages and its own gaps.
    """
    client, transport = connection
    first, second, firstGaps, secondGaps = [], [], [], []
    a = subscribed(client, transport, "a", first.append, lambda *gap: firstGaps.append(gap))
    b = subscribed(client, transport, "b", second.append, lambda *gap: secondGaps.append(gap))
    client.dataReceived(b"MSG a 1 sub=%s seq=1\r\n1\r\n" % a)
    client.dataReceived(b"MSG b 1 sub=%s seq=3\r\n2\r\n" % b)
    assert [message.payload for message in first] == [b"1"]
    assert [message.payload for message in second] == [b"2"]
    assert firstGaps == []
    assert secondGaps == [("b", 2)]


def test_subscribingAgainChangesTheHandlerAndKeepsTheSequence(connection):
    """
    Subscribing again to a topic gives it the new handler; the broker keeps
    the subscription's sequence, so its next message is no gap.
    """
    client, transport = connection
    first, second, gaps = [], [], []
    old = subscribed(client, transport, "a", first.append)
    client.dataReceived(b"MSG a 1 sub=%s seq=1\r\n1\r\n" % old)
    new = subscribed(client, transport, "a", second.append, lambda *gap: gaps.append(gap))
    client.dataReceived(b"MSG a 1 sub=%s seq=2\r\n2\r\n" % new)
    assert [message.payload for message in first] == [b"1"]
    assert [message.payload for message in second] == [b"2"]
    assert gaps == []


def test_unsubscribeForgetsTheHandlerOnceAcknowledged(connection):
    """
    Until the UnsubAck, a message in flight still reaches the handler;
    after it, the handler gets nothing more.
    """
    client, transport = connection
    received = []
    a = subscribed(client, transport, "a", received.append)
    outcome = Outcome(client.unsubscribe("a"))
    client.dataReceived(b"MSG a 1 sub=%s seq=1\r\n1\r\n" % a)
    (requestId,) = sentIds(transport, b"UNSUB")
    client.dataReceived(b"UNSUBACK %s\r\n" % requestId)
    assert outcome.fired and outcome.failure is None
    client.dataReceived(b"MSG a 1 sub=%s seq=2\r\n2\r\n" % a)
    assert [message.payload for message in received] == [b"1"]


def test_theBrokerEndingASubscriptionCallsItsOnEnded(connection):
    """
    An C{ERR} with a subscription's id is the broker ending it (its ACL
    read again): C{onEnded} gets the topic and the error, and the
    subscription is forgotten; the other subscription stays.
    """
    client, transport = connection
    ended = []
    client.subscribe("a", lambda message: None, onEnded=lambda *what: ended.append(what))
    a = sentIds(transport, b"SUB")[-1]
    client.dataReceived(b"SUBACK %s\r\n" % a)
    subscribed(client, transport, "b", lambda message: None)
    client.dataReceived(
        b"ERR %s FORBIDDEN user x may no longer read a: the subscription has ended\r\n" % a
    )
    [(topic, error)] = ended
    assert (topic, error.code) == ("a", "FORBIDDEN")
    assert error.reason == "user x may no longer read a: the subscription has ended"
    assert [state.topic for state in client._subscriptions.values()] == ["b"]
    assert list(client.serverErrors) == [error]


def test_unexpectedFrameClosesConnection(connection):
    """
    A frame the client cannot understand means it no longer knows where it
    is in the stream: it closes the connection, failing what was pending.
    """
    client, transport = connection
    outcome = Outcome(client.publish("news", b"hi"))
    client.dataReceived(b"NONSENSE from the server\r\n")
    assert transport.disconnecting
    client.connectionLost(Failure(ConnectionLost()))
    assert outcome.failure.check(ConnectionLost)


@pytest.mark.parametrize("topic", ["", "two words", "tab\there", "line\nend"])
def test_topicThatWouldBreakTheFrame(connection, topic):
    """
    Such a topic is refused before anything is sent.
    """
    client, transport = connection
    with pytest.raises(ValueError):
        client.publish(topic, b"hi")
    with pytest.raises(ValueError):
        client.subscribe([topic], lambda message: None)
    assert transport.value() == b""


def test_close(connection):
    client, transport = connection
    closed = Outcome(client.close())
    assert transport.disconnecting
    assert not closed.fired
    client.connectionLost(Failure(ConnectionLost()))
    assert closed.fired and closed.failure is None
    assert Outcome(client.whenDisconnected()).fired


# Logging in


def test_loginSaysHelloWithTheCredentials(connection):
    """
    The password travels in base64, whatever bytes it holds; the answer's
    C{user} says who the client is now.
    """
    client, transport = connection
    outcome = Outcome(client.login(("alice", "pässword with spaces=="), clientId="c7"))
    assert transport.value() == (
        b"HELLO 1 c7 user=alice password=cMOkc3N3b3JkIHdpdGggc3BhY2VzPT0=\r\n"
    )
    assert client.user is None
    client.dataReceived(b"HELLO 1 version=0.1.0 ping=10 user=alice\r\n")
    assert outcome.result["user"] == "alice"
    assert client.user == "alice"


def test_loginRefused(connection):
    client, transport = connection
    outcome = Outcome(client.login(("alice", b"\x00\xff")))
    assert b" password=AP8=\r\n" in transport.value()
    client.dataReceived(b"ERR 1 BAD_CREDENTIALS bad user name or password\r\n")
    assert outcome.failure.value.code == "BAD_CREDENTIALS"
    assert client.user is None


def test_loginRefusesABadUserNameBeforeSending(connection):
    client, transport = connection
    with pytest.raises(ValueError, match="user name 'a b' must be"):
        client.login(("a b", "pw"))
    assert transport.value() == b""


def test_serverErrorsKeptAreBounded(connection):
    """
    ERR frames tied to no request are kept for diagnostics, the latest
    SERVER_ERRORS_KEPT of them: a long-lived client does not grow.
    """
    from dallal.client import SERVER_ERRORS_KEPT

    client, _ = connection
    for number in range(SERVER_ERRORS_KEPT + 5):
        client.dataReceived(b"ERR x%d BAD_ARGUMENTS late\r\n" % number)
    assert len(client.serverErrors) == SERVER_ERRORS_KEPT
    assert client.serverErrors[-1].code == "BAD_ARGUMENTS"
