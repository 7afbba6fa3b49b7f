"""
Bridges between brokers (PROTOCOL.md, "Bridges"), on a clock:

  - the serving side: another broker's bridge connected to this one over TCP
    (C{PUB ... origin=}, C{SUB ... bridge=1}), through L{BrokerHarness};
  - the link: this broker's L{BridgeLink} to a remote broker that the test
    plays over a L{StringTransport};
  - the loop and duplicate guards, and C{--bridge}'s parser.
"""

import json

import pytest
from helpers import PING_INTERVAL, BrokerHarness, decodeFrames, messages
from test_events_catalogue import LINK_EVENTS, catalogue
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred
from twisted.internet.error import ConnectionLost, ConnectionRefusedError
from twisted.internet.interfaces import IStreamClientEndpoint
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from zope.interface import implementer

from dallal.broker.core import BrokerConfig
from dallal.broker.delivery import DeliveryConfig
from dallal.broker.origin import (
    MAX_HOPS,
    NAME_FILE,
    SEEN_WINDOW,
    BrokerNameError,
    Origin,
    SeenMessages,
    storedName,
)
from dallal.broker.sysstats import SysPublisher
from dallal.cli.main import formatStats
from dallal.server.bridge import BridgeLink, BridgeSpec, parseBridge

REMOTE = IPv4Address("TCP", "10.0.0.1", 1373)


def options(frame):
    """
    The C{key=value} options of a L{Frame}'s control line.
    """
    return dict(argument.split(b"=", 1) for argument in frame.arguments if b"=" in argument)


def frames(data, verb):
    return [frame for frame in decodeFrames(data) if frame.verb == verb]


def bridgedPub(requestId, topic, payload, origin, oid, hops):
    return b"PUB %s %s %d origin=%s oid=%s hops=%d\r\n%s\r\n" % (
        requestId,
        topic,
        len(payload),
        origin,
        oid,
        hops,
        payload,
    )


# The serving side: another broker's bridge is a client of this one.


def test_aBridgedPublishReachesLocalSubscribersWithoutItsOrigin(harness):
    local = harness.connect()
    local.send(b"SUB 1 news\r\n")
    bridge = harness.connect()
    bridge.send(bridgedPub(b"7", b"news", b"hello", b"leaf", b"a1.5", 0))
    assert bridge.received() == b"PUBACK 7\r\n"
    [message] = frames(local.received(), b"MSG")
    assert message.line == b"MSG news 5 sub=1 seq=1 id=1"
    assert message.payload == b"hello"
    stats = harness.broker.stats()
    assert (stats["published"], stats["bridged_published"]) == (1, 1)
    [publish] = harness.fields("publish")
    assert (publish["origin"], publish["hops"]) == ("leaf", 1)


def test_bridgeSubscriptionsGetTheOriginAndNoRetainedMessages(harness):
    """
    A C{bridge=1} subscription's messages carry their origin: the broker they
    were first published on and its id there, and the bridges they crossed
    to reach this broker.
    """
    harness.broker.publishOwn("$SYS/x", b"kept")
    bridge = harness.connect()
    bridge.send(b"SUB 1 # mode=all bridge=1\r\nSUB 2 $SYS/# mode=all bridge=1\r\n")
    assert bridge.received() == b"SUBACK 1\r\nSUBACK 2\r\n"
    publisher = harness.connect()
    publisher.send(b"PUB 1 news 2\r\nhi\r\n")
    publisher.send(bridgedPub(b"2", b"news", b"yo", b"leaf", b"a1.5", 2))
    first, second = frames(bridge.received(), b"MSG")
    broker = harness.broker
    publishedHere = next(event for event in harness.fields("publish") if event["topic"] == "news")
    assert options(first) == {
        b"sub": b"1",
        b"seq": b"1",
        b"id": b"1",
        b"origin": broker.name.encode(),
        b"oid": b"%s.%d" % (broker.bridging.incarnation.encode(), publishedHere["mid"]),
        b"hops": b"0",
    }
    assert (options(second)[b"origin"], options(second)[b"oid"]) == (b"leaf", b"a1.5")
    assert options(second)[b"hops"] == b"3"
    assert broker.stats()["bridged_delivered"] == 2


