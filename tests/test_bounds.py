"""
What one client may make the broker hold or do: the output it does not
read (C{--max-output-bytes}), a stream of errors
(C{--max-consecutive-errors}), the password checks it makes wait
(C{--max-pending-logins}, C{--max-pending-logins-per-ip}), how long it
takes to send a frame (C{--max-frame-seconds}), the retained messages it
leaves (C{--max-retained}, C{--max-retained-bytes}).
"""

import tracemalloc

import pytest
from helpers import PING_INTERVAL, BrokerHarness, MemoryRetained, UdpHarness
from test_auth import USERS, PendingChecks, credentialOptions, udpHello
from test_topic_requests import document
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport

from dallal.broker.core import BrokerConfig
from dallal.protocol.mqtt import MQTT_3_1_1, ConnAck, Connect, PingReq, PingResp
from dallal.security.auth import FAILURE_DELAY, MAX_CONCURRENT_CHECKS, CheckQueue
from dallal.server.streams import OUTPUT_SOFT_MARK
from dallal.server.tcp import TURN_SECONDS
from dallal.server.udp import ANSWER_BOOKKEEPING, LOGIN_RESEND_TIMEOUT, AnswerCache


def assertRefusedBy(harness, limit, maximum):
    """
    One refusal by C{limit}, whose value is C{maximum}: counted in its
    C{refused_<limit>}, and logged.
    """
    assert harness.broker.stats()[f"refused_{limit}"] == 1
    [event] = harness.fields("limit_reached")
    assert (event["limit"], event["max"]) == (limit, maximum)


class FillingTransport(StringTransport):
    """
    A L{StringTransport} whose buffer fills as a socket's does when its
    client does not read: past C{bufferSize} bytes it pauses its producer,
    and it empties (resuming the producer) only when told to.
    """

    bufferSize = 65536
    full = False

    def write(self, data):
        StringTransport.write(self, data)
        self._checkFull()

    def writeSequence(self, data):
        StringTransport.writeSequence(self, data)
        self._checkFull()

    def _checkFull(self):
        if len(self.value()) > self.bufferSize and not self.full:
            self.full = True
            self.producer.pauseProducing()

    def drain(self):
        """
        The client read everything.
        """
        self.clear()
        if self.full:
            self.full = False
            self.producer.resumeProducing()


def subscribedWithLongFilters(harness, count=100):
    """
    A client with C{count} subscriptions of 200-byte filters, whose LIST is
    some 20 KiB.
    """
    client = harness.connect(transport=FillingTransport())
    client.send(b"".join(b"SUB %d f/%s/%d\r\n" % (n, b"x" * 190, n) for n in range(count)))
    client.transport.drain()
    return client


def test_aClientThatDoesNotReadIsNotAnsweredFurther():
    """
    1000 pipelined LISTs from a client that reads nothing: the broker
    answers until the client's transport is full, a few of them, then
    stops reading its requests; it serves the rest once the client reads.
    """
    harness = BrokerHarness()
    client = subscribedWithLongFilters(harness)
    client.send(b"LIST 1\r\n" * 1000)
    answered = client.transport.value().count(b"LIST 1 ")
    # Reading stopped.
    assert client.transport.producerState == "paused"
    assert 1 <= answered <= OUTPUT_SOFT_MARK * 2 // 20000
    assert len(client.transport.value()) < 3 * OUTPUT_SOFT_MARK
    assert not client.closing
    total = answered
    while total < 1000:
        client.transport.drain()
        answeredNow = client.transport.value().count(b"LIST 1 ")
        assert answeredNow, total
        total += answeredNow
    assert total == 1000


def test_outputWhileFullUpToTheBound():
    """
    What is written to a client whose transport is full counts against
    --max-output-bytes: up to it the connection stays, over it it is closed,
    counted and logged.  Here the broker's pings (6 bytes each) fill it.
    """
    harness = BrokerHarness(BrokerConfig(maxOutputBytes=6, messageEvents=True))
    client = harness.connect(transport=FillingTransport())
    client.transport.producer.pauseProducing()
    harness.clock.advance(PING_INTERVAL)
    assert client.transport.value() == b"PING\r\n"
    assert not client.closing
    # The count starts again once the transport has emptied.
    client.transport.producer.resumeProducing()
    client.transport.producer.pauseProducing()
    harness.clock.advance(PING_INTERVAL)
    assert not client.closing
    harness.clock.advance(PING_INTERVAL)
    assert client.closing
    client.lose()
    assertRefusedBy(harness, "output_bytes", 6)
    [disconnect] = harness.fields("disconnect")
    assert disconnect["reason"] == "output_limit"


