"""
What the tests share: the broker core wired to in-memory transports and a
fake clock, and real C{twistd dallal} / C{dallal} processes with bounded
waits on their output.
"""

import dataclasses
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections import namedtuple
from pathlib import Path

from twisted.internet.address import IPv4Address
from twisted.internet.defer import maybeDeferred, succeed
from twisted.internet.error import ConnectionDone
from twisted.internet.task import Clock, deferLater
from twisted.internet.testing import StringTransport
from twisted.logger import Logger, formatEvent
from twisted.python.failure import Failure
from zope.interface import implementer

from dallal.broker.core import BrokerConfig
from dallal.broker.events import NAMESPACE, EventLog
from dallal.broker.interfaces import ISubscriber
from dallal.broker.retained import RetainedStats
from dallal.protocol import wire
from dallal.security.acl import parseAcl
from dallal.security.auth import BrokerRealm, Gatekeeper, PasswordFileChecker
from dallal.security.passwords import PasswordHash
from dallal.server import udp
from dallal.server.service import DallalService
from dallal.topictree import TopicMap

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
TWISTD = BIN / "twistd"
DALLAL = BIN / "dallal"

# The broker's own address on the loopback, with an ephemeral port.
LOOPBACK_ANY_PORT = "tcp:0:interface=127.0.0.1"
LISTENING = re.compile(rb"event=listening transport=tcp address=127\.0\.0\.1:(\d+)")
HTTP_LISTENING = re.compile(rb"event=listening transport=http address=127\.0\.0\.1:(\d+)")

# Generous bounds: the machine is small and shared, and a bound only has to
# turn a hang into a failure.
START_TIMEOUT = 30.0
STOP_TIMEOUT = 15.0
COMMAND_TIMEOUT = 30.0

PING_INTERVAL = 10.0

# scrypt as cheap as it goes, for tests that check passwords by the
# hundred; the hash format and the code are the same.
CHEAP_SCRYPT = {"n": 2, "r": 1, "p": 1}


def runInline(function, *arguments):
    """
    Run a password check at once, in this thread (the broker runs it in the
    reactor's thread pool).
    """
    return maybeDeferred(function, *arguments)


def makeGatekeeper(clock, users=None, acl=None, runHash=runInline, bridgeUsers=(), config=None):
    """
    A L{Gatekeeper} on C{clock}, checking passwords with cheap scrypt,
    inline unless told otherwise.

    @param users: user name -> password (bytes), or C{None} for a broker
        without passwords.
    @param acl: the text of an ACL file, or C{None}.
    @param bridgeUsers: the users that may send bridge frames.
    @param config: the broker's, whose limits on pending logins it keeps.
    """
    checker = None
    if users is not None:
        checker = PasswordFileChecker(
            {name: PasswordHash.make(password, **CHEAP_SCRYPT) for name, password in users.items()},
            runHash=runHash,
        )
    if config is None:
        config = BrokerConfig()
    realm = BrokerRealm(parseAcl(acl) if acl is not None else None, bridgeUsers)
    return Gatekeeper(
        clock,
        realm,
        checker,
        maxPendingChecks=config.maxPendingLogins,
        maxPendingChecksPerIp=config.maxPendingLoginsPerIp,
    )


# The name of a BrokerHarness's broker, unless its config gives one.
HARNESS_NAME = "harness"


# In memory: a broker core, its TCP protocol and its ping sweep on a Clock.


