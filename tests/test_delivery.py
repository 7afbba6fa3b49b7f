"""
Acknowledged delivery on a fake clock: the modes C{latest}, C{all} and
C{fire}, redelivery, slow consumers and the broker's accounting
(PROTOCOL.md, "Delivery"; docs/EVENTS.md), then the client's side of it.

Broker-side scenarios run a real L{dallal.broker.core.Broker} on a L{Clock}, either
with fake subscribers that record what the core hands them, or with its TCP
protocol over a L{StringTransport} when what matters is the bytes a client
would see.  Every scenario ends by checking that the counters add up and
that the events tell the same story.
"""

import json
from collections import Counter
from itertools import count

import pytest
from helpers import BrokerHarness, RecordingSubscriber, Sent, decodeFrames
from twisted.internet.defer import Deferred
from twisted.internet.testing import StringTransport
from zope.interface.verify import verifyObject

from dallal.broker.core import BrokerConfig
from dallal.broker.counters import DELIVERY_COUNTERS, DROP_REASONS
from dallal.broker.delivery import DISCONNECT, DeliveryConfig
from dallal.broker.interfaces import ISubscriber
from dallal.client import DallalClientProtocol, ReceivedMessage
from dallal.modes import ALL, FIRE, LATEST

TOPIC = "news"
ACK_TIMEOUT = 2.0

# What a message's story can end with, besides a `deliver` in fire mode.
ENDING_EVENTS = ("ack", "replace", "drop")


def harnessWith(messageEvents=True, **limits):
    """
    A L{BrokerHarness} whose broker has these L{DeliveryConfig} limits.

    @param messageEvents: whether it logs per-message events.
    """
    harness = BrokerHarness(BrokerConfig(delivery=DeliveryConfig(**limits)))
    harness.broker.events.messageEvents = messageEvents
    return harness


def deliveryCounters(harness):
    counters = harness.broker.counters
    return {name: counters[name] for name in DELIVERY_COUNTERS}


def assertAccountsAgree(harness):
    """
    The broker's counters add up (matched = acked + fired + replaced +
    dropped + inflight), the events count the same things, and no
    (message, session) pair ends its story twice.
    """
    counters = harness.broker.counters
    assert counters["matched"] == (
        counters["acked"]
        + counters["fired"]
        + counters["replaced"]
        + counters["dropped"]
        + counters["inflight"]
    ), dict(counters)
    assert counters["inflight"] >= 0, dict(counters)
    publishes = harness.fields("publish")
    delivers = harness.fields("deliver")
    fires = [event for event in delivers if event["mode"] == FIRE]
    drops = harness.fields("drop")
    told = {
        "published": len(publishes),
        "matched": sum(event["subscribers"] for event in publishes),
        "delivered": sum(event["attempt"] == 1 for event in delivers),
        "redelivered": sum(event["attempt"] > 1 for event in delivers),
        "fired": len(fires),
        "acked": len(harness.fields("ack")),
        "replaced": len(harness.fields("replace")),
        "dropped": len(drops),
    }
    for reason in DROP_REASONS:
        told["dropped_" + reason] = sum(event["reason"] == reason for event in drops)
    assert told == {name: counters[name] for name in told}
    endings = Counter(
        (event["mid"], event["session"]) for name in ENDING_EVENTS for event in harness.fields(name)
    )
    endings.update((event["mid"], event["session"]) for event in fires)
    assert [pair for pair, times in endings.items() if times > 1] == []
    assert counters["matched"] - endings.total() == counters["inflight"]


# The core with fake subscribers.


class Bench:
    """
    A broker core on a L{Clock} with L{RecordingSubscriber}s, one of which
    publishes; published messages are named by their payload.
    """

    def __init__(self, **limits):
        self.harness = harnessWith(**limits)
        self.broker = self.harness.broker
        self.clock = self.harness.clock
        self._ports = count(50001)
        self._payloads = {}
        self.publisher = self.attach()

    def attach(self):
        subscriber = RecordingSubscriber(f"127.0.0.1:{next(self._ports)}")
        self.broker.attach(subscriber)
        subscriber.sid = self.broker.sessionId(subscriber)
        return subscriber

    def subscribe(self, mode, topic=TOPIC, subscriber=None, subscriptionId="s"):
        """
        Subscribe C{subscriber} (a new session by default) to C{topic}.
        """
        if subscriber is None:
            subscriber = self.attach()
        self.broker.subscribe(subscriber, topic, subscriptionId, mode)
        return subscriber

    def publish(self, *payloads, topic=TOPIC):
        for payload in payloads:
            message = self.broker.publish(self.publisher, topic, payload, "p")
            self._payloads[message.mid] = payload

    def stall(self):
        """
        Let the stall timeout pass: a subscriber that made no progress in
        it, with a full queue, is a slow consumer.
        """
        self.clock.advance(self.broker.config.delivery.stallTimeout)

    def ack(self, subscriber, *deliveryIds):
        for deliveryId in deliveryIds:
            self.broker.acknowledge(subscriber, deliveryId)

    def drops(self):
        """
        C{(payload, session, reason)} of each C{drop} event so far.
        """
        return [
            (self._payloads[event["mid"]], event["session"], event["reason"])
            for event in self.harness.fields("drop")
        ]

    def counters(self):
        return deliveryCounters(self.harness)

    def assertAccountsAgree(self):
        assertAccountsAgree(self.harness)


