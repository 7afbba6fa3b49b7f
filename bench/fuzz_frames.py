"""
A fuzz target for everything that parses bytes from the network: the
broker's TCP protocol (dallal.server.tcp.BrokerProtocol on dallal.protocol.framing), its
UDP protocol (dallal.server.udp), the TCP client (dallal.client), and
FrameReceiver on its own.  docs/FUZZING.md says how to run it and what it
checks.

    python3 bench/fuzz_frames.py --seconds 300            # atheris if installed
    python3 bench/fuzz_frames.py --seconds 60 --no-atheris
    python3 bench/fuzz_frames.py --replay crash-*          # rerun findings

With atheris (pip install atheris) it is coverage-guided (libFuzzer);
without it, or with --no-atheris, a plain mutation loop runs instead (seeds
of valid sessions, byte flips, inserted protocol tokens, splices), for the
same bounded time.  Either way it stops at the first input that makes a
check fail, writes it to crash-<sha1> in --artifacts, and exits with status
1; otherwise it exits 0 after --seconds.

An input is one byte choosing the target, one byte choosing how to cut the
stream into reads, and the bytes.  The checks (the same as
tests/test_parser_properties.py, which holds the regression tests):

 - nothing raises, and nothing is logged as a failure or an error (except
   the client's own report of an unreadable frame);
 - broker over TCP: however the stream is cut into reads, it writes the
   same bytes, logs the same events and closes (or not) the same way; what
   it writes is well-formed frames; it closes only after a fatal ERR or a
   BYE;
 - broker over UDP (datagrams separated by C{||}; the first byte of each
   picks the source address; C{$TOKEN} is replaced by the valid token of
   client C{me} at that address, so that sessions are reachable): an
   address that never sent its token is sent at most three times the bytes
   it sent;
 - FrameReceiver: the same lines, payloads and errors however the stream
   is cut.
"""

import argparse
import hashlib
import os
import random
import shlex
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

try:
    import atheris
except ImportError:
    atheris = None


def _importTargets():
    """
    Import what is fuzzed (instrumented for coverage when atheris runs):
    the broker's protocols, the client and the framing the property tests'
    harness drives.
    """
    global BrokerHarness, LogLevel, globalLogPublisher, udp

    from helpers import BrokerHarness
    from twisted.logger import LogLevel, globalLogPublisher

    import dallal.client  # noqa: F401
    import dallal.protocol.framing  # noqa: F401
    from dallal.server import udp


class CheckFailed(AssertionError):
    pass


def check(condition, *what):
    if not condition:
        raise CheckFailed(*what)


# What must never be logged


class LogWatch:
    """
    Collects events of Twisted's global log publisher that are failures or
    errors, except the client's report of an unreadable frame.
    """

    ALLOWED = ("closing: unexpected frame from the broker: {reason}",)

    def __init__(self):
        self.bad = []
        globalLogPublisher.addObserver(self)

    def __call__(self, event):
        level = event.get("log_level")
        if "log_failure" in event or level in (LogLevel.error, LogLevel.critical):
            if event.get("log_format") not in self.ALLOWED:
                self.bad.append(event)

    def check(self):
        bad, self.bad = self.bad, []
        check(not bad, "logged", bad)


# Cutting streams


def cut(data, stride):
    """
    C{data} in reads of C{stride} bytes, the first read shorter so that the
    cuts move with the stride.
    """
    first = len(data) % stride or stride
    return [data[:first]] + [data[i : i + stride] for i in range(first, len(data), stride)]


def cuts(data, selector):
    """
    The ways to cut C{data} compared with the whole: by a stride chosen
    by C{selector}, and byte by byte for a short stream.
    """
    ways = [cut(data, 1 + selector % 61)]
    if len(data) <= 2048:
        ways.append([data[i : i + 1] for i in range(len(data))])
    return ways


# Targets


def fuzzTcpBroker(selector, data):
    config = SMALL if selector & 0x80 else DEFAULT
    written, closing, harness = runBroker(config, [data])
    whole = written, closing, harness.logLines()
    for chunks in cuts(data, selector):
        other, otherClosing, otherHarness = runBroker(config, chunks)
        check(
            (other, otherClosing, otherHarness.logLines()) == whole,
            "depends on how the stream is cut",
            data,
            chunks,
        )
    checkBrokerOutput(written, closing, harness)
    check(harness.broker.stats()["connections"] == 0, "session left attached")