def test_aBridgedMessageIsNotSentBackWhereItCameFrom(harness):
    bridge = harness.connect()
    other = harness.connect()
    for client in (bridge, other):
        client.send(b"SUB 1 # mode=all bridge=1\r\n")
        client.received()
    bridge.send(bridgedPub(b"7", b"news", b"hello", b"leaf", b"a1.5", 0))
    assert frames(bridge.received(), b"MSG") == []
    assert messages(other.received()) == [(b"news", b"hello")]


@pytest.mark.parametrize(
    "second, reason",
    [
        # The same message again, by another path.
        (bridgedPub(b"8", b"news", b"hello", b"leaf", b"a1.5", 3), "duplicate"),
        # Too many bridges crossed.
        (bridgedPub(b"8", b"news", b"hello", b"leaf", b"a1.6", MAX_HOPS), "hop_limit"),
    ],
)
def test_copiesAreAckedButNotPublished(harness, second, reason):
    local = harness.connect()
    local.send(b"SUB 1 news mode=fire\r\n")
    bridge = harness.connect()
    bridge.send(bridgedPub(b"7", b"news", b"hello", b"leaf", b"a1.5", 0))
    bridge.send(second)
    assert bridge.received() == b"PUBACK 7\r\nPUBACK 8\r\n"
    assert messages(local.received()) == [(b"news", b"hello")]
    [discard] = harness.fields("bridge_discard")
    assert discard["reason"] == reason
    stats = harness.broker.stats()
    assert stats["published"] == 1
    assert stats["bridged_duplicates" if reason == "duplicate" else "bridged_hop_limit"] == 1


def test_aForgedOidCannotSuppressAnotherMessage(harness):
    """
    A client that publishes junk under the origin and ids of the hub's
    messages to come, on a topic it may write, does not make the broker
    discard the hub's real messages on other topics.
    """
    local = harness.connect()
    local.send(b"SUB 1 # mode=fire\r\n")
    mallory = harness.connect()
    for number in range(3):
        oid = b"h1.%d" % number
        mallory.send(bridgedPub(b"%d" % number, b"users/mallory/x", b"junk", b"hub", oid, 0))
    hub = harness.connect()
    for number in range(3):
        oid = b"h1.%d" % number
        hub.send(bridgedPub(b"%d" % number, b"alerts", b"real %d" % number, b"hub", oid, 0))
    assert hub.received() == b"PUBACK 0\r\nPUBACK 1\r\nPUBACK 2\r\n"
    assert [payload for topic, payload in messages(local.received()) if topic == b"alerts"] == [
        b"real 0",
        b"real 1",
        b"real 2",
    ]
    assert harness.broker.stats()["bridged_duplicates"] == 0


USERS = {"hub-bridge": b"bridge secret", "mallory": b"mallory's"}
ACL = """\
user mallory
topic readwrite users/mallory/#

user hub-bridge
topic readwrite #
"""


@pytest.mark.parametrize(
    "frame",
    [
        bridgedPub(b"7", b"users/mallory/x", b"junk", b"hub", b"h1.1", 0),
        b"SUB 7 users/mallory/# mode=all bridge=1\r\n",
    ],
)
def test_bridgeFramesOnlyFromBridgeUsers(frame):
    """
    On a broker that takes passwords, a user that is no bridge may not send
    bridge frames, even on the topics it may write: they are refused with
    NOT_AUTHORIZED, counted and logged, and its connection stays open.  The
    bridge's user may.
    """
    harness = BrokerHarness(users=USERS, acl=ACL, bridgeUsers={"hub-bridge"})
    mallory = harness.connect()
    mallory.login("mallory", USERS["mallory"])
    mallory.send(frame)
    assert mallory.received().startswith(b"ERR 7 NOT_AUTHORIZED user mallory is not a bridge: ")
    [denied] = harness.fields("denied")
    assert (denied["user"], denied["action"]) == ("mallory", "bridge")
    stats = harness.broker.stats()
    assert (stats["denied"], stats["published"], stats["subscriptions"]) == (1, 0, 0)
    mallory.send(b"PING\r\n")
    assert mallory.received() == b"PONG\r\n"
    bridge = harness.connect()
    bridge.login("hub-bridge", USERS["hub-bridge"])
    bridge.send(frame)
    assert bridge.received().split(b" ")[0] in (b"PUBACK", b"SUBACK")


