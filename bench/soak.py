"""
A soak: the real broker under a bounded run of mixed traffic from many
clients with churn, over TCP and UDP, with slow, stopped and killed clients
among them.  At the end it checks three things:

 1. no message the broker PubAck'd is lost, in C{all} mode, for a
    subscriber that stayed connected: each such subscriber received every
    PubAck'd message its filter matches, except -- for the slow and the
    stopped ones -- messages the broker dropped for its full queue, which
    the subscriber saw as gaps in its sequence numbers and the broker
    counted;
 2. the broker's peak resident memory (VmHWM) stays under a bound computed
    from the run's parameters (L{memoryBound} says how);
 3. the broker's log has no traceback, no unhandled error, nothing logged
    at level error or critical, and the broker stops cleanly on SIGTERM.

It starts a fresh broker (C{twistd -n dallal --udp 0}, on free loopback
ports, logging to a file), then load processes, each a Twisted reactor
running L{dallal.client} clients (this script again, with C{--worker}):

 - publishers (TCP and UDP), each at its share of C{--rate}, numbering its
   messages, over a window of unacked publishes; each lives a while, then
   closes and another takes its place;
 - checked C{all} subscribers, one topic each (TCP and UDP), connected for
   the whole run;
 - slow C{all} subscribers on every topic, whose handler takes longer per
   message than messages arrive;
 - C{latest} and C{fire} subscribers;
 - churners: connect, maybe subscribe in some mode, stay a few seconds,
   leave (close, BYE, or abort the connection), again and again;
 - subscribers that never read (raw TCP, the reading side paused), which
   the broker drops for missed pings, and which come back;
 - in a process of their own, C{all} subscribers that the script stops
   with SIGSTOP for 1.5 ping intervals at a time (long enough to fill
   queues, too short to be dropped);
 - in another, clients that the script kills with SIGKILL every so often
   and starts again.

Meanwhile it samples the broker's memory (C{/proc}), CPU, counters and the
machine's load average.  Then it stops the traffic, lets deliveries settle,
collects what every client saw, stops the broker with SIGTERM and checks.

    python3 bench/soak.py                       # 1,000 clients for 10 minutes
    python3 bench/soak.py --clients 100 --minutes 0.5

It prints the figures, then the command that reproduces the run, and exits
non-zero if a check failed.  tests/test_soak_short.py runs it with 100
clients for 20 seconds; docs/SOAK.md has the figures of the long run.
"""

import argparse
import glob
import json
import os
import random
import re
import shlex
import signal
import socket
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

from brokerproc import BenchError, Broker, ControlConnection, raiseDescriptorLimit  # noqa: E402
from helpers import OutputCollector, SlowHandler, countersAddUp, loggedEvents  # noqa: E402
from twisted.internet import stdio  # noqa: E402
from twisted.internet.defer import (  # noqa: E402
    Deferred,
    DeferredList,
    ensureDeferred,
    gatherResults,
)
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol  # noqa: E402
from twisted.internet.protocol import Protocol  # noqa: E402
from twisted.internet.task import LoopingCall, deferLater  # noqa: E402
from twisted.logger import LogLevel, formatEvent, globalLogBeginner  # noqa: E402
from twisted.protocols.basic import LineReceiver  # noqa: E402

from dallal.client import connect, connectUDP  # noqa: E402

TOPICS = 20
PREFIX = "soak"
IDLE_TOPICS = 50
PAYLOAD_SIZES = (16, 1024)
PUBLISH_WINDOW = 20
# How long a client waits for the broker before counting a failure.
REQUEST_TIMEOUT = 30.0
# tcpi_state of a connection in Linux's struct tcp_info.
TCP_ESTABLISHED = 1
# What the broker logs when something went wrong that nobody handled.
LOG_PROBLEMS = (b"Traceback", b"Unhandled", b"#error]", b"#critical]")


def topicOf(seq):
    """
    The topic of a publisher's message number C{seq}: every publisher
    cycles through the same C{TOPICS} topics.
    """
    return f"{PREFIX}/t{seq % TOPICS}"


def matches(topicFilter, seq):
    return topicFilter == f"{PREFIX}/#" or topicFilter == topicOf(seq)


@dataclass
class Settings:
    """
    What a run does; C{Settings()} is the long run of docs/SOAK.md.
    """

    clients: int = 1000
    seconds: float = 600.0
    # Publishes per second, all publishers together.
    rate: float = 50.0
    # The broker's --ping-interval: the stopped subscribers stop for 1.5 of
    # them, the subscribers that never read are dropped after 4 or 5.
    pingInterval: float = 5.0
    workers: int = 4
    udpShare: float = 0.2
    seed: int = 1373

    def plan(self):
        """
        How many clients of each kind: the kind -> count mapping.
        """
        clients = self.clients
        share = lambda fraction: max(1, round(clients * fraction))  # noqa: E731
        plan = {
            "publisher": share(0.04),
            "checked": share(0.10),
            "slow": share(0.01),
            "stopped": share(0.01),
            "neverReads": share(0.005),
            "killed": share(0.05),
            "steady": share(0.15),
        }
        plan["churner"] = max(1, clients - sum(plan.values()))
        return plan

    def command(self):
        """
        The command line that reproduces this run.
        """
        return shlex.join(
            [
                "python3", "bench/soak.py",
                "--clients", str(self.clients),
                "--minutes", f"{self.seconds / 60:g}",
                "--rate", f"{self.rate:g}",
                "--ping-interval", f"{self.pingInterval:g}",
                "--workers", str(self.workers),
                "--udp-share", f"{self.udpShare:g}",
                "--seed", str(self.seed),
            ]
        )  # fmt: skip


