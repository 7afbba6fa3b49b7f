"""
What the attacks share: starting the broker under attack (Dallal through
bench/brokerproc.py, its peers through bench/compare.py), raw blocking
clients that speak Dallal over TCP and UDP, a probe that measures a normal
client's publish round trip while an attack runs, and the one verdict line
each attack prints.

Every attack talks to 127.0.0.1 (and other loopback addresses, to look
like another host) only, and runs for a bounded time.
"""

import argparse
import base64
import contextlib
import os
import re
import select
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, BENCH)

import compare  # noqa: E402
from brokerproc import BenchError, Broker, twistdExecutable  # noqa: E402

MiB = 2**20
KiB = 2**10

# Loopback addresses an attack uses to look like other hosts: every address
# of 127.0.0.0/8 is this machine's.
ATTACKER_HOST = "127.0.0.1"
OTHER_HOST = "127.0.0.2"


# The verdict


def reproduceCommand(argv=None):
    """
    The command that runs this attack again, from the checkout.
    """
    argv = sys.argv if argv is None else argv
    script = os.path.relpath(os.path.abspath(argv[0]), os.path.dirname(BENCH))
    return shlex.join(["python3", script, *argv[1:]])


def verdict(name, passed, figure, extra=None):
    """
    Print the attack's one verdict line and exit: 0 on PASS, 1 on FAIL.

    @param figure: the measured figure and what it means.
    @param extra: what else to say about the run (options used), or None.
    """
    word = "PASS" if passed else "FAIL"
    tail = f" [{extra}]" if extra else ""
    print(f"{word} {name}: {figure}{tail} (reproduce: {reproduceCommand()})", flush=True)
    sys.exit(0 if passed else 1)


def broken(name, error):
    """
    The attack could not run (the broker did not start, say): an ERROR
    line, exit 2, so that it is never mistaken for a verdict.
    """
    print(f"ERROR {name}: {error} (reproduce: {reproduceCommand()})", flush=True)
    sys.exit(2)


def arguments(description, peers=()):
    """
    The command line every attack takes: C{--broker} (dallal, or one of the
    C{peers} it knows how to attack the same way).
    """
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--broker",
        choices=("dallal", *peers),
        default="dallal",
        help="which broker to attack (default dallal)",
    )
    return parser


def runAttack(name, description, attack, peers=(), note=None, addArguments=None):
    """
    An attack script's main: parse its command line (L{arguments}, and
    what C{addArguments(parser)} adds), run C{attack(options)}, which
    returns C{(passed, figure)} or C{(passed, figure, note)}, and print its
    verdict.

    @param note: what to add to the verdict about the options used (an
        attack that returns its own note adds it to this one).
    """
    parser = arguments(description, peers)
    if addArguments is not None:
        addArguments(parser)
    options = parser.parse_args()
    try:
        passed, figure, *ownNote = attack(options)
    except (BenchError, Closed, OSError) as error:
        broken(name, repr(error))
    notes = [text for text in (note, *ownNote) if text]
    verdict(name, passed, figure, "; ".join(notes) or None)


# Brokers


_helpText = None


def dallalOptions():
    """
    The options C{twistd dallal --help} lists (the fixers add new ones):
    a set of names such as C{'--max-retained'}.
    """
    global _helpText
    if _helpText is None:
        _helpText = subprocess.run(
            [twistdExecutable(), "dallal", "--help"], capture_output=True, text=True, timeout=60
        ).stdout
    return set(re.findall(r"(--[a-z][a-z0-9-]*)=?", _helpText))


def optionsIfPresent(wanted):
    """
    Those of C{wanted} (option -> value) that this broker has, as twistd
    arguments, and a note of which were used or missing, for the verdict.
    """
    known = dallalOptions()
    used, missing, argv = [], [], []
    for option, value in wanted.items():
        if option in known:
            argv += [option, str(value)] if value is not None else [option]
            used.append(option if value is None else f"{option} {value}")
        else:
            missing.append(option)
    notes = []
    if used:
        notes.append("with " + ", ".join(used))
    if missing:
        notes.append("no " + ", ".join(missing) + " in this broker: defaults")
    return argv, "; ".join(notes)