def test_mqttOutputWhileFullUpToTheBound():
    """
    MQTT connections are bounded by --max-output-bytes too: here a client
    whose transport is full is answered the PINGREQs it sent before (a
    PINGRESP is 2 bytes) up to the bound, and is closed over it, counted
    and logged.
    """
    harness = BrokerHarness(BrokerConfig(maxOutputBytes=2, messageEvents=True))
    client = harness.connect(transport=FillingTransport(), factory=harness.service.mqttFactory)
    client.send(Connect("c", MQTT_3_1_1).encode(MQTT_3_1_1))
    assert client.received() == ConnAck().encode(MQTT_3_1_1)
    client.transport.producer.pauseProducing()
    client.send(PingReq().encode(MQTT_3_1_1))
    assert client.received() == PingResp().encode(MQTT_3_1_1)
    assert not client.closing
    client.send(PingReq().encode(MQTT_3_1_1))
    assert client.closing
    client.lose()
    assertRefusedBy(harness, "output_bytes", 2)
    [disconnect] = harness.fields("disconnect")
    assert (disconnect["transport"], disconnect["reason"]) == ("mqtt", "output_limit")


# A stream of errors


def test_connectionClosedAfterConsecutiveErrors():
    """
    Nine refused requests in a row are answered one by one; the tenth is
    answered, then the connection is closed with TOO_MANY_ERRORS, counted
    and logged.
    """
    harness = BrokerHarness()
    client = harness.connect()
    client.send(b"NOPE\r\n" * 9)
    assert client.received().count(b"ERR - BAD_COMMAND ") == 9
    assert not client.closing
    client.send(b"PUB 1 +bad 2\r\nhi\r\nPING\r\n")
    assert client.received() == (
        b"ERR 1 BAD_TOPIC '+' and '#' are reserved for subscription wildcards\r\n"
        b"ERR - TOO_MANY_ERRORS the last 10 requests were all refused: closing the connection\r\n"
    )
    assert client.closing
    client.lose()
    assertRefusedBy(harness, "consecutive_errors", 10)
    assert harness.fields("protocol_error")[-1]["code"] == "TOO_MANY_ERRORS"
    [disconnect] = harness.fields("disconnect")
    assert disconnect["reason"] == "protocol_error"


@pytest.mark.parametrize("carriedOut", [b"PING\r\n", b"PUB 1 news 2\r\nhi\r\n", b"SUB 2 news\r\n"])
def test_aRequestCarriedOutEndsTheRun(carriedOut):
    harness = BrokerHarness()
    client = harness.connect()
    client.send(b"NOPE\r\n" * 9 + carriedOut + b"NOPE\r\n" * 9)
    assert client.received().count(b"ERR - BAD_COMMAND ") == 18
    assert not client.closing


def test_aUdpClientEndedAfterConsecutiveErrors():
    """
    Over UDP too: a session whose requests are refused ten times in a row
    (garbage, or requests the broker refuses) gets TOO_MANY_ERRORS after
    the tenth ERR, and its session ends: what it sends next finds none.
    """
    harness, (peer, _) = udpHarness()
    for _number in range(9):
        peer.request(b"NOPE")
    assert [answer.split()[2] for answer in peer.received()] == [b"BAD_COMMAND"] * 9
    peer.request(b"PUB 1 +bad 2", b"hi")
    assert peer.received() == [
        b"ERR 1 BAD_TOPIC '+' and '#' are reserved for subscription wildcards\r\n",
        b"ERR - TOO_MANY_ERRORS the last 10 requests were all refused: ending the session\r\n",
    ]
    assertRefusedBy(harness, "consecutive_errors", 10)
    harness.clock.advance(0)
    [disconnect] = harness.fields("disconnect")
    assert (disconnect["reason"], disconnect["transport"]) == ("protocol_error", "udp")
    peer.request(b"PING")
    assert peer.received()[0].startswith(b"ERR - NO_SESSION ")


