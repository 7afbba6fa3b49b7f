"""
The MQTT protocol (L{dallal.server.mqtt}) on in-memory connections and a
clock: packets in, packets out, and what the broker core makes of them.
"""

import gc
import weakref

import pytest
from helpers import BrokerHarness, MemoryRetained, countersAddUp, harnessWithRetained, messages
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_auth import PendingChecks
from twisted.internet.address import IPv4Address
from twisted.python import usage

from dallal.broker.core import BrokerConfig
from dallal.broker.delivery import DeliveryConfig
from dallal.protocol.mqtt import (
    MQTT_3_1_1,
    MQTT_5,
    Auth,
    ConnAck,
    Connect,
    Disconnect,
    MQTTDecoder,
    PingReq,
    PingResp,
    Property,
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
)
from dallal.server.mqtt import TOPIC_ALIAS_MAXIMUM
from dallal.server.tap import Options


class MQTTClient:
    """
    A fake MQTT client of a L{BrokerHarness}: sends packets, decodes what
    the broker wrote.
    """

    def __init__(self, harness, version=MQTT_3_1_1):
        self.harness = harness
        self.version = version
        self.connection = harness.connectMQTT()
        self.decoder = MQTTDecoder(version)

    def send(self, *packets):
        self.connection.send(b"".join(packet.encode(self.version) for packet in packets))

    def received(self):
        return list(self.decoder.feed(self.connection.received()))

    def connect(self, clientId="c1", **fields):
        self.send(Connect(clientId, self.version, **fields))
        return self.received()

    def subscribe(self, *filters, packetId=1):
        self.send(
            Subscribe(
                packetId,
                [f if isinstance(f, Subscription) else Subscription(*f) for f in filters],
            )
        )
        return self.received()

    @property
    def closing(self):
        return self.connection.closing

    def lose(self):
        self.connection.lose()


@pytest.fixture
def harness():
    return harnessWithRetained()


def connected(harness, clientId="c1", version=MQTT_3_1_1, **fields):
    client = MQTTClient(harness, version)
    (answer,) = client.connect(clientId, **fields)
    assert answer.reasonCode == 0, answer
    return client


# CONNECT


def test_connectIsAnsweredInTheClientsVersion(harness):
    old = MQTTClient(harness, MQTT_3_1_1)
    assert old.connect("a") == [ConnAck()]
    new = MQTTClient(harness, MQTT_5)
    (answer,) = new.connect("b")
    assert answer.reasonCode == 0 and not answer.sessionPresent
    assert answer.properties[Property.TOPIC_ALIAS_MAXIMUM] == TOPIC_ALIAS_MAXIMUM
    (event,) = [e for e in harness.fields("connect")][-1:]
    assert event["transport"] == "mqtt"


def test_anEmptyClientIdIsAssignedOne(harness):
    client = MQTTClient(harness, MQTT_5)
    (answer,) = client.connect("")
    assigned = answer.properties[Property.ASSIGNED_CLIENT_IDENTIFIER]
    assert assigned.startswith("auto-")
    assert client.connection.protocol.clientId == assigned


def test_anEmptyClientIdCannotKeepASessionIn311(harness):
    client = MQTTClient(harness)
    assert client.connect("", cleanStart=False) == [ConnAck(reasonCode=2)]
    assert client.closing


def test_aSecondConnectionWithTheClientIdTakesItOver(harness):
    first = connected(harness, "same", MQTT_5)
    connected(harness, "same", MQTT_5)
    assert first.received() == [Disconnect(ReasonCode.SESSION_TAKEN_OVER)]
    assert first.closing
    first.lose()
    assert harness.fields("disconnect")[-1]["reason"] == "taken_over"


def test_pingreqIsAnswered(harness):
    client = connected(harness)
    client.send(PingReq())
    assert client.received() == [PingResp()]


def test_keepAliveClosesASilentClientAfterOneAndAHalfTimes(harness):
    client = connected(harness, keepAlive=10)
    harness.clock.advance(14)
    client.send(PingReq())
    harness.clock.advance(14)
    assert not client.closing
    harness.clock.advance(1.1)
    assert client.closing
    assert harness.broker.counters["clients_dropped"] == 1


def test_noConnectWithinTheLoginTimeoutCloses(harness):
    """
    A connection that sends no CONNECT, or half of one, is closed after
    the login timeout, and counted and logged as a LOGIN_TIMEOUT.
    """
    silent = MQTTClient(harness)
    half = MQTTClient(harness)
    half.connection.send(Connect("c1").encode(MQTT_3_1_1)[:8])
    harness.clock.advance(59)
    assert not silent.closing and not half.closing
    harness.clock.advance(1)
    assert silent.closing and half.closing
    assert harness.broker.counters["errors"] == 2
    assert [(e["code"], e["fatal"]) for e in harness.fields("protocol_error")] == [
        ("LOGIN_TIMEOUT", True),
        ("LOGIN_TIMEOUT", True),
    ]


# Logins and the ACL


def test_aLoginIsCheckedByTheBrokersCheckers():
    harness = BrokerHarness(users={"alice": b"secret"})
    anonymous = MQTTClient(harness)
    assert anonymous.connect("x") == [ConnAck(reasonCode=5)]
    wrong = MQTTClient(harness, MQTT_5)
    assert wrong.connect("y", username="alice", password=b"nope") == []
    harness.clock.advance(1)
    (answer,) = wrong.received()
    assert answer.reasonCode == ReasonCode.NOT_AUTHORIZED
    assert wrong.closing
    right = MQTTClient(harness)
    assert right.connect("z", username="alice", password=b"secret") == [ConnAck()]
    assert harness.broker.counters["logins"] == 1
    assert harness.broker.counters["logins_failed"] == 1


def test_aSessionIsResumedOrTakenOverOnlyByItsOwnUser():
    """
    A client id is no credential: another user's CONNECT with it neither
    resumes the session (nor reads what waits in it) nor closes the
    connection that carries it; it is refused, counted and logged.  The
    session's own user still takes it over.
    """
    harness = BrokerHarness(users={"alice": b"a-pw", "mallory": b"m-pw"})
    alice = connected(harness, "phone", cleanStart=False, username="alice", password=b"a-pw")
    resuming = MQTTClient(harness)
    assert resuming.connect("phone", cleanStart=False, username="mallory", password=b"m-pw") == [
        ConnAck(reasonCode=2)
    ]
    assert resuming.closing
    kicking = MQTTClient(harness, MQTT_5)
    (answer,) = kicking.connect("phone", cleanStart=True, username="mallory", password=b"m-pw")
    assert answer.reasonCode == ReasonCode.CLIENT_IDENTIFIER_NOT_VALID
    assert "another user's session" in answer.properties[Property.REASON_STRING]
    assert not alice.closing and alice.received() == []
    assert [f["code"] for f in harness.fields("protocol_error")] == ["CLIENT_ID_TAKEN"] * 2
    again = MQTTClient(harness)
    assert again.connect("phone", cleanStart=False, username="alice", password=b"a-pw") == [
        ConnAck(sessionPresent=True)
    ]
    assert alice.closing


