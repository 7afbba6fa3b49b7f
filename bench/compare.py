"""
Dallal against real brokers doing the same work in one run: Dallal's own
protocol and its MQTT listener against Mosquitto and amqtt (and, on
request, Redis pub/sub and NATS), deliveries per broker CPU-second first.

Each measurement starts a fresh broker on a free loopback port, connects
subscribers and publishers from two other processes over raw sockets
(bench/protocols.py) and publishes pre-encoded frames in one of two
styles: a firehose, each publisher writing all its frames in one
sendall with no window (a burst, a replayed backlog), or windowed,
keeping at most a window of messages that the subscribers have not yet
received.  The clock stops when every subscriber has had every
publisher's last message, or has heard nothing for --idle-seconds after
the publishers finished (the broker dropped the rest: they count as
lost).  Dallal's fire mode and MQTT QoS 0 are compared with Mosquitto
QoS 0; Dallal's all mode and MQTT QoS 1 with Mosquitto QoS 1.

    python3 bench/compare.py                   # scenarios a b c, both styles, ten brokers: about 5 minutes
    python3 bench/compare.py --scenarios a --styles firehose --brokers dallal-fire mosquitto-qos0
    python3 bench/compare.py --json report.json

bench/README.md describes the output; docs/PERFORMANCE.md has the figures.
"""

import collections
import json
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
import threading
import time
from dataclasses import dataclass
from selectors import EVENT_READ, DefaultSelector