@pytest.mark.parametrize("carriedOut", [(b"PING", None), (b"PUB 1 news 2", b"hi")])
def test_aUdpRequestCarriedOutEndsTheRun(carriedOut):
    harness, (peer, _) = udpHarness()
    for _number in range(9):
        peer.request(b"NOPE")
    peer.request(*carriedOut)
    for _number in range(9):
        peer.request(b"NOPE")
    assert b"TOO_MANY_ERRORS" not in b"".join(peer.received())
    assert harness.broker.stats()["refused_consecutive_errors"] == 0


def test_aStrangersErrorsEndNoSession():
    """
    Garbage with a session's client id but from another address (anyone
    can send that) does not count in the session's run.
    """
    harness, (peer, _) = udpHarness()
    stranger = harness.peer(40009)
    for _number in range(20):
        stranger.send(b"NOPE client=me token=%s\r\n" % peer.token)
    assert harness.broker.stats()["refused_consecutive_errors"] == 0
    peer.request(b"PING")
    assert peer.received()[-1] == b"PONG\r\n"


def test_errorsLoggedPerClientAndInAll():
    """
    At most 10 protocol_error events a second per client and 100 in all;
    the others are counted and reported by code a second later.
    """
    harness = BrokerHarness(BrokerConfig(maxConsecutiveErrors=1000, messageEvents=True))
    clients = [harness.connect() for _ in range(11)]
    clients[0].send(b"NOPE\r\n" * 30)
    assert len(harness.fields("protocol_error")) == 10
    for client in clients[1:]:
        client.send(b"SUB 1 +bad#\r\n" * 10)
    assert len(harness.fields("protocol_error")) == 100
    assert harness.broker.stats()["errors"] == 130
    harness.clock.advance(1)
    assert harness.fields("protocol_errors_suppressed") == [
        {"code": "BAD_COMMAND", "count": 20},
        {"code": "BAD_TOPIC", "count": 10},
    ]
    # A new second, a new allowance.
    clients[0].send(b"NOPE\r\n")
    assert len(harness.fields("protocol_error")) == 101


def test_subscriptionEventsLoggedPerClientAndInAll():
    """
    At most 100 subscribe and unsubscribe events a second per client and
    1000 in all; the subscriptions are made all the same, and the events not
    logged are reported by kind a second later.
    """
    harness = BrokerHarness(BrokerConfig(messageEvents=True))
    storm = harness.connect()
    storm.send(b"SUB 1 a\r\nUNSUB 2 a\r\n" * 60 + b"SUB 3 kept\r\n")
    assert storm.received().split(b"\r\n").count(b"SUBACK 1") == 60
    assert len(harness.fields("subscribe")) + len(harness.fields("unsubscribe")) == 100
    assert harness.broker.stats()["subscriptions"] == 1
    others = [harness.connect() for _ in range(10)]
    for client in others:
        client.send(b"".join(b"SUB %d t/%d\r\n" % (n, n) for n in range(100)))
    assert len(harness.fields("subscribe")) + len(harness.fields("unsubscribe")) == 1000
    harness.clock.advance(1)
    assert harness.fields("subscriptions_suppressed") == [
        {"kind": "subscribe", "count": 11 + 100},
        {"kind": "unsubscribe", "count": 10},
    ]
    # A new second, a new allowance.
    storm.send(b"UNSUB 4 kept\r\n")
    assert len(harness.fields("unsubscribe")) == 51


# Password checks


def test_sourcesTakeTurns():
    """
    A check from a second source runs right after the one running, however
    many the first source has waiting.
    """
    checks = PendingChecks()
    queue = CheckQueue(1, 100, 100)
    order = []
    for number in range(5):
        queue.run("10.0.0.1", checks, order.append, f"flood {number}")
    queue.run("10.0.0.2", checks, order.append, "real")
    while checks.waiting:
        checks.runAll()
    assert order == ["flood 0", "real", "flood 1", "flood 2", "flood 3", "flood 4"]
    assert len(queue) == 0