def test_mqttLoginsWaitWithinTheBoundPerAddress():
    """
    MQTT logins take their turn in the same check queue as Dallal's, by
    the client's address: one over --max-pending-logins-per-ip is refused
    at once as "server unavailable", counted as the limit's refusal, while
    another address is still served.
    """
    checks = PendingChecks()
    harness = BrokerHarness(
        BrokerConfig(maxPendingLoginsPerIp=1, messageEvents=True),
        users={"alice": b"pw"},
        runHash=checks,
    )
    waiting = MQTTClient(harness)
    assert waiting.connect("a", username="alice", password=b"pw") == []
    refused = MQTTClient(harness, MQTT_5)
    (answer,) = refused.connect("b", username="alice", password=b"pw")
    assert answer.reasonCode == ReasonCode.SERVER_UNAVAILABLE
    assert "maximum of 1 logins from 127.0.0.1" in answer.properties[Property.REASON_STRING]
    assert refused.closing
    assert harness.broker.stats()["refused_pending_logins_per_ip"] == 1
    other = MQTTClient(harness)
    other.connection = harness.connectMQTT(host="10.0.0.2")
    assert other.connect("c", username="alice", password=b"pw") == []
    while checks.waiting:
        checks.runAll()
    assert waiting.received() == other.received() == [ConnAck()]


def test_theAclAppliesWithTheClientIdAsPercentC():
    harness = BrokerHarness(acl="pattern readwrite devices/%c/#\n")
    client = connected(harness, "d1", MQTT_5)
    assert client.subscribe(("devices/d1/#", 1), ("devices/d2/#", 1)) == [
        SubAck(1, [1, ReasonCode.NOT_AUTHORIZED])
    ]
    client.send(Publish("devices/d2/x", b"no", qos=1, packetId=7))
    (answer,) = client.received()
    assert answer.reasonCode == ReasonCode.NOT_AUTHORIZED
    client.send(Publish("devices/d1/x", b"yes", qos=1, packetId=8))
    assert [type(p) for p in client.received()] == [Publish, PubAck]


def test_anAclRefusalIsAckedIn311AsMosquittoDoes():
    harness = BrokerHarness(acl="pattern readwrite devices/%c/#\n")
    client = connected(harness, "d1")
    client.send(Publish("elsewhere", b"no", qos=1, packetId=7))
    assert client.received() == [PubAck(7)]
    assert harness.broker.counters["denied"] == 1


# PUBLISH both ways


def test_qosIsTheLowerOfThePublishAndTheSubscription(harness):
    subscriber = connected(harness, "s")
    assert subscriber.subscribe(("q0", 0), ("q1", 1), ("q2", 2)) == [SubAck(1, [0, 1, 2])]
    publisher = connected(harness, "p")
    packetIds = iter(range(1, 100))
    for topic in ("q0", "q1", "q2"):
        for qos in (0, 1, 2):
            publisher.send(
                Publish(topic, b"%d" % qos, qos=qos, packetId=next(packetIds) if qos else None)
            )
    got = [(p.topic, p.qos) for p in subscriber.received()]
    assert got == [
        ("q0", 0),
        ("q0", 0),
        ("q0", 0),
        ("q1", 0),
        ("q1", 1),
        ("q1", 1),
        ("q2", 0),
        ("q2", 1),
        ("q2", 2),
    ]


def test_qos1IsAckedByPuback(harness):
    subscriber = connected(harness, "s")
    subscriber.subscribe(("t", 1))
    publisher = connected(harness, "p")
    publisher.send(Publish("t", b"x", qos=1, packetId=5))
    assert publisher.received() == [PubAck(5)]
    (message,) = subscriber.received()
    assert harness.broker.counters["acked"] == 0
    subscriber.send(PubAck(message.packetId))
    assert harness.broker.counters["acked"] == 1
    assert countersAddUp(harness.broker.counters)


@pytest.mark.parametrize("messageEvents", [True, False])
def test_pubAcksReadTogetherAckEachAndRefillTheWindow(messageEvents):
    harness = BrokerHarness(BrokerConfig(delivery=DeliveryConfig(maxInflight=2)))
    harness.broker.events.messageEvents = messageEvents
    subscriber = connected(harness, "s")
    subscriber.subscribe(("t", 1))
    publisher = connected(harness, "p")
    publisher.send(
        *[Publish("t", b"%d" % number, qos=1, packetId=number) for number in range(1, 6)]
    )
    first, second = subscriber.received()
    # A duplicate and an unknown packet identifier ack nothing.
    subscriber.send(PubAck(first.packetId), PubAck(first.packetId), PubAck(second.packetId))
    subscriber.send(PubAck(99))
    assert harness.broker.counters["acked"] == 2
    assert [message.payload for message in subscriber.received()] == [b"3", b"4"]
    assert len(harness.fields("ack")) == (2 if messageEvents else 0)
    assert countersAddUp(harness.broker.counters)


def test_everyQos1PublishOfAReadGoesOutAtQos1(harness):
    """
    A read's QoS 1 PUBLISHes on a topic the broker has checked before are
    published without a check each, yet as any other: at the lower of
    their QoS and the subscription's, acked once each.
    """
    subscriber = connected(harness, "s", MQTT_5)
    subscriber.subscribe(("t", 2))
    publisher = connected(harness, "p")
    publisher.send(*[Publish("t", b"%d" % i, qos=1, packetId=i) for i in (1, 2, 3)])
    assert publisher.received() == [PubAck(1), PubAck(2), PubAck(3)]
    delivered = subscriber.received()
    assert [(p.payload, p.qos, p.retain) for p in delivered] == [
        (b"1", 1, False),
        (b"2", 1, False),
        (b"3", 1, False),
    ]
    assert harness.broker.counters["published"] == 3
    assert countersAddUp(harness.broker.counters)


def test_theAcksOfOneReadComeInTheOrderOfItsPackets(harness):
    """
    The bare PUBACKs of a read's QoS 1 PUBLISHes are written together, yet
    every answer comes in the order of the packets it answers, up to the
    protocol error that closes the connection [MQTT-4.6.0-2].
    """
    publisher = connected(harness, "p", MQTT_5)
    publisher.send(
        Publish("t", b"1", qos=1, packetId=1),
        Publish("t", b"2", qos=1, packetId=2),
        Publish("t", b"3", qos=2, packetId=3),
        Publish("t", b"4", qos=1, packetId=4),
        PingReq(),
        Publish("t", b"5", qos=1, packetId=5),
        Publish("", b"6", qos=1, packetId=6, properties={Property.TOPIC_ALIAS: 9}),
    )
    *answers, refusal = publisher.received()
    assert answers == [PubAck(1), PubAck(2), PubRec(3), PubAck(4), PingResp(), PubAck(5)]
    assert refusal.reasonCode == ReasonCode.PROTOCOL_ERROR
    assert publisher.closing