from brokerproc import BROKER_START_TIMEOUT, BenchError, Broker, ServerProcess
from protocols import (
    MQTT_PACKET_IDS,
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
# The broker's CPU time is read to the nanosecond: this stands in for none.
LEAST_CPU = 1e-6


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


class DallalMqttServer(DallalServer):
    """
    The same broker with an MQTT listener (C{--mqtt}): the benchmark's
    clients connect to C{port}, which here is the MQTT listener's.
    """

    def __init__(self, directory):
        DallalServer.__init__(self, directory, mqtt=True)

    def awaitPorts(self):
        DallalServer.awaitPorts(self)
        self.port = self.mqttPort


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
    """
    Mosquitto with its default bound on what waits for a subscriber.
    """

    name = executable = package = "mosquitto"
    versionArguments = ["-h"]
    # Once a subscriber has this many messages waiting, Mosquitto 2.0 drops
    # further ones, QoS 0 ones included; 0 means no bound.
    maxQueuedMessages = 1000

    def startCommand(self, directory):
        configuration = os.path.join(directory, "mosquitto.conf")
        with open(configuration, "w") as file:
            file.write(
                f"listener {self._port} 127.0.0.1\n"
                "allow_anonymous true\n"
                "persistence false\n"
                f"max_queued_messages {self.maxQueuedMessages}\n"
                f"max_inflight_messages {MAX_INFLIGHT}\n"
                f"log_dest file {self.logPath}\n"
                # Stay root (the default drops to the mosquitto user, which
                # cannot write to the measurement's directory).
                "user root\n"
            )
        return [self.path(), "-c", configuration]


class UnboundedMosquittoServer(MosquittoServer):
    """
    Mosquitto with C{max_queued_messages 0}: it queues without bound and
    drops nothing.
    """

    maxQueuedMessages = 0


class AmqttServer(PeerServer):
    """
    amqtt, the asyncio MQTT 3.1.1 broker from PyPI (the C{bench} extra),
    run by this Python's C{amqtt} script with anonymous access and no other
    plugin: no packet logging, no C{$SYS} topics.
    """

    name = executable = "amqtt"
    # Not a Debian package: installMissing says how to install it.
    package = None
    versionArguments = ["--version"]

    @classmethod
    def path(cls):
        beside = os.path.join(os.path.dirname(sys.executable), cls.executable)
        return beside if os.path.exists(beside) else shutil.which(cls.executable)

    @classmethod
    def version(cls):
        # It prints its version number alone.
        return f"amqtt {super().version()}"

    def startCommand(self, directory):
        configuration = os.path.join(directory, "amqtt.yaml")
        with open(configuration, "w") as file:
            file.write(
                "listeners:\n"
                "  default:\n"
                "    type: tcp\n"
                f"    bind: 127.0.0.1:{self._port}\n"
                "plugins:\n"
                "  amqtt.plugins.authentication.AnonymousAuthPlugin:\n"
                "    allow_anonymous: true\n"
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

    @raise BenchError: a peer from PyPI (amqtt) is not installed.
    """
    for server in servers:
        if server.package is None and server.path() is None:
            raise BenchError(
                f"{server.name} is not installed: pip install -e '.[bench]' "
                "in the virtualenv that runs this benchmark"
            )
    missing = sorted(
        {server.package for server in servers if server.package and server.path() is None}
    )
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
    # What it promises: 0 at most once (compared with Mosquitto QoS 0), 1
    # at least once (with Mosquitto QoS 1).
    qos: int
    # The share of --messages it is given: amqtt delivers a few thousand
    # messages a second, and its figures per CPU-second need no more.
    messageShare: float = 1.0


CONTENDERS = [
    Contender("dallal-fire", "Dallal fire", DallalServer, DallalClient("fire"), 0),
    Contender("dallal-all", "Dallal all", DallalServer, DallalClient("all"), 1),
    Contender("dallal-mqtt-qos0", "Dallal MQTT QoS 0", DallalMqttServer, MqttClient(0), 0),
    Contender("dallal-mqtt-qos1", "Dallal MQTT QoS 1", DallalMqttServer, MqttClient(1), 1),
    Contender("mosquitto-qos0", "Mosquitto QoS 0", MosquittoServer, MqttClient(0), 0),
    Contender("mosquitto-qos1", "Mosquitto QoS 1", MosquittoServer, MqttClient(1), 1),
    Contender(
        "mosquitto-qos0-unbounded",
        "Mosquitto QoS 0 unbounded",
        UnboundedMosquittoServer,
        MqttClient(0),
        0,
    ),
    Contender(
        "mosquitto-qos1-unbounded",
        "Mosquitto QoS 1 unbounded",
        UnboundedMosquittoServer,
        MqttClient(1),
        1,
    ),
    Contender("amqtt-qos0", "amqtt QoS 0", AmqttServer, MqttClient(0), 0, messageShare=0.1),
    Contender("amqtt-qos1", "amqtt QoS 1", AmqttServer, MqttClient(1), 1, messageShare=0.1),
    Contender("redis", "Redis", RedisServer, RedisClient(), 0),
    Contender("nats", "NATS", NatsServer, NatsClient(), 0),
]
CONTENDERS_BY_KEY = {contender.key: contender for contender in CONTENDERS}
# Measured unless --brokers says otherwise: all but Redis and NATS.
DEFAULT_CONTENDERS = [key for key in CONTENDERS_BY_KEY if key not in ("redis", "nats")]
# The reference of each promise: Mosquitto at that QoS, in whichever of its
# two configurations (default queue bound, or none) delivered more per
# broker CPU-second in the scenario and style at hand, so that a ratio is
# never flattered by the configuration that suits Mosquitto worse.
MOSQUITTO = {
    0: ("mosquitto-qos0", "mosquitto-qos0-unbounded"),
    1: ("mosquitto-qos1", "mosquitto-qos1-unbounded"),
}


@dataclass(frozen=True)
class Target:
    """
    A goal of an issue, per broker CPU-second: C{contender} at least
    C{factor} times C{peer} (strictly more if C{strictly}) in C{scenario}.
    A C{peer} of C{None} is the Mosquitto reference at the contender's QoS.
    """

    issue: int
    contender: str
    peer: str | None
    scenario: str
    factor: float
    strictly: bool = False

    def describe(self):
        peer = "Mosquitto" if self.peer is None else CONTENDERS_BY_KEY[self.peer].label
        relation = ">" if self.strictly else ">="
        return (
            f"{CONTENDERS_BY_KEY[self.contender].label} {relation} {self.factor:g}x {peer}"
            f" (issue {self.issue})"
        )


TARGETS = [
    Target(25, "dallal-fire", None, "a", 1),
    Target(25, "dallal-fire", None, "b", 2),
    Target(25, "dallal-fire", None, "c", 1),
    Target(25, "dallal-all", None, "a", 1),
    Target(28, "dallal-mqtt-qos0", None, "a", 1),
    Target(28, "dallal-mqtt-qos0", None, "b", 2),
    *(
        Target(28, f"dallal-mqtt-qos{qos}", f"amqtt-qos{qos}", scenario, 10, strictly=True)
        for qos in (0, 1)
        for scenario in ("a", "b", "c")
    ),
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
DEFAULT_SCENARIOS = ["a", "b", "c"]

# How the publishers publish: every frame in one sendall, or under a window.
FIREHOSE, WINDOWED = "firehose", "windowed"
STYLES = (FIREHOSE, WINDOWED)
# The latency scenario's only style: a message every 1/--latency-rate s.
PACED = "paced"


def stylesOf(scenario, styles):
    return [PACED] if scenario.paced else list(styles)


# The load generator.
#
# In the windowed style flow control is end to end: the publishers keep at
# most a window of messages that the subscribers have not all received,
# whatever the broker acknowledges.  An acknowledgement only says a message
# was queued (and MQTT QoS 0 and NATS have none), so publishing at the rate
# of the broker's acknowledgements would fill its queues for the
# subscribers and measure overflow, not delivery.  The subscribers' process
# reports through a pipe how many messages the slowest subscriber has
# received, every quarter window.  The firehose style has no window: it
# measures what the broker does with a burst.

# A round of reads that brings less than TRICKLE_BYTES per read makes the
# generator pause, TRICKLE_PAUSE per connection read up to LONGEST_PAUSE,
# before it looks again, so that what the broker writes piles up into
# larger reads: the generator then costs a few system calls per many
# messages, not per message (Mosquitto writes each message to each
# subscriber on its own), and the kernel's socket buffers hold far more
# than a broker writes meanwhile.  A subscriber at QoS 1 or in mode all,
# with at most 100 messages unacknowledged, is held to 100 messages per
# pause: 200,000 a second alone, 10,000 a second each of 100, more than any
# broker here delivers to it.  The last messages may be read up to a pause
# late.
TRICKLE_BYTES = 16384
TRICKLE_PAUSE = 0.0005
LONGEST_PAUSE = 0.01


def pauseAfterTrickle(read, reads):
    """
    Pause if a round of C{reads} reads brought fewer than C{TRICKLE_BYTES}
    each, C{read} bytes in all.
    """
    if reads and read < TRICKLE_BYTES * reads:
        time.sleep(min(TRICKLE_PAUSE * reads, LONGEST_PAUSE))


def readInto(sock, stream, held=None):
    """
    Read what C{sock} holds into its stream and send back what the stream
    answers, or add it to C{held} to be sent later.

    @return: how many bytes were read.
    """
    data = sock.recv(RECEIVE_SIZE)
    if not data:
        raise BenchError("the broker closed a connection")
    replies = stream.feed(data)
    if replies:
        if held is None:
            sock.sendall(replies)
        else:
            held += replies
    return len(data)


def receive(selector, streams, timeout, held=None):
    """
    Read every socket ready within C{timeout}, pausing after a trickle.

    @param held: a bytearray per socket for its replies, if they must wait.
    """
    ready = selector.select(timeout)
    read = 0
    for key, _ in ready:
        read += readInto(
            key.fileobj, streams[key.fileobj], None if held is None else held[key.fileobj]
        )
    pauseAfterTrickle(read, len(ready))


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


def receiveUntil(selector, streams, done, waitingFor, deadline):
    while not done():
        if time.monotonic() > deadline:
            received = sum(stream.messages for stream in streams.values())
            raise BenchError(f"timed out waiting for {waitingFor}, {received:,} messages received")
        receive(selector, streams, 1.0)


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


def runSubscribers(
    client, port, scenario, style, progressStep, idleSeconds, timeout, pipe, progress
):
    """
    Subscribe one connection per subscriber to every topic, report
    C{"ready"} once the broker confirmed them all, then count messages
    until each connection has had every publisher's last one, or, once
    told C{"published"}, until none has arrived for C{idleSeconds}.  In the
    windowed style, send the slowest subscriber's count down C{progress}
    every C{progressStep}.  Report the messages, when the last arrived, the
    CPU time spent counting and the latencies of stamped messages.
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
        selector.register(pipe, EVENT_READ)
        reporter = (
            ProgressReporter(progressStep, scenario.subscribers, progress)
            if style == WINDOWED
            else None
        )
        waiting = set(streams.values())
        published = False
        lastArrival = time.monotonic()
        while waiting and not (published and time.monotonic() - lastArrival > idleSeconds):
            if time.monotonic() > deadline:
                received = sum(stream.messages for stream in streams.values())
                raise BenchError(f"timed out with {received:,} messages received")
            read = reads = 0
            for key, _ in selector.select(0.1):
                if key.fileobj is pipe:
                    pipe.recv()
                    published = True
                    # Idle from now at the earliest: the broker may not
                    # have written anything yet.
                    lastArrival = max(lastArrival, time.monotonic())
                    continue
                stream = streams[key.fileobj]
                before = stream.messages
                read += readInto(key.fileobj, stream)
                reads += 1
                if stream.messages != before:
                    lastArrival = time.monotonic()
                    if reporter:
                        reporter(before, stream.messages)
                    if stream.lastMarkers >= scenario.publishers:
                        waiting.discard(stream)
            # A paced scenario measures latency: no pause there.
            if not scenario.paced:
                pauseAfterTrickle(read, reads)
        received = sum(stream.messages for stream in streams.values())
        latencies = [latency for stream in streams.values() for latency in stream.latencies or ()]
        pipe.send(("done", received, lastArrival, time.process_time() - cpuBefore, latencies))
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


def firehoseFrames(client, topic, messages, size):
    """
    All of one publisher's frames in one buffer, the last one's payload
    marked as such.
    """
    return b"".join(
        client.publish(topic, payload(size), number) for number in range(messages - 1)
    ) + client.publish(topic, lastPayload(size), messages - 1)


def runPublishers(
    client, port, scenario, style, messages, window, rate, idleSeconds, timeout, pipe, progress
):
    """
    Connect one publisher per topic, report C{"ready"}, wait for C{"go"},
    then publish C{messages} messages on each in C{style}: in one sendall
    each, pipelined under C{window} (over all publishers), or at C{rate} a
    second each.  Report when publishing started, then keep reading the
    broker's answers until told to C{"stop"}; report the CPU time it took.
    """
    try:
        topics = scenario.topics
        size = scenario.payloadSize
        if style == FIREHOSE:
            frames = [firehoseFrames(client, topic, messages, size) for topic in topics]
        elif style == WINDOWED:
            frames = [
                PublishWrites(client, topic, messages, size, max(1, window // len(topics)))
                for topic in topics
            ]
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
        if style == FIREHOSE:
            publishFirehose(selector, streams, frames, deadline)
        elif style == WINDOWED:
            publishWindowed(selector, streams, frames, window, progress, idleSeconds, deadline)
        else:
            publishPaced(client, selector, streams, topics, messages, size, rate, deadline)
        pipe.send(("published", started))
        while not pipe.poll(0):
            receive(selector, streams, 0.05)
        pipe.recv()
        pipe.send(("stopped", time.process_time() - cpuBefore))
        for sock in streams:
            sock.close()
    except Exception as error:
        pipe.send(("error", f"publishers: {error!r}"))


def publishFirehose(selector, streams, frames, deadline):
    """
    Write each connection's C{frames} in one sendall, every connection at
    once (a thread each: sendall lets go of the GIL while it waits),
    reading the broker's answers meanwhile.  Replies (PONGs to Dallal's
    PINGs) wait until the connection's sendall has returned, so as not to
    land inside a frame.
    """
    failures = []

    def write(sock, data):
        try:
            sock.sendall(data)
        except OSError as error:
            failures.append(error)

    writers = [
        threading.Thread(target=write, args=(sock, data), daemon=True)
        for sock, data in zip(streams, frames)
    ]
    for writer in writers:
        writer.start()
    held = {sock: bytearray() for sock in streams}
    while any(writer.is_alive() for writer in writers):
        if time.monotonic() > deadline:
            raise BenchError("timed out writing the firehose")
        receive(selector, streams, 0.05, held)
    if failures:
        raise BenchError(f"a publisher's sendall failed: {failures[0]!r}")
    for sock, replies in held.items():
        if replies:
            sock.sendall(replies)


def publishWindowed(selector, streams, writes, window, progress, idleSeconds, deadline):
    """
    Send each connection's C{writes}, one write per connection in turn,
    while the messages sent and not yet received by the slowest subscriber
    stay within C{window}.  A window that has not moved for C{idleSeconds}
    is written off: the broker dropped what it held.
    """
    selector.register(progress, EVENT_READ)
    sockets = list(streams)
    nextWrites = [0] * len(sockets)
    sent = 0
    reported = 0  # messages the slowest subscriber has, as last reported
    writtenOff = 0  # messages given up as dropped
    moved = time.monotonic()
    while True:
        wrote = False
        for index, sock in enumerate(sockets):
            if nextWrites[index] == len(writes[index]):
                continue
            frames, data = writes[index][nextWrites[index]]
            if sent - (reported + writtenOff) + frames > window:
                continue
            sock.sendall(data)
            sent += frames
            nextWrites[index] += 1
            wrote = True
        if all(nextWrite == len(w) for nextWrite, w in zip(nextWrites, writes)):
            break
        if wrote:
            moved = time.monotonic()
            continue
        now = time.monotonic()
        if now > deadline:
            raise BenchError(f"timed out with {sent:,} messages sent, {reported:,} delivered")
        if now - moved > idleSeconds:
            writtenOff = sent - reported
            moved = now
        for key, _ in selector.select(0.1):
            if key.fileobj is progress:
                while progress.poll():
                    reported = progress.recv()
                moved = time.monotonic()
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
    style: str
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
        return self.deliveries / max(self.brokerCpu, LEAST_CPU)

    @property
    def lost(self):
        return self.expected - self.deliveries

    @property
    def brokerBusy(self):
        return self.brokerCpu / self.seconds

    @property
    def brokerWaiting(self):
        return self.brokerWait / self.seconds

    @property
    def generatorShare(self):
        """
        The generator's CPU over the broker's.
        """
        return self.generatorCpu / max(self.brokerCpu, LEAST_CPU)

    def latencyPercentile(self, percent):
        """
        The latency below which C{percent}% of the stamped messages arrived,
        in microseconds.
        """
        return statistics.quantiles(self.latencies, n=100)[percent - 1] / 1e3

    def asDict(self):
        return {
            "run": self.run,
            "scenario": self.scenario.key,
            "style": self.style,
            "broker": self.contender.key,
            "expected": self.expected,
            "delivered": self.deliveries,
            "lost": self.lost,
            "seconds": self.seconds,
            "broker_cpu_seconds": self.brokerCpu,
            "deliveries_per_broker_cpu_second": self.perCpuSecond,
            "deliveries_per_second": self.rate,
            "broker_waiting_seconds": self.brokerWait,
            "generator_cpu_seconds": self.generatorCpu,
            "broker_peak_rss_bytes": self.peakMemory,
        }


def messagesPerPublisher(scenario, contender, settings):
    if scenario.paced:
        return max(2, round(settings.latency_rate * settings.latency_seconds))
    deliveries = round(settings.messages * contender.messageShare) // scenario.messagesDivisor
    return max(1, deliveries // (scenario.subscribers * scenario.publishers))


def measure(run, scenario, style, contender, settings):
    """
    Run C{scenario} in C{style} against a fresh broker of C{contender}.
    """
    perPublisher = messagesPerPublisher(scenario, contender, settings)
    window = max(1, min(settings.window, WINDOW_BYTES // scenario.payloadSize))
    client = contender.client
    timeout = settings.timeout
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
                        style,
                        progressStep,
                        settings.idle_seconds,
                        timeout,
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
                        style,
                        perPublisher,
                        window,
                        settings.latency_rate,
                        settings.idle_seconds,
                        timeout,
                        publisherEnd,
                        progressReader,
                    ),
                )
            )
            processes[-1].start()
            awaitReport(publisherPipe, BROKER_START_TIMEOUT, "the publishers")
            cpuBefore = server.preciseCpuSeconds()
            waitBefore = server.secondsWaitingForCore()
            publisherPipe.send("go")
            _, started = awaitReport(publisherPipe, timeout, "the publishers")
            subscriberPipe.send("published")
            _, received, finished, subscriberCpu, latencies = awaitReport(
                subscriberPipe, timeout, "the subscribers"
            )
            brokerCpu = server.preciseCpuSeconds() - cpuBefore
            brokerWait = server.secondsWaitingForCore() - waitBefore
            peakMemory = server.peakMemory()
            publisherPipe.send("stop")
            _, publisherCpu = awaitReport(publisherPipe, timeout, "the publishers")
        except BenchError as error:
            raise BenchError(
                f"{contender.label}, scenario {scenario.label}, {style}: {error}\n"
                f"{server.lastWords()}"
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
        style,
        contender,
        perPublisher * scenario.publishers * scenario.subscribers,
        received,
        # Nothing arrived at all: the clock ran until the publishers ended.
        max(finished - started, 1e-3),
        brokerCpu,
        brokerWait,
        publisherCpu + subscriberCpu,
        peakMemory,
        latencies,
    )


# Comparing.


def median(group, attribute):
    return statistics.median(getattr(measurement, attribute) for measurement in group)


def mosquittoReference(groups, scenario, style, qos):
    """
    The key of the Mosquitto configuration at C{qos} that delivered the
    most per broker CPU-second in C{scenario} and C{style}, or C{None} if
    none was measured.

    @param groups: measurements by (scenario key, style, contender key).
    """
    measured = [key for key in MOSQUITTO[qos] if (scenario, style, key) in groups]
    return max(
        measured,
        key=lambda key: median(groups[scenario, style, key], "perCpuSecond"),
        default=None,
    )


@dataclass(frozen=True)
class Ratio:
    """
    A contender's medians over its reference's in one scenario and style,
    and the lowest and highest ratio of the two within a run (each run
    measures both close together, so the machine's load hits them alike).
    """

    scenario: str
    style: str
    contender: str
    peer: str
    perCpuSecond: float
    perCpuSecondRuns: tuple
    perSecond: float
    perSecondRuns: tuple

    def asDict(self):
        return {
            "scenario": self.scenario,
            "style": self.style,
            "broker": self.contender,
            "against": self.peer,
            "deliveries_per_broker_cpu_second": self.perCpuSecond,
            "deliveries_per_second": self.perSecond,
        }


def ratioOf(groups, scenario, style, contender, peer):
    ours, theirs = groups[scenario, style, contender], groups[scenario, style, peer]

    def ratios(attribute):
        paired = [
            getattr(a, attribute) / getattr(b, attribute)
            for a, b in zip(ours, theirs)
            if getattr(b, attribute)
        ]
        return (
            median(ours, attribute) / median(theirs, attribute),
            (min(paired), max(paired)) if paired else (math.nan, math.nan),
        )

    perCpuSecond, perCpuSecondRuns = ratios("perCpuSecond")
    perSecond, perSecondRuns = ratios("rate")
    return Ratio(
        scenario, style, contender, peer, perCpuSecond, perCpuSecondRuns, perSecond, perSecondRuns
    )


def ratiosToMosquitto(groups, scenarios, styles, contenders):
    """
    Every contender but the reference against the Mosquitto reference of
    its QoS (L{mosquittoReference}), per scenario and style measured.
    """
    ratios = []
    for scenario in scenarios:
        for style in styles:
            for contender in contenders:
                if (scenario, style, contender.key) not in groups:
                    continue
                peer = mosquittoReference(groups, scenario, style, contender.qos)
                if peer is not None and peer != contender.key:
                    ratios.append(ratioOf(groups, scenario, style, contender.key, peer))
    return ratios


@dataclass(frozen=True)
class Verdict:
    """
    A target judged in one style: the medians of deliveries per broker
    CPU-second of the contender and of the peer it was compared with.
    """

    target: Target
    style: str
    peer: str
    ours: float
    theirs: float

    @property
    def ratio(self):
        return self.ours / self.theirs

    @property
    def met(self):
        if self.target.strictly:
            return self.ratio > self.target.factor
        return self.ratio >= self.target.factor

    def describe(self):
        return (
            f"{self.target.scenario} {self.style}: {self.target.describe()}:"
            f" {self.ours:,.0f} against {CONTENDERS_BY_KEY[self.peer].label}'s"
            f" {self.theirs:,.0f} per CPU-s = {self.ratio:.3g}x:"
            f" {'met' if self.met else 'not met'}"
        )

    def asDict(self):
        return {
            "target": self.target.describe(),
            "scenario": self.target.scenario,
            "style": self.style,
            "broker": self.target.contender,
            "against": self.peer,
            "factor": self.target.factor,
            "ratio": self.ratio,
            "met": self.met,
        }


def judgeTargets(groups, styles, targets=TARGETS):
    """
    The L{Verdict} of every target whose contender and peer were measured,
    in each style.
    """
    verdicts = []
    for target in targets:
        qos = CONTENDERS_BY_KEY[target.contender].qos
        for style in styles:
            if (target.scenario, style, target.contender) not in groups:
                continue
            peer = target.peer or mosquittoReference(groups, target.scenario, style, qos)
            if peer is None or (target.scenario, style, peer) not in groups:
                continue
            verdicts.append(
                Verdict(
                    target,
                    style,
                    peer,
                    median(groups[target.scenario, style, target.contender], "perCpuSecond"),
                    median(groups[target.scenario, style, peer], "perCpuSecond"),
                )
            )
    return verdicts


# Reporting.


def printMeasurement(measurement):
    m = measurement
    line = (
        f"run {m.run}  {m.scenario.label:<17} {m.style:<8} {m.contender.label:<25}"
        f" {m.perCpuSecond:>9,.0f}/CPU-s {m.rate:>9,.0f}/s"
        f"  {m.deliveries:>7,} of {m.expected:,} ({m.lost:,} lost) in {m.seconds:5.2f} s"
        f"  broker CPU {m.brokerCpu:5.2f} s busy {m.brokerBusy:4.0%}"
        f" waiting {m.brokerWaiting:3.0%}  generator CPU {m.generatorCpu:5.2f} s"
        f"  peak RSS {m.peakMemory / 2**20:5.1f} MiB"
    )
    if m.latencies:
        line += (
            f"  latency p50 {m.latencyPercentile(50):,.0f} us p99 {m.latencyPercentile(99):,.0f} us"
        )
    print(line, flush=True)


def printTable(header, rows):
    print("| " + " | ".join(header) + " |")
    print("|" + " --- |" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")


def summaryRows(groups):
    """
    Per scenario, style and broker measured: the medians of the runs.
    """
    rows = []
    for (scenario, style, contender), group in groups.items():
        if style == PACED:
            continue
        rows.append(
            {
                "scenario": scenario,
                "style": style,
                "broker": contender,
                "runs": len(group),
                "deliveries_per_broker_cpu_second": median(group, "perCpuSecond"),
                "deliveries_per_second": median(group, "rate"),
                "expected": group[0].expected,
                "lost": median(group, "lost"),
                "broker_busy": median(group, "brokerBusy"),
                "broker_waiting_for_a_core": median(group, "brokerWaiting"),
                "generator_cpu_over_broker_cpu": median(group, "generatorShare"),
                "broker_peak_rss_bytes": median(group, "peakMemory"),
            }
        )
    return rows


def printSummary(groups, runs):
    print(f"\nmedians of {runs} run(s); spread = the lowest and highest run around the median\n")
    rows = []
    for row in summaryRows(groups):
        group = groups[row["scenario"], row["style"], row["broker"]]
        rows.append(
            [
                SCENARIOS_BY_KEY[row["scenario"]].label,
                row["style"],
                CONTENDERS_BY_KEY[row["broker"]].label,
                f"{row['deliveries_per_broker_cpu_second']:,.0f}"
                f" ({spread([m.perCpuSecond for m in group])})",
                f"{row['deliveries_per_second']:,.0f} ({spread([m.rate for m in group])})",
                f"{row['lost']:,.0f} of {row['expected']:,}",
                f"{row['broker_busy']:.0%}",
                f"{row['broker_waiting_for_a_core']:.0%}",
                f"{row['generator_cpu_over_broker_cpu']:.0%}",
                f"{row['broker_peak_rss_bytes'] / 2**20:.1f} MiB",
            ]
        )
    if rows:
        printTable(
            [
                "scenario",
                "style",
                "broker",
                "deliveries per broker CPU-s (spread)",
                "deliveries/s (spread)",
                "lost",
                "broker busy",
                "waiting for a core",
                "generator/broker CPU",
                "peak RSS",
            ],
            rows,
        )
    latencyRows = []
    for (scenario, style, contender), group in groups.items():
        if style != PACED:
            continue
        p50 = [m.latencyPercentile(50) for m in group]
        p99 = [m.latencyPercentile(99) for m in group]
        latencyRows.append(
            [
                SCENARIOS_BY_KEY[scenario].label,
                CONTENDERS_BY_KEY[contender].label,
                f"{statistics.median(p50):,.0f} us ({spread(p50)})",
                f"{statistics.median(p99):,.0f} us ({spread(p99)})",
                f"{median(group, 'brokerBusy'):.0%}",
                f"{median(group, 'peakMemory') / 2**20:.1f} MiB",
            ]
        )
    if latencyRows:
        print()
        printTable(
            ["scenario", "broker", "p50 (spread)", "p99 (spread)", "broker busy", "peak RSS"],
            latencyRows,
        )


def formatRatio(value, runs):
    return f"{value:.2g}x ({runs[0]:.2g}-{runs[1]:.2g})"


def printComparisons(ratios, verdicts):
    """
    Each broker over the Mosquitto reference of its QoS, and the targets.
    """
    if ratios:
        print(
            "\nover Mosquitto at the same QoS, in whichever of its two configurations"
            " delivered more per CPU-s: ratio of the medians (lowest-highest within a run)\n"
        )
        printTable(
            ["scenario", "style", "broker", "against", "per broker CPU-s", "per second"],
            [
                [
                    SCENARIOS_BY_KEY[ratio.scenario].label,
                    ratio.style,
                    CONTENDERS_BY_KEY[ratio.contender].label,
                    CONTENDERS_BY_KEY[ratio.peer].label,
                    formatRatio(ratio.perCpuSecond, ratio.perCpuSecondRuns),
                    formatRatio(ratio.perSecond, ratio.perSecondRuns),
                ]
                for ratio in ratios
            ],
        )
    if verdicts:
        print("\ntargets, per broker CPU-second (goals, not tests)")
        for verdict in verdicts:
            print("  " + verdict.describe())


def reproduceCommand(arguments):
    return commandLine(
        "compare.py",
        arguments,
        "--idle-seconds",
        str(arguments.idle_seconds),
        "--latency-rate",
        str(arguments.latency_rate),
        "--latency-seconds",
        str(arguments.latency_seconds),
        "--scenarios",
        *arguments.scenarios,
        "--styles",
        *arguments.styles,
        "--brokers",
        *arguments.brokers,
    )


def parseArguments(argv):
    parser = runOptions(
        __doc__.split("\n\n")[0],
        30_000,
        "deliveries per measurement with 64-byte payloads (a scenario with S "
        "subscribers publishes messages/S); 1 KiB payloads get a quarter, 64 KiB "
        "ones a 32nd, amqtt a tenth",
        "across brokers",
        "windowed style: messages published and not yet received by the slowest subscriber, "
        f"shared by the publishers and capped at {WINDOW_BYTES // 2**20} MiB of payload",
    )
    parser.add_argument(
        "--styles",
        nargs="+",
        choices=STYLES,
        default=list(STYLES),
        help="firehose: each publisher writes all its frames in one sendall; windowed: "
        "under --window (default: both)",
    )
    parser.add_argument(
        "--idle-seconds",
        type=float,
        default=1.0,
        help="once the publishers are done, a run ends when the subscribers have heard "
        "nothing for this long (the broker dropped the rest); a window that has not "
        "moved for this long is written off (default: %(default)s)",
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
        default=DEFAULT_SCENARIOS,
        help="a: 1 publisher to 1 subscriber; b: to 100 subscribers; c: 10 "
        "publishers on 10 topics to 10 subscribers of all of them; d1k, d64k: "
        "1 to 1 with 1 KiB and 64 KiB payloads; latency: 1 to 1 at "
        "--latency-rate (default: a b c)",
    )
    parser.add_argument(
        "--brokers",
        nargs="+",
        choices=list(CONTENDERS_BY_KEY),
        default=DEFAULT_CONTENDERS,
        help="which brokers and modes (default: all but redis and nats)",
    )
    parser.add_argument(
        "--json",
        metavar="FILE",
        help="also write the measurements, medians, ratios and targets to FILE as JSON",
    )
    return parser.parse_args(argv)


def loadAverage():
    return [round(value, 2) for value in os.getloadavg()]


def main(argv=None):
    arguments = parseArguments(argv)
    scenarios = [SCENARIOS_BY_KEY[key] for key in arguments.scenarios]
    contenders = [CONTENDERS_BY_KEY[key] for key in arguments.brokers]
    servers = list(dict.fromkeys(contender.server for contender in contenders))
    installMissing([server for server in servers if issubclass(server, PeerServer)])
    loadBefore = loadAverage()
    setup = describeSetup()
    versions = "; ".join(dict.fromkeys(server.version() for server in servers))
    print(setup)
    print(f"brokers: {versions}")
    print(
        f"{arguments.messages:,} deliveries per measurement (64 B; amqtt a tenth), "
        f"{arguments.window:,} messages in flight at most when windowed; latency at "
        f"{arguments.latency_rate:,.0f} messages/s for {arguments.latency_seconds:g} s",
        flush=True,
    )
    for scenario in scenarios:
        for contender in contenders:
            if (
                FIREHOSE in arguments.styles
                and isinstance(contender.client, MqttClient)
                and contender.client.qos
                and messagesPerPublisher(scenario, contender, arguments) > MQTT_PACKET_IDS
            ):
                print(
                    f"note: {contender.label}'s firehose in {scenario.label} reuses packet ids"
                    f" (more than {MQTT_PACKET_IDS:,} messages per publisher) before their"
                    " PUBACKs have come back"
                )
    groups = {}
    for run in range(1, arguments.runs + 1):
        for scenario in scenarios:
            for style in stylesOf(scenario, arguments.styles):
                for contender in contenders:
                    measurement = measure(run, scenario, style, contender, arguments)
                    printMeasurement(measurement)
                    groups.setdefault((scenario.key, style, contender.key), []).append(measurement)
    ratios = ratiosToMosquitto(groups, arguments.scenarios, arguments.styles, contenders)
    verdicts = judgeTargets(groups, arguments.styles)
    printSummary(groups, arguments.runs)
    printComparisons(ratios, verdicts)
    loadAfter = loadAverage()
    command = reproduceCommand(arguments)
    print(f"\nload average {loadBefore} at the start, {loadAfter} at the end")
    print(f"reproduce: {command}")
    if arguments.json:
        with open(arguments.json, "w") as file:
            json.dump(
                {
                    "command": command,
                    "setup": setup,
                    "brokers": versions,
                    "load_average": {"start": loadBefore, "end": loadAfter},
                    "measurements": [m.asDict() for group in groups.values() for m in group],
                    "medians": summaryRows(groups),
                    "ratios_to_mosquitto": [ratio.asDict() for ratio in ratios],
                    "targets": [verdict.asDict() for verdict in verdicts],
                },
                file,
                indent=2,
            )


if __name__ == "__main__":
    try:
        main()
    except BenchError as error:
        sys.exit(f"compare: {error}")
