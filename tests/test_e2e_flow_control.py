"""
Flow control end to end: the real C{twistd -n dallal} and C{dallal}
commands over TCP on the loopback.  A burst to subscribers that read is
slowed down, not dropped; a subscriber stopped with SIGSTOP holds the
publisher back for the stall timeout only, then loses messages, counted.
"""

import json
import re
import signal
import time

import pytest
from helpers import DALLAL, OutputCollector, countersAddUp, dallal
from test_e2e_delivery import PUBLISHED, TIMEOUT
from test_e2e_udp import UdpBroker

from dallal.broker.delivery import DeliveryConfig

pytestmark = pytest.mark.e2e

BURST = 2000
# The stall timeout of the broker whose fire subscriber stops reading until
# its full queue holds the publisher back: far longer than that takes, even
# on a busy machine.
STALL_TIMEOUT = 60


def publishBurst(port, topic, message, count=BURST, transport=()):
    """
    C{dallal publish --count}: every PUB written at once, then the acks
    awaited.

    @param transport: C{("--udp",)} to publish over UDP.
    """
    result = dallal(*transport, "127.0.0.1", port, "publish", "--count", count, topic, message)
    assert (result.stdout, result.stderr, result.returncode) == (PUBLISHED, b"", 0)


def stats(port):
    result = dallal("127.0.0.1", port, "stats", "--json")
    assert result.returncode == 0, result.stderr
    counters = json.loads(result.stdout)
    assert countersAddUp(counters), counters
    return counters


def statsWhen(port, predicate, timeout):
    """
    Poll the broker's counters until C{predicate} holds for them.

    @return: the counters then.
    """
    deadline = time.monotonic() + timeout
    while not predicate(counters := stats(port)):
        assert time.monotonic() < deadline, counters
        time.sleep(0.1)
    return counters


def test_aBurstToAReadingSubscriberLosesNothing(startBroker, subscribers):
    """
    C{publish --count 2000} against one C{all} subscriber that reads and
    acks as fast as it can: it prints exactly 2000 lines, and the broker
    dropped nothing.
    """
    broker = startBroker()
    reader = subscribers(broker.port, "al", "all")
    publishBurst(broker.port, "al", "m")
    reader.waitForLines(BURST)
    assert reader.stop() == 0
    assert reader.payloads() == [b"m"] * BURST
    assert reader.gaps() == []
    counters = stats(broker.port)
    assert (counters["published"], counters["dropped"]) == (BURST, 0)


def udpBurst(tmp_path, subscribers, count, *options):
    """
    C{dallal --udp publish --count} to a TCP subscriber in mode C{all} of a
    broker started with C{options}: it receives each message once.

    @return: the broker's counters afterwards.
    """
    broker = UdpBroker(tmp_path, *options)
    try:
        reader = subscribers(broker.tcpPort, "u", "all")
        publishBurst(broker.udpPort, "u", "m", count, transport=("--udp",))
        reader.waitForLines(count)
        counters = stats(broker.tcpPort)
        assert reader.stop() == 0
    finally:
        broker.process.stop()
    assert reader.payloads() == [b"m"] * count
    assert (counters["published"], counters["delivered"], counters["dropped"]) == (
        count,
        count,
        0,
    )
    return counters


def test_aUdpBurstIsAnsweredBusyAndResentNotDropped(tmp_path, subscribers):
    """
    A burst over UDP: the broker answers C{BUSY} while the queue is full,
    and C{dallal --udp publish} resends until each message is taken (a
    smaller queue, to fill it).
    """
    counters = udpBurst(tmp_path, subscribers, 500, "--max-inflight", "10", "--max-queued", "50")
    assert counters["publishes_busy"] > 0


def test_aUdpBurstIsPublishedExactlyOnce(tmp_path, subscribers):
    """
    C{dallal --udp publish --count 2000}: far more requests than the
    answers the broker remembers per UDP session, each published exactly
    once however many of them the client resends, and received once.
    """
    udpBurst(tmp_path, subscribers, BURST)


def test_aFireSubscriberThatPausesIsSlowedDownNotDropped(startBroker, subscribers):
    """
    C{fire}: a subscriber that stops reading (SIGSTOP) for less than the
    stall timeout while a burst comes gets the whole burst once it reads
    again: its full queue held the publisher back instead of dropping.
    """
    broker = startBroker("--stall-timeout", STALL_TIMEOUT)
    reader = subscribers(broker.port, "f", "fire")
    reader.signal(signal.SIGSTOP)
    # 2000 messages of 4 KiB: more than the kernel buffers on the way
    # to the subscriber and the broker's queue for it hold.
    message = "x" * 4096
    publisher = OutputCollector(
        [DALLAL, "127.0.0.1", broker.port, "publish", "--count", BURST, "f", message],
        None,
    )
    try:
        # It reads again once the publisher is held back, well within the
        # stall timeout.
        statsWhen(broker.port, lambda counters: counters["publishers_paused"] >= 1, TIMEOUT)
        reader.signal(signal.SIGCONT)
        publisher.waitFor(re.escape(PUBLISHED), TIMEOUT)
        assert publisher.process.wait(TIMEOUT) == 0
    finally:
        publisher.kill()
    reader.waitForLines(BURST)
    assert reader.stop() == 0
    assert reader.payloads() == [message.encode()] * BURST
    counters = stats(broker.port)
    assert (counters["fired"], counters["dropped"]) == (BURST, 0)
    assert counters["publishers_paused"] >= 1


def test_aStoppedSubscriberHoldsThePublisherOnlyForTheStallTimeout(startBroker, subscribers):
    """
    Beside a subscriber that reads, one stopped with SIGSTOP: the burst is
    held back while the stopped one's queue is full, for the stall timeout
    (the default); then the stopped one is a slow consumer and the reading
    one gets every message.  The stopped one's losses are counted.
    """
    broker = startBroker()
    reader = subscribers(broker.port, "al", "all")
    stopped = subscribers(broker.port, "al", "all")
    stopped.signal(signal.SIGSTOP)
    publishBurst(broker.port, "al", "m")
    reader.waitForLines(BURST)
    counters = stats(broker.port)
    assert counters["slow_consumers"] == 1
    assert counters["publishers_held"] == 0
    # The stopped one holds a window in flight and a full queue; the rest
    # of what it matched was dropped, oldest first.
    config = DeliveryConfig()
    held = config.maxInflight + config.maxQueued
    assert (counters["inflight"], counters["dropped_queue_full"]) == (
        held,
        BURST - held,
    )
    assert counters["acked"] == BURST
    assert reader.stop() == 0
    assert reader.payloads() == [b"m"] * BURST