def test_qos2FromTheClientIsPublishedOnceAndReleased(harness):
    subscriber = connected(harness, "s")
    subscriber.subscribe(("t", 0))
    publisher = connected(harness, "p")
    publisher.send(Publish("t", b"once", qos=2, packetId=9))
    assert publisher.received() == [PubRec(9)]
    publisher.send(Publish("t", b"once", qos=2, packetId=9, dup=True))
    assert publisher.received() == [PubRec(9)]
    assert [p.payload for p in subscriber.received()] == [b"once"]
    publisher.send(PubRel(9))
    assert publisher.received() == [PubComp(9)]
    # Released: the identifier may carry a new message.
    publisher.send(Publish("t", b"again", qos=2, packetId=9))
    assert [p.payload for p in subscriber.received()] == [b"again"]


@pytest.mark.parametrize("version", [MQTT_3_1_1, MQTT_5])
def test_unreleasedQos2PublishesAreBoundedByTheReceiveMaximum(version):
    """
    A client may leave at most the broker's Receive Maximum (--max-inflight,
    told in an MQTT 5 CONNACK) QoS 2 publishes unreleased, whose packet
    identifiers its session holds: one more closes the connection (MQTT 5:
    DISCONNECT 0x93), counted and logged as a limit.  A PUBREL frees one.
    """
    harness = BrokerHarness(BrokerConfig(delivery=DeliveryConfig(maxInflight=2)))
    client = MQTTClient(harness, version)
    (answer,) = client.connect("p", cleanStart=False)
    if version == MQTT_5:
        assert answer.properties[Property.RECEIVE_MAXIMUM] == 2
    client.send(Publish("t", b"1", qos=2, packetId=1), Publish("t", b"2", qos=2, packetId=2))
    client.send(PubRel(1), Publish("t", b"3", qos=2, packetId=3))
    assert client.received() == [PubRec(1), PubRec(2), PubComp(1), PubRec(3)]
    assert not client.closing
    client.send(Publish("t", b"4", qos=2, packetId=4))
    expected = [] if version == MQTT_3_1_1 else [ReasonCode.RECEIVE_MAXIMUM_EXCEEDED]
    assert [packet.reasonCode for packet in client.received()] == expected
    assert client.closing
    assert harness.broker.stats()["refused_receive_maximum"] == 1
    (event,) = harness.fields("limit_reached")
    assert event["limit"] == "receive_maximum" and event["max"] == 2


def test_anUnknownPubrelIsAnsweredWithNotFoundInMQTT5(harness):
    client = connected(harness, "p", MQTT_5)
    client.send(PubRel(3))
    assert client.received() == [PubComp(3, ReasonCode.PACKET_IDENTIFIER_NOT_FOUND)]


def test_qos2ToTheClientIsAckedAtPubcomp(harness):
    subscriber = connected(harness, "s")
    subscriber.subscribe(("t", 2))
    publisher = connected(harness, "p")
    publisher.send(Publish("t", b"x", qos=2, packetId=1), PubRel(1))
    (message,) = subscriber.received()
    assert message.qos == 2
    subscriber.send(PubRec(message.packetId))
    assert subscriber.received() == [PubRel(message.packetId)]
    assert harness.broker.counters["acked"] == 0
    subscriber.send(PubComp(message.packetId))
    assert harness.broker.counters["acked"] == 1
    assert countersAddUp(harness.broker.counters)


def test_theReceiveMaximumIsTheWindow(harness):
    subscriber = connected(harness, "s", MQTT_5, properties={Property.RECEIVE_MAXIMUM: 2})
    subscriber.subscribe(("t", 1))
    publisher = connected(harness, "p")
    for number in range(3):
        publisher.send(Publish("t", b"%d" % number, qos=1, packetId=number + 1))
    first = subscriber.received()
    assert [p.payload for p in first] == [b"0", b"1"]
    subscriber.send(PubAck(first[0].packetId))
    assert [p.payload for p in subscriber.received()] == [b"2"]


def test_nothingIsResentWithinAConnection(harness):
    subscriber = connected(harness, "s")
    subscriber.subscribe(("t", 1))
    connected(harness, "p").send(Publish("t", b"x", qos=1, packetId=1))
    assert len(subscriber.received()) == 1
    harness.clock.advance(3600)
    assert subscriber.received() == []
    subscriber.lose()
    assert harness.broker.counters["dropped_disconnected"] == 1


def test_aDallalPublishReachesAnMQTTSubscriberAndBack(harness):
    mqtt = connected(harness, "m")
    mqtt.subscribe(("news/#", 1))
    tcp = harness.connect()
    tcp.send(b"SUB s1 news/# mode=all\r\n")
    tcp.received()
    tcp.send(b"PUB p1 news/a 5\r\nhello\r\n")
    (message,) = mqtt.received()
    assert (message.topic, message.payload, message.qos) == ("news/a", b"hello", 1)
    mqtt.send(Publish("news/b", b"back", qos=0))
    assert messages(tcp.received()) == [(b"news/a", b"hello"), (b"news/b", b"back")]


# Subscriptions


def test_retainedMessagesAreSentWithTheRetainFlag(harness):
    publisher = connected(harness, "p")
    publisher.send(Publish("r/a", b"kept", qos=1, packetId=1, retain=True))
    assert publisher.received() == [PubAck(1)]
    subscriber = connected(harness, "s")
    received = subscriber.subscribe(("r/#", 1))
    assert received[0] == SubAck(1, [1])
    assert [(p.topic, p.payload, p.retain) for p in received[1:]] == [("r/a", b"kept", True)]
    # An empty retained payload deletes it, and is published as such.
    publisher.send(Publish("r/a", b"", retain=True))
    assert [(p.payload, p.retain) for p in subscriber.received()] == [(b"", False)]
    late = connected(harness, "l")
    assert late.subscribe(("r/#", 0)) == [SubAck(1, [0])]


def test_retainHandlingAndRetainAsPublished(harness):
    connected(harness, "p").send(Publish("r", b"kept", retain=True))
    subscriber = connected(harness, "s", MQTT_5)
    never = Subscription("r", 0, retainHandling=2)
    assert subscriber.subscribe(never) == [SubAck(1, [0])]
    onlyNew = Subscription("r", 0, retainHandling=1, retainAsPublished=True)
    assert subscriber.subscribe(onlyNew) == [SubAck(1, [0])]
    connected(harness, "q").send(Publish("r", b"live", retain=True))
    (message,) = subscriber.received()
    assert message.retain


def test_wildcardsAtTheFirstLevelDoNotMatchDollarTopics(harness):
    subscriber = connected(harness, "s")
    subscriber.subscribe(("#", 0), ("+/broker/x", 0))
    harness.broker.publishOwn("$SYS/broker/x", b"1")
    assert subscriber.received() == []
    subscriber.subscribe(("$SYS/#", 0))
    harness.broker.publishOwn("$SYS/broker/x", b"2")
    assert [p.payload for p in subscriber.received()] == [b"2"]


