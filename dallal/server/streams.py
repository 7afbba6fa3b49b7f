"""
What the broker's stream protocols (Dallal's over TCP, MQTT) share: the
frames of one read written in one write, the bound on what a client that
does not read is written, and the reasons a connection's reading is paused.
"""

from twisted.internet.interfaces import IPushProducer
from zope.interface import implementer

from dallal.limits import OUTPUT_BYTES

# Why a connection's reading is paused (L{ReadPause}): its password is being
# checked, a subscriber it publishes to has a full queue, its transport is
# full (it does not read its answers), or it had its turn.
LOGIN_CHECK = "login_check"
CONGESTION = "congestion"
OUTPUT_FULL = "output_full"
TURN_OVER = "turn_over"

# Bytes a connection may collect in one read's batch before they are written
# at once: Twisted's transport buffers as much (its bufferSize) before it
# says it is full, which stops the broker reading the connection's requests
# until its client has read the answers.
OUTPUT_SOFT_MARK = 65536

# Bytes of pipelined publishes published together as one run at most
# (L{dallal.broker.router.Router.publishRun}): a subscriber whose connection
# fills during a run is written about this much more than it would be one
# by one.
RUN_BYTES = 65536


class ReadPause(set):
    """
    The reasons a connection's reading is paused: it reads nothing while
    any is left, and reads again, buffered frames first, once the last one
    is gone (L{BrokerProtocol.pauseReading}, L{BrokerProtocol.resumeReading}).

    A set of reasons, so that asking whether reading is paused (once per
    request) and whether for a reason costs no Python call.  It keeps no
    reference to its connection: a connection is freed as soon as it ends,
    with what it had buffered, rather than by the cyclic garbage collector
    some time later.
    """

    __slots__ = ()

    def add(self, reason):
        """
        @return: whether reading stops now: C{reason} is the first.
        """
        first = not self
        set.add(self, reason)
        return first

    def discard(self, reason):
        """
        @return: whether reading goes on now: C{reason} was the last.
        """
        if reason not in self:
            return False
        self.remove(reason)
        return not self


class WriteBatch:
    """
    Holds back what the broker writes to its stream connections while it
    handles one read, then gives each connection its share with a single
    C{transport.write}.

    One read of a publisher's stream carries hundreds of pipelined PUBs, and
    each makes a PUBACK for the publisher and a MSG for every subscriber.
    Twisted already sends a connection's buffer with one system call per
    reactor turn, but every C{write} costs about a microsecond of Python
    (checks, the producer and the reactor's writer bookkeeping): as much as
    a tenth of a 1 -> 1 message.  Appending to one bytearray per connection
    and writing once per read costs a few percent of that.  Frames keep
    their order: everything a connection writes goes through its own
    buffer while a batch is open.

    A connection whose share grows past L{OUTPUT_SOFT_MARK} writes it at
    once (L{BoundedOutput._write}), so that its transport can say it is
    full before the read is over.
    """

    def __init__(self):
        self.open = False
        self._writers = []

    def run(self, function, *args):
        """
        Call C{function}, writing what it sends once it returns.  Within a
        batch already open (re-entered), just call it.
        """
        if self.open:
            return function(*args)
        self.open = True
        try:
            return function(*args)
        finally:
            self.open = False
            writers, self._writers = self._writers, []
            for protocol in writers:
                protocol.flushOutput()

    def holdFor(self, protocol):
        """
        C{protocol} has started collecting output in this batch.
        """
        self._writers.append(protocol)


@implementer(IPushProducer)
class _OutputValve:
    """
    Registered with the transport, which tells it when the connection's
    write buffer fills and drains (L{BoundedOutput.outputFull},
    L{BoundedOutput.outputDrained}).

    The protocol itself cannot be the producer: its C{pauseProducing}
    pauses I{reading} from the client, which is only part of what a full
    buffer calls for.
    """

    def __init__(self, protocol):
        self.protocol = protocol

    def pauseProducing(self):
        self.protocol.outputFull()

    def resumeProducing(self):
        # What waited in the outbox goes out in one write.
        self.protocol.batch.run(self.protocol.outputDrained)

    def stopProducing(self):
        # The connection is closing; connectionLost detaches the session.
        pass