def test_forgedOidsFromANonBridgeDoNotSuppressTheHubsMessages():
    """
    Issue 24's attack on a secured leaf: mallory, who may write only
    users/mallory/#, publishes junk under the oids of the hub's messages to
    come.  Refused: the hub's real messages, coming over the bridge, reach
    the leaf's subscribers.
    """
    harness = BrokerHarness(users=USERS, acl=ACL, bridgeUsers={"hub-bridge"})
    mallory = harness.connect()
    mallory.login("mallory", USERS["mallory"])
    mallory.send(b"SUB 1 users/mallory/# mode=fire\r\n")
    mallory.received()
    mallory.send(bridgedPub(b"2", b"users/mallory/x", b"junk", b"hub", b"h1.1", 0))
    assert mallory.received().startswith(b"ERR 2 NOT_AUTHORIZED ")
    bridge = harness.connect()
    bridge.login("hub-bridge", USERS["hub-bridge"])
    bridge.send(b"SUB 1 # mode=fire\r\n")
    bridge.received()
    bridge.send(bridgedPub(b"2", b"users/mallory/x", b"real", b"hub", b"h1.1", 0))
    assert messages(mallory.received()) == [(b"users/mallory/x", b"real")]
    assert harness.broker.stats()["bridged_duplicates"] == 0


def test_ownMessagesComingBackAreDiscarded(harness):
    bridge = harness.connect()
    name = harness.broker.name.encode()
    bridge.send(bridgedPub(b"7", b"news", b"hello", name, b"a1.5", 2))
    assert bridge.received() == b"PUBACK 7\r\n"
    assert harness.fields("bridge_discard")[0]["reason"] == "loop"
    assert harness.broker.stats()["published"] == 0


def test_theLastHopAllowedIsPublished(harness):
    bridge = harness.connect()
    bridge.send(bridgedPub(b"7", b"news", b"hello", b"leaf", b"a1.5", MAX_HOPS - 1))
    assert harness.broker.stats()["bridged_published"] == 1


@pytest.mark.parametrize(
    "line",
    [
        b"PUB 7 news 2 origin=leaf hops=0",
        b"PUB 7 news 2 origin=leaf oid=1 hops=many",
        "PUB 7 news 2 origin=leaf oid=1 hops=\u00b2".encode(),
        "PUB 7 news 2 origin=leaf oid=1 hops=\u0661".encode(),
        b"PUB 7 news 2 origin=le/af oid=1 hops=0",
        b"PUB 7 news 2 origin=leaf oid=1 hops=0 retain=1",
    ],
)
def test_malformedBridgedPublishesAreRefused(harness, line):
    bridge = harness.connect()
    bridge.send(line + b"\r\nhi\r\n")
    assert bridge.received().startswith(b"ERR 7 BAD_ARGUMENTS ")
    assert harness.broker.stats()["published"] == 0


def test_bridgedPublishesWaitForTheNextRunWhileShuttingDown(harness):
    bridge = harness.connect()
    harness.broker.drain(1.0)
    bridge.send(bridgedPub(b"7", b"news", b"hi", b"leaf", b"a1.5", 0))
    assert bridge.received().startswith(b"ERR 7 SHUTTING_DOWN ")
    stats = harness.broker.stats()
    assert (stats["published"], stats["bridged_refused"]) == (0, 0)
    # Not remembered: the same message, sent again to the next run, is new.
    assert len(harness.broker.bridging.seen) == 0


def test_bridgedPublishOnAReservedTopicIsRefusedAndCounted(harness):
    bridge = harness.connect()
    bridge.send(bridgedPub(b"7", b"$SYS/x", b"hi", b"leaf", b"a1.5", 0))
    assert bridge.received().startswith(b"ERR 7 BAD_TOPIC ")
    assert harness.broker.stats()["bridged_refused"] == 1


def test_dropsOnTheWayToABridgeAreCountedAsBridged(harness):
    bridge = harness.connect()
    bridge.send(b"SUB 1 # mode=all bridge=1\r\n")
    local = harness.connect()
    local.send(b"SUB 1 # mode=all\r\n")
    harness.connect().send(b"PUB 1 news 2\r\nhi\r\n")
    bridge.lose()
    local.lose()
    stats = harness.broker.stats()
    assert (stats["dropped"], stats["bridged_dropped"]) == (2, 1)