def test_overlappingSubscriptionsDeliverOnceAtTheirHighestQos(harness):
    subscriber = connected(harness, "s")
    subscriber.subscribe(("a/#", 0), ("a/+", 2), ("a/b", 1))
    publisher = connected(harness, "p")
    publisher.send(Publish("a/b", b"x", qos=2, packetId=1))
    (message,) = subscriber.received()
    assert message.qos == 2
    publisher.send(Publish("a/c", b"y", qos=2, packetId=2))
    (message,) = subscriber.received()
    assert message.qos == 2
    subscriber.send(Unsubscribe(3, ["a/+"]))
    subscriber.received()
    publisher.send(Publish("a/b", b"z", qos=2, packetId=3))
    (message,) = subscriber.received()
    assert message.qos == 1


def test_subscriptionIdentifiersOfEveryMatchingSubscription(harness):
    subscriber = connected(harness, "s", MQTT_5)
    subscriber.send(
        Subscribe(1, [Subscription("a/#", 1)], {Property.SUBSCRIPTION_IDENTIFIER: [7]}),
        Subscribe(2, [Subscription("a/b", 0)], {Property.SUBSCRIPTION_IDENTIFIER: [9]}),
        Subscribe(3, [Subscription("a/+", 0)]),
    )
    assert subscriber.received() == [SubAck(1, [1]), SubAck(2, [0]), SubAck(3, [0])]
    connected(harness, "p").send(Publish("a/b", b"x", qos=1, packetId=1), Publish("a/c", b"y"))
    first, second = subscriber.received()
    assert sorted(first.properties[Property.SUBSCRIPTION_IDENTIFIER]) == [7, 9]
    assert second.properties[Property.SUBSCRIPTION_IDENTIFIER] == [7]


def test_manyOverlappingSubscriptionsGiveEveryIdentifierToEveryNewTopic(harness):
    """
    64 overlapping filters, each with its identifier, all match every
    a/b/c/d/e/f/<n>: each new topic's message carries the 64 identifiers
    beside its own properties (more than 127 bytes of them), and a new
    subscription changes what the topics it matches get, and only those.
    """
    subscriber = connected(harness, "s", MQTT_5)
    levels = "abcdef"
    filters = [
        "/".join("+" if mask >> depth & 1 else level for depth, level in enumerate(levels)) + "/+"
        for mask in range(64)
    ]
    subscriber.send(
        *(
            Subscribe(
                number, [Subscription(topicFilter, 0)], {Property.SUBSCRIPTION_IDENTIFIER: [number]}
            )
            for number, topicFilter in enumerate(filters, 1)
        )
    )
    assert len(subscriber.received()) == 64
    tagged = {Property.USER_PROPERTY: [("k", "v")]}
    publisher = connected(harness, "p", MQTT_5)
    publisher.send(
        Publish("a/b/c/d/e/f/1", b"x", properties=tagged),
        Publish("a/b/c/d/e/f/2", b"y", properties=tagged),
    )
    for message in subscriber.received():
        assert message.properties[Property.USER_PROPERTY] == [("k", "v")]
        assert sorted(message.properties[Property.SUBSCRIPTION_IDENTIFIER]) == list(range(1, 65))
    subscriber.send(
        Subscribe(65, [Subscription("a/b/c/d/e/f/3", 0)], {Property.SUBSCRIPTION_IDENTIFIER: [65]})
    )
    subscriber.received()
    publisher.send(Publish("a/b/c/d/e/f/3", b"z"), Publish("a/b/c/d/e/f/4", b"w"))
    third, fourth = subscriber.received()
    assert sorted(third.properties[Property.SUBSCRIPTION_IDENTIFIER]) == list(range(1, 66))
    assert sorted(fourth.properties[Property.SUBSCRIPTION_IDENTIFIER]) == list(range(1, 65))


def test_aQos0MessageIsEncodedForEachSubscribersVersionAndOptions(harness):
    old = connected(harness, "old")
    new = connected(harness, "new", MQTT_5)
    asPublished = connected(harness, "asPublished", MQTT_5)
    identified = connected(harness, "identified", MQTT_5)
    for client in (old, new):
        client.subscribe(("t", 0))
    asPublished.subscribe(Subscription("t", 0, retainAsPublished=True))
    identified.send(Subscribe(1, [Subscription("t", 0)], {Property.SUBSCRIPTION_IDENTIFIER: [4]}))
    identified.received()
    tagged = {Property.USER_PROPERTY: [("k", "v")]}
    publisher = connected(harness, "p", MQTT_5)
    publisher.send(Publish("t", b"x", retain=True, properties=tagged))
    assert old.received() == [Publish("t", b"x")]
    assert new.received() == [Publish("t", b"x", properties=tagged)]
    assert asPublished.received() == [Publish("t", b"x", retain=True, properties=tagged)]
    assert identified.received() == [
        Publish("t", b"x", properties={**tagged, Property.SUBSCRIPTION_IDENTIFIER: [4]})
    ]


def test_aQos1Or2MessageIsEncodedForEachSubscriberWithItsOwnPacketId(harness):
    old = connected(harness, "old")
    new = connected(harness, "new", MQTT_5)
    exactlyOnce = connected(harness, "exactlyOnce", MQTT_5)
    asPublished = connected(harness, "asPublished", MQTT_5)
    identified = connected(harness, "identified", MQTT_5)
    for client in (old, new):
        client.subscribe(("t", 1))
    exactlyOnce.subscribe(("t", 2))
    asPublished.subscribe(Subscription("t", 1, retainAsPublished=True))
    identified.send(Subscribe(1, [Subscription("t", 1)], {Property.SUBSCRIPTION_IDENTIFIER: [4]}))
    identified.received()
    # Each subscriber is at another packet identifier.
    new.subscribe(("u", 1), packetId=2)
    publisher = connected(harness, "p", MQTT_5)
    publisher.send(Publish("u", b"u", qos=1, packetId=1))
    new.received()
    tagged = {Property.USER_PROPERTY: [("k", "v")]}
    # Over 127 bytes: a Remaining Length of two bytes.
    payload = b"x" * 200
    for packetId in (2, 3):
        publisher.send(
            Publish("t", payload, qos=2, packetId=packetId, retain=True, properties=tagged)
        )
        publisher.received()
        publisher.send(PubRel(packetId))
    assert old.received() == [
        Publish("t", payload, qos=1, packetId=1),
        Publish("t", payload, qos=1, packetId=2),
    ]
    assert new.received() == [
        Publish("t", payload, qos=1, packetId=2, properties=tagged),
        Publish("t", payload, qos=1, packetId=3, properties=tagged),
    ]
    assert exactlyOnce.received() == [
        Publish("t", payload, qos=2, packetId=1, properties=tagged),
        Publish("t", payload, qos=2, packetId=2, properties=tagged),
    ]
    assert asPublished.received() == [
        Publish("t", payload, qos=1, packetId=1, retain=True, properties=tagged),
        Publish("t", payload, qos=1, packetId=2, retain=True, properties=tagged),
    ]
    assert identified.received() == [
        Publish(
            "t",
            payload,
            qos=1,
            packetId=packetId,
            properties={**tagged, Property.SUBSCRIPTION_IDENTIFIER: [4]},
        )
        for packetId in (1, 2)
    ]