class BrokerHarness:
    """
    A running L{DallalService} -- its L{Broker}, L{PingSweep} and
    L{BrokerFactory} -- driven by a L{Clock}, with connections over
    L{StringTransport}s and the broker's log events collected in C{events}.
    """

    def __init__(
        self,
        config=None,
        users=None,
        acl=None,
        runHash=runInline,
        shutdownGrace=None,
        clock=None,
        bridgeUsers=(),
    ):
        """
        @param config: the broker's; by default with per-message events
            (C{publish}, C{deliver}, ...) on, for tests to look at.
        @param users: user name -> password (bytes): the broker requires a
            login (L{makeGatekeeper}, which C{runHash} is given to).
        @param acl: the text of an ACL file the broker enforces.
        @param bridgeUsers: the users that may send bridge frames.
        @param shutdownGrace: the service's, if not its default.
        @param clock: the service's reactor, if not a new L{Clock}.
        A config without a name gets C{HARNESS_NAME}, so that two harnesses
        log the same events.
        """
        if config is None:
            config = BrokerConfig(messageEvents=True)
        self.clock = Clock() if clock is None else clock
        self.events = []
        logger = Logger(namespace=NAMESPACE, observer=self.events.append)
        if config.name is None:
            config = dataclasses.replace(config, name=HARNESS_NAME)
        self.gatekeeper = None
        if users is not None or acl is not None:
            self.gatekeeper = makeGatekeeper(self.clock, users, acl, runHash, bridgeUsers, config)
        grace = {} if shutdownGrace is None else {"shutdownGrace": shutdownGrace}
        # No $SYS statistics: the tests that want them start their own.
        self.service = DallalService(
            self.clock,
            config,
            PING_INTERVAL,
            sysInterval=0,
            gatekeeper=self.gatekeeper,
            events=EventLog(self.clock, logger=logger, messageEvents=config.messageEvents),
            **grace,
        )
        self.service.startService()
        self.broker = self.service.broker
        self.sweep = self.service.sweep
        self.factory = self.service.factory
        self._nextPort = 40001

    def connect(self, host="127.0.0.1", transport=None, factory=None):
        """
        A new client connection, each from its own port.

        @param transport: the L{StringTransport} it goes over, if not a
            plain one.
        @param factory: the protocol factory, if not the broker's TCP one.
        """
        address = IPv4Address("TCP", host, self._nextPort)
        self._nextPort += 1
        protocol = (self.factory if factory is None else factory).buildProtocol(address)
        if transport is None:
            transport = StringTransport()
        transport.peerAddr = address
        protocol.makeConnection(transport)
        return FakeClient(protocol, transport)

    def connectMQTT(self, host="127.0.0.1"):
        """
        A new MQTT client connection (L{dallal.server.mqtt}), each from its
        own port.
        """
        return self.connect(host, factory=self.service.mqttFactory)

    def logLines(self, name=None):
        """
        The broker's events as twistd writes them (C{event=... t=...}),
        optionally only those named C{name}.
        """
        return [
            formatEvent(event)
            for event in self.events
            if name is None or event.get("dallal_event") == name
        ]

    def fields(self, name):
        """
        The fields of each event named C{name}, without the broker's name
        and the time, which every event carries.
        """
        return [
            {
                key: value
                for key, value in event.items()
                if not key.startswith("log_") and key not in ("dallal_event", "broker", "t")
            }
            for event in self.events
            if event.get("dallal_event") == name
        ]


class MemoryRetained:
    """
    The retained store's interface, in memory: writes are durable at once.
    """

    def __init__(self):
        self.messages = TopicMap()
        self.changed = None

    def set(self, topic, payload):
        held = topic in self.messages
        if payload:
            self.messages[topic] = payload
        else:
            self.messages.pop(topic, None)
        if self.changed is not None and held != bool(payload):
            self.changed(topic, bool(payload))
        return succeed(None)

    def topics(self):
        return iter(self.messages)

    def watch(self, changed):
        self.changed = changed

    def get(self, topic):
        return self.messages.get(topic)

    def match(self, topicFilter, limit=None):
        return self.messages.match(topicFilter, limit)

    @property
    def stats(self):
        return RetainedStats(len(self.messages), sum(map(len, self.messages.values())))


def harnessWithRetained():
    """
    A L{BrokerHarness} whose broker keeps retained messages in a
    L{MemoryRetained}.
    """
    harness = BrokerHarness()
    harness.broker.retained = MemoryRetained()
    return harness


# The broker core with fake subscribers.

Sent = namedtuple("Sent", "payload sub seq id redelivered")


@implementer(ISubscriber)
class RecordingSubscriber:
    """
    A session as the core sees it, recording what the core does to it.

    @ivar sent: the L{Sent} messages not yet taken by L{take}.
    @ivar disconnected: the reasons the core asked it to disconnect for.
    @ivar revoked: C{(subscription id, reason)} of each subscription the
        core ended.
    """

    transportName = "tcp"

    def __init__(self, peer):
        self.peer = peer
        self.sid = None
        self.sent = []
        self.disconnected = []
        self.revoked = []
        # Whether the core told it to stop publishing, and how many times.
        self.publishingPaused = False
        self.pauses = 0

    def sendMessage(self, message, subscriptionId, seq, deliveryId, redelivered):
        self.sent.append(Sent(message.payload, subscriptionId, seq, deliveryId, redelivered))

    def disconnect(self, reason):
        self.disconnected.append(reason)

    def subscriptionRevoked(self, subscriptionId, reason):
        self.revoked.append((subscriptionId, reason))

    def pausePublishing(self):
        assert not self.publishingPaused
        self.publishingPaused = True
        self.pauses += 1

    def resumePublishing(self):
        assert self.publishingPaused
        self.publishingPaused = False

    def take(self):
        """
        What was sent since the last call.
        """
        sent, self.sent = self.sent, []
        return sent

    def takePayloads(self):
        return [sent.payload for sent in self.take()]


