"""
Dallal against real brokers: Mosquitto (MQTT 3.1.1), Redis pub/sub and NATS,
doing the same work in one run, and the ratios between them.

Each measurement starts a fresh broker on a free loopback port (the peers
from their Debian packages, installed with apt-get when missing), connects
subscribers and publishers from two other processes over raw sockets
(bench/protocols.py), publishes pre-encoded frames pipelined under a window
of messages the subscribers have not yet received, and stops the clock when
every subscriber has had every publisher's last message.  Dallal's `fire`
mode is compared with MQTT QoS 0, Redis and NATS; its `all` mode with MQTT
QoS 1.  A last scenario publishes at a fixed rate below saturation and
measures latency from a timestamp in the payload.

    python3 bench/compare.py                       # every scenario and broker, 2 to 3 minutes
    python3 bench/compare.py --messages 200000     # the figures in docs/PERFORMANCE.md
    python3 bench/compare.py --scenarios a b --brokers dallal-fire mosquitto-qos0

bench/README.md describes the output; docs/PERFORMANCE.md has the figures.
"""

import collections
import math
import multiprocessing
import os
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from selectors import EVENT_READ, DefaultSelector

from brokerproc import BROKER_START_TIMEOUT, CLOCK_TICKS, BenchError, Broker, ServerProcess
from protocols import (
    DallalClient,
    MqttClient,
    NatsClient,
    RedisClient,
    lastPayload,
    payload,
    stampedPayload,
)
from throughput import (
    PUBLISH_WRITES_PER_WINDOW,
    RECEIVE_SIZE,
    awaitReport,
    commandLine,
    connect,
    describeSetup,
    runOptions,
    spread,
)

# The publishers' window is also capped in payload bytes, so that what a
# subscriber can have queued stays under every broker's per-client limit
# (Dallal's --max-queued-bytes is 8 MiB, Redis's soft pubsub limit 8 MB).
WINDOW_BYTES = 4 * 2**20
# Dallal's --max-inflight default: Mosquitto is given the same window of
# unacknowledged QoS 1 messages per subscriber (its default is 20).
MAX_INFLIGHT = 100
LATENCY_PAYLOAD_SIZE = 64


# The brokers.


class DallalServer(Broker):
    """
    C{twistd -n dallal} with its defaults (no --message-events), retained
    messages stored in the measurement's directory.
    """

    @staticmethod
    def version():
        import dallal

        return f"dallal {dallal.__version__}"


