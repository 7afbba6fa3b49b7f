"""
Throughput of the real broker per delivery mode: messages delivered per
second, the broker's CPU seconds and its peak memory; then its memory under
a subscriber that never reads.

Each measurement starts a fresh broker (`twistd -n dallal`, logging to a
file as in production), connects the subscribers and one publisher from two
other processes, publishes pipelined 64-byte messages on one topic and stops
the clock when every subscriber has received the last one (counting any the
broker replaced or dropped).  The load generator pre-encodes its frames,
writes them in large batches, and counts and acknowledges what comes back
with a few C-speed scans per read, so that the broker, not the generator,
is the bottleneck.

    python3 bench/throughput.py                    # 1->1 and 1->100, every mode, then stalled
    python3 bench/throughput.py --runs 5 --messages 400000 --no-stalled
    python3 bench/throughput.py --modes fire --message-events --no-message-events
    python3 bench/throughput.py --stalled-only --stalled-messages 1600

bench/README.md describes the output; docs/PERFORMANCE.md has the figures.
"""

import argparse
import importlib.util
import multiprocessing
import os
import platform
import re
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from selectors import EVENT_READ, DefaultSelector

from brokerproc import BROKER_START_TIMEOUT, BenchError, Broker

TOPIC = b"bench"
PAYLOAD = b"x" * 64
# The last message of a run carries this payload (or, for larger payloads,
# one that starts with it) instead: a subscriber that has it has had
# everything it will get (the broker may replace or drop older messages for
# a slow consumer, never the newest).
LAST_PAYLOAD = b"z" * 64
MODES = ("fire", "latest", "all")
# Modes whose messages carry id=<delivery-id> and wait for an ACK.
ACKED_MODES = ("latest", "all")
# The mode in which a newer message replaces a waiting one: its subscribers
# receive fewer messages than were published, by design.
REPLACING_MODE = "latest"
# The delivery id of each MSG in a stretch of complete frames.  Payloads are
# the benchmark's own runs of x and z, so only control lines hold " id=".
DELIVERY_ID = re.compile(rb" id=([^ \r\n]+)")
# The publisher writes its window of unacknowledged PUBs in this many writes,
# so that the next write is ready as soon as a quarter has been acknowledged.
PUBLISH_WRITES_PER_WINDOW = 4
RECEIVE_SIZE = 256 * 1024
# The delivery window is also capped in payload bytes, to half the broker's
# default --max-queued-bytes (8 MiB), so that large payloads cannot overflow
# the queue of a subscriber that reads either.
DELIVERY_WINDOW_BYTES = 4 * 2**20
# How often a publisher stopped by its delivery window looks again, in
# seconds: a fraction of the time the broker takes to deliver a window.
DELIVERY_WINDOW_POLL = 0.0005

# The load generator.


def messageSize(line):
    # MSG <topic> <size> [key=value ...]
    return int(line.split(b" ", 3)[2])