class FakeDatagramTransport:
    """
    A UDP port in memory: keeps what its protocol writes as
    C{(datagram, address)} pairs, or hands each to C{network}.
    """

    def __init__(self, address=("127.0.0.1", 1234), network=None):
        self.address = address
        self.network = network
        self.written = []
        self.listening = True

    def write(self, data, address=None):
        if self.network is not None:
            self.network.send(self.address, address, data)
        else:
            self.written.append((data, address))

    def getHost(self):
        return IPv4Address("UDP", *self.address)

    def stopListening(self):
        self.listening = False


class FakeClient:
    """
    One client connection to a L{BrokerHarness}: what it sends goes straight
    to the broker's protocol, what the broker writes stays in C{transport}.

    @ivar address: the client's C{host:port}, as the broker logs it.
    """

    def __init__(self, protocol, transport):
        self.protocol = protocol
        self.transport = transport
        peer = transport.getPeer()
        self.address = f"{peer.host}:{peer.port}"

    def send(self, *chunks):
        """
        Deliver C{chunks} to the broker, one read each.
        """
        for chunk in chunks:
            self.protocol.dataReceived(chunk)

    def received(self):
        """
        What the broker wrote since the last call.
        """
        written = self.transport.value()
        self.transport.clear()
        return written

    def login(self, user, password, clientId="c1", requestId="h"):
        """
        Say HELLO with credentials, and return the broker's answer.
        """
        options = b"".join(
            b" %s=%s" % (key.encode(), value.encode())
            for key, value in wire.encodeCredentials(user, password).items()
        )
        self.send(b"HELLO %s %s%s\r\n" % (requestId.encode(), clientId.encode(), options))
        return self.received()

    def lose(self):
        """
        What the reactor does once the connection is closed, by either side.
        """
        self.protocol.connectionLost(Failure(ConnectionDone()))

    @property
    def closing(self):
        """
        Whether the broker closed (or aborted) the connection.
        """
        return self.transport.disconnecting


class Frame:
    """
    A frame from the broker: its control line, and its payload for C{MSG}.
    """

    def __init__(self, line, payload=None):
        self.line = line
        self.payload = payload
        self.verb, *self.arguments = line.split(b" ")

    def __repr__(self):
        return f"Frame({self.line!r}, {self.payload!r})"


# Where the payload size is among a frame's arguments, by verb.
_SIZE_ARGUMENT = {b"MSG": 1, b"PUB": 2}


def decodeFrames(data):
    """
    Cut what the broker wrote (or a client, such as a bridge) into
    L{Frame}s, as PROTOCOL.md describes them (and without L{dallal.protocol.wire},
    which is under test): CRLF-terminated control lines, and after C{MSG
    <topic> <size>} or C{PUB <id> <topic> <size>} exactly C{size} bytes of
    payload and a CRLF.
    """
    frames = []
    position = 0
    while position < len(data):
        end = data.index(b"\r\n", position)
        frame = Frame(data[position:end])
        position = end + 2
        if frame.verb in _SIZE_ARGUMENT:
            size = int(frame.arguments[_SIZE_ARGUMENT[frame.verb]])
            frame.payload = data[position : position + size]
            assert data[position + size : position + size + 2] == b"\r\n", data
            position += size + 2
        frames.append(frame)
    return frames


def messages(data):
    """
    The C{(topic, payload)} of each C{MSG} frame in C{data}.
    """
    return [
        (frame.arguments[0], frame.payload) for frame in decodeFrames(data) if frame.verb == b"MSG"
    ]


def splitAt(data, positions):
    """
    C{data} cut at each of the sorted C{positions}.
    """
    bounds = [0, *positions, len(data)]
    return [data[start:end] for start, end in zip(bounds, bounds[1:])]


def resultOf(deferred):
    """
    What C{deferred} fired with (as trial's C{successResultOf}).

    @raise AssertionError: it has not fired, or it failed (the failure is
        then handled, so it is not also logged as unhandled).
    """
    outcome = []
    deferred.addBoth(outcome.append)
    assert outcome, f"{deferred!r} has not fired"
    assert not isinstance(outcome[0], Failure), outcome[0].getTraceback()
    return outcome[0]