# The load processes.


def runWorker(job):
    """
    The body of a load process: run the clients of its C{job}, and answer
    the driver's commands on standard input (C{go}, C{stop}, C{report})
    with one JSON line each on standard output.
    """
    from twisted.internet import reactor

    worker = Worker(reactor, job)
    done = ensureDeferred(worker.run())
    done.addErrback(worker.crashed)
    done.addBoth(lambda _: reactor.stop())
    reactor.run()


class Commands(LineReceiver):
    """
    The load process's standard input and output: the driver's commands in,
    its answers and errors out.

    @ivar closed: fires once standard output is closed, all written.
    """

    delimiter = b"\n"

    def __init__(self, worker):
        self.worker = worker
        self.closed = Deferred()

    def lineReceived(self, line):
        self.worker.command(line.decode().strip()).callback(None)

    def connectionLost(self, reason):
        self.closed.callback(None)


class Worker:
    """
    One load process: its clients, what they saw, and the conversation with
    the driver.
    """

    def __init__(self, reactor, job):
        self.reactor = reactor
        self.job = job
        self.rng = random.Random(job["seed"])
        self.running = True
        self.publishers = []
        self.checked = []
        self.counts = Counter()
        self.problems = Counter()
        self.logLevels = Counter()
        self.tasks = []
        self.clients = set()
        self._commands = {}
        # Written through the reactor: StandardIO makes standard output
        # non-blocking, and a long report would not fit a pipe at once.
        self._stdio = Commands(self)
        stdio.StandardIO(self._stdio)
        globalLogBeginner.beginLoggingTo([self._observe], redirectStandardIO=False)

    def _observe(self, event):
        level = event.get("log_level")
        self.logLevels[level.name if level else "?"] += 1
        if level in (LogLevel.error, LogLevel.critical) or event.get("log_failure"):
            failure = event.get("log_failure")
            text = formatEvent(event)
            if failure is not None:
                text += "\n" + failure.getTraceback()
            self._write(text)

    def _write(self, text):
        self._stdio.transport.write(text.encode("utf-8", "replace") + b"\n")

    def say(self, **message):
        self._write(json.dumps(message))

    def crashed(self, failure):
        self._write(failure.getTraceback())
        return self.closeOutput()

    def closeOutput(self):
        """
        @return: a Deferred that fires once all that was written is out.
        """
        self._stdio.transport.loseConnection()
        return self._stdio.closed

    def command(self, name):
        """
        @return: a Deferred that fires when the driver says C{name}.
        """
        if name not in self._commands:
            self._commands[name] = Deferred()
        return self._commands[name]

    def problem(self, what, error=None):
        """
        Count something that went wrong for a client.
        """
        key = what if error is None else f"{what}: {type(error).__name__}: {error}"[:200]
        self.problems[key] += 1

    async def run(self):
        job = self.job
        await self._startSubscribers()
        if job["killed"]:
            self._startKilled(job["killed"])
            self.say(ready=True)
            # Runs until the driver kills it.
            await Deferred()
        self.say(ready=True)
        await self.command("go")
        for number in job["publisher"]:
            self.spawn(self._publishForever(number))
        for number in job["churner"]:
            self.spawn(self._churn(number))
        for number in job["neverReads"]:
            self.spawn(self._neverRead(number))
        await self.command("stop")
        self.running = False
        await DeferredList(self.tasks)
        self.say(stopped=True)
        await self.command("report")
        self.say(report=self.report())
        for client in list(self.clients):
            client.close()
        await self.closeOutput()

    def spawn(self, coroutine):
        task = ensureDeferred(coroutine)
        task.addErrback(lambda failure: self.problem("task crashed", failure.value))
        self.tasks.append(task)

    async def sleep(self, seconds):
        await deferLater(self.reactor, seconds)

    # Connecting

    def transportFor(self, number):
        """
        TCP or UDP: client number C{number} (of its kind, across the load
        processes) goes over UDP at evenly spread numbers, C{--udp-share}
        of them.
        """
        share = self.job["udpShare"]
        return "udp" if int((number + 1) * share) > int(number * share) else "tcp"

    async def connect(self, transport):
        if transport == "udp":
            attempt = connectUDP(self.reactor, "127.0.0.1", self.job["udpPort"])
        else:
            attempt = connect(self.reactor, f"tcp:127.0.0.1:{self.job['port']}")
        client = await attempt.addTimeout(REQUEST_TIMEOUT, self.reactor)
        self.clients.add(client)
        self.counts[f"connected {transport}"] += 1
        return client

    def forget(self, client):
        self.clients.discard(client)

    # Subscribers that stay

    async def _startSubscribers(self):
        starting = [
            self._subscribeChecked(kind, number)
            for kind in ("checked", "slow", "stopped")
            for number in self.job[kind]
        ]
        starting += [self._subscribeSteady(number) for number in self.job["steady"]]
        await gatherResults([ensureDeferred(coroutine) for coroutine in starting])

    async def _subscribeChecked(self, kind, number):
        name = f"{kind}{number}"
        transport = self.transportFor(number)
        client = await self.connect(transport)
        if kind == "slow":
            topicFilter = f"{PREFIX}/#"
            # Slower than messages arrive on every topic together (by a
            # sixth): the broker's window and queue for it fill up.
            delay = 1.2 / self.job["rate"]
        else:
            topicFilter = topicOf(number)
            delay = None
        record = CheckedRecord(name, kind, transport, topicFilter)
        self.checked.append(record)
        slowHandler = SlowHandler(delay, self.reactor) if delay else None

        def received(message):
            record.receive(message.payload)
            if slowHandler is not None:
                return slowHandler(message)

        def gap(topic, missed):
            record.gaps += missed

        await client.subscribe([topicFilter], received, mode="all", onGap=gap).addTimeout(
            REQUEST_TIMEOUT, self.reactor
        )
        client.whenDisconnected().addCallback(lambda _: record.lost(self.running))

    async def _subscribeSteady(self, number):
        transport = self.transportFor(number)
        client = await self.connect(transport)
        mode = ("latest", "fire")[number % 2]
        topicFilter = f"{PREFIX}/#" if number % 10 == 0 else topicOf(number)

        def received(message):
            self.counts[f"received {mode}"] += 1

        await client.subscribe([topicFilter], received, mode=mode).addTimeout(
            REQUEST_TIMEOUT, self.reactor
        )

    # Publishers

    async def _publishForever(self, number):
        incarnation = 0
        runFor = (self.job["seconds"] / 10, self.job["seconds"] / 3)
        while self.running:
            incarnation += 1
            name = f"p{number}i{incarnation}"
            publisher = PublisherRecord(name, self.transportFor(number + incarnation))
            self.publishers.append(publisher)
            try:
                await self._publish(publisher, self.rng.uniform(*runFor))
            except Exception as error:
                self.problem(f"publisher {publisher.transport}", error)
                await self.sleep(1.0)

    async def _publish(self, record, lifetime):
        """
        Publish at this publisher's rate for C{lifetime} seconds (or until
        the run stops), then wait for the last PubAcks and close.
        """

        client = await self.connect(record.transport)
        outstanding = []
        payloadRng = random.Random(record.name)

        def publishOne():
            if len(outstanding) >= PUBLISH_WINDOW:
                self.counts["publish window full"] += 1
                return
            record.sent += 1
            seq = record.sent
            head = b"%s %d " % (record.name.encode(), seq)
            size = max(len(head), payloadRng.randint(*PAYLOAD_SIZES))
            publish = client.publish(topicOf(seq), head + b"x" * (size - len(head)))
            outstanding.append(publish)
            publish.addTimeout(REQUEST_TIMEOUT, self.reactor)
            publish.addCallbacks(
                lambda _: record.acked.append(seq),
                lambda failure: self.problem(f"publish {record.transport}", failure.value),
            )
            publish.addBoth(lambda _: outstanding.remove(publish))

        loop = LoopingCall(publishOne)
        loop.clock = self.reactor
        ratePerPublisher = self.job["rate"] / self.job["publishers"]
        loop.start(1.0 / ratePerPublisher).addErrback(
            lambda failure: self.problem("publish loop", failure.value)
        )
        ends = self.reactor.seconds() + lifetime
        while self.running and self.reactor.seconds() < ends and client.connected:
            await self.sleep(0.5)
        loop.stop()
        await DeferredList(list(outstanding))
        await self._leave(client, "close")

    # Churn

    async def _churn(self, number):
        lifetimes = (1.0, max(2.0, self.job["seconds"] / 10))
        cycle = 0
        while self.running:
            cycle += 1
            transport = self.transportFor(number + cycle)
            try:
                client = await self.connect(transport)
                roll = self.rng.random()
                if roll < 0.5:
                    mode = self.rng.choice(["latest", "all", "fire"])
                    topicFilter = topicOf(self.rng.randrange(TOPICS))
                elif roll < 0.9:
                    mode, topicFilter = "latest", f"{PREFIX}/idle/{number % IDLE_TOPICS}"
                else:
                    mode = topicFilter = None
                if topicFilter is not None:
                    await client.subscribe(
                        [topicFilter],
                        lambda message: self.counts.update(["received by churners"]),
                        mode=mode,
                    ).addTimeout(REQUEST_TIMEOUT, self.reactor)
                ends = self.reactor.seconds() + self.rng.uniform(*lifetimes)
                while self.running and self.reactor.seconds() < ends and client.connected:
                    await self.sleep(0.5)
                leave = self.rng.choices(["close", "bye", "abort"], [7, 1, 2])[0]
                await self._leave(client, leave)
            except Exception as error:
                self.problem(f"churner {transport}", error)
                await self.sleep(1.0)

    async def _leave(self, client, how):
        """
        Leave the broker: C{close} the connection, say C{bye}, or C{abort}
        the connection (an RST, as a crashed client's kernel sends; UDP has
        no such thing, so a UDP client says BYE).
        """
        self.forget(client)
        if not client.connected:
            self.counts["left already disconnected"] += 1
            return
        isTcp = hasattr(client, "bye")
        if how == "abort" and isTcp:
            client.transport.abortConnection()
            closing = client.whenDisconnected()
        elif how == "bye" and isTcp:
            closing = client.bye()
        else:
            closing = client.close()
        self.counts[f"left by {how}"] += 1
        await closing.addTimeout(REQUEST_TIMEOUT, self.reactor)

    # Subscribers that never read

    async def _neverRead(self, number):
        class NeverReads(Protocol):
            def connectionMade(self):
                self.transport.write(b"SUB n %s/# mode=all\r\n" % PREFIX.encode())
                # Stop reading: the broker's writes fill the socket buffers.
                self.transport.pauseProducing()

        endpoint = TCP4ClientEndpoint(self.reactor, "127.0.0.1", self.job["port"])
        while self.running:
            try:
                protocol = await connectProtocol(endpoint, NeverReads()).addTimeout(
                    REQUEST_TIMEOUT, self.reactor
                )
            except Exception as error:
                self.problem("never-reader", error)
                await self.sleep(1.0)
                continue
            self.counts["never-reader connections"] += 1
            while self.running and _established(protocol.transport):
                await self.sleep(0.5)
            if self.running:
                self.counts["never-readers dropped by the broker"] += 1
            protocol.transport.abortConnection()

    # Clients that get killed

    def _startKilled(self, numbers):
        """
        Clients of a process the driver kills: they subscribe and publish
        without keeping records, until they die.
        """
        for number in numbers:
            self.spawn(self._liveUntilKilled(number))

    async def _liveUntilKilled(self, number):
        client = await self.connect(self.transportFor(number))
        await client.subscribe(
            [topicOf(number)], lambda message: None, mode=("all", "latest", "fire")[number % 3]
        )
        name = f"killed{number}pid{os.getpid()}"
        seq = 0
        while True:
            await self.sleep(self.rng.uniform(0.5, 2.0))
            seq += 1
            # Numbered like the tracked publishers' messages, whose checks
            # skip them: nobody keeps their PubAcks.
            payload = b"%s %d x" % (name.encode(), seq)
            client.publish(topicOf(seq), payload).addErrback(lambda _: None)

    def report(self):
        return {
            "publishers": [asdict(record) for record in self.publishers],
            "checked": [record.summary() for record in self.checked],
            "counts": dict(self.counts),
            "problems": dict(self.problems),
            "logLevels": dict(self.logLevels),
        }