# The loop guard's memory


def test_seenMessagesAreForgottenAfterTheWindow():
    clock = Clock()
    seen = SeenMessages(clock)
    message = (Origin("leaf", "a1.5", 1), "news", b"hi")
    assert seen.firstTime(*message)
    clock.advance(SEEN_WINDOW - 1)
    assert not seen.firstTime(*message)
    clock.advance(1)
    assert seen.firstTime(*message)
    assert len(seen) == 1


def test_seenMessagesAreBounded():
    seen = SeenMessages(Clock(), capacity=3)
    for number in range(5):
        assert seen.firstTime(Origin("leaf", str(number), 1), "news", b"hi")
    assert len(seen) == 3
    # The oldest went first.
    assert seen.firstTime(Origin("leaf", "0", 1), "news", b"hi")
    assert not seen.firstTime(Origin("leaf", "4", 1), "news", b"hi")


@pytest.mark.parametrize(
    "topic, payload",
    [("news", b"other"), ("alerts", b"hi"), ("new", b"shi"), ("news\0", b"hi")],
)
def test_seenMessagesKnowAMessageByItsTopicAndPayloadToo(topic, payload):
    """
    The same origin and id on another topic, or with another payload, is
    another message: a forged id cannot make the broker discard it.
    """
    seen = SeenMessages(Clock())
    assert seen.firstTime(Origin("hub", "a1.5", 1), "news", b"hi")
    assert seen.firstTime(Origin("hub", "a1.5", 1), topic, payload)
    assert not seen.firstTime(Origin("hub", "a1.5", 2), "news", b"hi")


# The link: this broker's bridge to a remote one, played by the test.


@implementer(IStreamClientEndpoint)
class FakeEndpoint:
    """
    The remote broker's endpoint: each connection attempt waits for the
    test to L{accept} or L{refuse} it.
    """

    def __init__(self):
        self.attempts = []

    def connect(self, factory):
        attempt = Deferred()
        self.attempts.append((factory, attempt))
        return attempt

    def accept(self):
        factory, attempt = self.attempts.pop(0)
        protocol = factory.buildProtocol(REMOTE)
        transport = StringTransport(peerAddress=REMOTE)
        protocol.makeConnection(transport)
        attempt.callback(protocol)
        return RemoteConnection(protocol, transport)

    def refuse(self):
        _, attempt = self.attempts.pop(0)
        attempt.errback(ConnectionRefusedError())


class RemoteConnection:
    """
    One connection of the link, seen from the remote broker.
    """

    def __init__(self, protocol, transport):
        self.protocol = protocol
        self.transport = transport

    def send(self, data):
        self.protocol.dataReceived(data)

    def received(self):
        written = self.transport.value()
        self.transport.clear()
        return written

    def lose(self):
        self.protocol.connectionLost(Failure(ConnectionLost()))


class LinkHarness:
    """
    A local broker (a L{BrokerHarness}) with one bridge to a played remote;
    the link waits C{n} seconds after C{n} failures in a row.
    """

    def __init__(self, direction="both", filters=("#",), config=None, credentials=None):
        self.local = BrokerHarness(config or BrokerConfig(messageEvents=True))
        self.endpoint = FakeEndpoint()
        self.link = BridgeLink(
            BridgeSpec("hub", "tcp:10.0.0.1:1373", filters, direction, credentials),
            self.local.broker,
            self.local.clock,
            self.local.sweep,
            self.endpoint,
            retryPolicy=float,
        )
        self.link.startService()

    def connect(self):
        """
        Accept the link's pending attempt and answer its subscriptions.
        """
        remote = self.endpoint.accept()
        subscribed = frames(remote.received(), b"SUB")
        remote.send(b"".join(b"SUBACK %s\r\n" % frame.arguments[0] for frame in subscribed))
        return remote, subscribed

    def states(self):
        return [
            (event["dallal_event"], event.get("reason"))
            for event in self.local.events
            if event.get("dallal_event") in LINK_EVENTS
        ]


def remoteMessage(deliveryId, topic, payload, origin=b"far", oid=b"z.1", hops=0):
    return b"MSG %s %d sub=1 seq=%s id=%s origin=%s oid=%s hops=%d\r\n%s\r\n" % (
        topic,
        len(payload),
        deliveryId,
        deliveryId,
        origin,
        oid,
        hops,
        payload,
    )