def test_invalidFiltersAreRefusedInTheSuback(harness):
    old = connected(harness, "o")
    assert old.subscribe(("a/#/b", 0), ("$share/g", 0), ("ok", 2)) == [SubAck(1, [0x80, 0x80, 2])]
    new = connected(harness, "n", MQTT_5)
    assert new.subscribe(("a/#/b", 0), ("$share/+/t", 0)) == [
        SubAck(1, [ReasonCode.TOPIC_FILTER_INVALID, ReasonCode.TOPIC_FILTER_INVALID])
    ]


def test_sharedSubscriptionsGiveEachMessageToOneMember(harness):
    members = [connected(harness, f"m{number}", MQTT_5) for number in range(3)]
    for member in members:
        assert member.subscribe(("$share/workers/jobs/+", 1)) == [SubAck(1, [1])]
    # Another group, and a plain subscription, get every message.
    other = connected(harness, "other")
    other.subscribe(("$share/audit/jobs/#", 0))
    plain = connected(harness, "plain")
    plain.subscribe(("jobs/#", 0))
    publisher = connected(harness, "p")
    for number in range(6):
        publisher.send(Publish("jobs/a", b"%d" % number, qos=1, packetId=number + 1))
    shares = [[p.payload for p in member.received()] for member in members]
    assert sorted(payload for share in shares for payload in share) == [b"%d" % n for n in range(6)]
    assert [len(share) for share in shares] == [2, 2, 2]
    assert len(other.received()) == 6
    assert len(plain.received()) == 6
    # A member that leaves leaves the others the whole load.
    members[0].send(Unsubscribe(2, ["$share/workers/jobs/+"]))
    assert members[0].received() == [UnsubAck(2, [0])]
    members[1].lose()
    publisher.send(Publish("jobs/b", b"x", qos=0))
    assert [p.payload for p in members[2].received()] == [b"x"]
    assert members[0].received() == []


def test_aSharedSubscriptionGetsNoRetainedMessages(harness):
    connected(harness, "p").send(Publish("r", b"kept", retain=True))
    member = connected(harness, "m", MQTT_5)
    assert member.subscribe(("$share/g/r", 0)) == [SubAck(1, [0])]


def test_unsubscribe(harness):
    client = connected(harness, "n", MQTT_5)
    client.subscribe(("a", 0))
    client.send(Unsubscribe(2, ["a", "b"]))
    assert client.received() == [UnsubAck(2, [0, ReasonCode.NO_SUBSCRIPTION_EXISTED])]
    old = connected(harness, "o")
    old.send(Unsubscribe(3, ["x"]))
    assert old.received() == [UnsubAck(3)]


# MQTT 5 extras


def test_propertiesArePassedThrough(harness):
    subscriber = connected(harness, "s", MQTT_5)
    subscriber.subscribe(("req", 1))
    properties = {
        Property.RESPONSE_TOPIC: "resp/1",
        Property.CORRELATION_DATA: b"\x01\x02",
        Property.CONTENT_TYPE: "text/plain",
        Property.PAYLOAD_FORMAT_INDICATOR: 1,
        Property.USER_PROPERTY: [("k", "v"), ("k", "w")],
    }
    connected(harness, "p", MQTT_5).send(
        Publish("req", b"?", qos=1, packetId=1, properties=properties)
    )
    (message,) = subscriber.received()
    assert message.properties == properties
    # And to an MQTT 3.1.1 subscriber, without them.
    old = connected(harness, "o")
    old.subscribe(("req", 1))
    connected(harness, "q", MQTT_5).send(Publish("req", b"!", properties=properties))
    assert [p.payload for p in old.received()] == [b"!"]


def test_topicAliases(harness):
    subscriber = connected(harness, "s")
    subscriber.subscribe(("long/topic/name", 0))
    publisher = connected(harness, "p", MQTT_5)
    publisher.send(Publish("long/topic/name", b"1", properties={Property.TOPIC_ALIAS: 1}))
    publisher.send(Publish("", b"2", properties={Property.TOPIC_ALIAS: 1}))
    assert [(p.topic, p.payload) for p in subscriber.received()] == [
        ("long/topic/name", b"1"),
        ("long/topic/name", b"2"),
    ]
    publisher.send(Publish("", b"3", properties={Property.TOPIC_ALIAS: 2}))
    (answer,) = publisher.received()
    assert answer.reasonCode == ReasonCode.PROTOCOL_ERROR
    assert publisher.closing


def test_noLocal(harness):
    client = connected(harness, "c", MQTT_5)
    client.subscribe(Subscription("t", 1, noLocal=True))
    client.send(Publish("t", b"mine", qos=1, packetId=1))
    assert client.received() == [PubAck(1)]
    connected(harness, "o").send(Publish("t", b"theirs"))
    assert [p.payload for p in client.received()] == [b"theirs"]
    harness.clock.advance(0)
    assert countersAddUp(harness.broker.counters)
    assert harness.broker.counters["inflight"] == 0


def test_anExpiredMessageIsNotDelivered(harness):
    subscriber = connected(harness, "s", MQTT_5, properties={Property.RECEIVE_MAXIMUM: 1})
    subscriber.subscribe(("t", 1))
    publisher = connected(harness, "p", MQTT_5)
    for number in range(2):
        publisher.send(
            Publish(
                "t",
                b"%d" % number,
                qos=1,
                packetId=number + 1,
                properties={Property.MESSAGE_EXPIRY_INTERVAL: 10},
            )
        )
    (first,) = subscriber.received()
    harness.clock.advance(10)
    subscriber.send(PubAck(first.packetId))
    harness.clock.advance(0)
    assert subscriber.received() == []
    assert harness.broker.counters["dropped_expired"] == 1


def test_theClientsMaximumPacketSizeIsRespected(harness):
    subscriber = connected(harness, "s", MQTT_5, properties={Property.MAXIMUM_PACKET_SIZE: 64})
    subscriber.subscribe(("t", 1))
    publisher = connected(harness, "p")
    publisher.send(
        Publish("t", b"x" * 100, qos=1, packetId=1), Publish("t", b"small", qos=1, packetId=2)
    )
    assert [p.payload for p in subscriber.received()] == [b"small"]
    harness.clock.advance(0)
    assert harness.broker.counters["dropped_too_large"] == 1


# Wills