class BrokerStream:
    """
    Reads what the broker sends on one benchmark connection: counts C{MSG},
    C{PUBACK} and C{SUBACK} frames, notices the run's last message, and
    says what to answer.

    All of the generator's frame handling is here.  A read holding nothing
    but messages and PUBACKs, nearly every read, is counted with a few
    C-speed scans of the bytes instead of frame by frame, so the generator
    costs a small fraction of what the broker does.  Any other read goes
    through L{_parseFrames}.  With C{acknowledge}, the C{id=} of every
    message of a read is answered with one write of C{ACK}s, found by one
    more scan.
    """

    def __init__(self, acknowledge=False):
        self.acknowledge = acknowledge
        self.messages = 0
        self.pubAcks = 0
        self.subAcks = 0
        self.lastSeen = False
        self._pending = b""

    def feed(self, data):
        """
        Consume bytes from the broker.

        @return: the bytes to send back (C{PONG}s and C{ACK}s), often
            C{b""}.
        @raise BenchError: the broker refused a request.
        """
        buffer = self._pending + data if self._pending else data
        end = self._completeFramesEnd(buffer)
        messages = buffer.count(b"MSG ", 0, end)
        pubAcks = buffer.count(b"PUBACK ", 0, end)
        # A MSG frame holds two line ends (the payload has none), a PUBACK
        # one: any other line end belongs to a frame that needs parsing.
        if buffer.count(b"\n", 0, end) == 2 * messages + pubAcks:
            self.messages += messages
            self.pubAcks += pubAcks
            self.lastSeen = self.lastSeen or buffer.find(LAST_PAYLOAD, 0, end) >= 0
            replies = b""
        else:
            replies = self._parseFrames(buffer, end)
        if self.acknowledge:
            deliveryIds = DELIVERY_ID.findall(buffer, 0, end)
            if deliveryIds:
                replies += b"ACK " + b"\r\nACK ".join(deliveryIds) + b"\r\n"
        self._pending = buffer[end:]
        return replies

    @staticmethod
    def _completeFramesEnd(buffer):
        """
        Where the last complete frame of C{buffer} ends: after its last line
        end, unless that is inside a message whose payload is still coming.
        """
        end = buffer.rfind(b"\n") + 1
        header = buffer.rfind(b"MSG ", 0, end)
        if header >= 0:
            lineEnd = buffer.find(b"\n", header)
            if lineEnd + 1 + messageSize(buffer[header:lineEnd]) + 2 > len(buffer):
                return header
        return end

    def _parseFrames(self, buffer, end):
        replies = []
        position = 0
        while position < end:
            lineEnd = buffer.find(b"\n", position)
            line = buffer[position:lineEnd].rstrip(b"\r")
            position = lineEnd + 1
            verb = line.split(b" ", 1)[0]
            if verb == b"MSG":
                payloadEnd = position + messageSize(line)
                self.messages += 1
                self.lastSeen = self.lastSeen or buffer.startswith(
                    LAST_PAYLOAD, position, payloadEnd
                )
                position = payloadEnd + 2
            elif verb == b"PUBACK":
                self.pubAcks += 1
            elif verb == b"SUBACK":
                self.subAcks += 1
            elif verb == b"PING":
                replies.append(b"PONG\r\n")
            elif verb != b"PONG":
                raise BenchError(f"the broker sent {line!r}")
        return b"".join(replies)


class DeliveryWindow:
    """
    How far the publisher may run ahead of its subscribers: it writes only
    while fewer than C{size} messages, on average over the subscribers, are
    published and not yet received (so at most one write more).

    The broker acknowledges a PUB once it is queued, so the PUB window alone
    lets the publisher outrun delivery: in C{all} mode, where each delivery
    waits for an ACK, the broker's per-subscriber queue fills, and holds
    the publisher back (a broker without flow control drops the excess).
    This keeps the run steady, and lossless on any broker.  The
    subscriber process adds what it receives to a counter in shared memory,
    which the publisher reads.
    """

    def __init__(self, size, subscribers):
        self.size = size
        self.subscribers = subscribers
        # One writer (the subscriber process), one reader: no lock needed.
        self.received = multiprocessing.Value("q", 0, lock=False)

    def isOpen(self, published):
        return published * self.subscribers - self.received.value < (self.size * self.subscribers)


def subscribeFrame(requestId, mode):
    # A broker without delivery modes ignores the mode option (fire is then
    # what it does).
    return b"SUB %s %s mode=%s\r\n" % (requestId, TOPIC, mode.encode("ascii"))


def connect(port):
    sock = socket.create_connection(("127.0.0.1", port))
    # Without this, Nagle's algorithm holds back the tail of each write
    # until the broker's kernel acknowledges the rest, stalling the window.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def runSubscribers(port, subscribers, timeout, pipe, mode="fire", deliveryWindow=None):
    """
    Subscribe C{subscribers} connections to the topic in delivery C{mode},
    report C{"ready"} once every SUBACK is in, then count (and in the acked
    modes acknowledge) messages until each connection has had the last one,
    adding them to C{deliveryWindow} if there is one; report the messages,
    the time the last one arrived and the CPU time spent counting.
    """
    try:
        sockets = [connect(port) for _ in range(subscribers)]
        selector = DefaultSelector()
        streams = {}
        for number, sock in enumerate(sockets):
            sock.sendall(subscribeFrame(b"s%d" % number, mode))
            sock.setblocking(False)
            streams[sock] = BrokerStream(acknowledge=mode in ACKED_MODES)
            selector.register(sock, EVENT_READ)
        deadline = time.monotonic() + timeout

        def receiveUntil(done, waitingFor):
            while not done():
                if time.monotonic() > deadline:
                    received = sum(stream.messages for stream in streams.values())
                    raise BenchError(
                        f"timed out waiting for {waitingFor}, {received} messages received"
                    )
                for key, _ in selector.select(1.0):
                    sock = key.fileobj
                    data = sock.recv(RECEIVE_SIZE)
                    if not data:
                        raise BenchError("the broker closed a subscriber connection")
                    stream = streams[sock]
                    before = stream.messages
                    replies = stream.feed(data)
                    if replies:
                        sock.sendall(replies)
                    if deliveryWindow is not None:
                        deliveryWindow.received.value += stream.messages - before

        receiveUntil(lambda: all(stream.subAcks for stream in streams.values()), "the SUBACKs")
        pipe.send("ready")
        cpuBefore = time.process_time()
        # Checking every stream after each read would cost the generator as
        # much as the reading: count down the connections still waiting.
        waiting = set(streams.values())

        def allDone():
            for stream in list(waiting):
                if stream.lastSeen:
                    waiting.discard(stream)
            return not waiting

        receiveUntil(allDone, "the last message")
        finished = time.monotonic()
        received = sum(stream.messages for stream in streams.values())
        pipe.send(("done", received, finished, time.process_time() - cpuBefore))
        for sock in sockets:
            sock.close()
    except Exception as error:
        pipe.send(("error", f"subscribers: {error!r}"))