def payloads(count, prefix=b"m"):
    return [b"%s%d" % (prefix, number) for number in range(1, count + 1)]


def test_recordingSubscriberIsASubscriber():
    verifyObject(ISubscriber, RecordingSubscriber("127.0.0.1:1"))


def test_latestKeepsOneInFlightAndReplacesTheWaitingOne():
    """
    In C{latest} mode one message is in flight; a newer one waits, and a
    still newer one replaces it, which is counted and logged as C{replace}
    with C{by=} the message that replaced it.  The ack sends the survivor,
    whose C{seq} shows the gap.
    """
    bench = Bench()
    subscriber = bench.subscribe(LATEST)
    bench.publish(b"m1", b"m2", b"m3")
    assert subscriber.take() == [Sent(b"m1", "s", 1, "1", False)]
    assert bench.harness.fields("replace") == [
        {"mid": 2, "topic": TOPIC, "session": subscriber.sid, "by": 3}
    ]
    assert bench.harness.logLines("replace")[0].startswith(
        f"event=replace mid=2 topic={TOPIC} session={subscriber.sid} by=3 "
        f"broker={bench.harness.broker.name} t="
    )
    assert (bench.counters()["replaced"], bench.counters()["inflight"]) == (1, 2)
    bench.assertAccountsAgree()

    bench.ack(subscriber, "1")
    assert subscriber.take() == [Sent(b"m3", "s", 3, "2", False)]
    bench.ack(subscriber, "2")
    assert subscriber.take() == []
    counters = bench.counters()
    assert (counters["acked"], counters["replaced"], counters["inflight"]) == (2, 1, 0)
    bench.assertAccountsAgree()


def test_allKeepsTheWindowAndQueuesTheRestInOrder():
    """
    In C{all} mode at most C{maxInflight} messages are in flight; the rest
    wait in order, and each ack, whichever it acks, releases the next one.
    """
    bench = Bench(maxInflight=3)
    subscriber = bench.subscribe(ALL)
    bench.publish(*payloads(7))
    assert subscriber.take() == [
        Sent(b"m1", "s", 1, "1", False),
        Sent(b"m2", "s", 2, "2", False),
        Sent(b"m3", "s", 3, "3", False),
    ]
    assert bench.counters()["inflight"] == 7
    for deliveryId, released in [("2", b"m4"), ("1", b"m5"), ("5", b"m6"), ("3", b"m7")]:
        bench.ack(subscriber, deliveryId)
        assert subscriber.takePayloads() == [released], deliveryId
        bench.assertAccountsAgree()
    bench.ack(subscriber, "4", "6", "7")
    assert subscriber.take() == []
    counters = bench.counters()
    assert (counters["acked"], counters["dropped"], counters["inflight"]) == (7, 0, 0)
    bench.assertAccountsAgree()


def test_allWindowIsPerConnection():
    """
    The window is shared by a connection's C{all} subscriptions; another
    connection has its own.
    """
    bench = Bench(maxInflight=2)
    both = bench.subscribe(ALL, topic="a")
    bench.subscribe(ALL, topic="b", subscriber=both)
    other = bench.subscribe(ALL, topic="a")
    bench.publish(b"a1", topic="a")
    bench.publish(b"b1", topic="b")
    bench.publish(b"a2", topic="a")
    assert both.takePayloads() == [b"a1", b"b1"]
    assert other.takePayloads() == [b"a1", b"a2"]
    bench.ack(both, "2")
    assert both.take() == [Sent(b"a2", "s", 2, "3", False)]
    bench.assertAccountsAgree()


def test_aWiderWindowSendsWhatWaitedAtOnce():
    """
    A client's window changed through the broker (an MQTT Receive Maximum)
    bounds what it is sent from then on: a wider one sends at once what
    waited for room, a narrower one holds back what the next acks free.
    """
    bench = Bench(maxInflight=2)
    subscriber = bench.subscribe(ALL)
    bench.publish(*payloads(6))
    assert subscriber.takePayloads() == [b"m1", b"m2"]
    bench.broker.setInflightWindow(subscriber, 4)
    assert subscriber.takePayloads() == [b"m3", b"m4"]
    bench.broker.setInflightWindow(subscriber, 1)
    bench.ack(subscriber, "1", "2", "3")
    assert subscriber.take() == []
    bench.ack(subscriber, "4")
    assert subscriber.takePayloads() == [b"m5"]
    bench.assertAccountsAgree()