def test_checksWaitingUpToTheBoundPerAddress():
    """
    --max-pending-logins-per-ip logins of one address wait for their check;
    one more is refused at once with TOO_MANY_CLIENTS, counted and logged,
    while another address is still served.
    """
    checks = PendingChecks()
    harness = BrokerHarness(
        BrokerConfig(maxPendingLoginsPerIp=3, messageEvents=True), users=USERS, runHash=checks
    )
    waiting = [harness.connect() for _ in range(3)]
    for client in waiting:
        assert client.login("alice", b"guess") == b""
    refused = harness.connect()
    assert refused.login("alice", b"guess") == (
        b"ERR h TOO_MANY_CLIENTS the broker is checking its maximum of 3 logins from "
        b"127.0.0.1: try again later\r\n"
    )
    assert refused.closing
    assertRefusedBy(harness, "pending_logins_per_ip", 3)
    other = harness.connect(host="10.0.0.2")
    assert other.login("alice", USERS["alice"]) == b""
    while checks.waiting:
        checks.runAll()
    assert other.received().endswith(b" user=alice\r\n")


def test_checksWaitingUpToTheBoundInAll():
    checks = PendingChecks()
    harness = BrokerHarness(
        BrokerConfig(maxPendingLogins=2, messageEvents=True), users=USERS, runHash=checks
    )
    for host in ("10.0.0.1", "10.0.0.2"):
        assert harness.connect(host=host).login("alice", b"guess") == b""
    refused = harness.connect(host="10.0.0.3")
    assert refused.login("alice", USERS["alice"]).startswith(
        b"ERR h TOO_MANY_CLIENTS the broker is checking its maximum of 2 logins: "
    )
    assert harness.broker.stats()["refused_pending_logins"] == 1


def test_aCheckWaitingForAClientThatLeftIsDropped():
    checks = PendingChecks()
    harness = BrokerHarness(
        BrokerConfig(maxPendingLoginsPerIp=MAX_CONCURRENT_CHECKS + 1, messageEvents=True),
        users=USERS,
        runHash=checks,
    )
    clients = [harness.connect() for _ in range(MAX_CONCURRENT_CHECKS + 1)]
    for client in clients:
        client.login("alice", b"guess")
    assert len(checks.waiting) == MAX_CONCURRENT_CHECKS
    clients[-1].lose()
    assert len(harness.gatekeeper.checks) == MAX_CONCURRENT_CHECKS
    checks.runAll()
    assert checks.waiting == []
    # Its place is free again.
    assert harness.connect().login("alice", b"guess") == b""


def test_aClientWaitingForItsCheckIsNotDroppedForMissedPings():
    checks = PendingChecks()
    harness = BrokerHarness(users=USERS, runHash=checks)
    client = harness.connect()
    client.login("alice", USERS["alice"])
    harness.clock.advance(PING_INTERVAL * 10)
    assert not client.closing
    checks.runAll()
    assert client.received().endswith(b" user=alice\r\n")
    # Pinged again once logged in.
    harness.clock.advance(PING_INTERVAL)
    assert client.received() == b"PING\r\n"


def test_udpLoginOverTheBound():
    checks = PendingChecks()
    harness = UdpHarness(
        BrokerConfig(maxPendingLoginsPerIp=1, messageEvents=True), users=USERS, runHash=checks
    )
    assert udpHello(harness.peer(40001), b"me", credentialOptions("alice", b"guess")) == []
    [answer] = udpHello(harness.peer(40002), b"you", credentialOptions("bob", USERS["bob"]))
    assert answer.startswith(b"ERR 2 TOO_MANY_CLIENTS the broker is checking its maximum of 1 ")
    assert harness.broker.stats()["refused_pending_logins_per_ip"] == 1


def busyChecks():
    """
    A UDP harness whose password checks all run for TCP clients from
    other addresses: a UDP login waits its turn.
    """
    checks = PendingChecks()
    harness = UdpHarness(BrokerConfig(messageEvents=True), users=USERS, runHash=checks)
    for number in range(MAX_CONCURRENT_CHECKS):
        harness.connect(host=f"10.0.0.{number + 1}").login("alice", b"guess")
    return harness, checks