class BoundedOutput:
    """
    What the broker writes to one stream connection: the frames of a read
    held in its L{WriteBatch} and written at once, and the bound on a client
    that does not read them.

    The transport buffers up to its bufferSize (64 KiB), then says it is
    full.  From then on, the broker holds this client's messages in its
    bounded outbox, stops reading its requests, and counts what it still
    writes (the answers to requests read before, pings) against
    C{--max-output-bytes}: a client that does not read its answers makes
    the broker hold no more than that for it, then is disconnected.

    The protocol has C{broker}, C{batch} (a L{WriteBatch}), C{transport},
    C{outputSubscriber()} (whose deliveries to hold: its session in the
    broker, or C{None}), C{pauseReading} and C{resumeReading} (of L{ReadPause}'s reasons) and
    C{disconnect(reason)}; it calls L{startOutput} once connected.
    """

    def startOutput(self):
        """
        The connection is made: be told when its write buffer fills.
        """
        # The frames written while a batch is open, in order, in one
        # buffer: its length is their size, and no list holds a string
        # per frame.
        self._output = bytearray()
        # Whether the transport's buffer is full, and the bytes written to
        # it since then.
        self._full = False
        self._overflow = 0
        self.transport.registerProducer(_OutputValve(self), True)

    def dropOutput(self):
        """
        Forget what was held: nothing more is written.
        """
        self._output.clear()

    def _write(self, chunks):
        """
        Write C{chunks} (byte strings) with the current read's batch, if one
        is open.
        """
        if self.batch.open:
            output = self._output
            if not output:
                self.batch.holdFor(self)
            for chunk in chunks:
                output += chunk
            if len(output) > OUTPUT_SOFT_MARK:
                self.flushOutput()
            return
        full = self._full
        if len(chunks) == 1:
            self.transport.write(chunks[0])
        else:
            self.transport.writeSequence(chunks)
        if full:
            self._writtenWhileFull(sum(map(len, chunks)))

    def flushOutput(self):
        """
        Write what this connection collected during a L{WriteBatch}.
        """
        output = self._output
        if not output:
            return
        data = bytes(output)
        output.clear()
        if not self.transport.disconnecting:
            full = self._full
            self.transport.write(data)
            if full:
                self._writtenWhileFull(len(data))

    def outputFull(self):
        """
        The transport's buffer is full: hold messages, stop reading.
        """
        self._full = True
        subscriber = self.outputSubscriber()
        if subscriber is not None:
            self.broker.pauseDelivery(subscriber)
        self.pauseReading(OUTPUT_FULL)

    def outputDrained(self):
        """
        The transport has written everything it held.
        """
        self._full = False
        self._overflow = 0
        subscriber = self.outputSubscriber()
        if subscriber is not None:
            self.broker.resumeDelivery(subscriber)
        if not self._full:
            self.resumeReading(OUTPUT_FULL)

    def _writtenWhileFull(self, size):
        self._overflow += size
        maximum = self.broker.config.maxOutputBytes
        if self._overflow > maximum and not self.transport.disconnecting:
            self.broker.refusedByLimit(self, OUTPUT_BYTES, maximum)
            self.disconnect("output_limit")

    def closeAfterOutput(self):
        """
        Close the connection once what was written is sent.

        The valve is unregistered first: over TLS (L{twisted.protocols.tls})
        a connection with a producer registered does not close until the
        producer is unregistered, so the client would stay connected after
        the broker's last word (a fatal ERR, BYE, a refusing CONNACK).
        """
        if not self.transport.disconnecting:
            # The frames held for this read go out first.
            self.flushOutput()
            self.transport.unregisterProducer()
            self.transport.loseConnection()
