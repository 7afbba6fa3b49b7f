"""
A new subscription's retained messages, sent a slice per turn of the
reactor as the subscriber takes them (L{dallal.broker.feed}), through the
broker's TCP protocol on a clock.
"""

import pytest
from helpers import BrokerHarness, MemoryRetained
from test_topic_requests import messages, messagesIn

from dallal.broker.core import BrokerConfig
from dallal.broker.delivery import DeliveryConfig
from dallal.broker.feed import RETAINED_PER_TURN

# More retained messages than one slice.
TOPICS = 3 * RETAINED_PER_TURN + 10


def retainedTopics(count=TOPICS, **delivery):
    """
    A broker keeping C{count} retained messages, on topics t/0000... in
    order, and a subscriber connected to it.
    """
    harness = BrokerHarness(BrokerConfig(delivery=DeliveryConfig(**delivery)))
    harness.broker.retained = MemoryRetained()
    for number in range(count):
        harness.broker.retained.set(f"t/{number:04d}", b"r%d" % number)
    return harness, harness.connect()


def oneTurn(clock):
    """
    Run the delayed calls due now, as one turn of the reactor does: not
    those they schedule (C{Clock.advance} would run them too).
    """
    due = [call for call in clock.getDelayedCalls() if call.getTime() <= clock.seconds()]
    for call in due:
        if call.active():
            clock.calls.remove(call)
            call.called = True
            call.func(*call.args, **call.kw)


def topicsOf(received):
    return [topic for topic, _, _ in received]


def ack(client, received):
    client.send(
        b"".join(b"ACK %s\r\n" % options[b"id"] for _, _, options in received if b"id" in options)
    )


def test_aSliceATurnAllInOrder():
    """
    C{SUB #} gets its SUBACK and a first slice at once, the others one per
    turn of the reactor, every retained message once and in order.
    """
    harness, client = retainedTopics()
    client.send(b"SUB 1 # mode=fire\r\n")
    first = client.received()
    assert first.startswith(b"SUBACK 1\r\n")
    received = messagesIn(first)
    assert len(received) == RETAINED_PER_TURN
    while len(received) < TOPICS:
        oneTurn(harness.clock)
        turn = messages(client)
        assert 0 < len(turn) <= RETAINED_PER_TURN
        received += turn
    assert sorted(topicsOf(received)) == [f"t/{number:04d}" for number in range(TOPICS)]
    assert all(options[b"retained"] == b"1" for _, _, options in received)
    oneTurn(harness.clock)
    assert messages(client) == []


def test_aSubscriberThatDoesNotReadStopsTheFeed():
    """
    A subscriber that acks nothing is offered its window and half its
    queue, no more: the broker does not hold the rest for it.  Acks let the
    feed go on.
    """
    harness, client = retainedTopics(maxInflight=10, maxQueued=20)
    client.send(b"SUB 1 # mode=all\r\n")
    for _turn in range(5):
        oneTurn(harness.clock)
    received = messages(client)
    assert len(received) == 10
    assert harness.broker.stats()["matched"] == 10 + 10
    assert harness.broker.stats()["dropped"] == 0
    total = []
    while received:
        total += received
        ack(client, received)
        oneTurn(harness.clock)
        received = messages(client)
    assert sorted(topicsOf(total)) == [f"t/{number:04d}" for number in range(TOPICS)]
    assert harness.broker.stats()["dropped"] == 0


def test_aPausedTransportStopsTheFeedUntilItDrains():
    harness, client = retainedTopics()
    client.send(b"SUB 1 # mode=fire\r\n")
    client.protocol.outputFull()
    before = len(messages(client))
    for _turn in range(5):
        oneTurn(harness.clock)
    assert messages(client) == []
    client.protocol.outputDrained()
    oneTurn(harness.clock)
    assert len(messages(client)) == RETAINED_PER_TURN
    assert before == RETAINED_PER_TURN


def drain(harness, client, turns=100):
    """
    Ack everything the client receives, turn after turn: what it received.
    """
    total = []
    for _turn in range(turns):
        received = messages(client)
        ack(client, received)
        total += received
        oneTurn(harness.clock)
    return total


@pytest.mark.parametrize("mode", [b"all", b"latest", b"fire"])
def test_aLiveMessageComesAfterItsTopicsRetainedOne(mode):
    """
    A message published on a topic whose retained message is still
    waiting has that retained message offered first; one on a topic whose
    retained message was sent comes after it, as any message does.
    """
    harness, client = retainedTopics()
    publisher = harness.connect()
    client.send(b"SUB 1 # mode=%s\r\n" % mode)
    first = messages(client)
    sentFirst = first[0][0]
    waiting = min({f"t/{number:04d}" for number in range(TOPICS)} - set(topicsOf(first)))
    ack(client, first)
    publisher.send(
        b"PUB 1 %s 4\r\nlive\r\nPUB 2 %s 4\r\nlive\r\n" % (sentFirst.encode(), waiting.encode())
    )
    total = first + drain(harness, client)
    order = [(topic, payload[:1]) for topic, payload, _ in total]
    assert order.index((sentFirst, b"r")) < order.index((sentFirst, b"l"))
    assert order.index((waiting, b"r")) < order.index((waiting, b"l"))
    retained = [topic for topic, kind in order if kind == b"r"]
    assert sorted(retained) == [f"t/{number:04d}" for number in range(TOPICS)]


def test_unsubscribingStopsTheFeed():
    harness, client = retainedTopics()
    client.send(b"SUB 1 # mode=fire\r\nUNSUB 2 #\r\n")
    client.received()
    oneTurn(harness.clock)
    assert messages(client) == []
    assert harness.broker.stats()["matched"] == RETAINED_PER_TURN


def test_subscribingAgainStartsTheFeedAgain():
    harness, client = retainedTopics()
    client.send(b"SUB 1 # mode=fire\r\nSUB 2 # mode=fire\r\n")
    client.received()
    for _turn in range(10):
        oneTurn(harness.clock)
    # The first feed's first slice, then the second feed whole.
    assert harness.broker.stats()["matched"] == RETAINED_PER_TURN + TOPICS


def test_aClientThatLeavesStopsTheFeed():
    harness, client = retainedTopics()
    client.send(b"SUB 1 # mode=fire\r\n")
    client.lose()
    oneTurn(harness.clock)
    oneTurn(harness.clock)
    assert harness.broker.stats()["matched"] == RETAINED_PER_TURN


def test_aQueueOfOneStillTakesTheFeed():
    """
    The feed's room is half the queue rounded up: a queue of one message
    gets its retained messages one at a time.
    """
    harness, client = retainedTopics(count=3, maxInflight=1, maxQueued=1)
    client.send(b"SUB 1 # mode=all\r\n")
    total = drain(harness, client, turns=10)
    assert sorted(topicsOf(total)) == ["t/0000", "t/0001", "t/0002"]
