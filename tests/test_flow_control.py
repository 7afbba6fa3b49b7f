"""
Flow control on a fake clock: a full delivery queue holds its publishers
back until it drains to half its bounds, and only a subscriber that makes
no progress for the stall timeout is a slow consumer (PROTOCOL.md,
"Delivery"; L{dallal.broker.delivery.FlowControl}).

The decision is tested on the core with recording subscribers; what a
publisher sees -- a TCP connection that is no longer read, a UDP C{ERR
BUSY} its client resends -- over in-memory transports.
"""

import pytest
from helpers import PING_INTERVAL, UdpHarness, decodeFrames
from test_client_udp import FakeBroker
from test_delivery import (
    Bench,
    assertAccountsAgree,
    connectSubscribed,
    deliveries,
    deliveryCounters,
    harnessWith,
    payloads,
)
from test_limits import parsed
from twisted.python import usage

from dallal.broker.core import BrokerConfig
from dallal.broker.delivery import DISCONNECT, DeliveryConfig
from dallal.modes import ALL, FIRE
from dallal.server.streams import CONGESTION, LOGIN_CHECK
from dallal.server.tap import brokerConfig

STALL = 5.0


def heldCounters(bench):
    counters = bench.broker.counters
    return counters["publishers_paused"], counters["publishers_held"]


def ackEach(bench, subscriber):
    """
    Ack every message the subscriber was sent since the last call.
    """
    sent = subscriber.take()
    bench.ack(subscriber, *(message.id for message in sent))
    return [message.payload for message in sent]


def test_fullQueueHoldsThePublisherUntilItDrainsToHalf():
    """
    The message that meets the full queue is taken, one beyond the bound,
    and its publisher is paused; it resumes once the queue is down to half
    its bound, on the clock's next turn.  Nothing is dropped.
    """
    bench = Bench(maxInflight=1, maxQueued=4)
    subscriber = bench.subscribe(ALL)
    bench.publish(*payloads(5))
    assert not bench.publisher.publishingPaused
    bench.publish(b"m6")
    assert bench.publisher.publishingPaused
    assert heldCounters(bench) == (1, 1)
    # Five queued: four acks bring the queue to two, the low-water mark.
    for _ in range(3):
        ackEach(bench, subscriber)
        assert bench.publisher.publishingPaused
    ackEach(bench, subscriber)
    assert bench.publisher.publishingPaused
    bench.clock.advance(0)
    assert not bench.publisher.publishingPaused
    assert heldCounters(bench) == (1, 0)
    got = [b"m1", b"m2", b"m3", b"m4"]
    while sent := ackEach(bench, subscriber):
        got += sent
    assert got == payloads(6)
    assert bench.drops() == []
    bench.assertAccountsAgree()


def test_fullQueueOfBytesHoldsThePublisherToo():
    """
    The bound in payload bytes holds publishers back as the count does: a
    C{fire} subscriber whose transport is not draining.
    """
    bench = Bench(maxQueuedBytes=10)
    subscriber = bench.subscribe(FIRE)
    bench.broker.pauseDelivery(subscriber)
    bench.publish(b"m1--", b"m2--")
    assert not bench.publisher.publishingPaused
    bench.publish(b"m3--")
    assert bench.publisher.publishingPaused
    bench.broker.resumeDelivery(subscriber)
    bench.clock.advance(0)
    assert not bench.publisher.publishingPaused
    assert subscriber.takePayloads() == [b"m1--", b"m2--", b"m3--"]
    assert bench.drops() == []
    bench.assertAccountsAgree()


def test_aSubscriberMakingProgressIsNeverASlowConsumer():
    """
    Each ack gives the subscriber a whole stall timeout again: one that
    acks every few seconds keeps its publisher held back, and loses nothing.
    """
    bench = Bench(maxInflight=1, maxQueued=4)
    subscriber = bench.subscribe(ALL)
    bench.publish(*payloads(6))
    assert bench.publisher.publishingPaused
    for _ in range(2):
        bench.clock.advance(STALL - 0.5)
        ackEach(bench, subscriber)
    bench.clock.advance(STALL - 0.1)
    assert bench.publisher.publishingPaused
    assert bench.harness.fields("slow_consumer") == []
    assert bench.drops() == []


