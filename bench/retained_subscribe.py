"""
A subscription to C{#} over many retained messages, against a probe: does
one client subscribing to everything stall the others?

    python3 bench/retained_subscribe.py                  # 100,000 retained topics
    python3 bench/retained_subscribe.py --retained 20000 --no-read

Starts a fresh broker (`twistd -n dallal` on a free loopback port), fills
its store with --retained retained messages of 16 bytes (`PUB ... retain=1`,
pipelined within a window), then starts a probe: a subscriber on `probe`
(mode `fire`) and a publisher that publishes on it every --interval seconds,
timing each publish until its MSG arrives.  After --settle seconds of
probing alone, an attacker connection sends `SUB 1 # mode=fire` and reads
what comes (or, with --no-read, never reads).  The script prints the probe's
round trips (median, 99th percentile and worst) before and while the
attacker is served, how long the attacker took to receive every retained
message, and the broker's peak memory (VmHWM), then one verdict line:
PASS when the probe's median round trip while the attacker is served stays
under 100 ms.  Bounded: every wait has a deadline.
"""

import argparse
import os
import shlex
import socket
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from brokerproc import BenchError, Broker  # noqa: E402

PAYLOAD = b"r" * 16
FILL_WINDOW = 2000
TARGET_MEDIAN = 0.100


def connect(port):
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def readUntil(sock, marker, deadline, buffer=b""):
    """
    Read until C{marker} is in what was read (PINGs are answered).

    @return: what was read after the marker.
    """
    while marker not in buffer:
        if b"PING\r\n" in buffer:
            sock.sendall(b"PONG\r\n")
            buffer = buffer.replace(b"PING\r\n", b"")
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        data = sock.recv(1 << 16)
        if not data:
            raise BenchError("the broker closed a connection")
        buffer += data
        if time.monotonic() > deadline:
            raise BenchError(f"no {marker!r} in time")
    return buffer.split(marker, 1)[1]


def fill(port, count, timeout):
    """
    Publish C{count} retained messages on r/000000..., a window at a time.
    """
    deadline = time.monotonic() + timeout
    sock = connect(port)
    sent = acked = 0
    buffer = b""
    while acked < count:
        while sent < count and sent - acked < FILL_WINDOW:
            batch = min(count - sent, FILL_WINDOW - (sent - acked))
            sock.sendall(
                b"".join(
                    b"PUB %d r/%06d %d retain=1\r\n%s\r\n" % (n, n, len(PAYLOAD), PAYLOAD)
                    for n in range(sent, sent + batch)
                )
            )
            sent += batch
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        data = sock.recv(1 << 16)
        if not data or time.monotonic() > deadline:
            raise BenchError(f"filling the store stopped at {acked} of {count}")
        buffer += data
        if b"ERR" in buffer:
            raise BenchError(f"the broker refused a retained publish: {buffer[:200]!r}")
        lines = buffer.split(b"\r\n")
        buffer = lines.pop()
        acked += sum(1 for line in lines if line.startswith(b"PUBACK"))
    sock.close()


class Attacker(threading.Thread):
    """
    Subscribes to C{#} and reads (or not) what comes, counting MSGs.
    """

    def __init__(self, port, expected, read, timeout):
        threading.Thread.__init__(self, daemon=True)
        self.sock = connect(port)
        self.expected = expected
        self.read = read
        self.deadline = time.monotonic() + timeout
        self.received = 0
        self.seconds = None

    def run(self):
        started = time.monotonic()
        self.sock.sendall(b"SUB 1 # mode=fire\r\n")
        if not self.read:
            return
        tail = b""
        try:
            while self.received < self.expected and time.monotonic() < self.deadline:
                self.sock.settimeout(max(0.01, self.deadline - time.monotonic()))
                data = self.sock.recv(1 << 20)
                if not data:
                    return
                chunk = tail + data
                self.received += chunk.count(b"\r\nMSG ") + chunk.startswith(b"MSG ")
                tail = chunk[-6:]
        except TimeoutError:
            return
        self.seconds = time.monotonic() - started


def probe(port, seconds, interval, stopWhen=None):
    """
    Publish on C{probe} every C{interval} seconds for C{seconds} (or until
    C{stopWhen()}), each time waiting for its MSG.

    @return: the round trips, in seconds.
    """
    subscriber = connect(port)
    subscriber.sendall(b"SUB 1 probe mode=fire\r\n")
    readUntil(subscriber, b"SUBACK 1\r\n", time.monotonic() + 10)
    publisher = connect(port)
    trips = []
    end = time.monotonic() + seconds
    number = 0
    while time.monotonic() < end and not (stopWhen and stopWhen()):
        number += 1
        payload = b"%08d" % number
        started = time.monotonic()
        publisher.sendall(b"PUB %d probe %d\r\n%s\r\n" % (number, len(payload), payload))
        readUntil(subscriber, b"\r\n" + payload + b"\r\n", started + 30)
        trips.append(time.monotonic() - started)
        time.sleep(interval)
    subscriber.close()
    publisher.close()
    return trips


def summary(trips):
    trips = sorted(trips)
    if not trips:
        return "no round trips"
    p99 = trips[min(len(trips) - 1, int(len(trips) * 0.99))]
    return (
        f"{len(trips)} round trips, median {statistics.median(trips) * 1000:.1f} ms, "
        f"p99 {p99 * 1000:.1f} ms, worst {trips[-1] * 1000:.1f} ms"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--retained", type=int, default=100_000)
    parser.add_argument("--interval", type=float, default=0.005)
    parser.add_argument("--settle", type=float, default=2.0)
    parser.add_argument("--seconds", type=float, default=30.0, help="at most, with the attacker")
    parser.add_argument("--no-read", dest="read", action="store_false")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        broker = Broker(directory)
        try:
            started = time.monotonic()
            fill(broker.port, args.retained, timeout=300)
            print(
                f"stored {args.retained} retained messages in {time.monotonic() - started:.1f} s",
                flush=True,
            )
            alone = probe(broker.port, args.settle, args.interval)
            attacker = Attacker(broker.port, args.retained, args.read, args.seconds)
            attacker.start()
            served = probe(
                broker.port,
                args.seconds,
                args.interval,
                stopWhen=lambda: args.read and not attacker.is_alive(),
            )
            attacker.join(args.seconds)
            peak = broker.peakMemory()
            print("probe alone:        " + summary(alone))
            print("probe with attacker: " + summary(served))
            if args.read:
                took = (
                    "did not finish" if attacker.seconds is None else f"in {attacker.seconds:.2f} s"
                )
                print(
                    f"attacker received {attacker.received} messages ({args.retained} "
                    f"retained, and the broker's own $SYS topics) {took}"
                )
            print(f"broker peak memory {peak / 2**20:.0f} MiB")
        finally:
            broker.stop()
    median = statistics.median(served) if served else float("inf")
    verdict = "PASS" if median < TARGET_MEDIAN else "FAIL"
    print(
        f"{verdict} retained_subscribe: probe median {median * 1000:.1f} ms while "
        f"SUB # over {args.retained} retained messages is served (target < 100 ms)"
    )
    print("reproduce: python3 " + " ".join(shlex.quote(a) for a in sys.argv))
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