def test_theWillIsPublishedWhenTheConnectionIsLost(harness):
    watcher = connected(harness, "w")
    watcher.subscribe(("status/#", 1))
    dying = connected(harness, "d", will=Will("status/d", b"gone", qos=1))
    dying.lose()
    (will,) = watcher.received()
    assert (will.topic, will.payload, will.qos) == ("status/d", b"gone", 1)


def test_aQueuedMessageDoesNotKeepItsPublishersSessionAlive(harness):
    """
    The wills of a client id taken over and back in a loop, queued for a
    session whose client is away, keep nothing of the closed connections'
    sessions: each would hold their subscriptions and caches for as long
    as the message waits.
    """
    away = connected(harness, "away", cleanStart=False)
    away.subscribe(("status/#", 1))
    away.lose()
    dying = connected(harness, "d", will=Will("status/d", b"gone", qos=1))
    dying.subscribe(("other/#", 1))
    session = weakref.ref(dying.connection.protocol.session)
    connected(harness, "d")
    dying.lose()
    del dying
    gc.collect()
    assert len(harness.service.mqttFactory.sessions["away"].pending) == 1
    assert session() is None


def test_theWillIsNotPublishedAfterDisconnect(harness):
    watcher = connected(harness, "w")
    watcher.subscribe(("status/#", 1))
    leaving = connected(harness, "d", will=Will("status/d", b"gone"))
    leaving.send(Disconnect())
    assert leaving.closing
    leaving.lose()
    assert watcher.received() == []


def test_disconnectWithWillMessagePublishesIt(harness):
    watcher = connected(harness, "w")
    watcher.subscribe(("status/#", 1))
    leaving = connected(harness, "d", MQTT_5, will=Will("status/d", b"gone", retain=True))
    leaving.send(Disconnect(ReasonCode.DISCONNECT_WITH_WILL_MESSAGE))
    leaving.lose()
    assert [p.payload for p in watcher.received()] == [b"gone"]
    assert harness.broker.retained.get("status/d") == b"gone"


def test_theWillIsPublishedWhenTheKeepAliveExpires(harness):
    watcher = connected(harness, "w")
    watcher.subscribe(("status/#", 0))
    silent = connected(harness, "d", keepAlive=2, will=Will("status/d", b"gone"))
    harness.clock.advance(3)
    assert silent.closing
    silent.lose()
    assert [p.payload for p in watcher.received()] == [b"gone"]


# Malformed packets


def test_aMalformedPacketClosesWithItsReasonInMQTT5(harness):
    client = connected(harness, "c", MQTT_5)
    # SUBSCRIBE's reserved flags must be 0010.
    client.connection.send(b"\x80\x06\x00\x01\x00\x01a\x00")
    (answer,) = client.received()
    assert isinstance(answer, Disconnect) and answer.reasonCode == ReasonCode.MALFORMED_PACKET
    assert client.closing
    (error,) = harness.fields("protocol_error")
    assert error["code"] == "MALFORMED_PACKET" and error["fatal"] is True
    client.lose()
    assert harness.fields("disconnect")[-1]["reason"] == "protocol_error"


def test_aPacketBegunMustBeCompleteWithinTheFrameDeadline():
    """
    A packet begun must be complete within --max-frame-seconds of the read
    that completed the one before, however slowly it trickles in: then the
    connection closes (MQTT 5: DISCONNECT 0x8D), counted and logged.  A
    client whose reads end in the middle of packets, but that completes
    them, is not cut.
    """
    harness = BrokerHarness(BrokerConfig(maxFrameSeconds=10))
    busy = connected(harness, "busy")
    encoded = Publish("t", b"x" * 100).encode(MQTT_3_1_1)
    busy.connection.send(encoded[:50])
    for _ in range(3):
        harness.clock.advance(9)
        busy.connection.send(encoded[50:] + encoded[:50])
    busy.connection.send(encoded[50:])
    assert not busy.closing
    slow = connected(harness, "slow", MQTT_5)
    encoded = Publish("t", b"x" * 100).encode(MQTT_5)
    for index in range(9):
        slow.connection.send(encoded[index : index + 1])
        harness.clock.advance(1)
    assert not slow.closing
    harness.clock.advance(1)
    (answer,) = slow.received()
    assert answer.reasonCode == ReasonCode.KEEP_ALIVE_TIMEOUT
    assert "not complete within 10 seconds" in answer.properties[Property.REASON_STRING]
    assert slow.closing
    assert harness.broker.stats()["refused_frame_seconds"] == 1


def test_aFirstPacketThatIsNoConnectCloses(harness):
    client = MQTTClient(harness)
    client.connection.send(b"\xc0\x00")
    assert client.closing
    assert harness.broker.counters["errors"] == 1


def test_anUnsupportedProtocolLevelIsAnsweredInTheOldForm(harness):
    client = MQTTClient(harness)
    client.connection.send(b"\x10\x0c\x00\x04MQTT\x03\x02\x00\x3c\x00\x00")
    assert client.connection.received() == b"\x20\x02\x00\x01"
    assert client.closing


def test_aServerPacketFromTheClientIsAProtocolError(harness):
    client = connected(harness, "c", MQTT_5)
    client.send(SubAck(1, [0]))
    (answer,) = client.received()
    assert answer.reasonCode == ReasonCode.PROTOCOL_ERROR
    assert client.closing


def test_anUnknownAuthenticationMethodIsRefused(harness):
    """
    No enhanced authentication, as Mosquitto without plugins: CONNACK 0x8C.
    """
    client = MQTTClient(harness, MQTT_5)
    (answer,) = client.connect("c", properties={Property.AUTHENTICATION_METHOD: "SCRAM-SHA-1"})
    assert answer.reasonCode == ReasonCode.BAD_AUTHENTICATION_METHOD
    assert client.closing


def test_anAuthWithoutAnAuthenticationMethodIsAProtocolError(harness):
    client = connected(harness, "c", MQTT_5)
    client.send(Auth(ReasonCode.RE_AUTHENTICATE, {Property.AUTHENTICATION_METHOD: "m"}))
    (answer,) = client.received()
    assert answer == Disconnect(
        ReasonCode.PROTOCOL_ERROR, {Property.REASON_STRING: "a client does not send AUTH"}
    )
    assert client.closing


def test_aPacketOverTheLimitIsRefusedBeforeItIsRead():
    harness = BrokerHarness(BrokerConfig(maxPayload=1000, messageEvents=True))
    client = connected(harness, "c", MQTT_5)
    # A PUBLISH announcing 200,000 bytes: refused from its header.
    client.connection.send(b"\x30\xc0\x9a\x0c\x00\x01t")
    (answer,) = client.received()
    assert answer.reasonCode == ReasonCode.PACKET_TOO_LARGE
    assert client.closing
    assert harness.broker.counters["refused_payload"] == 1