def test_aUdpLoginWhoseSenderIsGoneIsDroppedUnchecked():
    """
    A UDP login waiting for its check whose HELLO is not resent within
    LOGIN_RESEND_TIMEOUT leaves the queue: its password is never checked,
    and nothing is answered.
    """
    harness, checks = busyChecks()
    peer = harness.peer(40001)
    assert udpHello(peer, b"me", credentialOptions("alice", USERS["alice"])) == []
    assert len(harness.gatekeeper.checks) == MAX_CONCURRENT_CHECKS + 1
    harness.clock.advance(LOGIN_RESEND_TIMEOUT)
    assert len(harness.gatekeeper.checks) == MAX_CONCURRENT_CHECKS
    checks.runAll()
    assert checks.waiting == []
    harness.clock.advance(FAILURE_DELAY)
    assert peer.received() == []
    assert harness.fields("login") == []
    assert harness.broker.stats()["logins_abandoned"] == 1


def test_aUdpLoginWhoseHelloIsResentWaitsForItsCheck():
    harness, checks = busyChecks()
    peer = harness.peer(40001)
    hello = b"HELLO 2 me token=%s %s\r\n"
    udpHello(peer, b"me", credentialOptions("alice", USERS["alice"]))
    for _number in range(3):
        harness.clock.advance(LOGIN_RESEND_TIMEOUT - 0.5)
        peer.send(hello % (peer.token, credentialOptions("alice", USERS["alice"])))
    checks.runAll()
    checks.runAll()
    [answer] = peer.received()
    assert answer.endswith(b" session=new user=alice\r\n")
    # Answered: nothing is left to drop.
    harness.clock.advance(LOGIN_RESEND_TIMEOUT)
    assert len(harness.gatekeeper.checks) == 0
    assert harness.broker.stats()["logins_abandoned"] == 0


def test_aCheckCancelledBeforeItsTurnLeavesNothing():
    checks = PendingChecks()
    queue = CheckQueue(1, 100, 100)
    queue.run("10.0.0.1", checks, lambda: None)
    queue.run("10.0.0.2", checks, lambda: None).cancel()
    assert len(queue) == 1
    checks.runAll()
    assert (len(queue), checks.waiting) == (0, [])


def test_refusalsForTheBrokersStateAreNoClientErrors():
    """
    A publisher pipelining while the broker stops is refused with
    SHUTTING_DOWN every time, and is not closed for it.
    """
    harness = BrokerHarness()
    client = harness.connect()
    harness.broker.drain(1.0)
    client.send(b"PUB 1 news 2\r\nhi\r\n" * 20)
    assert client.received().count(b" SHUTTING_DOWN ") == 20
    assert not client.closing


# Slow senders


@pytest.mark.parametrize(
    "complete, begun",
    [
        (b"PING\r\n", b"SUB 1 ne"),
        (b"PUB 1 news 5\r\n", b"hel"),
        (b"PUB 1 news 5\r\n", b"hello"),
        (b"PUB 1 +bad 5\r\n", b"he"),
    ],
    ids=["line", "payload", "terminator", "discarded payload"],
)
def test_aFrameBegunMustBeCompleteInTime(complete, begun):
    """
    A frame begun, a byte at a time, must be complete --max-frame-seconds
    after the frame before it; then the client is told and closed.
    """
    harness = BrokerHarness(BrokerConfig(maxFrameSeconds=30, messageEvents=True))
    client = harness.connect()
    client.send(complete)
    client.received()
    for byte in range(len(begun)):
        client.send(begun[byte : byte + 1])
        harness.clock.advance(29 / len(begun))
    assert not client.closing
    harness.clock.advance(1)
    assert client.received().endswith(
        b" FRAME_TIMEOUT a frame begun was not complete within 30 seconds\r\n"
    )
    assert client.closing
    assert harness.broker.stats()["refused_frame_seconds"] == 1


def test_framesCompleteInTimeOneAfterTheOther():
    """
    A publisher whose reads each end in the middle of a frame is never
    timed out: the time runs from the last frame complete.
    """
    harness = BrokerHarness(BrokerConfig(maxFrameSeconds=30, messageEvents=True))
    client = harness.connect()
    client.send(b"SUB 0 ne")
    for number in range(1, 11):
        harness.clock.advance(20)
        client.send(b"ws\r\nSUB %d ne" % number)
    assert not client.closing
    assert client.received().count(b"SUBACK") == 10


