"""
traceback-fuzz: no traceback from any input.

A broker with --passwords, --acl and --udp. Over TCP (logged in as alice,
and on fresh connections for logins) and over UDP (in alice's session,
and in the HELLO that carries credentials), the attack sends crafted lines
(`HELLO 1 c user=u password=é`, `TOPICS 1 limit=²`, `hops=²`, digits that
are not ASCII, ...) then, for every field of every request, random
Unicode (any code point but whitespace and surrogates) and random bytes.
Each line over TCP is followed by a PING, so the answer to the line comes
before the PONG; over UDP each datagram waits for its own answer.

PASS if the broker's log has no "Traceback" nor "Unhandled", no
connection is dropped but by a documented error, and every request that
expects an answer got one.
"""

import random

import attacklib as lib

NAME = "traceback-fuzz"
RANDOM_LINES = 250
WHITESPACE = b" \t\n\r\x0b\x0c"
# Characters that str.isdigit() accepts and int() may not.
FANCY_DIGITS = ["²", "³", "¹", "⁴", "①", "١", "٣", "𝟙", "߁", "৪", "½", "Ⅻ", "٫"]

CRAFTED_TCP = [
    "TOPICS {id} limit=²",
    "TOPICS {id} limit=①",
    "TOPICS {id} limit=١",
    "TOPICS {id} limit=99999999999999999999999999",
    "TOPICS {id} limit=-1",
    "PUB {id} t/x 1 origin=a oid=b hops=²|x",
    "PUB {id} t/x 1 origin=a oid=b hops=١|x",
    "PUB {id} t/x 1 origin=é oid=é hops=1|x",
    "PUB {id} t/x 1 to-matching=²|x",
    "PUB {id} t/x 1 retain=²|x",
    "SUB {id} t/x mode=²",
    "SUB {id} t/x bridge=é",
    "SUB {id} é/#",
    "UNSUB {id} ²",
    "HELLO {id} c name=é version=²",
    "HELLO {id} c user=u password=é",
    "HELLO {id} c user=é password=é",
    "STATS {id} ²",
    "LIST {id} é",
    "ACK ²",
    "ACK é",
]

CRAFTED_LOGINS = [
    "HELLO {id} c user=u password=é",
    "HELLO {id} c user=é password=YQ==",
    "HELLO {id} c user=u password=²",
    "HELLO {id} c user=u password=YQ=é",
    "HELLO {id} é user=u password=YQ==",
    "HELLO {id} c user= password=",
]

TEMPLATES = [
    "PUB {id} {f} 1|x",
    "PUB {id} t/x 1 {f}={f}|x",
    "PUB {id} t/x 1 origin={f} oid={f} hops={f}|x",
    "PUB {id} {f} 1 to-matching=1|x",
    "PUB {id} t/x {f}",
    "SUB {id} {f}",
    "SUB {id} t/x mode={f} bridge={f}",
    "UNSUB {id} {f}",
    "ACK {f}",
    "LIST {f}",
    "TOPICS {id} limit={f}",
    "TOPICS {id} {f}={f}",
    "STATS {f}",
    "HELLO {id} {f} name={f}",
    "{f} {id} {f}",
]


def randomField(rng):
    """
    A random field: Unicode (any code point but whitespace and
    surrogates), bytes (any but whitespace), or a digit that is not ASCII.
    """
    kind = rng.random()
    length = rng.randint(1, 12)
    if kind < 0.4:
        chars = []
        while len(chars) < length:
            code = rng.randint(0x80, 0x10FFFF) if rng.random() < 0.8 else rng.randint(0x21, 0x7E)
            if 0xD800 <= code <= 0xDFFF or chr(code).isspace():
                continue
            chars.append(chr(code))
        return "".join(chars).encode("utf-8")
    if kind < 0.8:
        return (
            bytes(b for b in rng.randbytes(length * 2) if b not in WHITESPACE)[:length] or b"\xff"
        )
    return rng.choice(FANCY_DIGITS).encode("utf-8") * rng.randint(1, 3)


def expand(template, requestId, rng):
    """
    A template as (control line, payload or None): {id} is the request id,
    {f} a random field each, what follows '|' the payload.
    """
    line, _, payload = template.encode("utf-8").partition(b"|")
    line = line.replace(b"{id}", requestId)
    while b"{f}" in line:
        line = line.replace(b"{f}", randomField(rng), 1)
    return line, (payload if payload else None)


def expectsAnswer(line):
    verb = line.split()[0].upper() if line.split() else b""
    return verb not in (b"ACK", b"PONG")