def test_shutdownTellsMQTT5ClientsWhy():
    harness = BrokerHarness()
    client = connected(harness, "c", MQTT_5)
    stopped = harness.service.stopService()
    harness.clock.advance(harness.service.shutdownGrace)
    assert client.received() == [Disconnect(ReasonCode.SERVER_SHUTTING_DOWN)]
    assert client.closing
    del stopped


def test_aSlowConsumerIsDisconnected():
    """
    An MQTT subscriber that never acks holds its publisher back until the
    stall timeout; then it is a slow consumer, disconnected by that policy.
    """
    delivery = DeliveryConfig(maxQueued=1, slowConsumer="disconnect")
    harness = BrokerHarness(BrokerConfig(delivery=delivery))
    subscriber = connected(harness, "s", MQTT_5, properties={Property.RECEIVE_MAXIMUM: 1})
    subscriber.subscribe(("t", 1))
    publisher = connected(harness, "p")
    for number in range(3):
        publisher.send(Publish("t", b"x", qos=1, packetId=number + 1))
    assert not subscriber.closing
    assert harness.broker.stats()["publishers_held"] == 1
    harness.clock.advance(delivery.stallTimeout)
    assert subscriber.closing


def test_nothingIsReadAfterDisconnect(harness):
    watcher = connected(harness, "w")
    watcher.subscribe(("t", 0))
    leaving = connected(harness, "d")
    leaving.send(Disconnect(), Publish("t", b"same read"))
    leaving.send(Publish("t", b"next read"))
    assert watcher.received() == []


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    version=st.sampled_from([MQTT_3_1_1, MQTT_5]),
    garbage=st.lists(st.binary(min_size=1, max_size=40), min_size=1, max_size=5),
)
def test_anyBytesAfterAConnectNeverRaise(version, garbage):
    """
    Whatever a client sends after its CONNECT is served or refused: no
    exception escapes the protocol, and a refusal closes the connection.
    """
    harness = BrokerHarness(BrokerConfig(messageEvents=False))
    client = connected(harness, "fuzz", version)
    client.subscribe(("#", 2))
    for chunk in garbage:
        if client.closing:
            break
        client.connection.send(chunk)
    client.lose()
    harness.clock.advance(0)
    assert harness.broker.counters["connections"] == 0