def test_theLinkSubscribesOnTheRemoteThenIsUp():
    harness = LinkHarness(filters=("news/#", "alerts/+"))
    assert harness.link.state == "connecting"
    remote = harness.endpoint.accept()
    subscribed = frames(remote.received(), b"SUB")
    assert [frame.line for frame in subscribed] == [
        b"SUB 1 news/# mode=all bridge=1",
        b"SUB 2 alerts/+ mode=all bridge=1",
    ]
    assert harness.link.state == "connecting", "not up before the SubAcks"
    remote.send(b"SUBACK 1\r\nSUBACK 2\r\n")
    assert harness.link.state == "up"
    assert harness.local.fields("bridge_up") == [
        {"bridge": "hub", "address": "10.0.0.1:1373", "subscriptions": 2}
    ]
    assert harness.local.fields("connect")[0]["transport"] == "bridge"


def test_inboundMessagesArePublishedHereThenAcked():
    harness = LinkHarness()
    local = harness.local.connect()
    local.send(b"SUB 1 news mode=fire\r\n")
    local.received()
    remote, _ = harness.connect()
    remote.send(remoteMessage(b"5", b"news", b"hello"))
    # The local subscriber has it by the time the remote gets the ack.
    assert messages(local.received()) == [(b"news", b"hello")]
    assert remote.received() == b"ACK 5\r\n"
    [publish] = harness.local.fields("publish")
    assert (publish["origin"], publish["hops"], publish["transport"]) == ("far", 1, "bridge")
    assert harness.link.status()["received"] == 1


def test_anInboundMessageWithoutAnOriginIsRefusedAndCounted():
    """
    A remote that sends a bridge subscription's message without its origin
    has it refused for good (acked, so never sent again), counted and not
    published here.
    """
    harness = LinkHarness()
    local = harness.local.connect()
    local.send(b"SUB 1 news mode=fire\r\n")
    local.received()
    remote, _ = harness.connect()
    remote.send(b"MSG news 5 sub=1 seq=5 id=5\r\nhello\r\n")
    assert remote.received() == b"ACK 5\r\n"
    assert local.received() == b""
    stats = harness.local.broker.stats()
    assert (stats["bridged_refused"], stats["published"]) == (1, 0)


def test_noAckUntilTheLocalBrokerAccepted():
    """
    If publishing here fails, the remote gets no ack and sends the message
    again.
    """
    harness = LinkHarness()
    remote, _ = harness.connect()

    def broken(*arguments):
        raise RuntimeError("the local broker failed")

    harness.link.broker.publishBridged = broken
    remote.send(remoteMessage(b"5", b"news", b"hello"))
    assert remote.received() == b""
    assert harness.local.broker.stats()["published"] == 0


def test_inboundMessagesAreNotSentBackToTheRemote():
    harness = LinkHarness()
    remote, _ = harness.connect()
    remote.send(remoteMessage(b"5", b"news", b"hello"))
    assert remote.received() == b"ACK 5\r\n"
    assert harness.local.broker.stats()["bridged_delivered"] == 0


def test_outboundMessagesAreAckedHereWhenTheRemoteAcks():
    harness = LinkHarness()
    remote, _ = harness.connect()
    harness.local.connect().send(b"PUB 1 news 5\r\nhello\r\n")
    [pub] = frames(remote.received(), b"PUB")
    # Request 1 was the link's SUB.
    assert pub.arguments[:3] == [b"2", b"news", b"5"]
    assert pub.payload == b"hello"
    broker = harness.local.broker
    assert options(pub) == {
        b"origin": broker.name.encode(),
        b"oid": b"%s.1" % broker.bridging.incarnation.encode(),
        b"hops": b"0",
    }
    assert broker.stats()["inflight"] == 1
    remote.send(b"PUBACK 2\r\n")
    stats = broker.stats()
    assert (stats["inflight"], stats["acked"], stats["bridged_delivered"]) == (0, 1, 1)
    assert harness.link.status()["forwarded"] == 1


def test_aMessageTheRemoteRefusesIsDroppedHere():
    harness = LinkHarness()
    remote, _ = harness.connect()
    harness.local.connect().send(b"PUB 1 news 5\r\nhello\r\n")
    remote.received()
    remote.send(b"ERR 2 PAYLOAD_TOO_LARGE too big for me\r\n")
    stats = harness.local.broker.stats()
    assert (stats["inflight"], stats["dropped_bridge_refused"], stats["bridged_dropped"]) == (
        0,
        1,
        1,
    )