def _established(transport):
    """
    Whether a TCP connection is still established, asked of the kernel
    (Linux's TCP_INFO): a client that does not read cannot see the broker
    close it.
    """
    handle = transport.getHandle()
    return handle.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] == TCP_ESTABLISHED


@dataclass
class PublisherRecord:
    name: str
    transport: str
    sent: int = 0
    acked: list = field(default_factory=list)


class CheckedRecord:
    """
    What one checked subscriber received: per publisher, the message
    numbers, in the order they arrived.
    """

    def __init__(self, name, kind, transport, topicFilter):
        self.name = name
        self.kind = kind
        self.transport = transport
        self.topicFilter = topicFilter
        self.received = defaultdict(list)
        self.gaps = 0
        self.duplicates = 0
        self.corrupt = 0
        self.disconnected = False
        self._seen = set()

    def receive(self, payload):
        try:
            publisher, seq, filler = payload.split(b" ", 2)
            key = (publisher, int(seq))
        except ValueError:
            key = filler = None
        if key is None or filler.strip(b"x"):
            self.corrupt += 1
            return
        if key in self._seen:
            self.duplicates += 1
            return
        self._seen.add(key)
        self.received[publisher.decode()].append(int(seq))

    def lost(self, running):
        # Closing at the end of the run is not losing the connection.
        if running:
            self.disconnected = True

    def summary(self):
        return {
            "name": self.name,
            "kind": self.kind,
            "transport": self.transport,
            "filter": self.topicFilter,
            "received": self.received,
            "gaps": self.gaps,
            "duplicates": self.duplicates,
            "corrupt": self.corrupt,
            "disconnected": self.disconnected,
        }