def encodePublishWrites(messages, window, payloadSize=len(PAYLOAD)):
    """
    Every PUB frame of the run, pre-encoded and grouped into
    C{PUBLISH_WRITES_PER_WINDOW} writes per window: C{(frames, bytes)} pairs.
    The payloads are C{payloadSize} bytes (at least C{len(LAST_PAYLOAD)}),
    the last one made of the bytes of C{LAST_PAYLOAD}.
    """
    framesPerWrite = max(1, window // PUBLISH_WRITES_PER_WINDOW)
    payload = PAYLOAD[:1] * payloadSize
    lastPayload = LAST_PAYLOAD[:1] * payloadSize
    frames = [
        b"PUB %d %s %d\r\n%s\r\n" % (number, TOPIC, payloadSize, payload)
        for number in range(messages - 1)
    ]
    frames.append(b"PUB last %s %d\r\n%s\r\n" % (TOPIC, payloadSize, lastPayload))
    groups = [
        frames[start : start + framesPerWrite] for start in range(0, messages, framesPerWrite)
    ]
    return [(len(group), b"".join(group)) for group in groups]


def runPublisher(
    port, messages, window, timeout, pipe, payloadSize=len(PAYLOAD), deliveryWindow=None
):
    """
    Connect, report C{"ready"}, wait for C{"go"}, then publish C{messages}
    messages of C{payloadSize} bytes keeping at most C{window}
    unacknowledged, and within C{deliveryWindow} if there is one; report the
    time the first write started, and the CPU time spent.
    """
    try:
        writes = encodePublishWrites(messages, window, payloadSize)
        sock = connect(port)
        sock.settimeout(timeout)
        stream = BrokerStream()
        pipe.send("ready")
        pipe.recv()
        cpuBefore = time.process_time()
        started = time.monotonic()
        deadline = started + timeout
        sent = 0
        nextWrite = 0
        while stream.pubAcks < messages:
            while (
                nextWrite < len(writes)
                and sent - stream.pubAcks + writes[nextWrite][0] <= window
                and (deliveryWindow is None or deliveryWindow.isOpen(sent))
            ):
                frames, data = writes[nextWrite]
                sock.sendall(data)
                sent += frames
                nextWrite += 1
            if time.monotonic() > deadline:
                raise BenchError(f"timed out with {stream.pubAcks} of {messages} PUBACKs")
            if sent == stream.pubAcks:
                # Nothing is coming from the broker: only the subscribers'
                # progress can open the delivery window.
                time.sleep(DELIVERY_WINDOW_POLL)
                continue
            data = sock.recv(RECEIVE_SIZE)
            if not data:
                raise BenchError("the broker closed the publisher connection")
            replies = stream.feed(data)
            if replies:
                sock.sendall(replies)
        pipe.send(("done", started, time.process_time() - cpuBefore))
        sock.close()
    except Exception as error:
        pipe.send(("error", f"publisher: {error!r}"))


# One measurement.


@dataclass
class Exchange:
    """
    What one publisher and its subscribers saw of a broker.

    @ivar residentBefore: the broker's resident memory once everyone was
        connected, before the first publish.
    """

    published: int
    received: int
    seconds: float
    brokerCpu: float
    brokerWait: float
    generatorCpu: float
    residentBefore: int


def awaitReport(pipe, timeout, what):
    if not pipe.poll(timeout):
        raise BenchError(f"{what} did not report within {timeout:.0f} s")
    report = pipe.recv()
    if isinstance(report, tuple) and report[0] == "error":
        raise BenchError(report[1])
    return report


def exchange(
    broker,
    subscribers,
    messages,
    mode,
    window,
    deliveryWindow,
    timeout,
    payloadSize=len(PAYLOAD),
):
    """
    Publish C{messages} messages of C{payloadSize} bytes through C{broker}
    to C{subscribers} subscribers in delivery C{mode}, from a publisher and
    a subscriber process, keeping C{window} PUBs unacknowledged and, but in
    the mode that replaces messages, fewer than C{deliveryWindow} (and
    C{DELIVERY_WINDOW_BYTES}) published and not received (no such limit if
    C{deliveryWindow} is 0).
    """
    subscriberPipe, subscriberEnd = multiprocessing.Pipe()
    publisherPipe, publisherEnd = multiprocessing.Pipe()
    shared = (
        DeliveryWindow(
            max(1, min(deliveryWindow, DELIVERY_WINDOW_BYTES // payloadSize)), subscribers
        )
        if deliveryWindow and mode != REPLACING_MODE
        else None
    )
    processes = [
        multiprocessing.Process(
            target=runSubscribers,
            args=(broker.port, subscribers, timeout, subscriberEnd),
            kwargs={"mode": mode, "deliveryWindow": shared},
        ),
        multiprocessing.Process(
            target=runPublisher,
            args=(broker.port, messages, window, timeout, publisherEnd),
            kwargs={"payloadSize": payloadSize, "deliveryWindow": shared},
        ),
    ]
    try:
        for process in processes:
            process.start()
        awaitReport(subscriberPipe, BROKER_START_TIMEOUT, "the subscribers")
        awaitReport(publisherPipe, BROKER_START_TIMEOUT, "the publisher")
        residentBefore = broker.residentMemory()
        cpuBefore = broker.cpuSeconds()
        waitBefore = broker.secondsWaitingForCore()
        publisherPipe.send("go")
        _, started, publisherCpu = awaitReport(publisherPipe, timeout, "the publisher")
        _, received, finished, subscribersCpu = awaitReport(
            subscriberPipe, timeout, "the subscribers"
        )
        return Exchange(
            messages,
            received,
            finished - started,
            broker.cpuSeconds() - cpuBefore,
            broker.secondsWaitingForCore() - waitBefore,
            publisherCpu + subscribersCpu,
            residentBefore,
        )
    finally:
        for process in processes:
            process.join(5)
            if process.is_alive():
                process.terminate()
                process.join()


@dataclass
class Measurement:
    mode: str
    subscribers: int
    messageEvents: bool
    published: int
    deliveries: int
    seconds: float
    brokerCpu: float
    brokerWait: float
    generatorCpu: float
    peakMemory: int
    # The broker's STATS at the end, or None from a broker without STATS.
    counters: dict

    @property
    def rate(self):
        return self.deliveries / self.seconds

    @property
    def offered(self):
        """
        The (message, subscriber) pairs the broker had to deliver, replace
        or drop.
        """
        return self.published * self.subscribers

    @property
    def offeredRate(self):
        return self.offered / self.seconds

    def _share(self, counter):
        return self.counters[counter] / self.counters["matched"]

    @property
    def replaced(self):
        """
        The share of (message, subscriber) pairs replaced by a newer message
        in C{latest} mode, or C{None} without the broker's counters.
        """
        return None if self.counters is None else self._share("replaced")

    @property
    def dropped(self):
        """
        The share of (message, subscriber) pairs the broker dropped (for a
        slow consumer, as a rule).  Without its counters, the share never
        delivered: a broker without STATS has no mode that replaces.
        """
        if self.counters is None:
            return 1 - self.deliveries / self.offered
        return self._share("dropped")

    @property
    def brokerBusy(self):
        """
        The share of the time the broker was on a CPU: near 1 when it is
        the bottleneck.
        """
        return self.brokerCpu / self.seconds

    @property
    def brokerWaiting(self):
        """
        The share of the time the broker was ready but had no core: the
        machine's other load, not the benchmark, kept it from being busy.
        """
        return self.brokerWait / self.seconds

    @property
    def cpuPerDelivery(self):
        return self.brokerCpu / self.deliveries

    @property
    def cpuPerOffered(self):
        """
        The broker's CPU per (message, subscriber) pair: what compares
        across modes, since a replaced message costs work but is not
        delivered.
        """
        return self.brokerCpu / self.offered


def measure(subscribers, deliveries, messageEvents, window, timeout, mode="fire", deliveryWindow=0):
    """
    Publish enough messages for C{deliveries} deliveries to C{subscribers}
    subscribers of one topic in delivery C{mode}, on a fresh broker, keeping
    C{window} PUBs unacknowledged and within C{deliveryWindow} (see
    L{exchange}).
    """
    messages = max(1, deliveries // subscribers)
    with tempfile.TemporaryDirectory(prefix="dallal-bench-") as directory:
        broker = Broker(directory, messageEvents=messageEvents)
        try:
            result = exchange(broker, subscribers, messages, mode, window, deliveryWindow, timeout)
            peakMemory = broker.peakMemory()
            counters = broker.counters()
        except BenchError as error:
            raise BenchError(f"{error}\n{broker.lastWords()}") from None
        finally:
            broker.stop()
    return Measurement(
        mode,
        subscribers,
        messageEvents,
        result.published,
        result.received,
        result.seconds,
        result.brokerCpu,
        result.brokerWait,
        result.generatorCpu,
        peakMemory,
        counters,
    )


# The stalled subscriber.

# Asked of the kernel for the stalled subscriber's socket, which gives at
# least about 2 KiB: the broker's writes to it stop within a few KiB.
STALLED_RECEIVE_BUFFER = 4096
# The stalled subscriber answers no PING either, and the broker disconnects
# a client that misses 3: ping rarely enough that it stays connected
# (and its messages held) for the whole measurement.
STALLED_PING_INTERVAL = 600


@dataclass
class StalledMeasurement:
    mode: str
    published: int
    payloadSize: int
    # Messages the subscriber that reads received.
    received: int
    residentBefore: int
    peakMemory: int
    residentAfter: int
    counters: dict

    @property
    def growth(self):
        return self.peakMemory - self.residentBefore


def stalledSubscriber(port, mode, timeout):
    """
    A connection subscribed to the topic in C{mode} that reads nothing
    after its SUBACK, with a receive buffer as small as the kernel allows.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # Before connecting: the TCP window scale is fixed by the handshake.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, STALLED_RECEIVE_BUFFER)
    sock.settimeout(timeout)
    sock.connect(("127.0.0.1", port))
    sock.sendall(subscribeFrame(b"stalled", mode))
    received = b""
    while not received.endswith(b"\n"):
        data = sock.recv(256)
        if not data:
            raise BenchError("the broker closed the stalled subscriber's connection")
        received += data
    if not received.startswith(b"SUBACK stalled"):
        raise BenchError(f"the broker answered the stalled SUB with {received!r}")
    return sock


def measureStalled(mode, messages, payloadSize, window, deliveryWindow, timeout):
    """
    Publish C{messages} messages of C{payloadSize} bytes to two subscribers
    in C{mode}, on a fresh broker: one that never reads, and one that reads
    (and acks), whose receiving the last message ends the measurement.
    """
    with tempfile.TemporaryDirectory(prefix="dallal-bench-") as directory:
        broker = Broker(directory, extra=["--ping-interval", str(STALLED_PING_INTERVAL)])
        try:
            with stalledSubscriber(broker.port, mode, timeout):
                result = exchange(
                    broker, 1, messages, mode, window, deliveryWindow, timeout, payloadSize
                )
                peakMemory = broker.peakMemory()
                residentAfter = broker.residentMemory()
                counters = broker.counters()
        except BenchError as error:
            raise BenchError(f"{error}\n{broker.lastWords()}") from None
        finally:
            broker.stop()
    return StalledMeasurement(
        mode,
        result.published,
        payloadSize,
        result.received,
        result.residentBefore,
        peakMemory,
        residentAfter,
        counters,
    )


# Reporting.


def describeSetup():
    """
    The machine, and which dallal the broker runs (PYTHONPATH may point
    twistd at another copy than this checkout).
    """
    import twisted

    load = ", ".join(f"{value:.2f}" for value in os.getloadavg())
    package = os.path.dirname(os.path.dirname(importlib.util.find_spec("dallal").origin))
    try:
        revision = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=package,
        ).stdout.strip()
    except OSError:
        revision = ""
    return (
        f"machine: {os.cpu_count()} cores, load average {load}; "
        f"Python {platform.python_version()}, Twisted {twisted.__version__}\n"
        f"broker: dallal from {package}" + (f" at {revision}" if revision else "")
    )


def eventsLabel(messageEvents):
    return "events on " if messageEvents else "events off"


def share(fraction):
    """
    A share in percent, or C{-} when it is unknown.
    """
    return "-" if fraction is None else f"{fraction:.1%}"


def mebibytes(size):
    return f"{size / 2**20:.1f} MiB"


def printMeasurement(run, measurement):
    print(
        f"run {run}  1->{measurement.subscribers:<3}  {measurement.mode:<6}"
        f"  {eventsLabel(measurement.messageEvents)}"
        f"  {measurement.rate:>9,.0f} deliveries/s"
        f"  {measurement.deliveries:>8,} of {measurement.offered:,} in {measurement.seconds:6.2f} s"
        f" ({share(measurement.replaced)} replaced, {share(measurement.dropped)} dropped)"
        f"  broker CPU {measurement.brokerCpu:6.2f} s"
        f" ({measurement.cpuPerDelivery * 1e6:5.1f} us/delivery)"
        f"  busy {measurement.brokerBusy:4.0%}, waiting for a core {measurement.brokerWaiting:3.0%}"
        f"  generator CPU {measurement.generatorCpu:5.2f} s"
        f"  peak RSS {mebibytes(measurement.peakMemory):>9}",
        flush=True,
    )


def spread(values):
    """
    The range of C{values} around their median, in percent: C{-a%/+b%}.
    """
    middle = statistics.median(values)
    return f"-{(middle - min(values)) / middle:.0%}/+{(max(values) - middle) / middle:.0%}"


def ratio(numerators, denominators):
    """
    The ratio of two medians, and the range of the ratios run by run (each
    run measures both sides back to back, so the load of the machine hits
    them alike).
    """
    middle = statistics.median(numerators) / statistics.median(denominators)
    paired = [a / b for a, b in zip(numerators, denominators)]
    return f"{middle:.1f}x (runs {min(paired):.1f}-{max(paired):.1f})"


def medianShare(fractions):
    known = [fraction for fraction in fractions if fraction is not None]
    return share(statistics.median(known) if known else None)


def printSummary(measurements, subscriberCounts, modes, eventModes, runs):
    print(f"\nmedians of {runs} run(s), spread = min and max around the median")
    print(
        "scenario  mode    events  deliveries/s  spread     offered/s  replaced  dropped"
        "  broker busy  waiting  us/delivery  spread     us/offered"
        "  generator/broker CPU  peak RSS"
    )
    groups = {}
    for m in measurements:
        groups.setdefault((m.subscribers, m.mode, m.messageEvents), []).append(m)
    for subscribers in subscriberCounts:
        for mode in modes:
            for messageEvents in eventModes:
                group = groups[subscribers, mode, messageEvents]
                rates = [m.rate for m in group]
                costs = [m.cpuPerDelivery * 1e6 for m in group]
                print(
                    f"1->{subscribers:<5}  {mode:<6}  {'on ' if messageEvents else 'off'}"
                    f"  {statistics.median(rates):>14,.0f}  {spread(rates):<9}"
                    f"  {statistics.median(m.offeredRate for m in group):>9,.0f}"
                    f"  {medianShare(m.replaced for m in group):>8}"
                    f"  {medianShare(m.dropped for m in group):>7}"
                    f"  {statistics.median(m.brokerBusy for m in group):11.0%}"
                    f"  {statistics.median(m.brokerWaiting for m in group):7.0%}"
                    f"  {statistics.median(costs):11.1f}  {spread(costs):<9}"
                    f"  {statistics.median(m.cpuPerOffered * 1e6 for m in group):10.1f}"
                    f"  {statistics.median(m.generatorCpu / m.brokerCpu for m in group):20.0%}"
                    f"  {mebibytes(statistics.median(m.peakMemory for m in group)):>9}"
                )
    if len(modes) > 1:
        # Fire, the mode without acks, is the reference when it is among them.
        reference = "fire" if "fire" in modes else modes[0]
        print(
            f"\nbetween modes: deliveries/s, and broker CPU per offered message, "
            f"against {reference}'s"
        )
        for subscribers in subscriberCounts:
            for messageEvents in eventModes:
                base = groups[subscribers, reference, messageEvents]
                for mode in modes:
                    if mode == reference:
                        continue
                    other = groups[subscribers, mode, messageEvents]
                    print(
                        f"1->{subscribers:<5}  {eventsLabel(messageEvents)}"
                        f"  throughput {reference}/{mode} "
                        f"{ratio([m.rate for m in base], [m.rate for m in other])};"
                        f"  CPU per offered {mode}/{reference} "
                        f"{ratio([m.cpuPerOffered for m in other], [m.cpuPerOffered for m in base])}"
                    )
    if len(eventModes) == 2:
        print("\nwhat per-message events cost")
        for subscribers in subscriberCounts:
            for mode in modes:
                on = groups[subscribers, mode, True]
                off = groups[subscribers, mode, False]
                print(
                    f"1->{subscribers:<5}  {mode:<6}  throughput off/on "
                    f"{ratio([m.rate for m in off], [m.rate for m in on])};"
                    f"  CPU per delivery on/off "
                    f"{ratio([m.cpuPerDelivery for m in on], [m.cpuPerDelivery for m in off])}"
                )


def describeDrops(counters):
    """
    The nonzero C{dropped_<reason>} counters, as C{reason n, ...}.
    """
    reasons = [
        f"{name[len('dropped_') :]} {value:,}"
        for name, value in sorted(counters.items())
        if name.startswith("dropped_") and value
    ]
    return ", ".join(reasons) or "none"


def printStalledHeader(messages, payloadSize):
    print(
        f"\nstalled subscriber: {messages:,} messages of {payloadSize:,} bytes "
        f"({mebibytes(messages * payloadSize)}) published to two subscribers, one that "
        f"reads (and acks) and one that never reads (SO_RCVBUF {STALLED_RECEIVE_BUFFER:,})"
    )
    print(
        "mode    reader got   broker RSS before  peak        growth      after      broker counters"
    )


def printStalled(measurement):
    counters = measurement.counters
    if counters is None:
        described = "- (the broker has no STATS)"
    else:
        described = (
            f"matched {counters['matched']:,}, acked {counters['acked']:,}, "
            f"replaced {counters['replaced']:,}, dropped {counters['dropped']:,} "
            f"({describeDrops(counters)}), inflight {counters['inflight']:,}"
        )
    print(
        f"{measurement.mode:<6}  {measurement.received:>5,}/{measurement.published:<5,}"
        f"  {mebibytes(measurement.residentBefore):>17}  {mebibytes(measurement.peakMemory):>9}"
        f"  {'+' + mebibytes(measurement.growth):>10}  {mebibytes(measurement.residentAfter):>9}"
        f"  {described}",
        flush=True,
    )


def commandLine(script, arguments, *options):
    """
    The shell command that runs the benchmark C{script} again: its
    PYTHONPATH (which says which broker it measured), the options of
    L{runOptions} as C{arguments} holds them, then C{options}.
    """
    environment = [f"PYTHONPATH={os.environ['PYTHONPATH']}"] if os.environ.get("PYTHONPATH") else []
    return shlex.join(
        [
            *environment,
            "python3",
            f"bench/{script}",
            "--messages",
            str(arguments.messages),
            "--runs",
            str(arguments.runs),
            "--window",
            str(arguments.window),
            *options,
        ]
    )


def reproduceCommand(arguments):
    options = [
        "--delivery-window",
        str(arguments.delivery_window),
        "--subscribers",
        *map(str, arguments.subscribers),
        "--modes",
        *arguments.modes,
    ]
    if arguments.message_events:
        options.append("--message-events")
    if arguments.no_message_events:
        options.append("--no-message-events")
    if arguments.stalled_only:
        options.append("--stalled-only")
    if arguments.no_stalled:
        options.append("--no-stalled")
    else:
        options += [
            "--stalled-messages",
            str(arguments.stalled_messages),
            "--stalled-payload",
            str(arguments.stalled_payload),
        ]
    return commandLine("throughput.py", arguments, *options)


def runOptions(description, messages, messagesHelp, interleaved, windowHelp):
    """
    An argument parser with the options of every throughput benchmark:
    C{--messages} (default C{messages}), C{--runs}, C{--window} and
    C{--timeout}.

    @param interleaved: what the runs are interleaved across.
    """
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--messages",
        type=int,
        default=messages,
        help=f"{messagesHelp} (default: %(default)s)",
    )
    parser.add_argument(
        "--runs",
        type=int,
        default=3,
        help=f"runs of every measurement, interleaved {interleaved}; the "
        "summary gives medians and spreads (default: %(default)s)",
    )
    parser.add_argument(
        "--window",
        type=int,
        default=1000,
        help=f"{windowHelp} (default: %(default)s)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="seconds one measurement may take before the run fails (default: %(default)s)",
    )
    return parser


def payloadSize(text):
    size = int(text)
    if size < len(LAST_PAYLOAD):
        raise argparse.ArgumentTypeError(f"at least {len(LAST_PAYLOAD)} bytes")
    return size


def parseArguments(argv):
    parser = runOptions(
        __doc__.split("\n\n")[0],
        100_000,
        "deliveries per measurement: a scenario with S subscribers publishes messages/S",
        "across scenarios and modes",
        "PUBs the publisher keeps unacknowledged",
    )
    parser.add_argument(
        "--delivery-window",
        type=int,
        default=500,
        help="messages (and at most 4 MiB) the publisher may have published "
        "and its subscribers not yet received, on average, in modes fire and "
        "all (latest replaces messages by design); 0 for no limit "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--subscribers",
        type=int,
        nargs="+",
        default=[1, 100],
        help="the scenarios: one publisher to this many subscribers (default: 1 100)",
    )
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=MODES,
        default=list(MODES),
        help="the delivery modes the subscribers ask for (default: %(default)s)",
    )
    parser.add_argument(
        "--message-events",
        action="store_true",
        help="measure the broker started with --message-events, logging an "
        "event per message published and delivered",
    )
    parser.add_argument(
        "--no-message-events",
        action="store_true",
        help="measure the broker without per-message events (what it does "
        "by default; with --message-events too, both are measured and compared)",
    )
    stalled = parser.add_mutually_exclusive_group()
    stalled.add_argument(
        "--no-stalled",
        action="store_true",
        help="skip the stalled-subscriber measurements",
    )
    stalled.add_argument(
        "--stalled-only",
        action="store_true",
        help="run only the stalled-subscriber measurements",
    )
    parser.add_argument(
        "--stalled-messages",
        type=int,
        default=400,
        help="messages published in each stalled-subscriber measurement (default: %(default)s)",
    )
    parser.add_argument(
        "--stalled-payload",
        type=payloadSize,
        default=65536,
        help="their payload size in bytes (default: %(default)s)",
    )
    arguments = parser.parse_args(argv)
    if not arguments.message_events:
        arguments.no_message_events = True
    return arguments


def main(argv=None):
    arguments = parseArguments(argv)
    eventModes = [
        setting
        for setting, wanted in (
            (True, arguments.message_events),
            (False, arguments.no_message_events),
        )
        if wanted
    ]
    print(describeSetup())
    if not arguments.stalled_only:
        print(
            f"payload {len(PAYLOAD)} bytes, {arguments.messages:,} deliveries per "
            f"measurement, {arguments.window:,} PUBs in flight, delivery window "
            f"{arguments.delivery_window:,} (fire, all)"
        )
        measurements = []
        for run in range(1, arguments.runs + 1):
            for subscribers in arguments.subscribers:
                for mode in arguments.modes:
                    for messageEvents in eventModes:
                        measurement = measure(
                            subscribers,
                            arguments.messages,
                            messageEvents,
                            arguments.window,
                            arguments.timeout,
                            mode=mode,
                            deliveryWindow=arguments.delivery_window,
                        )
                        printMeasurement(run, measurement)
                        measurements.append(measurement)
        printSummary(
            measurements, arguments.subscribers, arguments.modes, eventModes, arguments.runs
        )
    if not arguments.no_stalled:
        printStalledHeader(arguments.stalled_messages, arguments.stalled_payload)
        for mode in arguments.modes:
            printStalled(
                measureStalled(
                    mode,
                    arguments.stalled_messages,
                    arguments.stalled_payload,
                    arguments.window,
                    arguments.delivery_window,
                    arguments.timeout,
                )
            )
    print(f"\nreproduce: {reproduceCommand(arguments)}")


if __name__ == "__main__":
    try:
        main()
    except BenchError as error:
        sys.exit(f"throughput: {error}")