@pytest.mark.parametrize("mode", [LATEST, ALL])
def test_redeliveredAfterTheAckTimeout(mode):
    """
    A message not acked within the ack timeout is sent again with the same
    id and seq, marked redelivered; once acked it is not sent again.
    """
    bench = Bench(ackTimeout=ACK_TIMEOUT)
    subscriber = bench.subscribe(mode)
    bench.publish(b"m1")
    first = Sent(b"m1", "s", 1, "1", False)
    assert subscriber.take() == [first]
    bench.clock.advance(ACK_TIMEOUT * 3 / 4)
    assert subscriber.take() == []
    bench.clock.advance(ACK_TIMEOUT / 4)
    assert subscriber.take() == [first._replace(redelivered=True)]
    assert [(e["seq"], e["attempt"]) for e in bench.harness.fields("deliver")] == [
        (1, 1),
        (1, 2),
    ]
    bench.ack(subscriber, "1")
    bench.clock.advance(ACK_TIMEOUT * 5)
    assert subscriber.take() == []
    counters = bench.counters()
    assert (counters["delivered"], counters["redelivered"], counters["acked"]) == (1, 1, 1)
    bench.assertAccountsAgree()


def test_eachDeliveryTimesOutOnItsOwn():
    """
    Deliveries sent at different times are each sent again one ack timeout
    after they were last sent, and a resend of the oldest does not delay the
    next one due; all this with one timer per session, however many
    deliveries are in flight, and none once the session is gone.
    """
    bench = Bench(ackTimeout=ACK_TIMEOUT)
    subscriber = bench.subscribe(ALL)
    sweepTimers = len(bench.clock.getDelayedCalls())
    bench.publish(b"m1")
    bench.clock.advance(ACK_TIMEOUT / 4)
    bench.publish(b"m2", b"m3")
    assert len(bench.clock.getDelayedCalls()) == sweepTimers + 1
    subscriber.take()
    resent = []
    for _ in range(8):
        bench.clock.advance(ACK_TIMEOUT / 4)
        resent.append([sent.payload for sent in subscriber.take()])
        if resent[-1] == [b"m2", b"m3"]:
            bench.ack(subscriber, "3")
    assert resent == [[], [], [b"m1"], [b"m2", b"m3"], [], [], [b"m1"], [b"m2"]]
    assert len(bench.clock.getDelayedCalls()) == sweepTimers + 1
    bench.broker.detach(subscriber, "closed")
    assert len(bench.clock.getDelayedCalls()) == sweepTimers
    bench.assertAccountsAgree()


@pytest.mark.parametrize("mode", [LATEST, ALL])
def test_redeliveryLimit(mode):
    """
    After C{maxAttempts} sends in all the message is dropped
    (C{redelivery_limit}) and its slot is free for the next message.
    """
    bench = Bench(ackTimeout=ACK_TIMEOUT, maxAttempts=3, maxInflight=1)
    subscriber = bench.subscribe(mode)
    bench.publish(b"m1")
    bench.clock.advance(ACK_TIMEOUT)
    bench.clock.advance(ACK_TIMEOUT)
    assert [sent.redelivered for sent in subscriber.take()] == [False, True, True]
    assert bench.drops() == []
    bench.clock.advance(ACK_TIMEOUT)
    assert subscriber.take() == []
    assert bench.drops() == [(b"m1", subscriber.sid, "redelivery_limit")]
    assert bench.harness.logLines("drop")[0].startswith(
        f"event=drop mid=1 topic={TOPIC} session={subscriber.sid} reason=redelivery_limit "
        f"broker={bench.harness.broker.name} t="
    )
    counters = bench.counters()
    assert (counters["redelivered"], counters["dropped_redelivery_limit"]) == (2, 1)
    assert counters["inflight"] == 0
    bench.ack(subscriber, "1")
    assert bench.counters() == counters
    bench.publish(b"m2")
    assert subscriber.take() == [Sent(b"m2", "s", 2, "2", False)]
    bench.assertAccountsAgree()


def test_latestWaitingMessageSupersedesTheUnackedOne():
    """
    In C{latest} mode, when the ack timeout expires with a newer message
    waiting, the unacked one is dropped (C{superseded}) and the newer one
    sent instead of a redelivery.
    """
    bench = Bench(ackTimeout=ACK_TIMEOUT)
    subscriber = bench.subscribe(LATEST)
    bench.publish(b"m1", b"m2")
    assert subscriber.takePayloads() == [b"m1"]
    bench.clock.advance(ACK_TIMEOUT)
    assert subscriber.take() == [Sent(b"m2", "s", 2, "2", False)]
    assert bench.drops() == [(b"m1", subscriber.sid, "superseded")]
    assert bench.counters()["redelivered"] == 0
    bench.ack(subscriber, "2")
    counters = bench.counters()
    assert (counters["acked"], counters["dropped_superseded"], counters["inflight"]) == (1, 1, 0)
    bench.assertAccountsAgree()


