"""
How fast can a receiver split a stream of small pipelined PUB frames?

Twisted's LineReceiver copies the rest of its buffer for every line it
splits off (twisted/twisted#6357), and a receiver that reads counted
payloads with setRawMode/setLineMode copies it again when it hands back
what follows a payload: a read holding thousands of frames costs time
quadratic in its size.  dallal.protocol.framing.FrameReceiver walks the buffer with
an offset instead.  This feeds both the same stream, cut into reads of a
given size, and prints frames per second.

    python3 bench/framing.py
    python3 bench/framing.py --read-sizes 4096 65536 --repeat 7

Twisted's TCP transport reads at most 64 KiB at a time, so 64 KiB is what
the broker sees when a publisher pipelines faster than it is served; 1 MiB
shows how the cost grows with the read.
"""

import argparse
import shlex
import statistics
import time

from twisted.internet.testing import StringTransport
from twisted.protocols.basic import LineReceiver

from dallal.protocol.framing import FrameReceiver

PAYLOAD = b"x" * 64


class PayloadCounter:
    """
    What both receivers do with a frame, so that only framing differs.
    """

    payloads = 0
    payloadBytes = 0

    def publishSize(self, line):
        # PUB <id> <topic> <size>
        return int(line.split()[3])

    def countPayload(self, payload):
        self.payloads += 1
        self.payloadBytes += len(payload)


class RawModeReceiver(PayloadCounter, LineReceiver):
    """
    Counted payloads the usual LineReceiver way: raw mode for the payload,
    then back to line mode with whatever followed it.
    """

    MAX_LENGTH = 4096

    def __init__(self):
        self._wanted = 0
        self._parts = []

    def lineReceived(self, line):
        self._wanted = self.publishSize(line) + 2  # the payload and its CRLF
        self.setRawMode()

    def rawDataReceived(self, data):
        if len(data) < self._wanted:
            # The payload continues in the next read.
            self._parts.append(data)
            self._wanted -= len(data)
            return
        self._parts.append(data[: self._wanted])
        payload = b"".join(self._parts)[:-2]
        self._parts = []
        self.countPayload(payload)
        self.setLineMode(data[self._wanted :])


class CountingFrameReceiver(PayloadCounter, FrameReceiver):
    """
    The same, with dallal's FrameReceiver.
    """

    def lineReceived(self, line):
        self.expectPayload(self.publishSize(line))

    def payloadReceived(self, payload):
        self.countPayload(payload)


RECEIVERS = {
    "LineReceiver + setRawMode": RawModeReceiver,
    "dallal FrameReceiver": CountingFrameReceiver,
}


def pipelinedReads(frames, readSize):
    """
    C{frames} PUB frames back to back, cut into reads of C{readSize} bytes
    (the last may be shorter), as a client writing faster than the broker
    reads would deliver them.
    """
    stream = b"".join(
        b"PUB %d bench %d\r\n%s\r\n" % (number, len(PAYLOAD), PAYLOAD) for number in range(frames)
    )
    return [stream[offset : offset + readSize] for offset in range(0, len(stream), readSize)]


def framesPerSecond(receiverClass, reads, frames):
    receiver = receiverClass()
    receiver.makeConnection(StringTransport())
    started = time.perf_counter()
    for data in reads:
        receiver.dataReceived(data)
    elapsed = time.perf_counter() - started
    if (receiver.payloads, receiver.payloadBytes) != (frames, frames * len(PAYLOAD)):
        raise AssertionError(
            f"{receiverClass.__name__} read {receiver.payloads} payloads of "
            f"{receiver.payloadBytes} bytes in all, instead of {frames} of "
            f"{len(PAYLOAD)} bytes"
        )
    return frames / elapsed


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--read-sizes",
        type=int,
        nargs="+",
        default=[4096, 65536, 1048576],
        help="bytes per dataReceived call (default: 4096 65536 1048576)",
    )
    parser.add_argument(
        "--stream-mib",
        type=int,
        default=8,
        help="MiB of frames fed per repetition (default: %(default)s)",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=5,
        help="repetitions; the median is printed (default: %(default)s)",
    )
    arguments = parser.parse_args(argv)
    frameSize = len(b"PUB 100000 bench 64\r\n") + len(PAYLOAD) + 2
    for readSize in arguments.read_sizes:
        frames = arguments.stream_mib * 2**20 // frameSize
        reads = pipelinedReads(frames, readSize)
        print(
            f"{readSize:,}-byte reads, {frames / len(reads):,.0f} frames each, "
            f"{frames:,} frames per repetition, median of {arguments.repeat}:"
        )
        rates = {name: [] for name in RECEIVERS}
        for _ in range(arguments.repeat):
            # Interleaved, so that a burst of load on the machine hits both.
            for name, receiverClass in RECEIVERS.items():
                rates[name].append(framesPerSecond(receiverClass, reads, frames))
        medians = {}
        for name, values in rates.items():
            medians[name] = statistics.median(values)
            print(
                f"  {name:<27} {medians[name]:>12,.0f} frames/s"
                f"  (min {min(values):,.0f}, max {max(values):,.0f})"
            )
        lineRate, frameRate = medians.values()
        print(f"  FrameReceiver / LineReceiver: {frameRate / lineRate:.1f}x")
    command = [
        "python3",
        "bench/framing.py",
        "--read-sizes",
        *map(str, arguments.read_sizes),
        "--stream-mib",
        str(arguments.stream_mib),
        "--repeat",
        str(arguments.repeat),
    ]
    print(f"\nreproduce: {shlex.join(command)}")


if __name__ == "__main__":
    main()