_topics = st.sampled_from(["t", "a/b", "$SYS/x", "a b", "x" * 300, "é/ü"])
_filters = st.sampled_from(["#", "+/b", "a/#", "$share/g/t", "$share/g/#", "a/#/b", "$SYS/#", "t"])
_ids = st.integers(1, 5)
_packets = st.one_of(
    st.builds(
        lambda topic, qos, packetId, retain, alias: Publish(
            topic if alias is None or topic != "t" else "",
            b"p",
            qos,
            retain,
            packetId=packetId if qos else None,
            properties={} if alias is None else {Property.TOPIC_ALIAS: alias},
        ),
        _topics,
        st.integers(0, 2),
        _ids,
        st.booleans(),
        st.one_of(st.none(), st.integers(1, 12)),
    ),
    st.builds(PubAck, _ids),
    st.builds(PubRec, _ids),
    st.builds(PubRel, _ids),
    st.builds(PubComp, _ids),
    st.builds(
        lambda packetId, topicFilter, qos, noLocal: Subscribe(
            packetId, [Subscription(topicFilter, qos, noLocal=noLocal)]
        ),
        _ids,
        _filters,
        st.integers(0, 2),
        st.booleans(),
    ),
    st.builds(lambda packetId, topicFilter: Unsubscribe(packetId, [topicFilter]), _ids, _filters),
    st.just(PingReq()),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(packets=st.lists(_packets, min_size=1, max_size=20))
def test_anySequenceOfPacketsKeepsTheCountersTrue(packets):
    """
    Two MQTT 5 clients sending each other any sequence of packets: no
    exception escapes, and once they are gone the broker's accounting
    adds up with nothing left in flight.
    """
    harness = BrokerHarness(BrokerConfig(messageEvents=False))
    first = connected(harness, "one", MQTT_5)
    second = connected(harness, "two", MQTT_5)
    first.subscribe(("#", 2))
    for number, packet in enumerate(packets):
        client = (first, second)[number % 2]
        if not client.closing:
            client.send(packet)
    first.lose()
    second.lose()
    harness.clock.advance(0)
    counters = harness.broker.counters
    assert countersAddUp(counters)
    assert counters["inflight"] == 0 and counters["connections"] == 0


# The command line


def test_mqttListensWhereTheOptionsSay(tmp_path):
    options = Options()
    options.parseOptions(["--mqtt", "1883", "--mqtt", "ssl:8883:privateKey=k:certKey=c"])
    assert options["mqtt"] == [
        "tcp:1883:interface=127.0.0.1",
        "ssl:8883:privateKey=k:certKey=c",
    ]
    with pytest.raises(
        usage.UsageError, match="^--mqtt must be a whole number from 0 to 65535, not .70000.$"
    ):
        Options().parseOptions(["--mqtt", "70000"])
    config = tmp_path / "dallal.toml"
    config.write_text('mqtt = ["1884"]\n')
    options = Options()
    options.parseOptions(["--config", str(config)])
    assert options["mqtt"] == ["tcp:1884:interface=127.0.0.1"]


def test_aSharedMessageGoesOnlyToMembersThatMayReadIt():
    harness = BrokerHarness(acl="pattern readwrite jobs/%c/#\n")
    a = connected(harness, "a")
    b = connected(harness, "b")
    for member in (a, b):
        assert member.subscribe(("$share/g/jobs/#", 0)) == [SubAck(1, [0])]
    for number in range(2):
        b.send(Publish("jobs/b/x", b"%d" % number))
    assert a.received() == []
    assert [p.payload for p in b.received()] == [b"0", b"1"]


def test_aClientWhoseOutputIsFullIsNotReadFrom(harness):
    """
    A client that does not read what the broker writes (its acks, its
    messages) is not read from either, and its messages wait in the
    broker, until the connection drains.
    """
    subscriber = connected(harness, "s", keepAlive=10)
    subscriber.subscribe(("t", 1))
    publisher = connected(harness, "p")
    transport = subscriber.connection.transport
    subscriber.connection.protocol.outputFull()
    assert transport.producerState == "paused"
    publisher.send(Publish("t", b"waits", qos=1, packetId=1))
    assert subscriber.received() == []
    harness.clock.advance(60)
    assert not subscriber.closing
    subscriber.connection.protocol.outputDrained()
    assert transport.producerState == "producing"
    assert [p.payload for p in subscriber.received()] == [b"waits"]


def test_packetsPipelinedAfterConnectWaitForTheLogin():
    """
    Nothing more is read while the password is checked: what the client
    sent after its CONNECT is served once the login succeeds.
    """
    checks = PendingChecks()
    harness = BrokerHarness(users={"alice": b"pw"}, runHash=checks)
    client = MQTTClient(harness)
    client.send(
        Connect("c", MQTT_3_1_1, username="alice", password=b"pw"),
        Subscribe(1, [Subscription("t", 0)]),
        PingReq(),
    )
    assert client.received() == []
    assert client.connection.transport.producerState == "paused"
    checks.runAll()
    assert client.received() == [ConnAck(), SubAck(1, [0]), PingResp()]
    assert client.connection.transport.producerState == "producing"


def test_reasonStringsNeverMakeAPacketLargerThanTheClientTakes():
    harness = BrokerHarness(acl="pattern readwrite devices/%c/#\n")
    client = connected(harness, "d1", MQTT_5, properties={Property.MAXIMUM_PACKET_SIZE: 8})
    client.send(Publish("devices/d2/x", b"no", qos=1, packetId=7))
    assert client.received() == [PubAck(7, ReasonCode.NOT_AUTHORIZED)]


def test_aRetainedPublishToABrokerWithoutAStoreIsAProtocolErrorInMQTT5():
    harness = BrokerHarness()
    client = connected(harness, "c", MQTT_5)
    client.send(Publish("t", b"x", retain=True))
    (answer,) = client.received()
    assert answer.reasonCode == ReasonCode.RETAIN_NOT_SUPPORTED
    assert client.closing


def test_mqttConnectionsCountInTheBrokersConnectionLimit():
    harness = BrokerHarness(BrokerConfig(maxConnections=2, messageEvents=True))
    harness.connect()
    connected(harness, "m")
    refused = harness.service.mqttFactory.buildProtocol(IPv4Address("TCP", "127.0.0.1", 50000))
    assert refused is None
    assert harness.broker.counters["refused_connections"] == 1
    (event,) = harness.fields("limit_reached")
    assert event["transport"] == "mqtt"


# Runs of QoS 0 PUBLISHes (dallal.server.mqtt._PublishRun): published
# together when per-message events are off, with what one by one gives.


def mixedPublishes(messageEvents, runs=True):
    """
    An MQTT 3.1.1 subscriber and a Dallal one in C{fire} mode to C{news},
    an MQTT 5 subscriber to C{mixed}, and an MQTT 3.1.1 publisher sending
    in one read QoS 0 PUBLISHes on C{news} broken by what does not go in a
    run (QoS 1, RETAIN, another topic, PINGREQ), then in another read two
    more and a malformed packet.

    @param runs: whether the broker takes runs of PUBLISHes (else each is
        published on its own).
    @return: what each client read, and the broker's counters.
    """
    harness = BrokerHarness(BrokerConfig(messageEvents=messageEvents))
    harness.broker.retained = MemoryRetained()
    if not runs:
        harness.broker.acceptsRun = lambda subscriber, topic: False
    old = connected(harness, "old")
    old.subscribe(("news", 0))
    dallal = harness.connect()
    dallal.send(b"SUB s news mode=fire\r\n")
    new = connected(harness, "new", MQTT_5)
    new.subscribe(("mixed", 0))
    publisher = connected(harness, "publisher")
    publisher.send(
        Publish("news", b"first", 0, False),
        *(Publish("news", b"%d" % n, 0, False) for n in range(1, 4)),
        Publish("news", b"qos1", 1, False, packetId=1),
        Publish("news", b"4", 0, False),
        Publish("mixed", b"m1", 0, False),
        Publish("mixed", b"m2", 0, False),
        PingReq(),
        Publish("news", b"retained", 0, True),
        Publish("news", b"long" * 10, 0, False),
    )
    publisher.connection.send(
        Publish("news", b"6", 0, False).encode(MQTT_3_1_1)
        + Publish("news", b"7", 0, False).encode(MQTT_3_1_1)
        + b"\x36\x00"
    )
    return (
        publisher.connection.received(),
        old.connection.received(),
        dallal.received(),
        new.connection.received(),
        dict(harness.broker.counters),
    )


def test_runsAsOneByOne():
    """
    Pipelined QoS 0 PUBLISHes published as runs give every client and the
    counters exactly what publishing each on its own gives.
    """
    oneByOne = mixedPublishes(messageEvents=False, runs=False)
    assert mixedPublishes(messageEvents=False) == oneByOne
    assert mixedPublishes(messageEvents=True) == oneByOne
    _, old, dallal, new, counters = oneByOne
    assert [packet.payload for packet in MQTTDecoder(MQTT_3_1_1).feed(old)] == [
        b"first",
        *(b"%d" % n for n in range(1, 4)),
        b"qos1",
        b"4",
        b"retained",
        b"long" * 10,
        b"6",
        b"7",
    ]
    assert dallal.count(b"MSG news") == 10
    assert [packet.payload for packet in MQTTDecoder(MQTT_5).feed(new)] == [b"m1", b"m2"]
    assert (counters["published"], counters["fired"]) == (12, 22)


def test_aPayloadOverTheLimitInARunIsRefused():
    """
    A QoS 0 PUBLISH over C{--max-payload} in the middle of a run of them
    on one topic is refused and counted, as on its own; the others of the
    run are delivered.
    """
    harness = BrokerHarness(BrokerConfig(maxPayload=10, messageEvents=False))
    subscriber = connected(harness, "subscriber")
    subscriber.subscribe(("news", 0))
    publisher = connected(harness, "publisher")
    # A topic is checked once: the run comes after its first message.
    publisher.send(Publish("news", b"first", 0, False))
    publisher.send(
        Publish("news", b"a", 0, False),
        Publish("news", b"x" * 11, 0, False),
        Publish("news", b"b", 0, False),
    )
    delivered = MQTTDecoder(MQTT_3_1_1).feed(subscriber.connection.received())
    assert [packet.payload for packet in delivered] == [b"first", b"a", b"b"]
    assert harness.broker.counters["refused_payload"] == 1
    assert harness.broker.counters["published"] == 3


@pytest.mark.parametrize("mqttFirst", [True, False])
def test_queuedMessagesEncodedOnceForEachProtocol(mqttFirst):
    """
    Messages queued for two MQTT 3.1.1 subscribers and a Dallal one (their
    connections full) are each written the same bytes as messages sent at
    once, whichever protocol's subscriber is written first.
    """

    def written(paused):
        harness = BrokerHarness(BrokerConfig(messageEvents=False))
        olds = [connected(harness, f"old{n}") for n in range(2)]
        for old in olds:
            old.subscribe(("news", 0))
        dallal = harness.connect()
        dallal.send(b"SUB s news mode=fire\r\n")
        dallal.received()
        connections = [old.connection for old in olds] + [dallal]
        order = connections if mqttFirst else connections[::-1]
        if paused:
            for connection in order:
                connection.transport.producer.pauseProducing()
        publisher = connected(harness, "publisher")
        publisher.send(*(Publish("news", b"m%d" % n, 0, False) for n in range(3)))
        if paused:
            for connection in order:
                connection.transport.producer.resumeProducing()
        return [connection.received() for connection in connections]

    atOnce = written(paused=False)
    assert all(atOnce)
    assert written(paused=True) == atOnce