def test_dropOldestDropsTheOldestQueuedMessage():
    """
    C{drop-oldest}: once the subscriber is a slow consumer, its full queue
    drops its oldest message for each new one (C{queue_full}), and the
    subscriber sees the gap in C{seq}.
    """
    bench = Bench(maxInflight=1, maxQueued=2)
    subscriber = bench.subscribe(ALL)
    bench.publish(*payloads(4))
    assert bench.drops() == []
    bench.stall()
    bench.publish(b"m5")
    assert subscriber.takePayloads() == [b"m1"]
    assert bench.drops() == [
        (b"m2", subscriber.sid, "queue_full"),
        (b"m3", subscriber.sid, "queue_full"),
    ]
    assert subscriber.disconnected == []
    bench.ack(subscriber, "1")
    assert subscriber.take() == [Sent(b"m4", "s", 4, "2", False)]
    bench.ack(subscriber, "2")
    assert subscriber.take() == [Sent(b"m5", "s", 5, "3", False)]
    bench.ack(subscriber, "3")
    counters = bench.counters()
    assert (counters["acked"], counters["dropped_queue_full"], counters["inflight"]) == (3, 2, 0)
    bench.assertAccountsAgree()


def pausedFireSubscriber(bench):
    subscriber = bench.subscribe(FIRE)
    bench.broker.pauseDelivery(subscriber)
    return subscriber


def test_dropOldestKeepsTheQueueWithinItsBytes():
    """
    The queue is bounded in payload bytes too: 4-byte messages in a 10-byte
    queue, two fit.
    """
    bench = Bench(maxQueuedBytes=10)
    subscriber = pausedFireSubscriber(bench)
    bench.publish(b"m1--", b"m2--", b"m3--")
    bench.stall()
    bench.publish(b"m4--")
    assert subscriber.take() == []
    assert bench.drops() == [
        (b"m1--", subscriber.sid, "queue_full"),
        (b"m2--", subscriber.sid, "queue_full"),
    ]
    bench.broker.resumeDelivery(subscriber)
    assert subscriber.take() == [
        Sent(b"m3--", "s", 3, None, False),
        Sent(b"m4--", "s", 4, None, False),
    ]
    counters = bench.counters()
    assert (counters["fired"], counters["dropped_queue_full"], counters["inflight"]) == (2, 2, 0)
    bench.assertAccountsAgree()


def test_aMessageLargerThanTheQueueCostsOnlyItself():
    """
    A message that could never fit in the queue is dropped by itself: the
    queued messages, which do fit, stay.
    """
    bench = Bench(maxQueuedBytes=10)
    subscriber = pausedFireSubscriber(bench)
    bench.publish(b"m1--", b"m2--", b"m3-too-large")
    bench.assertAccountsAgree()
    assert bench.drops() == [(b"m3-too-large", subscriber.sid, "queue_full")]
    bench.broker.resumeDelivery(subscriber)
    assert subscriber.takePayloads() == [b"m1--", b"m2--"]


# The TCP protocol over a StringTransport: what a client sees.


def connectSubscribed(harness, *subscriptions):
    """
    A client connection that sent each C{SUB} line in C{subscriptions} and
    got its C{SUBACK}.
    """
    client = harness.connect()
    for line in subscriptions:
        client.send(line + b"\r\n")
    assert [frame.verb for frame in decodeFrames(client.received())] == [b"SUBACK"] * len(
        subscriptions
    )
    return client


def publishOver(client, topic, *payloads):
    """
    Publish over a harness connection and check every message is PubAcked.
    """
    for payload in payloads:
        client.send(b"PUB p %s %d\r\n%s\r\n" % (topic, len(payload), payload))
    assert client.received() == b"PUBACK p\r\n" * len(payloads)


def deliveries(client):
    """
    C{(topic, payload, options)} of each C{MSG} the client got since the
    last call; other frames (C{PING}) are left out.
    """
    return [
        (
            frame.arguments[0],
            frame.payload,
            dict(option.split(b"=", 1) for option in frame.arguments[2:]),
        )
        for frame in decodeFrames(client.received())
        if frame.verb == b"MSG"
    ]


def test_acksReadTogetherAreEachCountedBeforeTheNextRequest():
    """
    The ACKs of one read ack each of their messages, and refill the
    window, before the request that follows them is carried out.
    """
    harness = harnessWith(maxInflight=2)
    subscriber = connectSubscribed(harness, b"SUB 1 t mode=all")
    publisher = harness.connect()
    publishOver(publisher, b"t", b"m1", b"m2", b"m3", b"m4", b"m5")
    assert [options[b"id"] for _, _, options in deliveries(subscriber)] == [b"1", b"2"]
    subscriber.send(b"ACK 1\r\nACK 1\r\nACK 2\r\nPING\r\nACK 3\r\n")
    assert [(frame.verb, frame.payload) for frame in decodeFrames(subscriber.received())] == [
        (b"MSG", b"m3"),
        (b"MSG", b"m4"),
        (b"PONG", None),
        (b"MSG", b"m5"),
    ]
    assert deliveryCounters(harness)["acked"] == 3
    assertAccountsAgree(harness)