def test_noFrameTimeWhileTheBrokerHoldsTheReading():
    checks = PendingChecks()
    harness = BrokerHarness(
        BrokerConfig(maxFrameSeconds=30, messageEvents=True), users=USERS, runHash=checks
    )
    client = harness.connect()
    hello = b"HELLO h c1 " + credentialOptions("alice", USERS["alice"]) + b"\r\n"
    client.send(hello + b"SUB 1 ne")
    harness.clock.advance(100)
    assert not client.closing
    checks.runAll()
    client.send(b"ws\r\n")
    assert client.received().endswith(b"SUBACK 1\r\n")


def test_aPayloadSentAByteAtATimeIsHeldAsItsBytes():
    """
    What the broker holds of a payload arriving a byte per read is about
    the bytes received (not an object per read).
    """
    harness = BrokerHarness()
    client = harness.connect()
    client.send(b"PUB 1 news 100000\r\n")
    byte = b"x"
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(20000):
            client.send(byte)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held < 2 * 20000, held


# The retained store


def retainedHarness(**limits):
    harness = BrokerHarness(BrokerConfig(messageEvents=True, **limits))
    harness.broker.retained = MemoryRetained()
    return harness


def test_retainedMessagesUpToTheLimit():
    """
    --max-retained topics may have a retained message; a retained publish
    on one more is refused before it is published, counted and logged;
    replacing or clearing one is still taken.
    """
    harness = retainedHarness(maxRetained=2)
    subscriber = harness.connect()
    subscriber.send(b"SUB 1 # mode=fire\r\n")
    client = harness.connect()
    client.send(b"PUB 1 a 1 retain=1\r\nx\r\nPUB 2 b 1 retain=1\r\nx\r\n")
    assert client.received() == b"PUBACK 1\r\nPUBACK 2\r\n"
    client.send(b"PUB 3 c 1 retain=1\r\nx\r\n")
    assert client.received() == (
        b"ERR 3 STORE_FAILED the broker keeps its maximum of 2 retained messages: "
        b"clear one first (a retained publish with no payload)\r\n"
    )
    assert subscriber.received().count(b"MSG ") == 2
    assertRefusedBy(harness, "retained", 2)
    client.send(
        b"PUB 4 b 2 retain=1\r\nyy\r\nPUB 5 a 0 retain=1\r\n\r\nPUB 6 c 1 retain=1\r\nx\r\n"
    )
    assert client.received() == b"PUBACK 4\r\nPUBACK 5\r\nPUBACK 6\r\n"


def test_retainedBytesUpToTheLimit():
    harness = retainedHarness(maxRetainedBytes=10)
    client = harness.connect()
    client.send(b"PUB 1 a 4 retain=1\r\nxxxx\r\nPUB 2 b 6 retain=1\r\nxxxxxx\r\n")
    assert client.received() == b"PUBACK 1\r\nPUBACK 2\r\n"
    client.send(b"PUB 3 c 1 retain=1\r\nx\r\nPUB 4 a 5 retain=1\r\nxxxxx\r\n")
    assert client.received() == (
        b"ERR 3 STORE_FAILED the retained messages would take 11 bytes, more than the "
        b"maximum of 10\r\n"
        b"ERR 4 STORE_FAILED the retained messages would take 11 bytes, more than the "
        b"maximum of 10\r\n"
    )
    assert harness.broker.stats()["refused_retained_bytes"] == 2
    client.send(b"PUB 5 a 3 retain=1\r\nxxx\r\nPUB 6 c 1 retain=1\r\nx\r\n")
    assert client.received() == b"PUBACK 5\r\nPUBACK 6\r\n"


# What UDP sessions remember


def udpHarness(**limits):
    harness = UdpHarness(BrokerConfig(messageEvents=True, **limits))
    peers = []
    for number, clientId in enumerate([b"me", b"you"]):
        peer = harness.peer(40001 + number)
        udpHello(peer, clientId)
        peer.received()
        peers.append(peer)
    return harness, peers


def publishes(peer, ids):
    for requestId in ids:
        peer.request(b"PUB %d news 1" % requestId, b"x")
    return peer.received()