class TcpFuzzer:
    def __init__(self, broker):
        self.broker = broker
        self.connection = None
        self.unanswered = []
        self.dropped = []

    def connect(self):
        self.connection = lib.Connection(self.broker.port)
        self.connection.login("alice", "alice-pw", "fuzz")

    def send(self, line, payload):
        if self.connection is None:
            self.connect()
        data = line + b"\r\n" + (payload + b"\r\n" if payload is not None else b"") + b"PING\r\n"
        try:
            self.connection.send(data)
            pong = self.connection.waitFor(lambda answer: answer == b"PONG", 10)
        except (lib.Closed, OSError):
            self.dropped.append(line)
            self.connection.close()
            self.connection = None
            return
        if pong is None:
            self.unanswered.append(line)
        elif expectsAnswer(line) and not self.connection.seen:
            self.unanswered.append(line)

    def login(self, line):
        """
        A HELLO with credentials on a fresh connection: answered with HELLO
        or ERR (BAD_CREDENTIALS closes the connection, as documented).
        """
        connection = lib.Connection(self.broker.port)
        try:
            connection.send(line + b"\r\n")
            answer = connection.waitFor(lambda frame: frame.startswith((b"HELLO", b"ERR")), 5)
        except (lib.Closed, OSError):
            answer = None
        if answer is None:
            self.unanswered.append(line)
        connection.close()


class UdpFuzzer:
    def __init__(self, broker):
        self.broker = broker
        self.client = lib.UdpClient(broker.udpPort, source=lib.OTHER_HOST)
        answer = self.client.hello("fuzz-udp", lib.credentialOptions("alice", "alice-pw"))
        if answer is None or b"session=" not in answer:
            raise lib.BenchError(f"the UDP session did not start: {answer!r}")
        self.unanswered = []

    def send(self, line, payload):
        datagram = self.client.frame(line, payload)
        self.client.sendRaw(datagram)
        if not expectsAnswer(line):
            return
        tokens = line.split()
        wanted = tokens[1] if len(tokens) > 1 else None
        answer = self.client.waitFor(
            lambda data: (
                data.startswith(b"ERR") or data.split()[1:2] == [wanted] or data.startswith(b"PONG")
            ),
            1.0,
        )
        if answer is None:
            self.unanswered.append(line)

    def login(self, line):
        """
        A HELLO with a valid token and these credentials (the line's own
        client id is replaced by one that has a token).
        """
        prober = lib.UdpClient(self.broker.udpPort, source=lib.OTHER_HOST)
        token = prober.askToken("login-fuzz")
        tokens = line.split(b" ")
        tokens[2] = b"login-fuzz token=" + token.encode()
        prober.sendRaw(b" ".join(tokens) + b"\r\n")
        # A refused login is answered after a second.
        if prober.waitFor(lambda data: data.startswith((b"HELLO", b"ERR")), 3) is None:
            self.unanswered.append(line)
        prober.close()


def attack(seed):
    rng = random.Random(seed)
    with lib.scratch() as directory:
        passwords = lib.writePasswords(directory, {"alice": "alice-pw"})
        acl = lib.writeFile(directory, "acl", "user alice\ntopic readwrite #\n")
        extra = ["--passwords", passwords, "--acl", acl]
        with lib.dallal(directory, extra, udp=True) as broker:
            tcp, udp = TcpFuzzer(broker), UdpFuzzer(broker)
            for number, template in enumerate(CRAFTED_LOGINS):
                line = template.replace("{id}", f"l{number}").encode("utf-8")
                tcp.login(line)
                udp.login(line)
            for number, template in enumerate(CRAFTED_TCP):
                line, _, payload = (
                    template.replace("{id}", f"c{number}").encode("utf-8").partition(b"|")
                )
                tcp.send(line, payload or None)
                udp.send(line, payload or None)
            for number in range(RANDOM_LINES):
                template = rng.choice(TEMPLATES)
                tcp.send(*expand(template, b"r%d" % number, rng))
                udp.send(*expand(template, b"u%d" % number, rng))
            alive = broker.alive()
            text = lib.logText(broker)
    found = text.count(b"Traceback") + text.count(b"Unhandled")
    lines = 2 * (len(CRAFTED_LOGINS) + len(CRAFTED_TCP) + RANDOM_LINES)
    unanswered = tcp.unanswered + udp.unanswered
    passed = alive and not found and not unanswered and not tcp.dropped
    examples = ", ".join(
        repr(line.decode("utf-8", "replace"))[:48] for line in (tcp.dropped + unanswered)[:4]
    )
    figure = (
        f"{lines} crafted and random lines over TCP and UDP (seed {seed}): {found} tracebacks or "
        f"unhandled errors in the log, {len(tcp.dropped)} TCP connections dropped, "
        f"{len(tcp.unanswered)} TCP and {len(udp.unanswered)} UDP requests unanswered"
        + (f" (e.g. {examples})" if examples else "")
    )
    return passed, figure


def seedArgument(parser):
    parser.add_argument("--seed", type=int, default=24, help="the random lines' seed")


if __name__ == "__main__":
    lib.runAttack(NAME, __doc__, lambda options: attack(options.seed), addArguments=seedArgument)