def test_lateDuplicateAndUnknownAcksAreIgnored():
    """
    An ack for a superseded message, a second ack, and acks for ids never
    sent change no counter, draw no error, and leave the connection open.
    """
    harness = harnessWith(ackTimeout=ACK_TIMEOUT)
    subscriber = connectSubscribed(harness, b"SUB 1 news")
    publisher = harness.connect()
    publishOver(publisher, b"news", b"m1", b"m2")
    assert deliveries(subscriber) == [(b"news", b"m1", {b"sub": b"1", b"seq": b"1", b"id": b"1"})]
    harness.clock.advance(ACK_TIMEOUT)
    assert deliveries(subscriber) == [(b"news", b"m2", {b"sub": b"1", b"seq": b"2", b"id": b"2"})]
    subscriber.send(b"ACK 2\r\n")
    acked = deliveryCounters(harness)
    assert acked["acked"] == 1
    subscriber.send(b"ACK 2\r\n", b"ACK 1\r\n", b"ACK 77\r\n", b"ACK some-id\r\n")
    assert deliveryCounters(harness) == acked
    assert subscriber.received() == b""
    assert not subscriber.closing
    assert harness.broker.counters["errors"] == 0
    assert harness.fields("protocol_error") == []
    assertAccountsAgree(harness)


def test_disconnectPolicyClosesTheSlowConsumer():
    """
    C{disconnect}: a subscriber whose full queue held its publisher back
    for the stall timeout without an ack is closed; what arrives before it
    is gone is dropped (C{slow_consumer}), and what it held when it went as
    C{disconnected}.
    """
    harness = harnessWith(slowConsumer=DISCONNECT, maxInflight=1, maxQueued=2)
    subscriber = connectSubscribed(harness, b"SUB 1 news mode=all")
    publisher = harness.connect()
    publishOver(publisher, b"news", b"m1", b"m2", b"m3", b"m4")
    assert [payload for _, payload, _ in deliveries(subscriber)] == [b"m1"]
    publisher.send(b"PUB p news 2\r\nm5\r\n")
    assert publisher.received() == b""
    harness.clock.advance(DeliveryConfig().stallTimeout - 0.1)
    assert not subscriber.closing
    harness.clock.advance(0.1)
    assert subscriber.closing
    assert publisher.received() == b"PUBACK p\r\n"
    assert subscriber.received() == b""
    counters = deliveryCounters(harness)
    assert (counters["dropped_slow_consumer"], counters["dropped_disconnected"]) == (1, 0)
    subscriber.lose()
    (disconnect,) = harness.fields("disconnect")
    assert (disconnect["client"], disconnect["reason"]) == (subscriber.address, "slow_consumer")
    drops = sorted((event["mid"], event["reason"]) for event in harness.fields("drop"))
    assert drops == [
        (1, "disconnected"),
        (2, "disconnected"),
        (3, "disconnected"),
        (4, "disconnected"),
        (5, "slow_consumer"),
    ]
    counters = deliveryCounters(harness)
    assert (counters["dropped"], counters["inflight"]) == (5, 0)
    assertAccountsAgree(harness)


def test_pausedConnectionIsWrittenNothingUntilResumed():
    """
    While the transport asks its producer to pause, nothing is written to
    it, not even after the ack timeout; on resume what waited is written:
    the newest message for C{latest}, every message in order for C{all} and
    C{fire}.
    """
    harness = harnessWith(ackTimeout=ACK_TIMEOUT)
    subscriber = connectSubscribed(harness, b"SUB 1 l", b"SUB 2 a mode=all", b"SUB 3 f mode=fire")
    publisher = harness.connect()
    subscriber.transport.producer.pauseProducing()
    for number in (1, 2, 3):
        for topic in (b"l", b"a", b"f"):
            publishOver(publisher, topic, topic + b"%d" % number)
    harness.clock.advance(ACK_TIMEOUT * 2)
    assert subscriber.received() == b""
    subscriber.transport.producer.resumeProducing()
    byTopic = {}
    for topic, payload, options in deliveries(subscriber):
        byTopic.setdefault(topic, []).append((payload, options[b"seq"], b"id" in options))
    assert byTopic == {
        b"l": [(b"l3", b"3", True)],
        b"a": [(b"a1", b"1", True), (b"a2", b"2", True), (b"a3", b"3", True)],
        b"f": [(b"f1", b"1", False), (b"f2", b"2", False), (b"f3", b"3", False)],
    }
    counters = deliveryCounters(harness)
    assert (counters["replaced"], counters["fired"], counters["inflight"]) == (2, 3, 4)
    assertAccountsAgree(harness)


