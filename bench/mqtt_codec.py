"""
How many 64-byte QoS 0 PUBLISH packets a second can dallal.protocol.mqtt
decode and encode, on one core?

Decoding feeds a stream of pipelined packets to one MQTTDecoder in reads of
a given size (Twisted's TCP transport reads at most 64 KiB at a time).
Encoding is measured twice: Publish.encode, building the packet object, and
encodePublishHeader, what the broker does for each subscriber (the topic is
encoded once, the payload is not copied).

    python3 bench/mqtt_codec.py
    python3 bench/mqtt_codec.py --version 4 --packets 200000 --repeat 7
"""

import argparse
import shlex
import statistics
import sys
import time

from dallal.protocol.mqtt import (
    MQTTDecoder,
    Publish,
    encodePublishHeader,
)

TOPIC = "sensors/kitchen/temperature"
PAYLOAD = b"x" * 64


def bestRate(function, count, repeat):
    """
    Run C{function} C{repeat} times; the median rate of C{count} operations.
    """
    rates = []
    for _ in range(repeat):
        started = time.perf_counter()
        function()
        rates.append(count / (time.perf_counter() - started))
    return statistics.median(rates)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--version", type=int, choices=(4, 5), default=5)
    parser.add_argument("--packets", type=int, default=100_000)
    parser.add_argument("--read-size", type=int, default=65536)
    parser.add_argument("--repeat", type=int, default=5)
    options = parser.parse_args(argv)
    version = options.version
    count = options.packets

    packet = Publish(TOPIC, PAYLOAD)
    encoded = packet.encode(version)
    stream = encoded * count
    reads = [
        stream[start : start + options.read_size]
        for start in range(0, len(stream), options.read_size)
    ]

    def decode():
        decoder = MQTTDecoder(version)
        decoded = 0
        for data in reads:
            for _ in decoder.feed(data):
                decoded += 1
        assert decoded == count, decoded

    def encodeObjects():
        for _ in range(count):
            packet.encode(version)

    topic = TOPIC.encode("utf-8")
    properties = b"\x00" if version == 5 else None

    def encodeHeaders():
        for _ in range(count):
            encodePublishHeader(topic, len(PAYLOAD), 0, None, False, False, properties)

    print(
        f"MQTT {'5' if version == 5 else '3.1.1'}, {len(encoded)}-byte QoS 0 PUBLISH "
        f"({len(PAYLOAD)}-byte payload), {count} packets, median of {options.repeat}"
    )
    print(
        f"  decode ({options.read_size}-byte reads): {bestRate(decode, count, options.repeat):>12,.0f}/s"
    )
    print(
        f"  Publish.encode:            {bestRate(encodeObjects, count, options.repeat):>12,.0f}/s"
    )
    print(
        f"  encodePublishHeader:       {bestRate(encodeHeaders, count, options.repeat):>12,.0f}/s"
    )
    print(f"  command: {shlex.join([sys.executable, *sys.argv])}")


if __name__ == "__main__":
    main()