def test_aRemoteShuttingDownGetsTheMessageAgainAfterItsRestart():
    harness = LinkHarness()
    remote, _ = harness.connect()
    harness.local.connect().send(b"PUB 1 news 3\r\none\r\n")
    remote.received()
    remote.send(b"ERR 2 SHUTTING_DOWN the broker is shutting down\r\n")
    assert harness.local.broker.stats()["dropped"] == 0
    remote.lose()
    harness.local.clock.advance(1)
    again, _ = harness.connect()
    [resent] = frames(again.received(), b"PUB")
    assert resent.payload == b"one"


def test_whileThisBrokerShutsDownInboundMessagesAreNotAcked():
    harness = LinkHarness()
    remote, _ = harness.connect()
    harness.local.broker.drain(1.0)
    remote.send(remoteMessage(b"5", b"news", b"hello"))
    assert remote.received() == b""
    assert harness.local.broker.stats()["bridged_refused"] == 0


def test_theLinkReconnectsResubscribesAndResendsWhatWasNotAcked():
    harness = LinkHarness()
    remote, _ = harness.connect()
    publisher = harness.local.connect()
    publisher.send(b"PUB 1 news 3\r\none\r\n")
    [first] = frames(remote.received(), b"PUB")
    remote.lose()
    assert harness.link.state == "down"
    # While the link is down messages wait here.
    publisher.send(b"PUB 2 news 3\r\ntwo\r\n")
    assert harness.endpoint.attempts == []
    harness.local.clock.advance(1)
    again, subscribed = harness.connect()
    assert [frame.line for frame in subscribed] == [b"SUB 1 # mode=all bridge=1"]
    resent = frames(again.received(), b"PUB")
    assert [frame.payload for frame in resent] == [b"one", b"two"]
    # The same message, the same origin: the remote can tell it is a copy.
    assert options(resent[0]) == options(first)
    again.send(b"PUBACK 2\r\nPUBACK 3\r\n")
    stats = harness.local.broker.stats()
    assert (stats["acked"], stats["inflight"], stats["dropped"]) == (2, 0, 0)
    assert harness.states() == [
        ("bridge_connecting", None),
        ("bridge_up", None),
        ("bridge_down", "lost"),
        ("bridge_connecting", None),
        ("bridge_up", None),
    ]
    assert harness.link.status()["connects"] == 2


def test_whileDownTheQueueLimitsHoldAndDropsAreCounted():
    harness = LinkHarness(config=BrokerConfig(delivery=DeliveryConfig(maxQueued=2)))
    publisher = harness.local.connect()
    for number in range(5):
        publisher.send(b"PUB %d news 1\r\nx\r\n" % number)
    # The link makes no progress while down: after the stall timeout, its
    # queue drops its oldest, and the publisher it held back goes on.
    harness.local.clock.advance(DeliveryConfig().stallTimeout)
    stats = harness.local.broker.stats()
    assert (stats["dropped_queue_full"], stats["bridged_dropped"], stats["inflight"]) == (3, 3, 2)


def test_failedAttemptsBackOff():
    harness = LinkHarness()
    endpoint, clock = harness.endpoint, harness.local.clock
    endpoint.refuse()
    assert harness.link.state == "down"
    clock.advance(0.9)
    assert endpoint.attempts == []
    clock.advance(0.1)
    endpoint.refuse()
    clock.advance(1.9)
    assert endpoint.attempts == []
    clock.advance(0.1)
    assert len(endpoint.attempts) == 1
    assert [fields["attempt"] for fields in harness.local.fields("bridge_connecting")] == [1, 2, 3]
    assert {fields["reason"] for fields in harness.local.fields("bridge_down")} == {"refused"}


def test_refusedSubscriptionsCloseTheConnectionAndBackOff():
    harness = LinkHarness()
    remote = harness.endpoint.accept()
    remote.received()
    remote.send(b"ERR 1 BAD_TOPIC no\r\n")
    assert remote.transport.disconnecting
    remote.lose()
    assert harness.states()[-1] == ("bridge_down", "subscribe_failed")
    # Counted as a failed attempt: twice as long before the next.
    harness.local.clock.advance(1)
    assert harness.endpoint.attempts == []
    harness.local.clock.advance(1)
    assert len(harness.endpoint.attempts) == 1