def loggedEvents(log, name):
    """
    The fields of each event named C{name} in a broker's log as twistd
    writes it (docs/EVENTS.md, "Format"), as C{str -> str} dicts without
    the time C{t}.

    @param log: the log's text, as bytes.
    """
    pattern = rb"\] event=%s( [^\n]*)? t=\S+$" % re.escape(name.encode())
    found = []
    for match in re.finditer(pattern, log, re.MULTILINE):
        fields = (match.group(1) or b"").decode().split()
        found.append(dict(field.split("=", 1) for field in fields))
    return found


def countersAddUp(counters):
    """
    Whether a broker's counters add up (docs/EVENTS.md): C{matched = acked
    + fired + replaced + dropped + inflight}.

    @param counters: as C{STATS} answers them, or as L{loggedEvents} reads
        them from a C{stats} event (text).
    """
    value = {name: int(counters[name]) for name in ("acked", "fired", "replaced", "dropped")}
    return int(counters["matched"]) == sum(value.values()) + int(counters["inflight"])


# Real processes.


class OutputCollector:
    """
    A child process whose standard output (and error, merged into it) a
    thread collects, so that tests can wait for what it prints without ever
    blocking longer than they said.
    """

    def __init__(self, argv, cwd, env=None, stdin=False):
        """
        @param stdin: whether to give it a pipe for standard input (its
            C{process.stdin}); otherwise it reads nothing.
        """
        self.argv = [str(arg) for arg in argv]
        self.process = subprocess.Popen(
            self.argv,
            cwd=cwd,
            env=env,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        self._output = bytearray()
        self._changed = threading.Condition()
        self._eof = False
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        stream = self.process.stdout
        while chunk := stream.read1(65536):
            with self._changed:
                self._output += chunk
                self._changed.notify_all()
        with self._changed:
            self._eof = True
            self._changed.notify_all()

    @property
    def output(self):
        with self._changed:
            return bytes(self._output)

    def waitUntil(self, predicate, timeout, what):
        """
        Wait until C{predicate(output)} returns something true, and return it.

        @raise AssertionError: it did not within C{timeout} seconds, or the
            process closed its output first.
        """
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                result = predicate(bytes(self._output))
                if result:
                    return result
                remaining = deadline - time.monotonic()
                if self._eof or remaining <= 0:
                    raise AssertionError(
                        f"{' '.join(self.argv)}: no {what} within {timeout} s; "
                        f"exit status {self.process.poll()}, output:\n"
                        f"{bytes(self._output[-4000:]).decode('utf-8', 'replace')}"
                    )
                self._changed.wait(remaining)

    def waitFor(self, pattern, timeout=START_TIMEOUT):
        """
        Wait until the output matches the regular expression C{pattern}.

        @return: the match.
        """
        return self.waitUntil(lambda output: re.search(pattern, output), timeout, repr(pattern))

    def terminate(self, timeout=STOP_TIMEOUT):
        """
        Send SIGTERM and wait for the process to exit.

        @return: its exit status.
        @raise AssertionError: it did not exit in time (it is then killed).
        """
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            status = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"{self.argv} still running {timeout} s after SIGTERM") from None
        self._reader.join(timeout)
        return status

    def kill(self):
        """
        Make sure the process is gone, whatever state it is in.
        """
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(STOP_TIMEOUT)
        self._reader.join(STOP_TIMEOUT)


class Conversation:
    """
    A running C{dallal} command we type into and read from through file
    descriptors (a pipe each way, or a pseudo-terminal), reading only when
    something is there, until a deadline.
    """

    def __init__(self, process, readFrom, writeTo):
        self.process = process
        self.readFrom = readFrom
        self.writeTo = writeTo
        self.output = b""

    def type(self, data):
        os.write(self.writeTo, data)

    def expect(self, pattern, timeout=COMMAND_TIMEOUT):
        """
        Read until the output matches C{pattern}.
        """
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.output):
            remaining = deadline - time.monotonic()
            readable, _, _ = select.select([self.readFrom], [], [], max(remaining, 0))
            chunk = os.read(self.readFrom, 65536) if readable else b""
            assert chunk, (
                f"no {pattern!r} within {timeout} s; exit status "
                f"{self.process.poll()}; output: {self.output[-2000:]!r}"
            )
            self.output += chunk

    def wait(self):
        """
        Wait for the command to exit, killing it if it does not in time.

        @return: its exit status.
        """
        try:
            return self.process.wait(COMMAND_TIMEOUT)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait(COMMAND_TIMEOUT)


