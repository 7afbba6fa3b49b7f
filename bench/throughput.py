"""
Throughput of the real broker: messages delivered per second, the broker's
CPU seconds and its peak memory, with and without per-message log events.

Each measurement starts a fresh broker (`twistd -n dallal`, logging to a
file as in production), connects the subscribers and one publisher from two
other processes, publishes pipelined 64-byte messages on one topic and stops
the clock when every subscriber has received the last one (counting any the
broker dropped for a slow consumer).  The load generator pre-encodes its
frames, writes them in large batches and counts what comes back with a few
C-speed scans per read, so that the broker, not the generator, is the
bottleneck.

    python3 bench/throughput.py                    # both scenarios, events on and off
    python3 bench/throughput.py --runs 5 --messages 400000
    python3 bench/throughput.py --subscribers 100 --no-message-events

bench/README.md describes the output; docs/PERFORMANCE.md has the figures.
"""

import argparse
import importlib.util
import multiprocessing
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from selectors import EVENT_READ, DefaultSelector

TOPIC = b"bench"
PAYLOAD = b"x" * 64
# The last message of a run carries this payload instead: a subscriber that
# has it has had everything it will get (a broker short of memory may drop
# older messages for a slow consumer, never the newest).
LAST_PAYLOAD = b"z" * 64
# The subscriptions ask for fire-and-forget delivery, the only mode whose
# messages need no ACK (brokers without delivery modes ignore the option).
SUBSCRIBE_OPTIONS = b" mode=fire"
# The publisher writes its window of unacknowledged PUBs in this many writes,
# so that the next write is ready as soon as a quarter has been acknowledged.
PUBLISH_WRITES_PER_WINDOW = 4
RECEIVE_SIZE = 256 * 1024
BROKER_START_TIMEOUT = 15.0
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class BenchError(Exception):
    pass


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
    through L{_parseFrames}, which is where a delivery mode that wants
    acknowledgements would answer each C{id=} with an C{ACK}.
    """

    def __init__(self):
        self.messages = 0
        self.pubAcks = 0
        self.subAcks = 0
        self.lastSeen = False
        self._pending = b""

    def feed(self, data):
        """
        Consume bytes from the broker.

        @return: the bytes to send back (C{PONG}s), often C{b""}.
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
                self.lastSeen = self.lastSeen or buffer[position:payloadEnd] == LAST_PAYLOAD
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


def connect(port):
    sock = socket.create_connection(("127.0.0.1", port))
    # Without this, Nagle's algorithm holds back the tail of each write
    # until the broker's kernel acknowledges the rest, stalling the window.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def runSubscribers(port, subscribers, timeout, pipe):
    """
    Subscribe C{subscribers} connections to the topic, report C{"ready"}
    once every SUBACK is in, then count messages until each connection has
    had the last one; report the messages, the time the last one arrived
    and the CPU time spent counting.
    """
    try:
        sockets = [connect(port) for _ in range(subscribers)]
        selector = DefaultSelector()
        streams = {}
        for number, sock in enumerate(sockets):
            sock.sendall(b"SUB s%d %s%s\r\n" % (number, TOPIC, SUBSCRIBE_OPTIONS))
            sock.setblocking(False)
            streams[sock] = BrokerStream()
            selector.register(sock, EVENT_READ)
        deadline = time.monotonic() + timeout

        def receiveUntil(done, waitingFor):
            while not done():
                if time.monotonic() > deadline:
                    received = sum(stream.messages for stream in streams.values())
                    raise BenchError(
                        f"timed out waiting for {waitingFor}, "
                        f"{received} messages received"
                    )
                for key, _ in selector.select(1.0):
                    sock = key.fileobj
                    data = sock.recv(RECEIVE_SIZE)
                    if not data:
                        raise BenchError("the broker closed a subscriber connection")
                    replies = streams[sock].feed(data)
                    if replies:
                        sock.sendall(replies)

        receiveUntil(
            lambda: all(stream.subAcks for stream in streams.values()), "the SUBACKs"
        )
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


