"""
What the broker's stream protocols (Dallal's over TCP, MQTT) share: the
frames of one read written in one write, and the reasons a connection's
reading is paused.
"""

# Why a connection's reading is paused (L{ReadPause}): its password is being
# checked, a subscriber it publishes to has a full queue, its transport is
# full (it does not read its answers), or it had its turn.
LOGIN_CHECK = "login_check"
CONGESTION = "congestion"
OUTPUT_FULL = "output_full"
TURN_OVER = "turn_over"


class ReadPause:
    """
    The reasons a connection's reading is paused: it reads nothing while
    any is left, and reads again, buffered frames first, once the last one
    is gone (L{BrokerProtocol.pauseReading}, L{BrokerProtocol.resumeReading}).

    It keeps no reference to its connection: a connection is freed as soon
    as it ends, with what it had buffered, rather than by the cyclic garbage
    collector some time later.
    """

    def __init__(self):
        self._reasons = set()

    def __contains__(self, reason):
        return reason in self._reasons

    def __bool__(self):
        return bool(self._reasons)

    def add(self, reason):
        """
        @return: whether reading stops now: C{reason} is the first.
        """
        first = not self._reasons
        self._reasons.add(reason)
        return first

    def discard(self, reason):
        """
        @return: whether reading goes on now: C{reason} was the last.
        """
        if reason not in self._reasons:
            return False
        self._reasons.remove(reason)
        return not self._reasons


class WriteBatch:
    """
    Holds back what the broker writes to its TCP connections while it
    handles one read, then gives each connection its share with a single
    C{transport.write}.

    One read of a publisher's stream carries hundreds of pipelined PUBs, and
    each makes a PUBACK for the publisher and a MSG for every subscriber.
    Twisted already sends a connection's buffer with one system call per
    reactor turn, but every C{write} costs about a microsecond of Python
    (checks, the producer and the reactor's writer bookkeeping): as much as
    a tenth of a 1 -> 1 message.  Appending to a list and writing once per
    read costs a few percent of that.  Frames keep their order: everything a
    connection writes goes through its own list while a batch is open.

    A connection whose share grows past L{OUTPUT_SOFT_MARK} writes it at
    once (L{BrokerProtocol.sendFrame}), so that its transport can say it is
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