# The driver.


class LoadProcess:
    """
    A load process (this script with C{--worker}), its job, and the JSON
    lines it answers with.
    """

    def __init__(self, job, directory):
        self.job = job
        self.collector = OutputCollector(
            [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(job)],
            directory,
            stdin=True,
        )
        self.pid = self.collector.process.pid

    def tell(self, line):
        self.collector.process.stdin.write(line.encode() + b"\n")
        self.collector.process.stdin.flush()

    def answer(self, key):
        """
        The value of C{key} in the JSON line that has it, or C{None} if it
        has not written one yet.
        """
        found = _jsonLine(self.collector.output, key)
        return None if found is None else found[key]

    def signal(self, number):
        if self.collector.process.poll() is None:
            os.kill(self.pid, number)

    def stop(self):
        self.signal(signal.SIGCONT)
        self.collector.kill()

    def errors(self):
        """
        What it wrote that is not one of its JSON lines: errors and
        tracebacks.
        """
        return [
            line
            for line in self.collector.output.decode("utf-8", "replace").splitlines()
            if line and not line.startswith("{")
        ]


def answers(processes, key, control=None, timeout=120.0):
    """
    Wait until every process has answered with C{key}, keeping the control
    connection answering the broker's pings meanwhile.

    @return: their answers, in order.
    """
    deadline = time.monotonic() + timeout
    while True:
        found = [process.answer(key) for process in processes]
        if all(answer is not None for answer in found):
            return found
        for process in processes:
            if process.collector.process.poll() is not None and process.answer(key) is None:
                raise BenchError(
                    f"load process {process.job['index']} exited before saying {key}: "
                    + "\n".join(process.errors()[-20:])
                )
        if time.monotonic() > deadline:
            raise BenchError(f"no {key} from the load processes within {timeout:g} s")
        if control is not None:
            control.pollPings()
        time.sleep(0.2)