def freePort():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class PeerServer(ServerProcess):
    """
    A broker from a Debian package, started in the foreground on a free
    loopback port with a minimal configuration.
    """

    # The executable, and the Debian package it comes in.
    executable = None
    package = None
    # The arguments that make it print its version.
    versionArguments = None

    def __init__(self, directory):
        self._port = freePort()
        ServerProcess.__init__(self, directory)

    def awaitPorts(self):
        deadline = time.monotonic() + BROKER_START_TIMEOUT
        while time.monotonic() < deadline:
            self.checkAlive()
            try:
                socket.create_connection(("127.0.0.1", self._port), timeout=1).close()
                self.port = self._port
                return
            except OSError:
                time.sleep(0.05)
        raise BenchError(f"{self.name} did not listen on port {self._port} in time")

    @classmethod
    def path(cls):
        # Servers are installed in sbin, which a user's PATH may lack.
        return shutil.which(cls.executable, path=f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin")

    @classmethod
    def version(cls):
        completed = subprocess.run(
            [cls.path(), *cls.versionArguments], capture_output=True, text=True, timeout=10
        )
        lines = (completed.stdout + completed.stderr).strip().splitlines()
        return lines[0] if lines else f"{cls.name}, version unknown"


class MosquittoServer(PeerServer):
    name = executable = package = "mosquitto"
    versionArguments = ["-h"]

    def startCommand(self, directory):
        configuration = os.path.join(directory, "mosquitto.conf")
        with open(configuration, "w") as file:
            file.write(
                f"listener {self._port} 127.0.0.1\n"
                "allow_anonymous true\n"
                "persistence false\n"
                # Unlimited: the default, 1000, makes Mosquitto 2.0 drop QoS 0
                # messages too once a subscriber has that many waiting.
                "max_queued_messages 0\n"
                f"max_inflight_messages {MAX_INFLIGHT}\n"
                f"log_dest file {self.logPath}\n"
                # Stay root (the default drops to the mosquitto user, which
                # cannot write to the measurement's directory).
                "user root\n"
            )
        return [self.path(), "-c", configuration]


class RedisServer(PeerServer):
    name = executable = "redis-server"
    package = "redis-server"
    versionArguments = ["--version"]

    def startCommand(self, directory):
        return [
            self.path(),
            "--port",
            str(self._port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            directory,
            "--logfile",
            self.logPath,
        ]


class NatsServer(PeerServer):
    name = executable = "nats-server"
    package = "nats-server"
    versionArguments = ["--version"]

    def startCommand(self, directory):
        return [self.path(), "-a", "127.0.0.1", "-p", str(self._port), "-l", self.logPath]


def installMissing(servers):
    """
    Install the Debian packages of the peer brokers that are not installed.
    """
    missing = sorted({server.package for server in servers if server.path() is None})
    if not missing:
        return
    install = ["apt-get", "install", "-y", *missing]
    print(
        f"{', '.join(missing)} not installed: installing from Debian packages with "
        f"`{shlex.join(install)}` (after `apt-get update` if that fails). "
        "This benchmark starts its own instances on free loopback ports; a "
        "system service the package may start is left as it is.",
        flush=True,
    )
    if subprocess.run(install).returncode != 0:
        subprocess.run(["apt-get", "update"], check=False)
        if subprocess.run(install).returncode != 0:
            raise BenchError(f"could not install {', '.join(missing)}")


# What is compared.


@dataclass(frozen=True)
class Contender:
    key: str
    label: str
    server: type
    client: object


CONTENDERS = [
    Contender("dallal-fire", "Dallal fire", DallalServer, DallalClient("fire")),
    Contender("dallal-all", "Dallal all", DallalServer, DallalClient("all")),
    Contender("mosquitto-qos0", "Mosquitto QoS 0", MosquittoServer, MqttClient(0)),
    Contender("mosquitto-qos1", "Mosquitto QoS 1", MosquittoServer, MqttClient(1)),
    Contender("redis", "Redis", RedisServer, RedisClient()),
    Contender("nats", "NATS", NatsServer, NatsClient()),
]
CONTENDERS_BY_KEY = {contender.key: contender for contender in CONTENDERS}
# Dallal's mode against the peer that promises the same.
COMPARISONS = [
    ("dallal-fire", "mosquitto-qos0"),
    ("dallal-fire", "redis"),
    ("dallal-fire", "nats"),
    ("dallal-all", "mosquitto-qos1"),
]
# The goals: Dallal at least as fast as the peer in these scenarios.
TARGETS = [
    ("dallal-fire", "mosquitto-qos0", ["a", "b", "c"]),
    ("dallal-all", "mosquitto-qos1", ["a"]),
]


@dataclass(frozen=True)
class Scenario:
    key: str
    label: str
    publishers: int  # each on its own topic
    subscribers: int  # each subscribed to every topic
    payloadSize: int
    # Deliveries per measurement: --messages divided by this, so that the
    # large payloads move a bounded number of bytes.
    messagesDivisor: int = 1
    # Publish at --latency-rate for --latency-seconds and measure latency,
    # instead of throughput.
    paced: bool = False

    @property
    def topics(self):
        return [b"bench%d" % number for number in range(self.publishers)]


SCENARIOS = [
    Scenario("a", "a 1->1 64 B", 1, 1, 64),
    Scenario("b", "b 1->100 64 B", 1, 100, 64),
    Scenario("c", "c 10x10->10 64 B", 10, 10, 64),
    Scenario("d1k", "d 1->1 1 KiB", 1, 1, 1024, messagesDivisor=4),
    Scenario("d64k", "d 1->1 64 KiB", 1, 1, 65536, messagesDivisor=32),
    Scenario("latency", "latency 1->1 64 B", 1, 1, LATENCY_PAYLOAD_SIZE, paced=True),
]
SCENARIOS_BY_KEY = {scenario.key: scenario for scenario in SCENARIOS}


# The load generator.
#
# Flow control is end to end: the publishers keep at most a window of
# messages that the subscribers have not all received, whatever the broker
# acknowledges.  An acknowledgement only says a message was queued (and
# MQTT QoS 0 and NATS have none), so publishing at the rate of the broker's
# acknowledgements would fill its queues for the subscribers (Dallal's hold
# 1000 messages, then drop the oldest) and measure overflow, not delivery.
# The subscribers' process reports through a pipe how many messages the
# slowest subscriber has received, every quarter window.


def readInto(sock, stream, onArrival=None):
    """
    Read what C{sock} holds into its stream and send back what the stream
    answers; if messages arrived, tell C{onArrival} how many the stream had
    before and has now.
    """
    data = sock.recv(RECEIVE_SIZE)
    if not data:
        raise BenchError("the broker closed a connection")
    before = stream.messages
    replies = stream.feed(data)
    if replies:
        sock.sendall(replies)
    if onArrival and stream.messages != before:
        onArrival(before, stream.messages)


def receive(selector, streams, timeout, onArrival=None):
    """
    Read every socket ready within C{timeout}.
    """
    for key, _ in selector.select(timeout):
        readInto(key.fileobj, streams[key.fileobj], onArrival)


def openConnections(port, requests, client, timestamps, timeout):
    """
    One connection per request, each sent its request: a selector over them
    and the connections' streams.
    """
    selector = DefaultSelector()
    streams = {}
    for request in requests:
        sock = connect(port)
        # A timeout, not non-blocking: replies (ACKs, PUBACKs) are sent with
        # sendall, which must be able to wait for room.
        sock.settimeout(timeout)
        if request:
            sock.sendall(request)
        streams[sock] = client.stream(timestamps)
        selector.register(sock, EVENT_READ)
    return selector, streams


def receiveUntil(selector, streams, done, waitingFor, deadline, onArrival=None):
    while not done():
        if time.monotonic() > deadline:
            received = sum(stream.messages for stream in streams.values())
            raise BenchError(f"timed out waiting for {waitingFor}, {received:,} messages received")
        receive(selector, streams, 1.0, onArrival)


class ProgressReporter:
    """
    Sends down C{pipe} how many messages every one of C{subscribers}
    subscribers has received, each time that grows by C{step}.  Called with
    one subscriber's count before and after a read, it counts the
    subscribers past each multiple of C{step}, so the slowest is known
    without looking at every subscriber.
    """

    def __init__(self, step, subscribers, pipe):
        self.step = step
        self.subscribers = subscribers
        self.pipe = pipe
        # Multiple of the step -> how many subscribers have reached it.
        self._reached = collections.Counter()

    def __call__(self, before, after):
        for level in range(before // self.step + 1, after // self.step + 1):
            self._reached[level] += 1
            # A subscriber reaches the levels in order, so when the last one
            # reaches this level every lower one is complete too.
            if self._reached[level] == self.subscribers:
                del self._reached[level]
                self.pipe.send(level * self.step)


def runSubscribers(client, port, scenario, progressStep, timeout, pipe, progress):
    """
    Subscribe one connection per subscriber to every topic, report
    C{"ready"} once the broker confirmed them all, then count messages
    until each connection has had every publisher's last one, sending the
    slowest one's count down C{progress} every C{progressStep}; report the
    messages, when the last arrived, the CPU time spent counting and the
    latencies of stamped messages.
    """
    try:
        topics = scenario.topics
        selector, streams = openConnections(
            port,
            [client.subscribe(number, topics) for number in range(scenario.subscribers)],
            client,
            scenario.paced,
            timeout,
        )
        deadline = time.monotonic() + timeout
        receiveUntil(
            selector,
            streams,
            lambda: all(client.subscribed(stream, topics) for stream in streams.values()),
            "the subscriptions",
            deadline,
        )
        pipe.send("ready")
        cpuBefore = time.process_time()
        waiting = set(streams.values())

        def allDone():
            waiting.difference_update(
                [stream for stream in waiting if stream.lastMarkers >= scenario.publishers]
            )
            return not waiting

        # A paced publisher does not need to hear of progress.
        reporter = (
            None
            if scenario.paced
            else ProgressReporter(progressStep, scenario.subscribers, progress)
        )
        receiveUntil(selector, streams, allDone, "the last messages", deadline, reporter)
        finished = time.monotonic()
        received = sum(stream.messages for stream in streams.values())
        latencies = [latency for stream in streams.values() for latency in stream.latencies or ()]
        pipe.send(("done", received, finished, time.process_time() - cpuBefore, latencies))
        for sock in streams:
            sock.close()
    except Exception as error:
        pipe.send(("error", f"subscribers: {error!r}"))


class PublishWrites:
    """
    One publisher's writes: C{(frames, bytes)} pairs of C{framesPerWrite}
    frames, the last ending with the last message.

    Frames differ only in their ids, which cycle over twice the window (no
    id is reused while its message may be unacknowledged), so a cycle of
    writes is encoded once and repeated: the run's frames are pre-encoded
    without holding gigabytes of 64 KiB payloads.
    """

    def __init__(self, client, topic, messages, size, window):
        self.framesPerWrite = max(1, window // PUBLISH_WRITES_PER_WINDOW)
        self._count = math.ceil(messages / self.framesPerWrite)
        cycleWrites = math.ceil(2 * window / self.framesPerWrite)
        cycleFrames = cycleWrites * self.framesPerWrite
        frames = [client.publish(topic, payload(size), number) for number in range(cycleFrames)]
        self._cycle = [
            (self.framesPerWrite, b"".join(frames[start : start + self.framesPerWrite]))
            for start in range(0, cycleFrames, self.framesPerWrite)
        ]
        firstOfLast = (self._count - 1) * self.framesPerWrite
        lastFrames = [
            client.publish(topic, payload(size), number % cycleFrames)
            for number in range(firstOfLast, messages - 1)
        ]
        lastFrames.append(client.publish(topic, lastPayload(size), (messages - 1) % cycleFrames))
        self._last = (len(lastFrames), b"".join(lastFrames))

    def __len__(self):
        return self._count

    def __getitem__(self, index):
        if index == self._count - 1:
            return self._last
        return self._cycle[index % len(self._cycle)]


def runPublishers(client, port, scenario, messages, window, rate, timeout, pipe, progress):
    """
    Connect one publisher per topic, report C{"ready"}, wait for C{"go"},
    then publish C{messages} messages on each: pipelined, keeping at most
    C{window} (over all publishers) that the subscribers have not received,
    or at C{rate} a second each for a paced scenario.  Report when
    publishing started and the CPU time it took, then keep reading the
    broker's answers until told to C{"stop"}.
    """
    try:
        topics = scenario.topics
        writes = (
            None
            if scenario.paced
            else [
                PublishWrites(
                    client, topic, messages, scenario.payloadSize, max(1, window // len(topics))
                )
                for topic in topics
            ]
        )
        selector, streams = openConnections(
            port,
            [client.hello(number) for number in range(len(topics))],
            client,
            False,
            timeout,
        )
        deadline = time.monotonic() + timeout
        receiveUntil(
            selector,
            streams,
            lambda: all(client.welcomed(stream) for stream in streams.values()),
            "the publishers' handshakes",
            deadline,
        )
        pipe.send("ready")
        pipe.recv()
        cpuBefore = time.process_time()
        started = time.monotonic()
        deadline = started + timeout
        if scenario.paced:
            publishPaced(
                client, selector, streams, topics, messages, scenario.payloadSize, rate, deadline
            )
        else:
            publishWindowed(selector, streams, writes, window, progress, deadline)
        pipe.send(("sent", started, time.process_time() - cpuBefore))
        while not pipe.poll(0):
            receive(selector, streams, 0.05)
        for sock in streams:
            sock.close()
    except Exception as error:
        pipe.send(("error", f"publishers: {error!r}"))


def publishWindowed(selector, streams, writes, window, progress, deadline):
    """
    Send each connection's C{writes}, one write per connection in turn,
    while the messages sent and not yet received by the slowest subscriber
    stay within C{window}.
    """
    selector.register(progress, EVENT_READ)
    sockets = list(streams)
    nextWrites = [0] * len(sockets)
    sent = 0
    delivered = 0  # messages the slowest subscriber has, as last reported
    while True:
        wrote = False
        for index, sock in enumerate(sockets):
            if nextWrites[index] == len(writes[index]):
                continue
            frames, data = writes[index][nextWrites[index]]
            if sent - delivered + frames > window:
                continue
            sock.sendall(data)
            sent += frames
            nextWrites[index] += 1
            wrote = True
        if all(nextWrite == len(w) for nextWrite, w in zip(nextWrites, writes)):
            break
        if wrote:
            continue
        if time.monotonic() > deadline:
            raise BenchError(f"timed out with {sent:,} messages sent, {delivered:,} delivered")
        for key, _ in selector.select(1.0):
            if key.fileobj is progress:
                while progress.poll():
                    delivered = progress.recv()
            else:
                # The broker's answers (PUBACKs, Redis's counts) are read
                # too, so that it never waits to write them.
                readInto(key.fileobj, streams[key.fileobj])
    selector.unregister(progress)


def publishPaced(client, selector, streams, topics, messages, size, rate, deadline):
    """
    Publish C{messages} messages on each connection, one every 1/C{rate}
    seconds, each stamped with the time it is sent, reading the broker's
    answers in between.
    """
    interval = 1e9 / rate
    sockets = list(streams)
    start = time.monotonic_ns()
    for number in range(messages):
        due = start + number * interval
        while (now := time.monotonic_ns()) < due:
            receive(selector, streams, (due - now) / 1e9)
        if time.monotonic() > deadline:
            raise BenchError(f"timed out after publishing {number:,} messages")
        last = number == messages - 1
        for sock, topic in zip(sockets, topics):
            body = lastPayload(size) if last else stampedPayload(size)
            sock.sendall(client.publish(topic, body, number))


# One measurement.


@dataclass
class Measurement:
    run: int
    scenario: Scenario
    contender: Contender
    expected: int  # (message, subscriber) pairs published
    deliveries: int
    seconds: float
    brokerCpu: float
    brokerWait: float
    generatorCpu: float
    peakMemory: int
    latencies: list

    @property
    def rate(self):
        return self.deliveries / self.seconds

    @property
    def perCpuSecond(self):
        # The CPU clock ticks every 10 ms: a measurement shorter than a tick
        # counts as one, and its figure is a lower bound.
        return self.deliveries / max(self.brokerCpu, 1 / CLOCK_TICKS)

    @property
    def dropped(self):
        return 1 - self.deliveries / self.expected

    @property
    def brokerBusy(self):
        return self.brokerCpu / self.seconds

    @property
    def brokerWaiting(self):
        return self.brokerWait / self.seconds

    def latencyPercentile(self, percent):
        """
        The latency below which C{percent}% of the stamped messages arrived,
        in microseconds.
        """
        return statistics.quantiles(self.latencies, n=100)[percent - 1] / 1e3


def measure(run, scenario, contender, settings):
    """
    Run C{scenario} against a fresh broker of C{contender}.
    """
    if scenario.paced:
        perPublisher = max(2, round(settings.latency_rate * settings.latency_seconds))
    else:
        deliveries = settings.messages // scenario.messagesDivisor
        perPublisher = max(1, deliveries // (scenario.subscribers * scenario.publishers))
    window = max(1, min(settings.window, WINDOW_BYTES // scenario.payloadSize))
    client = contender.client
    with tempfile.TemporaryDirectory(prefix="dallal-compare-") as directory:
        server = contender.server(directory)
        processes = []
        try:
            subscriberPipe, subscriberEnd = multiprocessing.Pipe()
            publisherPipe, publisherEnd = multiprocessing.Pipe()
            progressReader, progressWriter = multiprocessing.Pipe(duplex=False)
            # A report every quarter window, so that the publishers hear of
            # room before the window runs dry.
            progressStep = max(1, window // PUBLISH_WRITES_PER_WINDOW)
            processes.append(
                multiprocessing.Process(
                    target=runSubscribers,
                    args=(
                        client,
                        server.port,
                        scenario,
                        progressStep,
                        settings.timeout,
                        subscriberEnd,
                        progressWriter,
                    ),
                )
            )
            processes[-1].start()
            # The publishers connect once the subscriptions are in place, so
            # that none of their messages precedes a subscription.
            awaitReport(subscriberPipe, BROKER_START_TIMEOUT, "the subscribers")
            processes.append(
                multiprocessing.Process(
                    target=runPublishers,
                    args=(
                        client,
                        server.port,
                        scenario,
                        perPublisher,
                        window,
                        settings.latency_rate,
                        settings.timeout,
                        publisherEnd,
                        progressReader,
                    ),
                )
            )
            processes[-1].start()
            awaitReport(publisherPipe, BROKER_START_TIMEOUT, "the publishers")
            cpuBefore = server.cpuSeconds()
            waitBefore = server.secondsWaitingForCore()
            publisherPipe.send("go")
            _, started, publisherCpu = awaitReport(
                publisherPipe, settings.timeout, "the publishers"
            )
            _, received, finished, subscriberCpu, latencies = awaitReport(
                subscriberPipe, settings.timeout, "the subscribers"
            )
            brokerCpu = server.cpuSeconds() - cpuBefore
            brokerWait = server.secondsWaitingForCore() - waitBefore
            peakMemory = server.peakMemory()
            publisherPipe.send("stop")
        except BenchError as error:
            raise BenchError(
                f"{contender.label}, scenario {scenario.label}: {error}\n{server.lastWords()}"
            ) from None
        finally:
            for process in processes:
                process.join(5)
                if process.is_alive():
                    process.terminate()
                    process.join()
            server.stop()
    return Measurement(
        run,
        scenario,
        contender,
        perPublisher * scenario.publishers * scenario.subscribers,
        received,
        finished - started,
        brokerCpu,
        brokerWait,
        publisherCpu + subscriberCpu,
        peakMemory,
        latencies,
    )


# Reporting.


def printMeasurement(measurement):
    m = measurement
    line = (
        f"run {m.run}  {m.scenario.label:<18} {m.contender.label:<16}"
        f" {m.rate:>10,.0f} deliveries/s  {m.deliveries:>9,} in {m.seconds:6.2f} s"
        f" ({m.dropped:.1%} dropped)  broker CPU {m.brokerCpu:5.2f} s"
        f" ({m.perCpuSecond:>10,.0f}/CPU-s), busy {m.brokerBusy:4.0%},"
        f" waiting {m.brokerWaiting:3.0%}  generator CPU {m.generatorCpu:5.2f} s"
        f"  peak RSS {m.peakMemory / 2**20:6.1f} MiB"
    )
    if m.latencies:
        line += (
            f"  latency p50 {m.latencyPercentile(50):,.0f} us p99 {m.latencyPercentile(99):,.0f} us"
        )
    print(line, flush=True)


def ratioOfMedians(numerators, denominators):
    """
    The ratio of two medians, and the range of the ratios run by run (each
    run measures both close together, so the machine's load hits them
    alike), with two significant digits: these ratios go down to hundredths.
    """
    middle = statistics.median(numerators) / statistics.median(denominators)
    paired = [a / b for a, b in zip(numerators, denominators)]
    return f"{middle:.2g}x (runs {min(paired):.2g}-{max(paired):.2g})"


def printTable(header, rows):
    print("| " + " | ".join(header) + " |")
    print("|" + " --- |" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")


def printSummary(groups, scenarios, contenders, runs):
    print(f"\nmedians of {runs} run(s); spread = the lowest and highest run around the median\n")
    rows = []
    for scenario in scenarios:
        if scenario.paced:
            continue
        for contender in contenders:
            group = groups[scenario.key, contender.key]
            rates = [m.rate for m in group]
            efficiencies = [m.perCpuSecond for m in group]
            rows.append(
                [
                    scenario.label,
                    contender.label,
                    f"{statistics.median(rates):,.0f} ({spread(rates)})",
                    f"{statistics.median(efficiencies):,.0f} ({spread(efficiencies)})",
                    f"{statistics.median(m.brokerBusy for m in group):.0%}",
                    f"{statistics.median(m.brokerWaiting for m in group):.0%}",
                    f"{statistics.median(m.generatorCpu / max(m.brokerCpu, 1 / CLOCK_TICKS) for m in group):.0%}",
                    f"{statistics.median(m.dropped for m in group):.1%}",
                    f"{statistics.median(m.peakMemory for m in group) / 2**20:.1f} MiB",
                ]
            )
    if rows:
        printTable(
            [
                "scenario",
                "broker",
                "deliveries/s (spread)",
                "deliveries per broker CPU-s (spread)",
                "broker busy",
                "waiting for a core",
                "generator/broker CPU",
                "dropped",
                "peak RSS",
            ],
            rows,
        )
    latencyRows = []
    for scenario in scenarios:
        if not scenario.paced:
            continue
        for contender in contenders:
            group = groups[scenario.key, contender.key]
            p50 = [m.latencyPercentile(50) for m in group]
            p99 = [m.latencyPercentile(99) for m in group]
            latencyRows.append(
                [
                    scenario.label,
                    contender.label,
                    f"{statistics.median(p50):,.0f} us ({spread(p50)})",
                    f"{statistics.median(p99):,.0f} us ({spread(p99)})",
                    f"{statistics.median(m.brokerBusy for m in group):.0%}",
                    f"{statistics.median(m.peakMemory for m in group) / 2**20:.1f} MiB",
                ]
            )
    if latencyRows:
        print()
        printTable(
            ["scenario", "broker", "p50 (spread)", "p99 (spread)", "broker busy", "peak RSS"],
            latencyRows,
        )


def printComparisons(groups, scenarios, contenders):
    """
    Dallal's figures over each peer's, the targets, and the scenario and
    peer where Dallal's throughput falls furthest behind.
    """
    present = {contender.key for contender in contenders}
    comparisons = [(a, b) for a, b in COMPARISONS if a in present and b in present]
    if not comparisons:
        return
    print(
        "\nDallal over its peer: ratios of the medians (and the lowest and highest ratio within a run)\n"
    )
    rows = []
    furthestBehind = None
    for scenario in scenarios:
        for dallal, peer in comparisons:
            ours, theirs = groups[scenario.key, dallal], groups[scenario.key, peer]
            label = f"{CONTENDERS_BY_KEY[dallal].label} / {CONTENDERS_BY_KEY[peer].label}"
            if scenario.paced:
                rows.append(
                    [
                        scenario.label,
                        label,
                        "",
                        "",
                        "p50 "
                        + ratioOfMedians(
                            [m.latencyPercentile(50) for m in ours],
                            [m.latencyPercentile(50) for m in theirs],
                        )
                        + ", p99 "
                        + ratioOfMedians(
                            [m.latencyPercentile(99) for m in ours],
                            [m.latencyPercentile(99) for m in theirs],
                        ),
                    ]
                )
                continue
            rateRatio = statistics.median(m.rate for m in ours) / statistics.median(
                m.rate for m in theirs
            )
            if furthestBehind is None or rateRatio < furthestBehind[0]:
                furthestBehind = (rateRatio, scenario, dallal, peer)
            rows.append(
                [
                    scenario.label,
                    label,
                    ratioOfMedians([m.rate for m in ours], [m.rate for m in theirs]),
                    ratioOfMedians(
                        [m.perCpuSecond for m in ours], [m.perCpuSecond for m in theirs]
                    ),
                    "",
                ]
            )
    printTable(
        ["scenario", "Dallal / peer", "deliveries/s", "deliveries per CPU-s", "latency"], rows
    )
    print("\ntargets (goals, not tests)")
    for dallal, peer, targetScenarios in TARGETS:
        for key in targetScenarios:
            if (key, dallal) not in groups or (key, peer) not in groups:
                continue
            ours = statistics.median(m.rate for m in groups[key, dallal])
            theirs = statistics.median(m.rate for m in groups[key, peer])
            verdict = "met" if ours >= theirs else f"missed by {1 - ours / theirs:.0%}"
            print(
                f"  {SCENARIOS_BY_KEY[key].label}: {CONTENDERS_BY_KEY[dallal].label} "
                f"{ours:,.0f}/s >= {CONTENDERS_BY_KEY[peer].label} {theirs:,.0f}/s: {verdict}"
                f" ({ours / theirs:.2g}x)"
            )
    if furthestBehind:
        ratio, scenario, dallal, peer = furthestBehind
        print(
            f"\nfurthest behind: {scenario.label}, {CONTENDERS_BY_KEY[dallal].label} at "
            f"{ratio:.2g}x {CONTENDERS_BY_KEY[peer].label}'s deliveries/s"
        )


def reproduceCommand(arguments):
    return commandLine(
        "compare.py",
        arguments,
        "--latency-rate",
        str(arguments.latency_rate),
        "--latency-seconds",
        str(arguments.latency_seconds),
        "--scenarios",
        *arguments.scenarios,
        "--brokers",
        *arguments.brokers,
    )


def parseArguments(argv):
    parser = runOptions(
        __doc__.split("\n\n")[0],
        50_000,
        "deliveries per measurement with 64-byte payloads (a scenario with S "
        "subscribers publishes messages/S); 1 KiB payloads get a quarter, 64 KiB "
        "ones a 32nd",
        "across brokers",
        "messages published and not yet received by the slowest subscriber, "
        f"shared by the publishers and capped at {WINDOW_BYTES // 2**20} MiB of payload",
    )
    parser.add_argument(
        "--latency-rate",
        type=float,
        default=5000,
        help="messages a second in the latency scenario: below every "
        "broker's saturation (default: %(default)s)",
    )
    parser.add_argument(
        "--latency-seconds",
        type=float,
        default=1,
        help="how long the latency scenario publishes (default: %(default)s)",
    )
    parser.add_argument(
        "--scenarios",
        nargs="+",
        choices=list(SCENARIOS_BY_KEY),
        default=list(SCENARIOS_BY_KEY),
        help="a: 1 publisher to 1 subscriber; b: to 100 subscribers; c: 10 "
        "publishers on 10 topics to 10 subscribers of all of them; d1k, d64k: "
        "1 to 1 with 1 KiB and 64 KiB payloads; latency: 1 to 1 at "
        "--latency-rate (default: all)",
    )
    parser.add_argument(
        "--brokers",
        nargs="+",
        choices=list(CONTENDERS_BY_KEY),
        default=list(CONTENDERS_BY_KEY),
        help="which brokers and modes (default: all)",
    )
    return parser.parse_args(argv)


def main(argv=None):
    arguments = parseArguments(argv)
    scenarios = [SCENARIOS_BY_KEY[key] for key in arguments.scenarios]
    contenders = [CONTENDERS_BY_KEY[key] for key in arguments.brokers]
    servers = list(dict.fromkeys(contender.server for contender in contenders))
    installMissing([server for server in servers if issubclass(server, PeerServer)])
    print(describeSetup())
    print("brokers: " + "; ".join(server.version() for server in servers))
    print(
        f"{arguments.messages:,} deliveries per measurement (64 B), {arguments.window:,} "
        f"messages in flight at most; latency at {arguments.latency_rate:,.0f} messages/s "
        f"for {arguments.latency_seconds:g} s",
        flush=True,
    )
    groups = {}
    for run in range(1, arguments.runs + 1):
        for scenario in scenarios:
            for contender in contenders:
                measurement = measure(run, scenario, contender, arguments)
                printMeasurement(measurement)
                groups.setdefault((scenario.key, contender.key), []).append(measurement)
    printSummary(groups, scenarios, contenders, arguments.runs)
    printComparisons(groups, scenarios, contenders)
    print(f"\nreproduce: {reproduceCommand(arguments)}")


if __name__ == "__main__":
    try:
        main()
    except BenchError as error:
        sys.exit(f"compare: {error}")