class BrokerProcess(OutputCollector):
    """
    A broker run by C{twistd -n}, which logs to standard output.

    @ivar port: the TCP port it listens on, read from its C{listening} event.
    """

    def __init__(self, argv, cwd, env=None):
        OutputCollector.__init__(self, argv, cwd, env)
        try:
            self.port = int(self.waitFor(LISTENING).group(1))
        except BaseException:
            self.kill()
            raise

    @classmethod
    def plugin(cls, cwd, *options, twistd=TWISTD, env=None):
        """
        C{twistd -n --pidfile= dallal} listening on an ephemeral loopback port.
        """
        return cls(
            [twistd, "-n", "--pidfile=", "dallal", "--tcp", LOOPBACK_ANY_PORT, *options],
            cwd,
            env,
        )

    def stop(self):
        """
        Stop the broker with SIGTERM, and check that it shut down cleanly
        and never logged a traceback.
        """
        status = self.terminate()
        output = self.output.decode("utf-8", "replace")
        assert "Traceback" not in output, output
        assert "Unhandled" not in output, output
        assert "Server Shut Down." in output, output
        # After a clean shutdown twistd re-raises the signal that stopped it,
        # so that its parent sees why it exited.
        assert status in (0, -signal.SIGTERM), output


def dallal(*arguments, timeout=COMMAND_TIMEOUT, executable=DALLAL, env=None, input=None):
    """
    Run the C{dallal} command to completion.

    @param env: its environment, if not this process's.
    @param input: bytes for its standard input, if not nothing.
    @return: its L{subprocess.CompletedProcess}, output as bytes.
    """
    return subprocess.run(
        [str(executable), *map(str, arguments)],
        input=input,
        stdin=subprocess.DEVNULL if input is None else None,
        capture_output=True,
        timeout=timeout,
        env=env,
    )


def subscriber(port, *topics, host="127.0.0.1", prefix=(), mode=None, udp=False):
    """
    Start C{dallal subscribe} (with C{--mode}, if given) and wait until it
    says it is subscribed.

    @param prefix: a command that runs it (C{ip netns exec ...}).
    @param udp: whether it subscribes over UDP (C{dallal --udp}).
    """
    modeOption = [] if mode is None else ["--mode", mode]
    udpOption = ["--udp"] if udp else []
    process = OutputCollector(
        [*prefix, DALLAL, *udpOption, host, port, "subscribe", *modeOption, *topics], None
    )
    try:
        process.waitFor(re.escape(b"subscribing on " + " ".join(topics).encode() + b"\n"))
    except BaseException:
        process.kill()
        raise
    return process


class SlowHandler:
    """
    A message handler (for L{dallal.client}) that finishes each message
    C{delay} seconds after the previous one finished, as a consumer working
    through them one by one: the broker's window fills up, and its ack
    timeout may expire.

    @ivar seen: C{(seq, payload)} of each message it was handed.
    """

    def __init__(self, delay, reactor):
        self.delay = delay
        self.reactor = reactor
        self.seen = []
        self._free = 0.0

    def __call__(self, message):
        self.seen.append((message.seq, message.payload))
        now = self.reactor.seconds()
        self._free = max(now, self._free) + self.delay
        return deferLater(self.reactor, self._free - now)


def environmentWithout(*names):
    """
    This process's environment without the variables C{names}.
    """
    return {key: value for key, value in os.environ.items() if key not in names}


# A gap a subscriber reports on standard error.
GAP = re.compile(rb"^dallal: (\S+): (\d+) message\(s\) not received", re.MULTILINE)


