"""
A firehose against the real broker: one publisher writes all its PUB frames
in one C{sendall}, with no window (as a burst or a replayed backlog does),
to one subscriber that reads (and in modes C{all} and C{latest} acks) as
fast as it can.  It reports how many of the messages were delivered, what
the broker's counters say happened to the others, and the broker's peak
memory and CPU time.

    python3 bench/firehose.py                       # 200,000 64-byte PUBs, mode all
    python3 bench/firehose.py --mode fire --messages 50000

Without flow control the broker drops what its bounded queue cannot hold
(docs/FLOW-CONTROL.md); with it, the publisher is slowed down instead and
every message arrives.
"""

import argparse
import select
import shlex
import socket
import sys
import tempfile
import threading
import time

from brokerproc import BenchError, Broker, ControlConnection
from protocols import DallalClient, lastPayload, payload

TOPIC = b"firehose"
# Seconds without a byte for the subscriber before it gives up on the rest.
IDLE_TIMEOUT = 10.0


class Reader(threading.Thread):
    """
    Reads one connection to the end (or until idle), feeding a protocol
    stream and sending back what it answers (acks, pongs).
    """

    def __init__(self, sock, stream, until):
        threading.Thread.__init__(self, daemon=True)
        self.sock = sock
        self.stream = stream
        self.until = until
        self.lastRead = time.monotonic()
        self.error = None

    def run(self):
        try:
            while not self.until(self.stream):
                # select, not a socket timeout: the publisher's sendall on
                # the same socket must block for as long as it takes.
                readable, _, _ = select.select([self.sock], [], [], 0.5)
                if not readable:
                    if time.monotonic() - self.lastRead > IDLE_TIMEOUT:
                        return
                    continue
                data = self.sock.recv(262144)
                if not data:
                    return
                self.lastRead = time.monotonic()
                replies = self.stream.feed(data)
                if replies:
                    self.sock.sendall(replies)
        except (OSError, BenchError) as error:
            self.error = error


def connect(port):
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def firehose(options):
    client = DallalClient(options.mode)
    with tempfile.TemporaryDirectory(prefix="dallal-firehose-") as directory:
        broker = Broker(directory, extra=options.broker_option)
        try:
            subscriberSocket = connect(broker.port)
            subscriberSocket.sendall(client.subscribe(0, [TOPIC]))
            subscription = client.stream()
            subscriber = Reader(
                subscriberSocket, subscription, lambda stream: stream.lastMarkers >= 1
            )
            while not client.subscribed(subscription, [TOPIC]):
                subscription.feed(subscriberSocket.recv(65536))
            subscriber.start()

            frames = b"".join(
                client.publish(TOPIC, payload(options.payload), number)
                for number in range(options.messages - 1)
            ) + client.publish(TOPIC, lastPayload(options.payload), options.messages - 1)
            publisherSocket = connect(broker.port)
            acks = DallalClient("fire").stream()
            publisher = Reader(
                publisherSocket, acks, lambda stream: stream.acks >= options.messages
            )
            publisher.start()
            cpuBefore = broker.cpuSeconds()
            started = time.monotonic()
            publisherSocket.sendall(frames)
            written = time.monotonic() - started
            publisher.join()
            acked = time.monotonic() - started
            subscriber.join()
            # The subscriber's last read, not the idle timeout after it.
            elapsed = subscriber.lastRead - started
            cpu = broker.cpuSeconds() - cpuBefore
            control = ControlConnection(broker.port)
            counters = control.stats()
            control.close()
            peak = broker.peakMemory()
            for reader in (publisher, subscriber):
                if reader.error is not None:
                    raise BenchError(f"a connection failed: {reader.error}")
        finally:
            broker.stop()
    delivered = subscription.messages
    print(
        f"mode {options.mode}: {options.messages:,} PUBs of {options.payload} bytes "
        f"in one sendall ({len(frames) / 1e6:.1f} MB), one subscriber"
    )
    print(
        f"delivered   {delivered:,} / {options.messages:,} "
        f"({100 * delivered / options.messages:.1f}%)"
    )
    print(f"PUBACKs     {acks.acks:,}")
    print(
        f"broker      dropped {counters['dropped']:,} "
        f"(queue_full {counters['dropped_queue_full']:,}), "
        f"publishers_paused {counters.get('publishers_paused', '-')}, "
        f"slow_consumers {counters.get('slow_consumers', '-')}"
    )
    print(
        f"time        sendall returned after {written:.2f} s, last PUBACK "
        f"{acked:.2f} s, last message {elapsed:.2f} s: "
        f"{delivered / elapsed:,.0f} deliveries/s"
    )
    print(f"broker CPU  {cpu:.2f} s: {delivered / cpu:,.0f} deliveries per CPU-second")
    print(f"peak RSS    {peak / 2**20:.1f} MiB (VmHWM)")
    print(f"broker      {broker.reproduce()}")
    print("reproduce   " + shlex.join([sys.executable, *sys.argv]))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("all", "fire", "latest"), default="all")
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--payload", type=int, default=64, help="bytes per message")
    parser.add_argument(
        "--broker-option",
        action="append",
        default=[],
        help="an option for twistd dallal, such as --broker-option=--stall-timeout=2 (repeatable)",
    )
    options = parser.parse_args(argv)
    firehose(options)


if __name__ == "__main__":
    main()