def fuzzUdpBroker(selector, data):
    harness = BrokerHarness(SMALL)
    protocol = udp.BrokerDatagramProtocol(harness.broker, harness.sweep, secret=SECRET)
    transport = FakeDatagramTransport()
    protocol.makeConnection(transport)
    received = dict.fromkeys(ADDRESSES, 0)
    proven = set()
    for number, datagram in enumerate(data.split(b"||")[:64]):
        if not datagram:
            continue
        address = ADDRESSES[datagram[0] % len(ADDRESSES)]
        datagram = datagram[1:]
        if b"$TOKEN" in datagram:
            datagram = datagram.replace(b"$TOKEN", protocol.token(b"me", address))
            proven.add(address)
        received[address] += len(datagram)
        protocol.datagramReceived(datagram, address)
        if (selector >> (number % 8)) & 1:
            harness.clock.advance(1.5)
    for _ in range(12):
        harness.clock.advance(4)
    for address in ADDRESSES:
        if address not in proven:
            sent = sum(len(d) for d, to in transport.written if to == address)
            check(sent <= 3 * received[address], "amplification", address, sent, received[address])
    check(harness.broker.stats()["connections"] == 0, "a session did not expire")
    for event in harness.events:
        check(event["log_level"] in (LogLevel.info, LogLevel.warn), "log level", event)


def fuzzClient(selector, data):
    whole = runClient([data])
    for chunks in cuts(data, selector):
        check(runClient(chunks) == whole, "client depends on how the stream is cut", data)


def _importTestPieces():
    """
    The property tests' harness: the broker, the client and a recording
    L{FrameReceiver} fed a stream, what they must write, the fake datagram
    transport, imported once the fuzzed modules are (atheris instruments
    what is imported under it).
    """
    global ADDRESSES, DEFAULT, SECRET, SMALL, FakeDatagramTransport
    global checkBrokerOutput, record, runBroker, runClient
    from helpers import FakeDatagramTransport
    from test_parser_properties import (
        ADDRESSES,
        DEFAULT,
        SECRET,
        SMALL,
        checkBrokerOutput,
        record,
        runBroker,
        runClient,
    )


def fuzzFrameReceiver(selector, data):
    whole = record([data])
    for chunks in cuts(data, selector):
        check(record(chunks) == whole, "FrameReceiver depends on how the stream is cut", data)
    calls, closed = whole
    check(closed == (calls[-1:] in ([("too long",)], [("terminator missing",)])), "closed", calls)


TARGETS = [fuzzTcpBroker, fuzzUdpBroker, fuzzClient, fuzzFrameReceiver]
TARGET_NAMES = ["tcp", "udp", "client", "framing"]
_only = None
_watch = None


def testOneInput(data):
    """
    The fuzz target: C{data[0]} picks the target (unless --target fixes
    it), C{data[1]} how to cut the stream.
    """
    if len(data) < 2:
        return
    target = TARGETS[data[0] % len(TARGETS)] if _only is None else _only
    target(data[1], data[2:])
    _watch.check()


# Seeds and the fallback mutation loop

TOKENS = [
    b"PUB ", b"SUB ", b"UNSUB ", b"ACK ", b"LIST ", b"TOPICS ", b"STATS ", b"PING",
    b"PONG", b"HELLO ", b"BYE", b"MSG ", b"PUBACK ", b"SUBACK ", b"ERR ", b"\r\n",
    b"\n", b"\r", b" ", b"=", b"mode=all", b"mode=fire", b"mode=latest", b"retain=1",
    b"to-matching=1", b"limit=", b"client=me", b"token=$TOKEN", b"$TOKEN", b"||",
    b"sub=2", b"seq=", b"id=", b"redelivered=1", b"retained=1", b"pad=", b"#", b"+",
    b"/", b"$SYS", b"a/+/c", b"news", b"0", b"1", b"16", b"17", b"4096",
    b"999999999999", b"\xff", b"\x00", b"\xc3\xa9",
]  # fmt: skip