@pytest.mark.parametrize("mode", [ALL, FIRE])
def test_aStalledSubscriberIsASlowConsumerAndDropsOldest(mode):
    """
    No progress (no ack; in C{fire} mode, no drained transport) for the
    stall timeout while it holds a publisher back: the subscriber is a slow
    consumer, logged as one; what went beyond its bound is dropped, and
    the publisher goes on.  From then on its full queue drops the oldest
    for each new message, as C{drop-oldest} says, until it makes progress.
    """
    bench = Bench(maxInflight=1, maxQueued=2)
    subscriber = bench.subscribe(mode)
    if mode == FIRE:
        bench.broker.pauseDelivery(subscriber)
    bench.publish(*payloads(4 if mode == ALL else 3))
    assert bench.publisher.publishingPaused
    bench.clock.advance(STALL - 0.1)
    assert bench.harness.fields("slow_consumer") == []
    bench.clock.advance(0.1)
    [event] = bench.harness.fields("slow_consumer")
    assert event == {
        "session": subscriber.sid,
        "client": subscriber.peer,
        "transport": "tcp",
        "idle": STALL,
        "queued": 3,
        "policy": "drop-oldest",
    }
    assert not bench.publisher.publishingPaused
    bench.publish(b"m9")
    assert not bench.publisher.publishingPaused
    first = b"m2" if mode == ALL else b"m1"
    second = b"m3" if mode == ALL else b"m2"
    assert bench.drops() == [
        (first, subscriber.sid, "queue_full"),
        (second, subscriber.sid, "queue_full"),
    ]
    counters = bench.counters()
    assert (counters["slow_consumers"], counters["dropped_queue_full"]) == (1, 2)
    bench.assertAccountsAgree()


def test_aDrainingSocketIsNoProgressWhileAcksAreAwaited():
    """
    An C{all} subscriber whose window is full makes progress only by
    acking: its transport draining (a peer that reads nothing still does,
    for a while, into the kernel's growing buffers) does not keep it from
    being a slow consumer.
    """
    bench = Bench(maxInflight=1, maxQueued=2)
    subscriber = bench.subscribe(ALL)
    bench.publish(*payloads(4))
    bench.clock.advance(STALL - 1)
    bench.broker.pauseDelivery(subscriber)
    bench.broker.resumeDelivery(subscriber)
    bench.clock.advance(1)
    assert [event["idle"] for event in bench.harness.fields("slow_consumer")] == [STALL]


def test_progressAfterAStallBringsBackpressure():
    """
    A slow consumer that acks again is one no longer: its full queue holds
    publishers back again instead of dropping.
    """
    bench = Bench(maxInflight=1, maxQueued=2)
    subscriber = bench.subscribe(ALL)
    bench.publish(*payloads(4))
    bench.clock.advance(STALL)
    assert not bench.publisher.publishingPaused
    ackEach(bench, subscriber)
    bench.publish(b"m5", b"m6")
    assert bench.publisher.publishingPaused
    assert [payload for payload, _, _ in bench.drops()] == [b"m2"]


def test_aStalledSubscriberIsDisconnectedUnderThatPolicy():
    """
    C{disconnect}: the slow consumer is closed, and the publisher goes on.
    """
    bench = Bench(maxInflight=1, maxQueued=2, slowConsumer=DISCONNECT)
    subscriber = bench.subscribe(ALL)
    bench.publish(*payloads(4))
    bench.clock.advance(STALL)
    assert subscriber.disconnected == ["slow_consumer"]
    assert bench.harness.fields("slow_consumer")[0]["policy"] == DISCONNECT
    bench.clock.advance(0)
    assert not bench.publisher.publishingPaused
    bench.publish(b"m5")
    assert bench.drops() == [(b"m5", subscriber.sid, "slow_consumer")]


def test_aSessionIsNeverHeldBackByItsOwnSubscription():
    """
    A client that publishes to its own subscription is not paused (it could
    not read its acks): what its full queue cannot take is dropped, by the
    policy, at once.
    """
    bench = Bench(maxInflight=1, maxQueued=2)
    bench.subscribe(ALL, subscriber=bench.publisher)
    bench.publish(*payloads(4))
    assert not bench.publisher.publishingPaused
    assert heldCounters(bench) == (0, 0)
    assert bench.drops() == [(b"m2", bench.publisher.sid, "queue_full")]
    bench.assertAccountsAgree()


def test_twoPublishersFeedingOneSubscriberAreHeldAndLetGoTogether():
    """
    Each publisher that meets the full queue is held back, with one message
    beyond the bound each; both go on at the low-water mark.
    """
    bench = Bench(maxInflight=1, maxQueued=2)
    subscriber = bench.subscribe(ALL)
    other = bench.attach()
    bench.publish(*payloads(4))
    bench.broker.publish(other, "news", b"o1", "q")
    assert (bench.publisher.publishingPaused, other.publishingPaused) == (True, True)
    assert heldCounters(bench) == (2, 2)
    ackEach(bench, subscriber)
    ackEach(bench, subscriber)
    ackEach(bench, subscriber)
    bench.clock.advance(0)
    assert (bench.publisher.publishingPaused, other.publishingPaused) == (False, False)
    assert heldCounters(bench) == (2, 0)
    assert bench.drops() == []