def _jsonLine(output, key):
    # The last part is a line still being written (a report is long).
    for line in output.split(b"\n")[:-1]:
        if line.startswith(b"{") and b'"%s"' % key.encode() in line:
            message = json.loads(line)
            if key in message:
                return message
    return None


def memoryBound(settings, startRss, plan, delivery):
    """
    The most resident memory the broker may reach, in bytes, stated from
    the run's parameters: its memory once started, plus for every client
    48 KiB (docs/CONNECTIONS.md measured 3-3.3 KiB per idle TCP
    connection; a session with subscriptions, delivery state, a read
    buffer and Twisted's write buffer is allowed much more), plus for
    every subscriber the broker may have to hold messages for (slow,
    stopped, never reading) its queue limits and window at the largest
    payload with 1 KiB of bookkeeping each, plus 64 MiB for the allocator
    and the log.  Memory that grew with the number of messages or of
    connections made over the run would break it.
    """
    perMessage = PAYLOAD_SIZES[1] + 1024
    held = min(delivery["maxQueued"] * perMessage, delivery["maxQueuedBytes"])
    held += delivery["maxInflight"] * perMessage
    holders = plan["slow"] + plan["stopped"] + plan["neverReads"]
    return startRss + settings.clients * 48 * 1024 + holders * held + 64 * 1024 * 1024


# The broker's delivery limits the run uses (its defaults).
DELIVERY = {"maxQueued": 1000, "maxQueuedBytes": 8 * 1024 * 1024, "maxInflight": 100}


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class Result:
    settings: Settings
    checks: list
    figures: dict

    @property
    def ok(self):
        return all(check.ok for check in self.checks)


def jobs(settings, port, udpPort):
    """
    The job of each load process: the load workers share the kinds that
    stay, publish and churn; one process holds the stopped subscribers, one
    the clients that get killed.  A job lists, for each kind, the numbers
    of its clients: they are numbered across processes, which names them
    and spreads them over TCP and UDP.
    """
    plan = settings.plan()
    base = {
        "port": port,
        "udpPort": udpPort,
        "seconds": settings.seconds,
        "rate": settings.rate,
        "publishers": plan["publisher"],
        "udpShare": settings.udpShare,
    }
    shared = ("publisher", "checked", "slow", "steady", "churner", "neverReads")
    empty = {kind: [] for kind in (*shared, "stopped", "killed")}
    result = []
    for index in range(settings.workers):
        job = {**base, **empty, "index": index, "seed": settings.seed + index}
        for kind in shared:
            job[kind] = list(range(index, plan[kind], settings.workers))
        result.append(job)
    stopped = {**base, **empty, "index": "stopped", "seed": settings.seed + 100}
    stopped["stopped"] = list(range(plan["stopped"]))
    killed = {**base, **empty, "index": "killed", "seed": settings.seed + 200}
    killed["killed"] = list(range(plan["killed"]))
    return result, stopped, killed


class Samples:
    """
    The broker's memory, CPU and counters, and the load average, over the
    run.
    """

    def __init__(self, broker):
        self.broker = broker
        self.rss = []
        self.load = []
        self.connections = []
        self.startCpu = broker.cpuSeconds()
        self.started = time.monotonic()

    def sample(self):
        self.rss.append(self.broker.residentMemory())
        self.load.append(os.getloadavg())

    def counters(self, control):
        counters = control.stats()
        self.connections.append(counters["connections"])
        return counters