SEEDS = [
    # TCP broker sessions (target 0), small limits (selector >= 0x80).
    b"\x00\x83SUB 1 a/+ mode=all\r\nPUB 2 a/b 2\r\nhi\r\nACK 1\r\nSTATS 3\r\nPING\r\n",
    b"\x00\x05PUB 1 news 3 retain=1\r\nabc\r\nTOPICS 2 limit=5\r\nLIST 3\r\nUNSUB 4 x\r\n",
    b"\x00\x81PUB 1 a 20\r\n" + b"x" * 20 + b"\r\nPUB 2 a 1\r\nxy\r\n",
    b"\x00\x02HELLO 1 me\r\nSUB 2 # mode=fire\r\nPUB 3 $SYS/x 0\r\n\r\nBYE\r\n",
    # UDP datagrams (target 1): address byte, then the datagram.
    b"\x01\x01\x00HELLO 1 me pad=xxxxxxxxxxxxxxxxxxxx\r\n||\x00HELLO 2 me token=$TOKEN\r\n"
    b"||\x00SUB 3 news client=me token=$TOKEN\r\n||\x01PUB 4 news 2 client=me token=$TOKEN"
    b"\r\nhi\r\n||\x00ACK 1 client=me token=$TOKEN\r\n||\x02PING\r\n",
    b"\x01\xff\x02HELLO 1 me\r\n||\x03PUB 1 a 99999 client=me token=x\r\n||\x01BYE client=me token=$TOKEN",
    # The client (target 2), fed the broker's side.
    b"\x02\x07PUBACK 1\r\nSUBACK 2\r\nMSG news 2 sub=2 seq=1 id=1\r\nhi\r\nSTATS 3 2\r\n{}\r\n"
    b"TOPICS 4 2\r\n[]\r\nPUBACK 5 topics=2\r\nHELLO 6 version=1\r\nPING\r\nPONG\r\nERR 9 X y\r\n",
    b"\x02\x03SUBACK 2\r\nMSG news 2 sub=2 seq=3 id=9 redelivered=1\r\nok\r\nBYE\r\n",
    # FrameReceiver (target 3): P<n> announces a payload, D<n> one to skip.
    b"\x03\x04P5\r\nab\r\nc\r\nD3\nxyz\nline\r\n" + b"x" * 40 + b"\r\n",
    # Bytes after the connection starts closing, which must change nothing:
    # the broker's after a BYE, the client's after a frame it cannot read
    # (docs/FUZZING.md, regression 3).
    b"\x00\x03SUBACK 2\r-\nMSG news 2 sub=2 seq=3 iid=9 red]livered=1\r\nok\r\nBYE\rd=9 "
    b"red]livered=1\r\nok\r\nBYE\r\n",
    b"\x02\x07PUBACK 1\r\nSUBACK 2\r\nMSG news 2 sub=2 seq=1 id=1\r\nhi\r\nS 3 2\r\n{}\r\n"
    b"TOPICS 4 2\r\n[]\r\nPUBACK 5 topics=2\r\n",
    # Inputs byte mutations rarely build, kept as seeds so that every run
    # checks them: a delivery id the client cannot ack, JSON nested too deep
    # (docs/FUZZING.md, regressions 1 and 2).
    b"\x02\x01SUBACK 2\r\n" + b"MSG news 2 sub=2 seq=1 id=\xc3\xa9\r\nhi\r\n" * 2,
    b"\x02\x01STATS 3 5000\r\n" + b"[" * 5000 + b"\r\n",
]


def mutate(rng, data, pool):
    data = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        choice = rng.randrange(7)
        position = rng.randint(0, len(data))
        if choice == 0 and data:
            data[rng.randrange(len(data))] = rng.randrange(256)
        elif choice == 1:
            data[position:position] = rng.choice(TOKENS)
        elif choice == 2 and data:
            end = min(len(data), position + rng.randint(1, 16))
            del data[position:end]
        elif choice == 3 and data:
            start = rng.randrange(len(data))
            piece = data[start : start + rng.randint(1, 64)]
            data[position:position] = piece * rng.randint(1, 4)
        elif choice == 4:
            other = rng.choice(pool)
            start = rng.randrange(len(other) + 1)
            data[position:] = other[start:]
        elif choice == 5 and data:
            # A number in the stream made larger, smaller or wrong.
            data[position:position] = str(rng.choice([0, 1, 2, 15, 16, 17, 64, 4097, -1])).encode()
        elif choice == 6:
            data[position:position] = b"x" * rng.choice([31, 32, 33, 63, 64, 65, 4096, 4097])
    if len(data) >= 1 and rng.random() < 0.05:
        data[0] = rng.randrange(256)
    return bytes(data[:20000])


