"""
What one client may make the broker hold or do, over TCP: the output it
does not read (C{--max-output-bytes}).
"""

from twisted.internet.testing import StringTransport

from dallal.core import BrokerConfig
from dallal.tcp import OUTPUT_SOFT_MARK
from helpers import PING_INTERVAL, BrokerHarness


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
    assert harness.broker.stats()["refused_output_bytes"] == 1
    [limit] = harness.fields("limit_reached")
    assert (limit["limit"], limit["max"]) == ("output_bytes", 6)
    [disconnect] = harness.fields("disconnect")
    assert disconnect["reason"] == "output_limit"