class Subscriber:
    """
    A C{dallal subscribe} process: what it prints on standard output is
    collected, what it reports on standard error goes to a file.
    """

    def __init__(self, port, topic, errors, mode=None):
        self.topic = topic.encode()
        self.errors = errors
        modeOptions = ["--mode", mode] if mode else []
        self.collector = OutputCollector(
            ["sh", "-c", 'exec "$@" 2>"$0"', errors, DALLAL, "127.0.0.1", port, "subscribe"]
            + modeOptions
            + [topic],
            None,
        )
        self.pid = self.collector.process.pid
        try:
            self.collector.waitFor(
                re.escape(b"subscribing on " + self.topic + b"\n"), COMMAND_TIMEOUT
            )
        except BaseException:
            self.collector.kill()
            raise

    def signal(self, number):
        os.kill(self.pid, number)

    def waitForLine(self, payload, timeout=COMMAND_TIMEOUT):
        """
        Wait until the last line printed is the message C{payload}.
        """
        line = self.topic + b": " + payload + b"\n"
        self.collector.waitUntil(lambda output: output.endswith(line), timeout, "the last message")

    def waitForLines(self, count, timeout=COMMAND_TIMEOUT):
        self.collector.waitUntil(
            lambda output: output.count(b"\n") >= count + 1, timeout, f"{count} messages"
        )

    def payloads(self):
        """
        The payload of each message line printed after C{subscribing on}.
        """
        header, *lines = self.collector.output.split(b"\n")
        assert header == b"subscribing on " + self.topic
        assert lines[-1] == b"", "the output ends in the middle of a line"
        prefix = self.topic + b": "
        assert all(line.startswith(prefix) for line in lines[:-1])
        return [line[len(prefix) :] for line in lines[:-1]]

    def gaps(self):
        """
        The number of missed messages each gap report on standard error gave.
        """
        return [int(missed) for _, missed in GAP.findall(self.errors.read_bytes())]

    def stop(self):
        """
        Continue it if it was stopped, then stop it with SIGTERM.

        @return: its exit status.
        """
        if self.collector.process.poll() is None:
            self.signal(signal.SIGCONT)
        return self.collector.terminate()


# The broker over UDP

UDP_SECRET = b"a fixed secret for the tests...."
UDP_BROKER = ("127.0.0.1", 1234)
TOKEN = re.compile(rb"token=(\S+)")
KEY = re.compile(rb" key=([A-Za-z0-9_-]{22})(?: |\r\n)")


class UdpHarness(BrokerHarness):
    """
    A L{BrokerHarness} (broker core, ping sweep and TCP factory on a Clock)
    with a UDP port on the same core.
    """

    def __init__(self, *arguments, **keywords):
        BrokerHarness.__init__(self, *arguments, **keywords)
        self.udp = udp.BrokerDatagramProtocol(
            self.broker, self.sweep, ackTimeout=1.0, secret=UDP_SECRET, gatekeeper=self.gatekeeper
        )
        self.transport = FakeDatagramTransport(UDP_BROKER)
        self.udp.makeConnection(self.transport)

    def peer(self, port, host="127.0.0.1"):
        return Peer(self, (host, port))

    @property
    def answers(self):
        return self.udp.answers

    def bytesSentTo(self, address):
        return sum(len(data) for data, to in self.transport.written if to == address)

    def counter(self, name):
        return self.broker.stats()[name]


class Peer:
    """
    An address datagrams come from, typed by hand as a person with
    C{nc -u} would, and what the broker sent back to it.
    """

    def __init__(self, harness, address):
        self.harness = harness
        self.address = address
        self.sentBytes = 0
        self.token = None
        self.clientId = None
        self.key = None
        self._seen = 0

    def send(self, data):
        self.sentBytes += len(data)
        self.harness.udp.datagramReceived(data, self.address)

    def received(self):
        """
        The datagrams the broker sent here since the last call.
        """
        mine = [data for data, to in self.harness.transport.written if to == self.address]
        new, self._seen = mine[self._seen :], len(mine)
        return new

    def hello(self, clientId="client-1", key=None):
        """
        Both HELLOs: get a token, then start (or resume) the session, and
        keep the session's key the broker answers.

        @param key: the session key to echo, to resume a session from here.
        @return: the broker's answer to the second.
        """
        self.send(b"HELLO 1 %s\r\n" % clientId.encode())
        [answer] = self.received()
        self.token = TOKEN.search(answer).group(1)
        self.clientId = clientId
        keyOption = b"" if key is None else b" key=" + key
        self.send(b"HELLO 2 %s token=%s%s\r\n" % (clientId.encode(), self.token, keyOption))
        [answer] = self.received()
        found = KEY.search(answer)
        if found is not None:
            self.key = found.group(1)
        return answer

    def request(self, line, payload=None):
        """
        Send a request with this peer's identity.
        """
        data = line + b" client=%s token=%s\r\n" % (self.clientId.encode(), self.token)
        if payload is not None:
            data += payload + b"\r\n"
        self.send(data)

    def publish(self, requestId, topic, payload):
        self.request(b"PUB %s %s %d" % (requestId, topic, len(payload)), payload)
