"""
The soak of bench/soak.py, short: the same code path with 100 clients for
20 seconds instead of 1,000 for 10 minutes, and the same three checks (no
PubAck'd C{all}-mode message lost for a subscriber that stayed connected,
the broker's peak memory under the bound the script states, nothing
unhandled in its log and a clean stop).  And, in memory on a clock, that
sessions and messages leave nothing behind in the broker.
"""

import gc
import re
import sys

import pytest
from helpers import REPO, UdpHarness

from dallal.broker.core import BrokerConfig

sys.path.insert(0, str(REPO / "bench"))

import soak  # noqa: E402

SHORT = soak.Settings(clients=100, seconds=20.0, rate=20.0, pingInterval=2.0)


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_shortSoak(tmp_path):
    result = soak.run(SHORT, tmp_path)
    # Shown by pytest -rP.
    soak.printResult(result)
    assert [check.name for check in result.checks] == [
        "no PubAck'd all-mode message lost",
        "memory",
        "no unhandled error, clean stop",
    ]
    for check in result.checks:
        assert check.ok, f"{check.name}: {check.detail}"
    figures = result.figures
    # The run did what it says: churn over both transports, stopped and
    # killed clients, slow and never-reading subscribers.
    assert figures["counters"]["connections_total"] > 2 * SHORT.clients
    counts = figures["workers"]["counts"]
    assert counts["connected udp"] > 0 and counts["never-reader connections"] > 0
    assert figures["stops"] > 0 and figures["kills"] > 0
    assert figures["workers"]["pubacked"] > SHORT.seconds * SHORT.rate / 2


DELIVERY_ID = re.compile(rb" id=(\S+)")


def test_sessionsAndMessagesLeaveNothingBehind():
    """
    The soak's memory check in memory, exactly: after 2,000 TCP sessions
    (subscribed in each mode, sent a message, acking it, closed) and 2,000
    UDP sessions (said HELLO, subscribed, said BYE), and as many messages,
    the broker holds no more Python objects than before them.  (Its tables
    bounded by design are not reached: one publisher, one source address.)
    """
    harness = UdpHarness(BrokerConfig(messageEvents=False))
    publisher = harness.connect()

    def session(number):
        client = harness.connect()
        mode = (b"all", b"latest", b"fire")[number % 3]
        client.send(b"SUB 1 t/%d mode=%s\r\n" % (number % 10, mode))
        publisher.send(b"PUB %d t/%d 5\r\nhello\r\n" % (number, number % 10))
        for deliveryId in DELIVERY_ID.findall(client.received()):
            client.send(b"ACK %s\r\n" % deliveryId)
        client.lose()
        peer = harness.peer(20000 + number)
        peer.hello(f"client-{number}")
        peer.request(b"SUB 3 t/1 mode=all")
        peer.request(b"BYE")
        if b"PING" in publisher.received():
            publisher.send(b"PONG\r\n")
        # Slow enough for the broker's limit on HELLOs from one address.
        harness.clock.advance(0.02)

    def objects():
        harness.events.clear()
        harness.transport.written.clear()
        gc.collect()
        return len(gc.get_objects())

    for number in range(200):
        session(number)
    before = objects()
    for number in range(200, 2200):
        session(number)
    assert objects() - before < 100
    assert harness.broker.counters["published"] == 2200
    assert harness.broker.counters["connections"] == 1