def test_theLinkLogsInBeforeItSubscribes():
    """
    A bridge with credentials logs in on each connection, its client id the
    broker's name, and subscribes once the login is answered.
    """
    harness = LinkHarness(credentials=("leaf-bridge", b"s3cret pw"))
    remote = harness.endpoint.accept()
    [hello] = frames(remote.received(), b"HELLO")
    assert hello.line == b"HELLO 1 harness user=leaf-bridge password=czNjcmV0IHB3"
    assert harness.link.state == "connecting"
    remote.send(b"HELLO 1 version=0.1.0 ping=10 user=leaf-bridge\r\n")
    [subscribe] = frames(remote.received(), b"SUB")
    remote.send(b"SUBACK %s\r\n" % subscribe.arguments[0])
    assert harness.link.state == "up"


def test_aRefusedLoginIsSaidAndBacksOff():
    harness = LinkHarness(credentials=("leaf-bridge", b"wrong"))
    remote = harness.endpoint.accept()
    remote.received()
    remote.send(b"ERR 1 BAD_CREDENTIALS bad user name or password\r\n")
    remote.lose()
    assert harness.states()[-1] == ("bridge_down", "login_failed")
    assert frames(remote.received(), b"SUB") == []
    harness.local.clock.advance(2)
    assert len(harness.endpoint.attempts) == 1


def test_aRemoteThatStopsAnsweringPingsIsLeft():
    harness = LinkHarness()
    remote, _ = harness.connect()
    clock = harness.local.clock
    clock.advance(PING_INTERVAL)
    assert remote.received() == b"PING\r\n"
    remote.send(b"PONG\r\n")
    for _ in range(4):
        clock.advance(PING_INTERVAL)
    assert remote.transport.disconnecting
    assert [fields["missed"] for fields in harness.local.fields("ping_missed")] == [1, 2]
    remote.lose()
    assert harness.states()[-1] == ("bridge_down", "missed_pings")


def test_stoppingTheLinkEndsItsSession():
    harness = LinkHarness()
    remote, _ = harness.connect()
    harness.local.connect().send(b"PUB 1 news 1\r\nx\r\n")
    harness.link.stopService()
    assert remote.transport.disconnecting
    remote.lose()
    assert harness.states()[-1] == ("bridge_down", "stopped")
    [disconnect] = harness.local.fields("disconnect")
    assert (disconnect["transport"], disconnect["reason"]) == ("bridge", "shutdown")
    assert harness.local.broker.stats()["dropped_disconnected"] == 1
    # A late PUBACK finds nothing to ack.
    remote.send(b"PUBACK 2\r\n")


def test_directionInDoesNotForwardAndDirectionOutDoesNotSubscribe():
    inbound = LinkHarness(direction="in")
    inbound.connect()
    assert inbound.local.broker.stats()["subscriptions"] == 0
    outbound = LinkHarness(direction="out")
    remote, subscribed = outbound.connect()
    assert subscribed == []
    assert outbound.link.state == "up"


def test_bridgeStateInStatsAndSys():
    harness = LinkHarness()
    SysPublisher(harness.local.broker, harness.local.clock, 1.0).start()
    watcher = harness.local.connect()
    watcher.send(b"SUB 1 $SYS/broker/bridges/hub/state mode=fire\r\n")
    harness.connect()
    harness.local.clock.advance(1)
    assert messages(watcher.received()) == [
        (b"$SYS/broker/bridges/hub/state", b"connecting"),
        (b"$SYS/broker/bridges/hub/state", b"up"),
    ]
    watcher.send(b"STATS 2\r\n")
    written = watcher.received()
    bridges = json.loads(written[written.index(b"\r\n") + 2 : -2])["bridges"]
    assert bridges == {
        "hub": {
            "state": "up",
            "remote": "tcp:10.0.0.1:1373",
            "direction": "both",
            "connects": 1,
            "received": 0,
            "forwarded": 0,
            "unacked": 0,
        }
    }