def test_answersRememberedUpToTheBytesOfTheSession():
    """
    A session's answers are remembered within --max-udp-answer-bytes; a
    retry of a request whose answer was forgotten is not carried out again
    (its decimal id is at or below the highest forgotten) but answered
    ANSWER_FORGOTTEN.
    """
    answer = len(b"1") + len(b"PUBACK 1\r\n") + ANSWER_BOOKKEEPING
    harness, (peer, _) = udpHarness(maxUdpAnswerBytes=3 * answer)
    publishes(peer, [1, 2, 3])
    assert harness.broker.stats()["refused_udp_answer_bytes"] == 0
    publishes(peer, [4])
    assertRefusedBy(harness, "udp_answer_bytes", 3 * answer)
    published = harness.broker.stats()["published"]
    assert publishes(peer, [2, 3, 4]) == [b"PUBACK %d\r\n" % n for n in (2, 3, 4)]
    assert harness.broker.stats()["published"] == published
    assert publishes(peer, [1]) == [
        b"ERR 1 ANSWER_FORGOTTEN request 1 was received before, and its answer is no "
        b"longer remembered: it is not carried out again\r\n"
    ]
    assert harness.broker.stats()["published"] == published
    assert publishes(peer, [5]) == [b"PUBACK 5\r\n"]
    assert harness.broker.stats()["published"] == published + 1


def test_aRetryOfAForgottenAnswerWithAnIdThatIsNotANumberIsCarriedOutAgain():
    """
    Only decimal ids are known to increase: a retry of a request with
    another id, whose answer was forgotten, is carried out again.
    """
    answer = len(b"a") + len(b"PUBACK a\r\n") + ANSWER_BOOKKEEPING
    harness, (peer, _) = udpHarness(maxUdpAnswerBytes=answer)
    for requestId in [b"a", b"b", b"a"]:
        peer.request(b"PUB %s news 1" % requestId, b"x")
    assert peer.received() == [b"PUBACK a\r\n", b"PUBACK b\r\n", b"PUBACK a\r\n"]
    assert harness.broker.stats()["published"] == 3


