"""
The pieces of the C{dallal} command that stand between the broker and a
pipe: L{MessagePrinter} (C{subscribe}) and L{LinePublisher}
(C{publish -l}), without a broker or a process.
"""

from twisted.internet.defer import Deferred

from dallal.cli.main import LinePublisher, MessagePrinter
from dallal.client import ReceivedMessage


def message(payload):
    return ReceivedMessage("news", payload, 1, False, {}, False)


class ClosedOutput:
    """
    Standard output whose reader is gone.
    """

    def write(self, data):
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self):
        pass


def test_aMessageThatCannotBePrintedIsNeverAcked():
    printer = MessagePrinter(ClosedOutput())
    printer.release()
    handled = printer(message(b"lost"))
    assert isinstance(handled, Deferred) and not handled.called
    assert printer.outputGone.called


def test_aHeldMessageThatCannotBePrintedIsNeverAcked():
    printer = MessagePrinter(ClosedOutput())
    handled = printer(message(b"held"))
    printer.release()
    assert not handled.called
    assert printer.outputGone.called


class FakeConsole:
    """
    A pipe console: it can be paused, and records whether it is.
    """

    interactive = False

    def __init__(self):
        self.paused = False

    def pauseProducing(self):
        self.paused = True

    def resumeProducing(self):
        self.paused = False


class Broker:
    """
    The publishes sent, each waiting for its answer.
    """

    def __init__(self):
        self.sent = []

    def publish(self, payload):
        acked = Deferred()
        self.sent.append((payload, acked))
        return acked

    def ack(self, count=1):
        for _ in range(count):
            payload, acked = self.sent.pop(0)
            acked.callback(None)


def test_linesArePublishedAsTheyAreRead():
    console, broker = FakeConsole(), Broker()
    publisher = LinePublisher(console, broker.publish)
    for line in ["a", "", "b\udcff"]:
        publisher.lineReceived(line)
    assert [payload for payload, _ in broker.sent] == [b"a", b"b\xff"]
    publisher.inputEnded()
    assert not publisher.finished.called
    broker.ack(2)
    assert publisher.finished.result == [None, None]


def test_readingWaitsWhileTheWindowIsFull():
    console, broker = FakeConsole(), Broker()
    publisher = LinePublisher(console, broker.publish, window=3)
    for line in ["a", "b"]:
        publisher.lineReceived(line)
    assert not console.paused
    publisher.lineReceived("c")
    assert console.paused
    broker.ack()
    assert not console.paused


def test_theFirstFailureEndsIt():
    console, broker = FakeConsole(), Broker()
    publisher = LinePublisher(console, broker.publish)
    publisher.lineReceived("a")
    publisher.lineReceived("b")
    broker.sent[0][1].errback(ValueError("refused"))
    failures = []
    publisher.finished.addErrback(failures.append)
    assert failures[0].check(ValueError)
    publisher.lineReceived("c")
    assert len(broker.sent) == 2