def save(artifacts, data):
    path = Path(artifacts) / ("crash-" + hashlib.sha1(data).hexdigest())
    path.write_bytes(data)
    return path


def mutationLoop(seconds, seed, artifacts):
    """
    Without coverage: mutate the seeds and what came of them, for
    C{seconds}.
    """
    rng = random.Random(seed)
    pool = list(SEEDS)
    runs = 0
    start = time.monotonic()
    seeds = list(SEEDS)
    while time.monotonic() - start < seconds:
        # The seeds as they are first, then mutations.
        data = seeds.pop(0) if seeds else mutate(rng, rng.choice(pool), pool)
        runs += 1
        try:
            testOneInput(data)
        except Exception:
            import traceback

            traceback.print_exc()
            print(f"after {runs} runs: reproducer written to {save(artifacts, data)}")
            return 1
        if len(pool) < 2000 and rng.random() < 0.1:
            pool.append(data)
    elapsed = time.monotonic() - start
    print(f"Done {runs} runs in {elapsed:.0f} second(s) ({runs / elapsed:.0f}/s), nothing found")
    return 0


def replay(paths):
    failures = 0
    for path in paths:
        try:
            testOneInput(Path(path).read_bytes())
        except Exception as error:
            failures += 1
            print(f"{path}: {type(error).__name__}: {error}"[:2000])
        else:
            print(f"{path}: ok")
    return 1 if failures else 0


def main():
    global _only, _watch
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60, help="how long to fuzz (default 60)")
    parser.add_argument("--target", choices=TARGET_NAMES, default=None, help="only this target")
    parser.add_argument(
        "--no-atheris", action="store_true", help="the mutation loop even if atheris is installed"
    )
    parser.add_argument("--seed", type=int, default=0, help="the mutation loop's random seed")
    parser.add_argument(
        "--corpus", default=None, help="atheris: the corpus folder (default: a new temporary one)"
    )
    parser.add_argument(
        "--artifacts", default=".", help="where reproducers are written (default: here)"
    )
    parser.add_argument(
        "--replay", nargs="+", metavar="FILE", help="run these inputs once each and report"
    )
    args = parser.parse_args()

    useAtheris = atheris is not None and not args.no_atheris and not args.replay
    if useAtheris:
        with atheris.instrument_imports(include=["dallal"]):
            _importTargets()
    else:
        _importTargets()
    _importTestPieces()
    if args.target is not None:
        _only = TARGETS[TARGET_NAMES.index(args.target)]
    _watch = LogWatch()
    print("reproduce: python3 bench/fuzz_frames.py " + shlex.join(sys.argv[1:]), flush=True)

    if args.replay:
        return replay(args.replay)
    if not useAtheris:
        why = "--no-atheris" if atheris is not None else "atheris is not installed"
        print(f"mutation loop ({why}), {args.seconds:g} s, seed {args.seed}", flush=True)
        return mutationLoop(args.seconds, args.seed, args.artifacts)

    corpus = args.corpus or tempfile.mkdtemp(prefix="dallal-fuzz-corpus-")
    os.makedirs(corpus, exist_ok=True)
    for data in SEEDS:
        Path(corpus, "seed-" + hashlib.sha1(data).hexdigest()).write_bytes(data)
    dictionary = Path(tempfile.mkdtemp(prefix="dallal-fuzz-dict-"), "tokens.dict")
    dictionary.write_text(
        "".join('"{}"\n'.format("".join(f"\\x{byte:02x}" for byte in token)) for token in TOKENS)
    )
    print(f"atheris (libFuzzer), {args.seconds:g} s, corpus {corpus}", flush=True)
    libFuzzerArguments = [
        sys.argv[0],
        f"-max_total_time={int(args.seconds)}",
        f"-dict={dictionary}",
        f"-artifact_prefix={os.path.join(args.artifacts, '')}",
        "-max_len=8192",
        "-len_control=10",
        "-rss_limit_mb=1024",
        "-print_final_stats=1",
        corpus,
    ]
    atheris.Setup(libFuzzerArguments, testOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    sys.exit(main())