class Faults:
    """
    What the script does to the clients while the traffic runs: SIGSTOP the
    stopped subscribers' process for 1.5 ping intervals every 2.5, and
    SIGKILL the killed clients' process every twentieth of the run (5 s at
    least), starting it again at once.
    """

    def __init__(self, settings, stoppable, killedJob, directory):
        self.stoppable = stoppable
        self.killedJob = killedJob
        self.directory = directory
        self.stopEvery = 2.5 * settings.pingInterval
        self.stopFor = 1.5 * settings.pingInterval
        self.killEvery = max(5.0, settings.seconds / 20)
        self.killed = self._startKilled()
        self.dead = []
        self.stops = self.kills = 0
        self._stoppedUntil = None

    def _startKilled(self):
        killed = LoadProcess(self.killedJob, self.directory)
        answers([killed], "ready")
        return killed

    def start(self, now):
        self._nextStop = now + self.stopEvery
        self._nextKill = now + self.killEvery

    def tick(self, now):
        if self._stoppedUntil is not None and now >= self._stoppedUntil:
            self.stoppable.signal(signal.SIGCONT)
            self._stoppedUntil = None
        elif self._stoppedUntil is None and now >= self._nextStop:
            self.stoppable.signal(signal.SIGSTOP)
            self.stops += 1
            self._stoppedUntil = now + self.stopFor
            self._nextStop = now + self.stopEvery
        if now >= self._nextKill:
            self.killed.signal(signal.SIGKILL)
            self.killed.collector.kill()
            self.dead.append(self.killed)
            self.kills += 1
            self.killed = LoadProcess(self.killedJob, self.directory)
            self._nextKill = now + self.killEvery

    def end(self):
        """
        Everyone running again; the killed clients gone for good.
        """
        self.stoppable.signal(signal.SIGCONT)
        self.killed.collector.kill()
        self.dead.append(self.killed)