def test_publishersResumedTogetherAreHeldAgainOneMessageEach():
    """
    Publishers let go together are resumed in the order they were held: the
    first at once publishes what it had buffered and fills the queue again,
    and is held again; the next is resumed all the same, and held again by
    its own first message.  Each adds one message beyond the bound.
    """
    bench = Bench(maxInflight=1, maxQueued=2)
    subscriber = bench.subscribe(ALL)
    other = bench.attach()
    bench.publish(*payloads(4))
    bench.broker.publish(other, "news", b"o1", "q")
    for _ in range(3):
        ackEach(bench, subscriber)
    resume = bench.publisher.resumePublishing
    order = []

    def resumeAndPublishBuffered():
        order.append("publisher")
        resume()
        bench.publish(b"b1", b"b2")

    bench.publisher.resumePublishing = resumeAndPublishBuffered
    bench.clock.advance(0)
    assert order == ["publisher"]
    assert (bench.publisher.publishingPaused, other.publishingPaused) == (True, False)
    bench.broker.publish(other, "news", b"o2", "q")
    assert (bench.publisher.pauses, other.pauses) == (2, 2)
    assert heldCounters(bench) == (4, 2)
    assert bench.drops() == []


def test_oneCongestedSubscriberSlowsItsPublisherForTheOthersUntilItStalls():
    """
    A publisher held back by one subscriber publishes nothing to the others
    either: they have everything it published, and after the stall timeout
    it goes on for them, while the stalled one's losses are counted.
    """
    bench = Bench(maxInflight=1, maxQueued=2)
    stuck = bench.subscribe(ALL)
    free = bench.subscribe(FIRE)
    bench.publish(*payloads(4))
    assert bench.publisher.publishingPaused
    assert free.takePayloads() == payloads(4)
    bench.clock.advance(STALL)
    assert not bench.publisher.publishingPaused
    bench.publish(b"m5", b"m6")
    assert free.takePayloads() == [b"m5", b"m6"]
    assert [payload for payload, _, _ in bench.drops()] == [b"m2", b"m3", b"m4"]
    assert {session for _, session, _ in bench.drops()} == {stuck.sid}
    bench.assertAccountsAgree()


def test_aHeldPublisherThatLeavesIsForgotten():
    bench = Bench(maxInflight=1, maxQueued=2)
    subscriber = bench.subscribe(ALL)
    bench.publish(*payloads(4))
    bench.broker.detach(bench.publisher, "closed")
    assert heldCounters(bench) == (1, 0)
    bench.clock.advance(STALL)
    assert bench.harness.fields("slow_consumer") == []
    assert subscriber.disconnected == []


def test_aSubscriberThatLeavesLetsItsPublishersGo():
    bench = Bench(maxInflight=1, maxQueued=2)
    subscriber = bench.subscribe(ALL)
    bench.publish(*payloads(4))
    bench.broker.detach(subscriber, "closed")
    bench.clock.advance(0)
    assert not bench.publisher.publishingPaused
    assert heldCounters(bench) == (1, 0)
    bench.assertAccountsAgree()


# What a TCP publisher sees.


def test_aHeldTcpPublisherIsNotReadUntilTheQueueDrains():
    """
    The connection's transport stops reading, and the frames it already
    read wait too: the PUB that met the full queue is acked, the next
    ones only once the queue has drained.
    """
    harness = harnessWith(maxInflight=1, maxQueued=2)
    subscriber = connectSubscribed(harness, b"SUB 1 news mode=all")
    publisher = harness.connect()
    burst = b"".join(b"PUB p%d news 2\r\nm%d\r\n" % (number, number) for number in range(1, 7))
    publisher.send(burst)
    assert publisher.received() == b"PUBACK p1\r\nPUBACK p2\r\nPUBACK p3\r\nPUBACK p4\r\n"
    assert publisher.transport.producerState == "paused"
    for number in range(1, 4):
        subscriber.send(b"ACK %d\r\n" % number)
    assert publisher.received() == b""
    harness.clock.advance(0)
    assert publisher.transport.producerState == "producing"
    assert publisher.received() == b"PUBACK p5\r\nPUBACK p6\r\n"
    for number in range(4, 7):
        subscriber.send(b"ACK %d\r\n" % number)
    assert [payload for _, payload, _ in deliveries(subscriber)] == payloads(6)
    assert deliveryCounters(harness)["dropped"] == 0
    assertAccountsAgree(harness)