def encodePublishWrites(messages, window):
    """
    Every PUB frame of the run, pre-encoded and grouped into
    C{PUBLISH_WRITES_PER_WINDOW} writes per window: C{(frames, bytes)} pairs.
    The last message carries C{LAST_PAYLOAD}.
    """
    framesPerWrite = max(1, window // PUBLISH_WRITES_PER_WINDOW)
    frames = [
        b"PUB %d %s %d\r\n%s\r\n" % (number, TOPIC, len(PAYLOAD), PAYLOAD)
        for number in range(messages - 1)
    ]
    frames.append(b"PUB last %s %d\r\n%s\r\n" % (TOPIC, len(LAST_PAYLOAD), LAST_PAYLOAD))
    groups = [
        frames[start : start + framesPerWrite]
        for start in range(0, messages, framesPerWrite)
    ]
    return [(len(group), b"".join(group)) for group in groups]


def runPublisher(port, messages, window, timeout, pipe):
    """
    Connect, report C{"ready"}, wait for C{"go"}, then publish C{messages}
    messages keeping at most C{window} unacknowledged; report the time the
    first write started, and the CPU time spent.
    """
    try:
        writes = encodePublishWrites(messages, window)
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
            while nextWrite < len(writes) and (
                sent - stream.pubAcks + writes[nextWrite][0] <= window
            ):
                frames, data = writes[nextWrite]
                sock.sendall(data)
                sent += frames
                nextWrite += 1
            if time.monotonic() > deadline:
                raise BenchError(f"timed out with {stream.pubAcks} of {messages} PUBACKs")
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


# The broker.


def twistdExecutable():
    """
    The twistd of this Python, so the broker runs the code being measured.
    """
    beside = os.path.join(os.path.dirname(sys.executable), "twistd")
    if os.path.exists(beside):
        return beside
    found = shutil.which("twistd")
    if found is None:
        raise BenchError("no twistd found: pip install -e . installs Twisted")
    return found


class Broker:
    """
    A C{twistd -n dallal} process listening on a free port, logging to a
    file in C{directory}.
    """

    def __init__(self, directory, messageEvents):
        self.logPath = os.path.join(directory, "twistd.log")
        self.command = [
            twistdExecutable(), "-n", "--pidfile=",
            f"--logfile={self.logPath}",
            "dallal", "--tcp", "tcp:0:interface=127.0.0.1",
        ]
        if messageEvents:
            self.command.append("--message-events")
        self._output = open(os.path.join(directory, "twistd.out"), "wb")
        self.process = subprocess.Popen(
            self.command, stdout=self._output, stderr=subprocess.STDOUT
        )
        try:
            self.port = self._waitForPort()
        except BenchError as error:
            self.stop()
            raise BenchError(f"{error}\n{self.lastWords()}") from None

    def _waitForPort(self):
        """
        The port from the broker's C{event=listening} line, which goes to the
        log file (twistd writes nothing else to stdout with --logfile).
        """
        deadline = time.monotonic() + BROKER_START_TIMEOUT
        listening = re.compile(rb"event=listening .*address=127\.0\.0\.1:(\d+)")
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise BenchError(
                    f"the broker exited with status {self.process.returncode}: "
                    f"{shlex.join(self.command)}"
                )
            try:
                with open(self.logPath, "rb") as log:
                    match = listening.search(log.read())
            except FileNotFoundError:
                match = None
            if match:
                return int(match.group(1))
            time.sleep(0.05)
        raise BenchError("the broker did not log event=listening in time")

    def cpuSeconds(self):
        with open(f"/proc/{self.process.pid}/stat", "rb") as stat:
            # The command name, in parentheses, may hold spaces: count the
            # fields after its closing parenthesis (utime is field 14).
            fields = stat.read().rpartition(b")")[2].split()
        return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS

    def secondsWaitingForCore(self):
        """
        How long the broker has been ready to run but waiting for a core
        (the second field of /proc/<pid>/schedstat, in nanoseconds): time
        the other processes on the machine took from it.
        """
        with open(f"/proc/{self.process.pid}/schedstat") as schedstat:
            return int(schedstat.read().split()[1]) / 1e9

    def peakMemory(self):
        """
        The peak resident set size in bytes (VmHWM).
        """
        with open(f"/proc/{self.process.pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        raise BenchError("no VmHWM in /proc/<pid>/status")

    def lastWords(self):
        """
        The end of the broker's log and output, to explain a failure.
        """
        lines = []
        for path in (self.logPath, self._output.name):
            if os.path.exists(path):
                with open(path, "rb") as output:
                    lines += output.read().decode("utf-8", "replace").splitlines()[-10:]
        return "\n".join(["the broker's last lines:", *lines])

    def stop(self):
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._output.close()


# One measurement.


@dataclass
class Measurement:
    subscribers: int
    messageEvents: bool
    published: int
    deliveries: int
    seconds: float
    brokerCpu: float
    brokerWait: float
    generatorCpu: float
    peakMemory: int

    @property
    def rate(self):
        return self.deliveries / self.seconds

    @property
    def dropped(self):
        """
        The share of (message, subscriber) pairs never delivered: the broker
        dropped them for a slow consumer.
        """
        return 1 - self.deliveries / (self.published * self.subscribers)

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


def awaitReport(pipe, timeout, what):
    if not pipe.poll(timeout):
        raise BenchError(f"{what} did not report within {timeout:.0f} s")
    report = pipe.recv()
    if isinstance(report, tuple) and report[0] == "error":
        raise BenchError(report[1])
    return report


def measure(subscribers, deliveries, messageEvents, window, timeout):
    """
    Publish enough messages for C{deliveries} deliveries to C{subscribers}
    subscribers of one topic, on a fresh broker, keeping C{window} PUBs
    unacknowledged.
    """
    messages = max(1, deliveries // subscribers)
    with tempfile.TemporaryDirectory(prefix="dallal-bench-") as directory:
        broker = Broker(directory, messageEvents)
        processes = []
        try:
            subscriberPipe, subscriberEnd = multiprocessing.Pipe()
            publisherPipe, publisherEnd = multiprocessing.Pipe()
            processes.append(
                multiprocessing.Process(
                    target=runSubscribers,
                    args=(broker.port, subscribers, timeout, subscriberEnd),
                )
            )
            processes.append(
                multiprocessing.Process(
                    target=runPublisher,
                    args=(broker.port, messages, window, timeout, publisherEnd),
                )
            )
            for process in processes:
                process.start()
            awaitReport(subscriberPipe, BROKER_START_TIMEOUT, "the subscribers")
            awaitReport(publisherPipe, BROKER_START_TIMEOUT, "the publisher")
            cpuBefore = broker.cpuSeconds()
            waitBefore = broker.secondsWaitingForCore()
            publisherPipe.send("go")
            _, started, publisherCpu = awaitReport(publisherPipe, timeout, "the publisher")
            _, received, finished, subscribersCpu = awaitReport(
                subscriberPipe, timeout, "the subscribers"
            )
            brokerCpu = broker.cpuSeconds() - cpuBefore
            brokerWait = broker.secondsWaitingForCore() - waitBefore
            peakMemory = broker.peakMemory()
        except BenchError as error:
            raise BenchError(f"{error}\n{broker.lastWords()}") from None
        finally:
            for process in processes:
                process.join(5)
                if process.is_alive():
                    process.terminate()
                    process.join()
            broker.stop()
    return Measurement(
        subscribers,
        messageEvents,
        messages,
        received,
        finished - started,
        brokerCpu,
        brokerWait,
        publisherCpu + subscribersCpu,
        peakMemory,
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
            capture_output=True, text=True, timeout=5, cwd=package,
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


def printMeasurement(run, measurement):
    print(
        f"run {run}  1->{measurement.subscribers:<3}  {eventsLabel(measurement.messageEvents)}"
        f"  {measurement.rate:>9,.0f} deliveries/s"
        f"  {measurement.deliveries:>8,} in {measurement.seconds:6.2f} s"
        f" ({measurement.dropped:.1%} dropped)"
        f"  broker CPU {measurement.brokerCpu:6.2f} s"
        f" ({measurement.cpuPerDelivery * 1e6:5.1f} us/delivery)"
        f"  busy {measurement.brokerBusy:4.0%}, waiting for a core {measurement.brokerWaiting:3.0%}"
        f"  generator CPU {measurement.generatorCpu:5.2f} s"
        f"  peak RSS {measurement.peakMemory / 2**20:6.1f} MiB",
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


def printSummary(measurements, subscriberCounts, eventModes, runs):
    print(f"\nmedians of {runs} run(s), spread = min and max around the median")
    print(
        "scenario  events  deliveries/s  spread     dropped  broker busy  waiting"
        "  us/delivery  spread     generator/broker CPU  peak RSS"
    )
    groups = {}
    for m in measurements:
        groups.setdefault((m.subscribers, m.messageEvents), []).append(m)
    for subscribers in subscriberCounts:
        for messageEvents in eventModes:
            group = groups[subscribers, messageEvents]
            rates = [m.rate for m in group]
            costs = [m.cpuPerDelivery * 1e6 for m in group]
            print(
                f"1->{subscribers:<5}  {'on ' if messageEvents else 'off'}"
                f"  {statistics.median(rates):>14,.0f}  {spread(rates):<9}"
                f"  {statistics.median(m.dropped for m in group):7.1%}"
                f"  {statistics.median(m.brokerBusy for m in group):11.0%}"
                f"  {statistics.median(m.brokerWaiting for m in group):7.0%}"
                f"  {statistics.median(costs):11.1f}  {spread(costs):<9}"
                f"  {statistics.median(m.generatorCpu / m.brokerCpu for m in group):20.0%}"
                f"  {statistics.median(m.peakMemory for m in group) / 2**20:6.1f} MiB"
            )
    if len(eventModes) == 2:
        print("\nwhat per-message events cost")
        for subscribers in subscriberCounts:
            on = groups[subscribers, True]
            off = groups[subscribers, False]
            print(
                f"1->{subscribers:<5}  throughput off/on "
                f"{ratio([m.rate for m in off], [m.rate for m in on])};"
                f"  CPU per delivery on/off "
                f"{ratio([m.cpuPerDelivery for m in on], [m.cpuPerDelivery for m in off])}"
            )


def reproduceCommand(arguments):
    environment = (
        [f"PYTHONPATH={os.environ['PYTHONPATH']}"] if os.environ.get("PYTHONPATH") else []
    )
    command = [
        *environment,
        "python3", "bench/throughput.py",
        "--messages", str(arguments.messages),
        "--runs", str(arguments.runs),
        "--window", str(arguments.window),
        "--subscribers", *map(str, arguments.subscribers),
    ]
    if arguments.message_events:
        command.append("--message-events")
    if arguments.no_message_events:
        command.append("--no-message-events")
    return shlex.join(command)


def parseArguments(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--messages", type=int, default=100_000,
        help="deliveries per measurement: a scenario with S subscribers "
        "publishes messages/S messages (default: %(default)s)",
    )
    parser.add_argument(
        "--runs", type=int, default=3,
        help="runs of every measurement, interleaved; the summary gives "
        "their median and spread (default: %(default)s)",
    )
    parser.add_argument(
        "--window", type=int, default=1000,
        help="PUBs the publisher keeps unacknowledged (default: %(default)s)",
    )
    parser.add_argument(
        "--subscribers", type=int, nargs="+", default=[1, 100],
        help="the scenarios: one publisher to this many subscribers "
        "(default: 1 100)",
    )
    parser.add_argument(
        "--message-events", action="store_true",
        help="measure the broker logging an event per message published and "
        "delivered (without either flag, both are measured)",
    )
    parser.add_argument(
        "--no-message-events", action="store_true",
        help="measure the broker started with --no-message-events",
    )
    parser.add_argument(
        "--timeout", type=float, default=120.0,
        help="seconds one measurement may take before it fails (default: %(default)s)",
    )
    arguments = parser.parse_args(argv)
    if not arguments.message_events and not arguments.no_message_events:
        arguments.message_events = arguments.no_message_events = True
    return arguments


def main(argv=None):
    arguments = parseArguments(argv)
    eventModes = [
        mode for mode, wanted in (
            (True, arguments.message_events), (False, arguments.no_message_events)
        ) if wanted
    ]
    print(describeSetup())
    print(
        f"payload {len(PAYLOAD)} bytes, {arguments.messages:,} deliveries per "
        f"measurement, {arguments.window:,} PUBs in flight"
    )
    measurements = []
    for run in range(1, arguments.runs + 1):
        for subscribers in arguments.subscribers:
            for messageEvents in eventModes:
                measurement = measure(
                    subscribers,
                    arguments.messages,
                    messageEvents,
                    arguments.window,
                    arguments.timeout,
                )
                printMeasurement(run, measurement)
                measurements.append(measurement)
    printSummary(measurements, arguments.subscribers, eventModes, arguments.runs)
    print(f"\nreproduce: {reproduceCommand(arguments)}")


if __name__ == "__main__":
    try:
        main()
    except BenchError as error:
        sys.exit(f"throughput: {error}")