def fanOutWithMessageEvents(messageEvents):
    """
    Publish three messages on C{f}, the second larger than the transport
    carries, to a C{fire} subscriber, a C{fire} one whose transport is full
    until the end (its queue holds one message, so the third holds the
    publisher back), and an C{all} one.

    @return: what each subscriber received, the delivery counters, and the
        topic's traffic counts.
    """
    harness = harnessWith(messageEvents, maxPayload=2, maxQueued=1)
    reading = connectSubscribed(harness, b"SUB 1 f mode=fire")
    full = connectSubscribed(harness, b"SUB 2 f mode=fire")
    acking = connectSubscribed(harness, b"SUB 3 f mode=all")
    publisher = harness.connect()
    full.transport.producer.pauseProducing()
    publishOver(publisher, b"f", b"f1", b"f22", b"f3")
    before = [deliveries(client) for client in (reading, full, acking)]
    full.transport.producer.resumeProducing()
    return (
        before,
        deliveries(full),
        deliveryCounters(harness),
        harness.broker.topicTraffic.topics,
    )


def test_fireFanOutIsCountedAsEachDeliveryIs():
    """
    Without per-message events, the messages a C{fire} subscription is
    sent at once are counted together per message: the counters, the
    sequence numbers and what every subscriber gets are those of the
    delivery-by-delivery path the events need.
    """
    counted = fanOutWithMessageEvents(messageEvents=False)
    logged = fanOutWithMessageEvents(messageEvents=True)
    assert counted == logged
    before, afterResume, counters, traffic = counted
    reading, full, acking = before
    assert [(payload, options[b"seq"]) for _, payload, options in reading] == [
        (b"f1", b"1"),
        (b"f3", b"3"),
    ]
    assert full == []
    assert [payload for _, payload, _ in afterResume] == [b"f1", b"f3"]
    assert [payload for _, payload, _ in acking] == [b"f1", b"f3"]
    assert (counters["matched"], counters["fired"], counters["delivered"]) == (9, 4, 6)
    assert (counters["dropped_too_large"], counters["inflight"]) == (3, 2)
    assert traffic == {"f": [3, 7, 6, 12]}


def ackedFanOutWithMessageEvents(messageEvents):
    """
    Publish three messages on C{a}, the second larger than the transport
    carries, to two C{all} subscribers with a window of one: one acks what
    it gets (its ack sends the third message, which waited in its queue),
    the other nothing (its third message waits on).

    @return: what each subscriber received, the delivery counters, and the
        topic's traffic counts.
    """
    harness = harnessWith(messageEvents, maxPayload=2, maxInflight=1)
    acking = connectSubscribed(harness, b"SUB 1 a mode=all")
    silent = connectSubscribed(harness, b"SUB 2 a mode=all")
    publisher = harness.connect()
    publishOver(publisher, b"a", b"a1", b"a22", b"a3")
    received = [deliveries(acking), deliveries(silent)]
    for _ in range(2):
        for _, _, options in received[0][-1:]:
            acking.send(b"ACK %s\r\n" % options[b"id"])
        received[0] += deliveries(acking)
    return received, deliveryCounters(harness), harness.broker.topicTraffic.topics


def test_ackedFanOutIsCountedAsEachDeliveryIs():
    """
    Without per-message events, the messages C{all} subscriptions are sent
    at once are counted together per message: the counters, the sequence
    numbers and what every subscriber gets are those of the
    delivery-by-delivery path the events need.
    """
    counted = ackedFanOutWithMessageEvents(messageEvents=False)
    assert counted == ackedFanOutWithMessageEvents(messageEvents=True)
    (acking, silent), counters, traffic = counted
    assert [(payload, options[b"seq"]) for _, payload, options in acking] == [
        (b"a1", b"1"),
        (b"a3", b"3"),
    ]
    assert [payload for _, payload, _ in silent] == [b"a1"]
    assert (counters["matched"], counters["delivered"], counters["acked"]) == (6, 3, 2)
    assert (counters["dropped_too_large"], counters["inflight"]) == (2, 2)
    assert traffic == {"a": [3, 7, 3, 6]}


def queuedTopicsWithMessageEvents(messageEvents):
    """
    Queue messages on two topics, in turn, for a C{fire} subscriber whose
    transport is full, then let it drain.

    @return: what it received, the delivery counters and the topics'
        traffic counts.
    """
    harness = harnessWith(messageEvents)
    subscriber = connectSubscribed(harness, b"SUB 1 a mode=fire", b"SUB 2 b mode=fire")
    publisher = harness.connect()
    subscriber.transport.producer.pauseProducing()
    publishOver(publisher, b"a", b"a1", b"a2")
    publishOver(publisher, b"b", b"b1")
    publishOver(publisher, b"a", b"a3")
    subscriber.transport.producer.resumeProducing()
    return deliveries(subscriber), deliveryCounters(harness), harness.broker.topicTraffic.topics


def test_queuedFireMessagesAreCountedPerTopic():
    """
    Without per-message events, the C{fire} messages a queue sends are
    counted together per run of one topic, as each would be on its own.
    """
    counted = queuedTopicsWithMessageEvents(messageEvents=False)
    assert counted == queuedTopicsWithMessageEvents(messageEvents=True)
    received, counters, traffic = counted
    assert [(payload, options[b"seq"]) for _, payload, options in received] == [
        (b"a1", b"1"),
        (b"a2", b"2"),
        (b"b1", b"1"),
        (b"a3", b"3"),
    ]
    assert (counters["matched"], counters["fired"], counters["inflight"]) == (4, 4, 0)
    assert traffic == {"a": [3, 6, 3, 6], "b": [1, 2, 1, 2]}