@contextlib.contextmanager
def scratch():
    """
    A temporary directory for a broker's log, data and files.
    """
    with tempfile.TemporaryDirectory(prefix="dallal-attack-") as directory:
        yield directory


@contextlib.contextmanager
def dallal(directory, extra=(), udp=False, mqtt=False):
    """
    A C{twistd -n dallal} on free loopback ports, stopped on exit (with
    C{mqtt}, its MQTT port is C{mqttPort}).
    """
    broker = Broker(directory, extra=extra, udp=udp, mqtt=mqtt)
    try:
        yield broker
    finally:
        broker.stop()


class DefaultMosquitto(compare.MosquittoServer):
    """
    Mosquitto with its default limits (bench/compare.py widens its
    in-flight window for throughput; an attack meets the defaults).
    """

    def startCommand(self, directory):
        configuration = os.path.join(directory, "mosquitto.conf")
        with open(configuration, "w") as file:
            file.write(
                f"listener {self._port} 127.0.0.1\nallow_anonymous true\n"
                f"persistence false\nlog_dest file {self.logPath}\nuser root\n"
            )
        return [self.path(), "-c", configuration]


PEERS = {
    "mosquitto": DefaultMosquitto,
    "nats": compare.NatsServer,
    "redis": compare.RedisServer,
}


@contextlib.contextmanager
def peer(kind, directory):
    """
    A peer broker (mosquitto, nats, redis) on a free loopback port, with
    its default limits, stopped on exit.
    """
    server = PEERS[kind](directory)
    try:
        yield server
    finally:
        server.stop()


def anyBroker(kind, directory, extra=()):
    """
    The broker an attack runs against: Dallal (with C{extra} options) or a
    peer, as a context manager.
    """
    if kind == "dallal":
        return dallal(directory, extra)
    return peer(kind, directory)


@contextlib.contextmanager
def anyMqttBroker(kind, directory, extra=()):
    """
    Dallal with C{--mqtt} (and C{extra} options) or Mosquitto, as a context
    manager giving C{(server, its MQTT port)}.
    """
    if kind == "dallal":
        with dallal(directory, extra, mqtt=True) as broker:
            yield broker, broker.mqttPort
    else:
        with peer(kind, directory) as server:
            yield server, server.port


@contextlib.contextmanager
def brokerAndPort(kind, directory, extra=()):
    """
    L{anyBroker} as C{(server, the port attacked)}; C{dallal-mqtt} is
    Dallal's C{--mqtt} listener, attacked as Mosquitto is.
    """
    if kind == "dallal-mqtt":
        with anyMqttBroker("dallal", directory, extra) as (server, port):
            yield server, port
    else:
        with anyBroker(kind, directory, extra) as server:
            yield server, server.port


def writePasswords(directory, users):
    """
    A password file made with C{dallal-passwd}, for C{users} (name ->
    password).

    @return: its path.
    """
    path = os.path.join(directory, "passwords.txt")
    command = os.path.join(os.path.dirname(twistdExecutable()), "dallal-passwd")
    for name, password in users.items():
        subprocess.run(
            [command, path, name],
            env={**os.environ, "DALLAL_PASSWORD": password},
            check=True,
            capture_output=True,
            timeout=60,
        )
    return path


def aliceAndMallory(directory):
    """
    The password file and ACL of the identity attacks: alice may read and
    write secret/#, mallory users/mallory/# only.

    @return: the C{--passwords} and C{--acl} options naming them.
    """
    passwords = writePasswords(directory, {"alice": "alice-pw", "mallory": "mallory-pw"})
    acl = writeFile(
        directory,
        "acl",
        "user alice\ntopic readwrite secret/#\n\nuser mallory\ntopic readwrite users/mallory/#\n",
    )
    return ["--passwords", passwords, "--acl", acl]


def writeFile(directory, name, text):
    path = os.path.join(directory, name)
    with open(path, "w") as file:
        file.write(text)
    return path


def credentialOptions(user, password):
    encoded = base64.b64encode(password.encode()).decode()
    return f"user={user} password={encoded}"