def run(settings, directory, log=print):
    """
    Run the soak in C{directory}.

    @return: a L{Result}.
    """
    raiseDescriptorLimit()
    plan = settings.plan()
    # Every client comes from 127.0.0.1: the per-address limit would be the
    # broker's whole limit.
    options = [
        "--ping-interval", f"{settings.pingInterval:g}",
        "--max-connections-per-ip", str(2 * settings.clients),
    ]  # fmt: skip
    broker = Broker(directory, extra=options, udp=True)
    reporting = []
    faults = control = None
    try:
        log(f"broker: {broker.reproduce()}")
        startRss = broker.residentMemory()
        loadJobs, stoppedJob, killedJob = jobs(settings, broker.port, broker.udpPort)
        reporting = [LoadProcess(job, directory) for job in (*loadJobs, stoppedJob)]
        answers(reporting, "ready")
        faults = Faults(settings, reporting[-1], killedJob, directory)
        control = ControlConnection(broker.port)
        samples = Samples(broker)
        loadBefore = os.getloadavg()
        log(f"{settings.clients} clients {plan}; traffic for {settings.seconds:g} s")

        for process in reporting:
            process.tell("go")
        started = time.monotonic()
        faults.start(started)
        traffic(settings, started, control, samples, faults, log)
        faults.end()
        for process in reporting:
            process.tell("stop")
        answers(reporting, "stopped", control)
        settled = settle(control, samples)
        for process in reporting:
            process.tell("report")
        reports = answers(reporting, "report", control)
        final = control.stats()
        elapsed = time.monotonic() - started
        cpu = broker.cpuSeconds() - samples.startCpu
        peakRss = broker.peakMemory()
        control.close()
        control = None
        for process in reporting:
            process.collector.process.wait(60)
        status = stopBroker(broker)
        workerErrors = [line for process in reporting + faults.dead for line in process.errors()]
    finally:
        if control is not None:
            control.close()
        for process in reporting + (faults.dead + [faults.killed] if faults else []):
            process.stop()
        broker.stop()

    logText = b"".join(readLogs(broker))
    bound = memoryBound(settings, startRss, plan, DELIVERY)
    checks = [
        checkDeliveries(reports, final),
        Check(
            "memory",
            peakRss <= bound,
            f"peak RSS {peakRss / 2**20:.1f} MiB, bound {bound / 2**20:.1f} MiB "
            f"(start {startRss / 2**20:.1f} MiB)",
        ),
        checkLog(logText, status, workerErrors),
    ]
    figures = {
        "clients": settings.clients,
        "plan": plan,
        "seconds": round(elapsed, 1),
        "settled": settled,
        "stops": faults.stops,
        "kills": faults.kills,
        "peakConnections": max(samples.connections),
        "counters": final,
        "startRss": startRss,
        "peakRss": peakRss,
        "rssSamples": [samples.rss[0], samples.rss[len(samples.rss) // 3], samples.rss[-1]],
        "brokerCpuSeconds": round(cpu, 1),
        "loadBefore": loadBefore,
        "loadMax": max(samples.load),
        "loadAfter": os.getloadavg(),
        "workers": summarizeWorkers(reports),
        "warnings": Counter(name.decode() for name in re.findall(rb"#warn\] event=(\w+)", logText)),
    }
    return Result(settings, checks, figures)


def traffic(settings, started, control, samples, faults, log):
    """
    While the traffic runs: sample the broker, answer its pings on the
    control connection, stop and kill clients, and say how it goes every
    10 seconds.
    """
    nextCounters = started
    while (now := time.monotonic()) < started + settings.seconds:
        samples.sample()
        control.pollPings()
        faults.tick(now)
        if now >= nextCounters:
            counters = samples.counters(control)
            nextCounters = now + 10
            log(
                f"  {now - started:5.0f} s: {counters['connections']} connections, "
                f"{counters['published']} published, RSS {samples.rss[-1] / 2**20:.1f} MiB, "
                f"load {samples.load[-1][0]:.2f}"
            )
        time.sleep(0.5)


def settle(control, samples, timeout=60.0):
    """
    Wait until nothing is in flight in the broker (or C{timeout}).

    @return: the seconds it took, or C{None} if it did not settle.
    """
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        samples.sample()
        if samples.counters(control)["inflight"] == 0:
            return round(time.monotonic() - started, 1)
        time.sleep(0.5)
    return None


def stopBroker(broker):
    """
    SIGTERM, and the exit status (twistd re-raises the signal after a clean
    shutdown: -SIGTERM).
    """
    broker.process.send_signal(signal.SIGTERM)
    try:
        return broker.process.wait(60)
    except Exception:
        broker.process.kill()
        return None


def readLogs(broker):
    """
    The broker's log, rotated parts included, and what twistd wrote to its
    standard output and error.
    """
    paths = glob.glob(glob.escape(broker.logPath) + "*")
    paths.append(os.path.join(os.path.dirname(broker.logPath), "twistd.out"))
    for path in sorted(paths):
        with open(path, "rb") as text:
            yield text.read()


def checkDeliveries(reports, counters):
    """
    Check 1: every PubAck'd message reached every checked C{all}
    subscriber that stayed connected and whose filter matches it; the
    slow and stopped ones may miss at most what they saw as gaps, which
    the broker must have counted as dropped for a full queue or the
    redelivery limit.
    """
    acked = {}
    for report in reports:
        for publisher in report["publishers"]:
            acked[publisher["name"]] = set(publisher["acked"])
    totalAcked = sum(len(seqs) for seqs in acked.values())
    problems = []
    # kind -> [subscribers, PubAck'd deliveries due, received, gaps]
    kinds = defaultdict(lambda: [0, 0, 0, 0])
    stayed = Counter()
    for report in reports:
        for record in report["checked"]:
            if record["disconnected"]:
                problems.append(f"{record['name']} ({record['transport']}) lost its connection")
                continue
            stayed[f"{record['kind']} {record['transport']}"] += 1
            received = {name: set(seqs) for name, seqs in record["received"].items()}
            due = got = 0
            for name, seqs in acked.items():
                expected = {seq for seq in seqs if matches(record["filter"], seq)}
                due += len(expected)
                got += len(expected & received.get(name, set()))
            figures = kinds[record["kind"]]
            for index, value in enumerate((1, due, got, record["gaps"])):
                figures[index] += value
            allowed = 0 if record["kind"] == "checked" else record["gaps"]
            if due - got > allowed:
                problems.append(
                    f"{record['name']} ({record['kind']}, {record['transport']}, "
                    f"{record['filter']}): {due - got} PubAck'd messages missing, "
                    f"{record['gaps']} reported as gaps"
                )
            if record["duplicates"] or record["corrupt"]:
                problems.append(
                    f"{record['name']}: {record['duplicates']} messages handed over twice, "
                    f"{record['corrupt']} not as published"
                )
    gaps = sum(figures[3] for figures in kinds.values())
    counted = counters["dropped_queue_full"] + counters["dropped_redelivery_limit"]
    if gaps > counted:
        problems.append(f"{gaps} gaps seen, but only {counted} drops counted by the broker")
    if not kinds or not totalAcked:
        problems.append("nothing to check: no checked subscriber or no PubAck")
    detail = f"{totalAcked} messages PubAck'd; stayed connected: {dict(stayed)}; " + "; ".join(
        f"{kind}: {due} PubAck'd deliveries due, {got} received, {kindGaps} told as gaps"
        for kind, (_, due, got, kindGaps) in kinds.items()
    )
    if problems:
        detail += "; " + "; ".join(problems[:10])
    return Check("no PubAck'd all-mode message lost", not problems, detail)


def checkLog(logText, status, workerErrors):
    """
    Check 3: nothing unhandled in the broker's log, a clean stop whose
    final counters add up (every message matched ended acked, fired,
    replaced or dropped), and no error in the load processes (which would
    make the other checks say less than they seem to).
    """
    problems = []
    for needle in LOG_PROBLEMS:
        count = logText.count(needle)
        if count:
            index = logText.find(needle)
            problems.append(
                f"{count} x {needle.decode()!r}, first: {logText[index - 200 : index + 300]!r}"
            )
    if b"Server Shut Down." not in logText:
        problems.append("no 'Server Shut Down.' in the log")
    final = loggedEvents(logText, "stats")
    if len(final) != 1:
        problems.append(f"{len(final)} stats events logged, not one at the stop")
    elif final[0]["inflight"] != "0" or not countersAddUp(final[0]):
        problems.append(f"the final counters do not add up: {final[0]}")
    if status not in (0, -signal.SIGTERM):
        problems.append(f"the broker exited with status {status}")
    if workerErrors:
        problems.append(
            f"load processes reported {len(workerErrors)} error lines: {workerErrors[:5]}"
        )
    lines = logText.count(b"\n")
    detail = f"{lines} log lines, exit status {status}"
    if problems:
        detail += "; " + "; ".join(problems)
    return Check("no unhandled error, clean stop", not problems, detail)


def summarizeWorkers(reports):
    counts, problems, levels = Counter(), Counter(), Counter()
    for report in reports:
        counts.update(report["counts"])
        problems.update(report["problems"])
        levels.update(report["logLevels"])
    published = sum(len(p["acked"]) for report in reports for p in report["publishers"])
    sent = sum(p["sent"] for report in reports for p in report["publishers"])
    incarnations = sum(len(report["publishers"]) for report in reports)
    return {
        "publishers": incarnations,
        "sent": sent,
        "pubacked": published,
        "counts": dict(counts),
        "problems": dict(problems),
        "clientLogLevels": dict(levels),
    }


def printResult(result, log=print):
    figures = result.figures
    counters = figures["counters"]
    workers = figures["workers"]
    MiB = 2**20
    log("")
    log(
        f"{figures['clients']} clients for {figures['seconds']:g} s: peak {figures['peakConnections']} "
        f"sessions at once, {counters['connections_total']} sessions in all; "
        f"{figures['stops']} SIGSTOPs, {figures['kills']} SIGKILLs of a load process"
    )
    log(
        f"messages: {workers['sent']} sent by {workers['publishers']} publishers, "
        f"{workers['pubacked']} PubAck'd; broker: published {counters['published']}, "
        f"matched {counters['matched']}, delivered {counters['delivered']}, acked "
        f"{counters['acked']}, fired {counters['fired']}, replaced {counters['replaced']}, "
        f"redelivered {counters['redelivered']}, dropped {counters['dropped']} ("
        + ", ".join(
            f"{name[8:]} {value}"
            for name, value in counters.items()
            if name.startswith("dropped_") and value
        )
        + f"), in flight at the end {counters['inflight']} (settled in {figures['settled']} s)"
    )
    log(
        f"broker: RSS {figures['startRss'] / MiB:.1f} MiB at start, peak {figures['peakRss'] / MiB:.1f} "
        f"MiB; samples at start/third/end of traffic "
        + "/".join(f"{rss / MiB:.1f}" for rss in figures["rssSamples"])
        + f" MiB; CPU {figures['brokerCpuSeconds']:g} s "
        f"({100 * figures['brokerCpuSeconds'] / figures['seconds']:.0f}% of a core)"
    )
    log(
        "load average (1/5/15 min): before "
        + " ".join(f"{value:.2f}" for value in figures["loadBefore"])
        + ", highest 1-min "
        + f"{figures['loadMax'][0]:.2f}, after "
        + " ".join(f"{value:.2f}" for value in figures["loadAfter"])
    )
    log(f"broker warnings: {dict(figures['warnings'])}")
    log(f"clients: {workers['counts']}")
    log(f"clients' log, by level: {workers['clientLogLevels']}")
    if workers["problems"]:
        log(f"client problems: {workers['problems']}")
    for check in result.checks:
        log(f"{'PASS' if check.ok else 'FAIL'} {check.name}: {check.detail}")
    log("")
    log(f"reproduce: {result.settings.command()}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", metavar="JOB", help=argparse.SUPPRESS)
    defaults = Settings()
    parser.add_argument("--clients", type=int, default=defaults.clients)
    parser.add_argument("--minutes", type=float, default=defaults.seconds / 60)
    parser.add_argument(
        "--rate",
        type=float,
        default=defaults.rate,
        help="publishes per second, all publishers together",
    )
    parser.add_argument("--ping-interval", type=float, default=defaults.pingInterval)
    parser.add_argument("--workers", type=int, default=defaults.workers)
    parser.add_argument("--udp-share", type=float, default=defaults.udpShare)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--keep", action="store_true", help="keep the broker's log folder")
    args = parser.parse_args()
    if args.worker:
        runWorker(json.loads(args.worker))
        return
    settings = Settings(
        clients=args.clients,
        seconds=args.minutes * 60,
        rate=args.rate,
        pingInterval=args.ping_interval,
        workers=args.workers,
        udpShare=args.udp_share,
        seed=args.seed,
    )
    directory = tempfile.mkdtemp(prefix="dallal-soak-")
    try:
        result = run(settings, directory)
    except BenchError as error:
        sys.exit(f"soak: {error}")
    printResult(result)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(
                {
                    "settings": asdict(settings),
                    "checks": [asdict(c) for c in result.checks],
                    "figures": result.figures,
                },
                out,
                indent=1,
                default=str,
            )
    if args.keep:
        print(f"broker log: {directory}")
    else:
        import shutil

        shutil.rmtree(directory, ignore_errors=True)
    sys.exit(0 if result.ok else 1)


if __name__ == "__main__":
    main()