def test_redeliveriesWaitWhileTheConnectionIsPaused():
    """
    While paused, an unacked message is not sent again and its attempts are
    not used up; after the resume it is redelivered, then dropped at the
    limit.
    """
    harness = harnessWith(ackTimeout=ACK_TIMEOUT, maxAttempts=2)
    subscriber = connectSubscribed(harness, b"SUB 1 news mode=all")
    publisher = harness.connect()
    publishOver(publisher, b"news", b"m1")
    assert deliveries(subscriber) == [(b"news", b"m1", {b"sub": b"1", b"seq": b"1", b"id": b"1"})]
    subscriber.transport.producer.pauseProducing()
    for _ in range(3):
        harness.clock.advance(ACK_TIMEOUT)
    assert subscriber.received() == b""
    assert deliveryCounters(harness)["dropped"] == 0
    subscriber.transport.producer.resumeProducing()
    harness.clock.advance(ACK_TIMEOUT)
    assert deliveries(subscriber) == [
        (b"news", b"m1", {b"sub": b"1", b"seq": b"1", b"id": b"1", b"redelivered": b"1"})
    ]
    harness.clock.advance(ACK_TIMEOUT)
    assert deliveries(subscriber) == []
    assert [event["reason"] for event in harness.fields("drop")] == ["redelivery_limit"]
    assertAccountsAgree(harness)


def test_queuedAndUnackedMessagesDieWithTheConnection():
    """
    When the connection closes, what was in flight, queued or waiting for
    it is dropped (C{disconnected}); later messages match nothing.
    """
    harness = harnessWith(maxInflight=1)
    subscriber = connectSubscribed(harness, b"SUB 1 q mode=all", b"SUB 2 l")
    publisher = harness.connect()
    publishOver(publisher, b"q", b"q1", b"q2", b"q3")
    publishOver(publisher, b"l", b"l1", b"l2")
    assert deliveryCounters(harness)["inflight"] == 5
    subscriber.lose()
    assert [event["reason"] for event in harness.fields("drop")] == ["disconnected"] * 5
    (disconnect,) = harness.fields("disconnect")
    assert (disconnect["reason"], disconnect["subscriptions"]) == ("closed", 2)
    publishOver(publisher, b"q", b"q4")
    publishOver(publisher, b"l", b"l3")
    assert [event["subscribers"] for event in harness.fields("publish")][-2:] == [0, 0]
    counters = deliveryCounters(harness)
    assert (counters["matched"], counters["dropped_disconnected"], counters["inflight"]) == (
        5,
        5,
        0,
    )
    assertAccountsAgree(harness)


def test_sequenceNumbersArePerSubscriptionAndShowGaps():
    """
    Each subscription numbers its own messages from 1, carrying its own
    C{sub=} id; a message replaced before it was sent leaves a gap.
    """
    harness = harnessWith()
    first = connectSubscribed(harness, b"SUB 1 news", b"SUB 2 sport mode=all")
    second = connectSubscribed(harness, b"SUB 9 news mode=all")
    publisher = harness.connect()
    publishOver(publisher, b"news", b"n1")
    publishOver(publisher, b"sport", b"s1")
    publishOver(publisher, b"news", b"n2", b"n3")
    publishOver(publisher, b"sport", b"s2")

    def sequence(client):
        return [
            (payload, options[b"sub"], options[b"seq"])
            for _, payload, options in deliveries(client)
        ]

    assert sequence(first) == [(b"n1", b"1", b"1"), (b"s1", b"2", b"1"), (b"s2", b"2", b"2")]
    assert sequence(second) == [(b"n1", b"9", b"1"), (b"n2", b"9", b"2"), (b"n3", b"9", b"3")]
    first.send(b"ACK 1\r\n")
    assert sequence(first) == [(b"n3", b"1", b"3")]
    assertAccountsAgree(harness)


# The client: acks, deduplication, gaps.


def subscribedClient(onMessage, onGap=None):
    """
    A client subscribed to C{news} as subscription C{1}, over a
    L{StringTransport} emptied of what it sent so far.
    """
    client = DallalClientProtocol()
    transport = StringTransport()
    client.makeConnection(transport)
    subscribed = []
    client.subscribe([TOPIC], onMessage, onGap=onGap).addCallback(subscribed.append)
    assert transport.value() == b"SUB 1 news\r\n"
    client.dataReceived(b"SUBACK 1\r\n")
    assert subscribed == [None]
    transport.clear()
    return client, transport


def messageFrame(payload, seq, deliveryId=None, redelivered=False):
    """
    A C{MSG} frame of subscription C{1} on C{news}.
    """
    options = b"sub=1 seq=%d" % seq
    if deliveryId is not None:
        options += b" id=" + deliveryId
    if redelivered:
        options += b" redelivered=1"
    return b"MSG news %d %s\r\n%s\r\n" % (len(payload), options, payload)