def test_linkEventsAreCatalogued():
    events, _ = catalogue()
    harness = LinkHarness()
    harness.endpoint.refuse()
    harness.local.clock.advance(1)
    harness.connect()
    for name in LINK_EVENTS:
        level, fields = events[name]
        event = next(event for event in harness.local.events if event.get("dallal_event") == name)
        assert event["log_level"].name == level
        assert list(harness.local.fields(name)[0]) == fields


# --bridge


def test_parseBridge():
    assert parseBridge("hub=tcp:hub.example:1373", Clock()) == BridgeSpec(
        "hub", "tcp:hub.example:1373", ("#",), "both"
    )
    assert parseBridge(
        "up-1=tcp:10.0.0.1:1373,topics=news/#;alerts/+,direction=out", Clock()
    ) == BridgeSpec("up-1", "tcp:10.0.0.1:1373", ("news/#", "alerts/+"), "out")


@pytest.mark.parametrize(
    "text, reason",
    [
        ("hub", "'hub' is not NAME=ENDPOINT"),
        ("h u b=tcp:h:1", "name 'h u b' must be 1 to 64 letters"),
        ("hub=bogus:h:1", "hub: 'bogus:h:1' is not a client endpoint description"),
        ("hub=tcp:h:1,direction=sideways", "hub: direction must be one of in, out, both"),
        ("hub=tcp:h:1,topics=a/b#", "hub: bad topic filter 'a/b#'"),
        ("hub=tcp:h:1,topics=$SYS/#", "are each broker's own and are not bridged"),
        ("hub=tcp:h:1,colour=red", "hub: unknown option 'colour=red'"),
        ("hub=tcp:h:1,user=leaf-1", "hub: user= and one of password-file= or password-env="),
        ("hub=tcp:h:1,password-env=HUB_PW", "hub: user= and one of password-file= or"),
        ("hub=tcp:h:1,user=le af,password-env=HUB_PW", "hub: user name 'le af' must be"),
        ("hub=tcp:h:1,user=l,password-env=NONE", "the environment has no variable 'NONE'"),
        ("hub=tcp:h:1,user=l,password-env=EMPTY", "the password in EMPTY is empty"),
        ("hub=tcp:h:1,user=l,password-file=/no/pw", "cannot read the password from /no/pw"),
        ("hub=tcp:h:1,user=l,password-env=HUB_PW,password-env=HUB_PW", "give one password-"),
    ],
)
def test_parseBridgeExplainsWhatIsWrong(text, reason):
    with pytest.raises(ValueError) as raised:
        parseBridge(text, Clock(), {"HUB_PW": "x", "EMPTY": ""})
    assert reason in str(raised.value)


def test_parseBridgeCredentials(tmp_path):
    """
    The password of a bridge's login comes from the first line of a file,
    or from an environment variable; it is never shown in the spec's repr.
    """
    (tmp_path / "pw").write_bytes(b"s3cret pw\r\nignored\n")
    spec = parseBridge(f"hub=tcp:h:1,user=leaf-1,password-file={tmp_path / 'pw'}", Clock())
    assert spec.credentials == ("leaf-1", b"s3cret pw")
    assert "s3cret" not in repr(spec)
    spec = parseBridge("hub=tcp:h:1,user=leaf-1,password-env=HUB_PW", Clock(), {"HUB_PW": "x"})
    assert spec.credentials == ("leaf-1", b"x")


def test_statsCommandShowsALinePerBridge():
    lines = formatStats(
        {
            "published": 3,
            "uptime": 1.5,
            "bridges": {"hub": {"state": "up", "connects": 2, "remote": "tcp:h:1"}},
        }
    )
    assert lines == [
        "published  3",
        "uptime     1.5",
        "bridge hub: connects=2 remote=tcp:h:1 state=up",
    ]


# The broker's name


def test_aGeneratedNameIsKeptInTheDataDirectory(tmp_path):
    name = storedName(tmp_path)
    assert name.startswith("dallal-")
    assert storedName(tmp_path) == name
    assert (tmp_path / NAME_FILE).read_text() == name + "\n"


def test_anUnusableNameFileIsExplained(tmp_path):
    (tmp_path / NAME_FILE).write_text("not a name\n")
    with pytest.raises(BrokerNameError) as raised:
        storedName(tmp_path)
    assert "must be 1 to 64 letters" in str(raised.value)
    assert "remove the file" in str(raised.value)