def test_answersCountedAtLeastWhatTheyTakeInMemory():
    """
    The bytes counted against --max-udp-answer-bytes(-total) are at least
    what the remembered answers take in memory, ids and bookkeeping
    included: the bounds bound memory, not a fraction of it.
    """
    cache = AnswerCache(2**40, 2**40, lambda *forgotten: None)
    sessions = [object() for _ in range(20)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for number in range(2000):
            requestId = f"{number:064d}"
            cache.remember(sessions[number % 20], requestId, b"PUBACK %s\r\n" % requestId.encode())
        taken = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert cache.bytes >= taken


def test_answersRememberedUpToTheBytesOfAllSessions():
    answer = len(b"1") + len(b"PUBACK 1\r\n") + ANSWER_BOOKKEEPING
    harness, (first, second) = udpHarness(maxUdpAnswerBytesTotal=4 * answer)
    publishes(first, [1, 2])
    publishes(second, [1, 2])
    assert harness.answers.bytes == 4 * answer
    publishes(second, [3])
    assert harness.broker.stats()["refused_udp_answer_bytes_total"] == 1
    # The oldest of all went: the first session's first answer.
    published = harness.broker.stats()["published"]
    publishes(first, [2])
    publishes(second, [1, 2, 3])
    assert harness.broker.stats()["published"] == published
    assert b"ANSWER_FORGOTTEN" in publishes(first, [1])[0]
    assert harness.broker.stats()["published"] == published


def test_aSessionThatEndsForgetsItsAnswers():
    harness, (peer, _) = udpHarness()
    publishes(peer, [1, 2])
    peer.request(b"BYE")
    assert harness.answers.bytes == 0


# Work per request


def test_publishToMatchingTopicsUpToTheLimit():
    """
    A to-matching publish may reach --max-matching-topics topics; one whose
    filter matches more is refused before anything is published.
    """
    harness = retainedHarness(maxMatchingTopics=3)
    client = harness.connect()
    client.send(b"SUB 1 t/named\r\n")
    client.send(b"PUB 2 t/a 1 retain=1\r\nx\r\nPUB 3 t/b 1 retain=1\r\nx\r\n")
    client.received()
    client.send(b"PUB 4 t/+ 1 to-matching=1\r\ny\r\n")
    assert client.received().endswith(b"PUBACK 4 topics=3\r\n")
    client.send(b"PUB 5 t/c 1 retain=1\r\nx\r\n")
    client.received()
    published = harness.broker.stats()["published"]
    client.send(b"PUB 6 t/# 1 to-matching=1\r\ny\r\n")
    assert client.received() == (
        b"ERR 6 TOO_MANY_TOPICS t/# matches more than 3 topics: publish to a narrower filter\r\n"
    )
    assert harness.broker.stats()["published"] == published
    assertRefusedBy(harness, "matching_topics", 3)


def listedTopics(count):
    """
    A broker with --max-listed 3 and C{count} topics, t/a first (retained),
    the others subscribed to; a client of it.
    """
    harness = retainedHarness(maxListed=3)
    client = harness.connect()
    client.send(b"PUB 1 t/a 1 retain=1\r\nx\r\n")
    for number in range(1, count):
        client.send(b"SUB %d t/%s\r\n" % (number + 1, b"abcd"[number : number + 1]))
    client.received()
    return harness, client


@pytest.mark.parametrize(
    "request_, listed",
    [
        (b"TOPICS 1", 3),
        (b"TOPICS 1 limit=3", 3),
        (b"TOPICS 1 limit=2", 2),
        (b"TOPICS 1 limit=4", 3),
    ],
)
def test_topicsListedUpToTheLimit(request_, listed):
    """
    A TOPICS answer lists at most --max-listed topics: with three topics
    and a bound of three, all of them, whatever the limit= asked.
    """
    harness, client = listedTopics(3)
    client.send(request_ + b"\r\n")
    answer = document(client.received(), b"TOPICS")
    assert (answer["total"], len(answer["topics"]), answer["truncated"]) == (3, listed, listed < 3)
    assert harness.broker.stats()["refused_listed"] == 0


@pytest.mark.parametrize("request_", [b"TOPICS 1", b"TOPICS 1 limit=4", b"TOPICS 1 limit=1000"])
def test_topicsOverTheLimitAreCutCountedAndLogged(request_):
    """
    With one topic more than --max-listed, a TOPICS that asks for no fewer
    gets the first ones, truncated, and the cut is counted and logged; one
    that asks for exactly the bound is not cut by it.
    """
    harness, client = listedTopics(4)
    client.send(request_ + b"\r\n")
    answer = document(client.received(), b"TOPICS")
    assert [row["topic"] for row in answer["topics"]] == ["t/a", "t/b", "t/c"]
    assert (answer["total"], answer["truncated"]) == (4, True)
    assertRefusedBy(harness, "listed", 3)
    client.send(b"TOPICS 6 limit=3\r\n")
    assert document(client.received(), b"TOPICS")["truncated"] is True
    assert harness.broker.stats()["refused_listed"] == 1


class BusyClock(Clock):
    """
    A L{Clock} on which each request costs time: every look at it is
    C{step} seconds after the one before.
    """

    def __init__(self, step):
        Clock.__init__(self)
        self.step = step

    def seconds(self):
        self.rightNow += self.step
        return self.rightNow

    def nextTurn(self):
        """
        A turn of the reactor: run the calls due now, not those they make
        (a L{Clock} would run those too, as their time has come).
        """
        due = [call for call in self.calls if call.getTime() <= self.rightNow]
        for call in due:
            self.calls.remove(call)
            call.called = True
            call.func(*call.args, **call.kw)


def test_pipelinedRequestsTakeTurnsWithOtherConnections():
    """
    A connection's pipelined requests are served for TURN_SECONDS of the
    reactor's time; the rest waits for the next turn, when the others have
    had theirs.
    """
    clock = BusyClock(TURN_SECONDS / 4)
    harness = BrokerHarness(clock=clock)
    busy, other = harness.connect(), harness.connect()
    busy.send(b"PING\r\n" * 100)
    first = busy.received().count(b"PONG")
    assert 1 <= first < 10
    other.send(b"PING\r\n")
    assert other.received() == b"PONG\r\n"
    served = first
    while served < 100:
        clock.nextTurn()
        now = busy.received().count(b"PONG")
        assert 1 <= now < 10
        served += now
    assert served == 100