class Handler:
    """
    A message handler that records what it got, and what the client had
    written to C{transport} when it got it; it returns C{result()}.
    """

    def __init__(self, result):
        self.transport = None
        self.result = result
        self.messages = []
        self.writtenBefore = []

    def __call__(self, message):
        self.messages.append(message)
        self.writtenBefore.append(self.transport.value())
        return self.result()


def handledBy(result=lambda: None):
    """
    A subscribed client whose handler returns C{result()}.
    """
    handler = Handler(result)
    client, transport = subscribedClient(handler)
    handler.transport = transport
    return client, transport, handler


def test_clientAcksOnceTheHandlerHasReturned():
    client, transport, handler = handledBy()
    client.dataReceived(messageFrame(b"hello", 1, b"7"))
    assert handler.messages == [
        ReceivedMessage(TOPIC, b"hello", 1, False, {"sub": "1", "seq": "1", "id": "7"})
    ]
    assert handler.writtenBefore == [b""]
    assert transport.value() == b"ACK 7\r\n"


def test_clientAcksWhenTheHandlersDeferredFires():
    pending = Deferred()
    client, transport, handler = handledBy(lambda: pending)
    client.dataReceived(messageFrame(b"hello", 1, b"7"))
    assert len(handler.messages) == 1
    assert transport.value() == b""
    pending.callback(None)
    assert transport.value() == b"ACK 7\r\n"


def test_clientAcksARedeliveryOfAHandledMessageWithoutHandlingItAgain():
    client, transport, handler = handledBy()
    client.dataReceived(messageFrame(b"hello", 1, b"7"))
    client.dataReceived(messageFrame(b"hello", 1, b"7", redelivered=True))
    assert len(handler.messages) == 1
    assert transport.value() == b"ACK 7\r\nACK 7\r\n"


def test_clientAcksARedeliveryOnlyOnceItsHandlerHasFinished():
    pending = Deferred()
    client, transport, handler = handledBy(lambda: pending)
    client.dataReceived(messageFrame(b"hello", 1, b"7"))
    client.dataReceived(messageFrame(b"hello", 1, b"7", redelivered=True))
    assert len(handler.messages) == 1
    assert transport.value() == b""
    pending.callback(None)
    assert transport.value() == b"ACK 7\r\n"


def test_clientHandsARedeliveryToTheHandlerAgainAfterItFailed():
    outcomes = iter([lambda: 1 / 0, lambda: None])
    client, transport, handler = handledBy(lambda: next(outcomes)())
    client.dataReceived(messageFrame(b"hello", 1, b"7"))
    assert transport.value() == b""
    client.dataReceived(messageFrame(b"hello", 1, b"7", redelivered=True))
    assert [message.redelivered for message in handler.messages] == [False, True]
    assert transport.value() == b"ACK 7\r\n"


def test_clientReportsGaps():
    gaps = []
    received = []
    client, transport = subscribedClient(received.append, onGap=lambda *gap: gaps.append(gap))
    for seq in (1, 4, 5, 9):
        client.dataReceived(messageFrame(b"m%d" % seq, seq, b"%d" % seq))
    assert gaps == [(TOPIC, 2), (TOPIC, 3)]
    assert [message.seq for message in received] == [1, 4, 5, 9]


def test_clientDoesNotAckFireMessages():
    client, transport, handler = handledBy()
    client.dataReceived(messageFrame(b"m1", 1) + messageFrame(b"m2", 2))
    assert [message.payload for message in handler.messages] == [b"m1", b"m2"]
    assert transport.value() == b""


def test_clientStatsParsesTheReply():
    client = DallalClientProtocol()
    transport = StringTransport()
    client.makeConnection(transport)
    results = []
    client.stats().addCallback(results.append)
    assert transport.value() == b"STATS 1\r\n"
    stats = {"matched": 3, "acked": 2, "inflight": 1, "uptime": 1.5}
    body = json.dumps(stats).encode("ascii")
    client.dataReceived(b"STATS 1 %d\r\n%s\r\n" % (len(body), body))
    assert results == [stats]


def test_latestKeepsOneSlotPerTopicOfAWildcardSubscription():
    """
    In C{latest} mode a message replaces only a waiting message on the same
    topic: through a wildcard subscription, messages on different topics
    each get delivered.
    """
    bench = Bench()
    subscriber = bench.subscribe(LATEST, topic="w/#")
    bench.publish(b"a1", topic="w/a")
    bench.publish(b"b1", topic="w/b")
    bench.publish(b"a2", topic="w/a")
    bench.publish(b"a3", topic="w/a")
    first = subscriber.take()
    assert [sent.payload for sent in first] == [b"a1", b"b1"]
    bench.ack(subscriber, *[sent.id for sent in first])
    assert subscriber.takePayloads() == [b"a3"]
    assert bench.counters()["replaced"] == 1
    bench.assertAccountsAgree()