def test_aHeldTcpPublisherIsNotDroppedForThePongsItCouldNotSend():
    """
    While its connection is not read, a publisher's silence proves nothing:
    it is neither pinged nor dropped, however long a subscriber that keeps
    acking holds it back.
    """
    harness = harnessWith(maxInflight=1, maxQueued=100)
    subscriber = connectSubscribed(harness, b"SUB 1 news mode=all")
    publisher = harness.connect()
    publisher.send(b"".join(b"PUB p%d news 1\r\nx\r\n" % number for number in range(105)))
    assert publisher.received().count(b"PUBACK") == 102
    # An ack every 4 s, within the stall timeout, for more than the five
    # ping intervals that drop a client that does not answer.
    for deliveryId in range(1, 16):
        harness.clock.advance(4)
        subscriber.send(b"ACK %d\r\n" % deliveryId)
    assert harness.clock.seconds() > 5 * PING_INTERVAL
    assert publisher.transport.producerState == "paused"
    assert publisher.received() == b""
    assert not publisher.closing
    assert harness.fields("ping_missed") == []


def test_aClientThatPublishesToItselfKeepsReading():
    harness = harnessWith(maxInflight=1, maxQueued=2)
    client = connectSubscribed(harness, b"SUB 1 news mode=all")
    client.send(b"".join(b"PUB p%d news 1\r\nx\r\n" % number for number in range(5)))
    assert client.transport.producerState == "producing"
    answers = [frame.verb for frame in decodeFrames(client.received())]
    assert answers.count(b"PUBACK") == 5


def test_readingResumesOnceNoReasonIsLeft():
    """
    A login checked while a subscriber's queue is full does not resume
    reading, nor the other way round.
    """
    harness = harnessWith()
    client = harness.connect()
    protocol = client.protocol
    protocol.pauseReading(LOGIN_CHECK)
    protocol.pauseReading(CONGESTION)
    protocol.resumeReading(LOGIN_CHECK)
    assert client.transport.producerState == "paused"
    assert CONGESTION in protocol.readPause and LOGIN_CHECK not in protocol.readPause
    client.send(b"PING\r\n")
    assert client.received() == b""
    protocol.resumeReading(LOGIN_CHECK)
    protocol.resumeReading(CONGESTION)
    assert client.transport.producerState == "producing"
    assert client.received() == b"PONG\r\n"


# What a UDP publisher sees.


def test_aHeldUdpPublisherIsAnsweredBusyUntilTheQueueDrains():
    """
    The PUB that met the full queue is acked; the next ones are refused
    with C{BUSY}, published nowhere, remembered not, until the queue has
    drained: then the same PUB, resent, is taken.
    """
    harness = UdpHarness(BrokerConfig(delivery=DeliveryConfig(maxInflight=1, maxQueued=2)))
    subscriber = connectSubscribed(harness, b"SUB 1 news mode=all")
    publisher = harness.peer(40002)
    publisher.hello("publisher")
    for number in range(1, 5):
        publisher.publish(b"%d" % number, b"news", b"m%d" % number)
    assert publisher.received() == [b"PUBACK %d\r\n" % number for number in range(1, 5)]
    publisher.publish(b"5", b"news", b"m5")
    [busy] = publisher.received()
    assert busy.startswith(b"ERR 5 BUSY ")
    for number in range(1, 4):
        subscriber.send(b"ACK %d\r\n" % number)
    harness.clock.advance(0)
    publisher.publish(b"5", b"news", b"m5")
    assert publisher.received() == [b"PUBACK 5\r\n"]
    counters = harness.broker.counters
    assert (counters["published"], counters["publishes_busy"], counters["errors"]) == (
        5,
        1,
        1,
    )
    assert harness.fields("protocol_error") == []
    subscriber.send(b"ACK 4\r\n")
    assert [payload for _, payload, _ in deliveries(subscriber)] == payloads(5)


def test_udpClientResendsABusyPublishUntilItIsTaken():
    broker = FakeBroker()
    broker.handshake()
    published = []
    broker.client.publish("news", b"hi").addCallback(published.append)
    [first] = broker.sent()
    broker.answer(b"ERR 3 BUSY a subscriber's queue is full\r\n")
    assert published == []
    broker.clock.advance(0.25)
    assert broker.sent() == [first]
    broker.answer(b"PUBACK 3\r\n")
    assert published == [None]
    assert list(broker.client.serverErrors) == []


# The option.


def test_stallTimeoutOption():
    assert brokerConfig(parsed()).delivery.stallTimeout == STALL
    assert brokerConfig(parsed("--stall-timeout", "0.5")).delivery.stallTimeout == 0.5
    for value in ("0", "-1", "soon"):
        with pytest.raises(usage.UsageError):
            parsed("--stall-timeout", value)