def logText(broker):
    """
    The broker's whole log, rotated parts included.
    """
    import glob

    text = b""
    for path in sorted(glob.glob(glob.escape(broker.logPath) + "*")):
        with open(path, "rb") as log:
            text += log.read()
    return text


def logSize(broker):
    import glob

    return sum(os.path.getsize(path) for path in glob.glob(glob.escape(broker.logPath) + "*"))


# Clients


class Closed(Exception):
    """
    The broker closed the connection.
    """


def receiveBefore(sock, deadline):
    """
    What C{sock} receives before C{deadline} (of C{time.monotonic()}):
    bytes, C{b""} once the broker has closed the connection, or None if the
    time runs out.
    """
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        return None
    sock.settimeout(remaining)
    try:
        return sock.recv(1 << 20)
    except TimeoutError:
        return None
    except ConnectionResetError:
        return b""


# The verbs whose frames carry a payload, its size the third token.
_PAYLOAD_VERBS = (b"MSG", b"STATS", b"LIST", b"TOPICS")


class Connection:
    """
    A blocking Dallal TCP client: sends raw bytes, reads frames (a control
    line, and the payload of those that carry one), answers PINGs.

    @param source: the local address to connect from (another loopback
        address looks like another host), or None.
    """

    def __init__(self, port, host="127.0.0.1", source=None, timeout=10.0, receiveBuffer=None):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if receiveBuffer is not None:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receiveBuffer)
        if source is not None:
            self.sock.bind((source, 0))
        self.sock.settimeout(timeout)
        self.sock.connect((host, port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buffer = b""
        self.closed = False
        self.answerPings = True

    def send(self, data):
        self.sock.sendall(data)

    def _takeFrame(self):
        end = self.buffer.find(b"\n")
        if end < 0:
            return None
        line = self.buffer[:end].rstrip(b"\r")
        tokens = line.split(b" ")
        if tokens[0] in _PAYLOAD_VERBS and len(tokens) >= 3 and tokens[2].isdigit():
            size = int(tokens[2])
            start = end + 1
            if len(self.buffer) < start + size + 2:
                return None
            payload = self.buffer[start : start + size]
            self.buffer = self.buffer[start + size + 2 :]
            return line, payload
        self.buffer = self.buffer[end + 1 :]
        return line, None

    def readFrame(self, timeout):
        """
        The next frame other than PING (answered) within C{timeout}
        seconds, or None.

        @raise Closed: the broker closed the connection.
        """
        deadline = time.monotonic() + timeout
        while True:
            frame = self._takeFrame()
            if frame is not None:
                if frame[0] == b"PING" and self.answerPings:
                    self.send(b"PONG\r\n")
                    continue
                return frame
            if self.closed:
                raise Closed()
            data = receiveBefore(self.sock, deadline)
            if data is None:
                return None
            if not data:
                self.closed = True
                continue
            self.buffer += data

    def waitFor(self, predicate, timeout):
        """
        Read frames until C{predicate(line)} is true: return that frame, and
        keep the others in C{self.seen}; None if the time runs out.
        """
        deadline = time.monotonic() + timeout
        self.seen = []
        while True:
            frame = self.readFrame(max(0.0, deadline - time.monotonic()))
            if frame is None:
                return None
            if predicate(frame[0]):
                return frame
            self.seen.append(frame)

    def answer(self, requestId, timeout=10.0):
        """
        The answer to the request C{requestId} (bytes), or None.
        """
        return self.waitFor(lambda line: line.split(b" ")[1:2] == [requestId], timeout)

    def request(self, line, requestId, payload=None, timeout=10.0):
        data = line + b"\r\n"
        if payload is not None:
            data += payload + b"\r\n"
        self.send(data)
        return self.answer(requestId, timeout)

    def login(self, user, password, clientId="c", timeout=15.0):
        answer = self.request(
            b"HELLO h %s %s" % (clientId.encode(), credentialOptions(user, password).encode()),
            b"h",
            timeout=timeout,
        )
        if answer is None or not answer[0].startswith(b"HELLO"):
            raise BenchError(f"login of {user} failed: {answer!r}")

    def drain(self, timeout=0.0):
        """
        Read whatever is there (for up to C{timeout} seconds) and forget it.

        @return: whether the connection is still open.
        """
        end = time.monotonic() + timeout
        while not self.closed:
            remaining = max(0.0, end - time.monotonic())
            readable, _, _ = select.select([self.sock], [], [], remaining)
            if not readable:
                break
            try:
                data = self.sock.recv(1 << 20)
            except (ConnectionResetError, BlockingIOError):
                data = b""
            if not data:
                self.closed = True
                break
            self.buffer = (self.buffer + data)[-65536:]
        return not self.closed

    def close(self):
        with contextlib.suppress(OSError):
            self.sock.close()


class UdpClient:
    """
    A blocking Dallal UDP client, from its own socket (and loopback address).

    @ivar token: its token, once L{hello} returned.
    """

    def __init__(self, port, host="127.0.0.1", source="127.0.0.1"):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((source, 0))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * MiB)
        self.server = (host, port)
        self.clientId = None
        self.token = None
        self.received = []

    def sendRaw(self, data, to=None):
        self.sock.sendto(data, to or self.server)

    def receive(self, seconds):
        """
        The datagrams that arrive within the next C{seconds}.
        """
        got = []
        deadline = time.monotonic() + seconds
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            self.sock.settimeout(remaining)
            try:
                data, _ = self.sock.recvfrom(70000)
            except TimeoutError:
                break
            got.append(data)
            self.received.append(data)
        return got

    def waitFor(self, predicate, timeout):
        """
        The first datagram C{predicate} accepts within C{timeout} seconds, or
        None; every datagram read is kept in C{received}.
        """
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            self.sock.settimeout(remaining)
            try:
                data, _ = self.sock.recvfrom(70000)
            except TimeoutError:
                return None
            self.received.append(data)
            if predicate(data):
                return data

    def askToken(self, clientId, timeout=3.0):
        """
        The first HELLO: the token of C{clientId} at this socket's address.
        """
        self.sendRaw(b"HELLO t %s pad=%s\r\n" % (clientId.encode(), b"x" * 40))
        answer = self.waitFor(lambda d: d.startswith(b"HELLO t "), timeout)
        if answer is None:
            return None
        match = re.search(rb"token=(\S+)", answer)
        return match.group(1).decode() if match else None

    def hello(self, clientId, credentials="", timeout=5.0):
        """
        Both HELLOs; C{credentials} as HELLO options (user=.. password=..).

        @return: the answer to the second, or None.
        """
        token = self.askToken(clientId, timeout)
        if token is None:
            return None
        self.clientId, self.token = clientId, token
        self.sendRaw(
            b"HELLO s %s token=%s %s\r\n"
            % (clientId.encode(), token.encode(), credentials.encode())
        )
        return self.waitFor(lambda d: d.split()[1:2] == [b"s"], timeout)

    def frame(self, line, payload=None, clientId=None, token=None):
        """
        A request datagram with this client's identity (or the one given).
        """
        clientId = clientId or self.clientId
        token = token or self.token
        data = b"%s client=%s token=%s\r\n" % (line, clientId.encode(), token.encode())
        if payload is not None:
            data += payload + b"\r\n"
        return data

    def request(self, line, requestId, payload=None, timeout=2.0, **identity):
        self.sendRaw(self.frame(line, payload, **identity))
        if requestId is None:
            return self.waitFor(lambda d: True, timeout)
        return self.waitFor(lambda d: d.split()[1:2] == [requestId], timeout)

    def close(self):
        self.sock.close()


class MqttClient:
    """
    A blocking MQTT 3.1.1 or 5.0 client over raw packets (an attacker's:
    it sends what it is told, checks nothing).

    @ivar connAck: the return code (reason code in MQTT 5) of its CONNACK,
        and whether it said session present, once L{connect} returned.
    """

    def __init__(self, port, source="127.0.0.1", version=4, timeout=10.0):
        from protocols import mqttPacket, mqttRemainingLength, mqttString

        self._packet, self._length, self._string = mqttPacket, mqttRemainingLength, mqttString
        self.version = version
        self.sock = socket.socket()
        self.sock.bind((source, 0))
        self.sock.settimeout(timeout)
        self.sock.connect(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buffer = b""
        self.connAck = None

    def properties(self, encoded=b""):
        """
        An MQTT 5 property block of already encoded properties (nothing in
        MQTT 3.1.1).
        """
        return self._length(len(encoded)) + encoded if self.version == 5 else b""

    def connectPacket(
        self,
        clientId,
        cleanStart=True,
        user=None,
        password=None,
        keepAlive=60,
        sessionExpiry=None,
        will=None,
    ):
        flags = 0x02 if cleanStart else 0
        payload = self._string(clientId.encode())
        properties = b""
        if sessionExpiry is not None:
            properties += b"\x11" + sessionExpiry.to_bytes(4, "big")
        if will is not None:
            topic, message, willProperties = will
            flags |= 0x04
            payload += self.properties(willProperties) + self._string(topic) + self._string(message)
        if user is not None:
            flags |= 0x80
            payload += self._string(user.encode())
        if password is not None:
            flags |= 0x40
            payload += self._string(password.encode())
        body = self._string(b"MQTT") + bytes([self.version, flags]) + keepAlive.to_bytes(2, "big")
        return self._packet(1, 0, body + self.properties(properties) + payload)

    def connect(self, clientId, timeout=10.0, **options):
        """
        CONNECT and wait for the CONNACK: its return (reason) code, or None
        if the broker closed the connection without one.
        """
        self.send(self.connectPacket(clientId, **options))
        try:
            packet = self.readPacket(timeout)
        except Closed:
            return None
        if packet is None or packet[0] != 2:
            return None
        self.connAck = (packet[2][1], bool(packet[2][0] & 1))
        return packet[2][1]

    def subscribe(self, topicFilter, qos=1, packetId=1, timeout=10.0):
        """
        SUBSCRIBE to one filter: the SUBACK's return code, or None.
        """
        body = packetId.to_bytes(2, "big") + self.properties() + self._string(topicFilter.encode())
        self.send(self._packet(8, 2, body + bytes([qos])))
        packet = self.waitFor(lambda kind, flags, body: kind == 9, timeout)
        return None if packet is None else packet[2][-1]

    def publishPacket(self, topic, payload, qos=0, packetId=1, retain=False, properties=b""):
        body = self._string(topic.encode())
        if qos:
            body += packetId.to_bytes(2, "big")
        return self._packet(3, qos << 1 | retain, body + self.properties(properties) + payload)

    def send(self, data):
        self.sock.sendall(data)

    def _takePacket(self):
        buffer = self.buffer
        length, multiplier, position = 0, 1, 1
        while True:
            if position >= len(buffer):
                return None
            digit = buffer[position]
            length += (digit & 0x7F) * multiplier
            multiplier *= 128
            position += 1
            if not digit & 0x80:
                break
        if len(buffer) < position + length:
            return None
        self.buffer = buffer[position + length :]
        return buffer[0] >> 4, buffer[0] & 0x0F, buffer[position : position + length]

    def readPacket(self, timeout):
        """
        The next packet, C{(type, flags, body)}, within C{timeout} seconds,
        or None.

        @raise Closed: the broker closed the connection.
        """
        deadline = time.monotonic() + timeout
        while True:
            packet = self._takePacket()
            if packet is not None:
                return packet
            data = receiveBefore(self.sock, deadline)
            if data is None:
                return None
            if not data:
                raise Closed()
            self.buffer += data

    def waitFor(self, predicate, timeout):
        """
        Read packets until C{predicate(type, flags, body)}: that packet, or
        None if the time runs out or the broker closes the connection.
        """
        deadline = time.monotonic() + timeout
        while True:
            try:
                packet = self.readPacket(max(0.0, deadline - time.monotonic()))
            except Closed:
                return None
            if packet is None or predicate(*packet):
                return packet

    def publishes(self, timeout):
        """
        The payloads of the PUBLISHes that arrive within C{timeout}
        seconds (QoS 1 ones acked).
        """
        got = []
        deadline = time.monotonic() + timeout
        while True:
            try:
                packet = self.readPacket(max(0.0, deadline - time.monotonic()))
            except Closed:
                return got
            if packet is None:
                return got
            kind, flags, body = packet
            if kind != 3:
                continue
            topicLength = int.from_bytes(body[:2], "big")
            position = 2 + topicLength
            qos = flags >> 1 & 3
            if qos:
                packetId = body[position : position + 2]
                self.send(self._packet(4 if qos == 1 else 5, 0, packetId))
                position += 2
            if self.version == 5:
                size, shift = 0, 0
                while True:
                    digit = body[position]
                    position += 1
                    size |= (digit & 0x7F) << shift
                    shift += 7
                    if not digit & 0x80:
                        break
                position += size
            got.append(body[position:])

    def close(self):
        with contextlib.suppress(OSError):
            self.sock.close()


# Measuring


def median(values):
    return statistics.median(values) if values else float("nan")


def percentile(values, fraction):
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


class DallalProbe:
    """
    A normal client measuring its publish -> deliver round trip: one
    connection subscribed to a topic of its own in mode fire, publishing on
    it and timing each message's arrival.

    It publishes at fixed times whatever the answers (open loop): a broker
    frozen for a second delays the twenty publishes due in that second, not
    one, so the median is the share of time the broker answers late, and
    not hidden by the quick answers around a freeze.
    """

    def __init__(self, port, topic="probe/rtt", source=OTHER_HOST):
        self.connection = Connection(port, source=source)
        self.topic = topic.encode()
        answer = self.connection.request(b"SUB ps %s mode=fire" % self.topic, b"ps")
        if answer is None or not answer[0].startswith(b"SUBACK"):
            raise BenchError(f"the probe could not subscribe: {answer!r}")
        self.connection.answerPings = False
        self._sending = threading.Lock()
        self._next = 0

    def _send(self, data):
        with self._sending:
            self.connection.send(data)

    def during(self, attack, interval=0.05, timeout=15.0):
        """
        Publish every C{interval} seconds while C{attack()} runs.

        @return: the round trip of each publish, in seconds; one that did
            not come back within C{timeout} of the attack's end counts as
            the time it waited.
        """
        sent, arrived = {}, {}
        running = threading.Event()
        running.set()
        header = b"MSG %s " % self.topic

        def receive():
            while running.is_set() or len(arrived) < len(sent):
                try:
                    frame = self.connection.readFrame(0.1)
                except (Closed, OSError):
                    return
                if frame is None:
                    if not running.is_set() and time.monotonic() > giveUp[0]:
                        return
                    continue
                if frame[0] == b"PING":
                    self._send(b"PONG\r\n")
                elif frame[0].startswith(header) and frame[1] in sent:
                    arrived.setdefault(frame[1], time.monotonic())

        def publish():
            start = time.monotonic()
            while running.is_set():
                self._next += 1
                marker = b"m%d" % self._next
                sent[marker] = time.monotonic()
                try:
                    self._send(b"PUB p %s %d\r\n%s\r\n" % (self.topic, len(marker), marker))
                except OSError:
                    return
                time.sleep(max(0.0, start + len(sent) * interval - time.monotonic()))

        giveUp = [float("inf")]
        threads = [
            threading.Thread(target=receive, daemon=True),
            threading.Thread(target=publish, daemon=True),
        ]
        for thread in threads:
            thread.start()
        try:
            attack()
        finally:
            giveUp[0] = time.monotonic() + timeout
            running.clear()
            for thread in threads:
                thread.join(timeout + 5)
        end = time.monotonic()
        return [arrived.get(marker, end) - at for marker, at in sent.items()]

    def close(self):
        self.connection.close()


class ProbeThread(threading.Thread):
    """
    Runs a probe's round trips every C{interval} seconds until stopped;
    C{samples} holds each (seconds, or the timeout for a lost one).
    """

    def __init__(self, probe, interval=0.1, timeout=15.0):
        threading.Thread.__init__(self, daemon=True)
        self.probe = probe
        self.interval = interval
        self.timeout = timeout
        self.samples = []
        self.lost = 0
        self._halt = threading.Event()

    def run(self):
        while not self._halt.is_set():
            took = self.probe.roundTrip(self.timeout)
            if took is None:
                self.lost += 1
                self.samples.append(self.timeout)
            else:
                self.samples.append(took)
            self._halt.wait(self.interval)

    def stop(self):
        self._halt.set()
        self.join(self.timeout + 5)


class PeerPublishProbe:
    """
    A normal client's publish round trip on a peer broker or on Dallal:
    the time from a publish to the broker's answer to it (Dallal's PUBACK,
    Redis's PUBLISH reply, NATS's PONG to a PING after the PUB, an MQTT
    QoS 1 PUBACK).
    """

    def __init__(self, kind, port, source=OTHER_HOST):
        from protocols import mqttPacket, mqttString, redisCommand

        self.kind = kind
        if kind == "redis":
            # Redis's protected mode serves 127.0.0.1 only, of the loopback.
            source = "127.0.0.1"
        self.sock = socket.socket()
        self.sock.bind((source, 0))
        self.sock.settimeout(10)
        self.sock.connect(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._next = 0
        if kind == "dallal":
            self._request = lambda n: b"PUB p%d probe 1\r\nx\r\n" % n
            self._answer = lambda n: b"PUBACK p%d\r\n" % n
        elif kind == "redis":
            self._request = lambda n: redisCommand(b"PUBLISH", b"probe", b"x")
            self._answer = lambda n: b":0\r\n"
        elif kind == "nats":
            self.sock.sendall(b'CONNECT {"verbose":false}\r\n')
            self._request = lambda n: b"PUB probe 1\r\nx\r\nPING\r\n"
            self._answer = lambda n: b"PONG\r\n"
        else:
            self.sock.sendall(
                mqttPacket(1, 0, mqttString(b"MQTT") + bytes([4, 2, 0, 60]) + mqttString(b"probe"))
            )
            self._recvUntil(b"\x20\x02", 10)
            self._request = lambda n: mqttPacket(
                3, 2, mqttString(b"probe") + (n % 65535 + 1).to_bytes(2, "big") + b"x"
            )
            self._answer = lambda n: b"\x40\x02" + (n % 65535 + 1).to_bytes(2, "big")
        self.buffer = b""

    def _recvUntil(self, marker, timeout):
        deadline = time.monotonic() + timeout
        buffer = getattr(self, "buffer", b"")
        while marker not in buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.buffer = buffer
                return False
            self.sock.settimeout(remaining)
            data = self.sock.recv(65536)
            if not data:
                raise Closed()
            buffer += data
        self.buffer = buffer[buffer.index(marker) + len(marker) :]
        return True

    def during(self, attack, interval=0.05):
        """
        Time a publish every C{interval} seconds, one after the other, while
        C{attack()} runs (closed loop: a publish waits for the one before).
        """
        thread = ProbeThread(self, interval=interval)
        thread.start()
        try:
            attack()
        finally:
            thread.stop()
        return thread.samples

    def roundTrip(self, timeout=15.0):
        self._next += 1
        start = time.monotonic()
        try:
            self.sock.sendall(self._request(self._next))
            if not self._recvUntil(self._answer(self._next), timeout):
                return None
        except (Closed, OSError):
            return None
        return time.monotonic() - start

    def close(self):
        self.sock.close()


def probeDuring(probe, attack):
    """
    The probe's round trips, every 50 ms, while C{attack()} runs.
    """
    return probe.during(attack)


def fillRetained(port, count, prefix="retained"):
    """
    Give the broker C{count} retained topics, C{<prefix>/<n>}, 1000
    pipelined at a time.
    """
    filler = Connection(port, timeout=120)
    for start in range(0, count, 1000):
        end = min(count, start + 1000)
        filler.send(
            b"".join(
                b"PUB r%d %s/%d 1 retain=1\r\nx\r\n" % (k, prefix.encode(), k)
                for k in range(start, end)
            )
        )
        if filler.answer(b"r%d" % (end - 1), timeout=120) is None:
            raise BenchError("the retained topics were not stored in 120 s")
    filler.close()


def ms(seconds):
    return f"{seconds * 1000:.0f} ms"


def mib(size):
    return f"{size / MiB:.1f} MiB"
