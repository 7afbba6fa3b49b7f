"""
mqtt-fuzz: no traceback from any MQTT input, end to end.

The codec has its own property tests; this sends what they generate, and
worse, to a running broker: valid MQTT 3.1.1 and 5.0 packets (CONNECT with
a will and properties, PUBLISH at every QoS with user properties and topic
aliases, SUBSCRIBE with options and identifiers, UNSUBSCRIBE, PUBREL, ...),
each mutated at a random byte (flipped, cut, repeated, its remaining
length made huge), on fresh connections, before and after a valid
CONNECT (--seed, 28 by default), for 20 s.

PASS if the log holds no Traceback or Unhandled error, the broker is
alive, and a probe's QoS 1 publish round trip meanwhile stays under
100 ms (median). With --broker mosquitto, the same against Mosquitto (its
log is not read for tracebacks).
"""

import random
import time

import attacklib as lib
from protocols import mqttPacket as packet
from protocols import mqttRemainingLength as varint
from protocols import mqttString as string

NAME = "mqtt-fuzz"
SECONDS = 20.0


def properties(version, encoded):
    return varint(len(encoded)) + encoded if version == 5 else b""


def samples(version, rng):
    """
    Valid packets of C{version} to mutate (after a CONNECT).
    """
    user = b"\x26" + string(b"k" * rng.randint(0, 50)) + string(b"v" * rng.randint(0, 50))
    publishProperties = user + b"\x23\x00\x01" + b"\x01\x01" + b"\x02\x00\x00\x00\x05"
    subscribeProperties = b"\x0b" + varint(rng.randint(1, 268435455))
    return [
        packet(3, 0, string(b"fuzz/a") + properties(version, publishProperties) + b"payload"),
        packet(3, 2, string(b"fuzz/b") + b"\x00\x07" + properties(version, user) + b"x" * 100),
        packet(3, 4, string(b"fuzz/c") + b"\x00\x08" + properties(version, b"") + b"q2"),
        packet(3, 1, string(b"fuzz/r") + properties(version, b"") + b"retained"),
        packet(6, 2, b"\x00\x08" + (b"\x00" + varint(0) if version == 5 else b"")),
        packet(4, 0, b"\x00\x01"),
        packet(5, 0, b"\x00\x02"),
        packet(7, 0, b"\x00\x03"),
        packet(
            8,
            2,
            b"\x00\x09"
            + properties(version, subscribeProperties)
            + string(b"fuzz/#")
            + bytes([rng.choice([0, 1, 2, 0x2D if version == 5 else 1])])
            + string(b"$share/g/fuzz/+")
            + b"\x01",
        ),
        packet(10, 2, b"\x00\x0a" + properties(version, b"") + string(b"fuzz/#")),
        packet(12, 0, b""),
        packet(14, 0, (b"\x04" + varint(5) + b"\x11\x00\x00\x00\x0a") if version == 5 else b""),
        packet(15, 0, b"\x00" + varint(0)),
    ]


def connectPacket(version, rng):
    will = properties(version, b"\x18\x00\x00\x00\x01" + b"\x26" + string(b"a") + string(b"b"))
    connectProperties = b"\x11\x00\x00\x00\x3c\x21\x00\x05\x22\x00\x02\x27\x00\x01\x00\x00"
    flags = 0x02 | 0x04 | 0x08 | (0x20 if rng.random() < 0.5 else 0)
    body = (
        string(b"MQTT")
        + bytes([version, flags])
        + b"\x00\x3c"
        + properties(version, connectProperties)
        + string(b"fuzz-%d" % rng.randint(0, 20))
        + will
        + string(b"fuzz/will")
        + string(b"gone")
    )
    return packet(1, 0, body)


def mutate(data, rng):
    data = bytearray(data)
    kind = rng.randrange(6)
    position = rng.randrange(len(data))
    if kind == 0:
        data[position] ^= 1 << rng.randrange(8)
    elif kind == 1:
        data[position] = rng.randrange(256)
    elif kind == 2:
        del data[position:]
    elif kind == 3:
        data[position:position] = data[position:][: rng.randint(1, 20)]
    elif kind == 4:
        # A remaining length of four bytes, as large as it may be.
        data[1:2] = b"\xff\xff\xff\x7f"
    else:
        data[position:position] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
    return bytes(data)


def fuzzOnce(port, rng):
    version = rng.choice([4, 5])
    stream = b""
    if rng.random() < 0.8:
        connect = connectPacket(version, rng)
        stream += connect if rng.random() < 0.8 else mutate(connect, rng)
    for _ in range(rng.randint(1, 6)):
        chosen = rng.choice(samples(version, rng))
        stream += mutate(chosen, rng) if rng.random() < 0.7 else chosen
    client = lib.MqttClient(port, timeout=2)
    try:
        client.send(stream)
        deadline = time.monotonic() + 0.2
        while time.monotonic() < deadline:
            if client.readPacket(0.05) is None:
                break
    except (lib.Closed, OSError):
        pass
    finally:
        client.close()


def attack(options):
    rng = random.Random(options.seed)
    with lib.scratch() as directory:
        with lib.anyMqttBroker(options.broker, directory) as (server, port):
            probe = lib.PeerPublishProbe("mosquitto", port)
            sent = [0]

            def fuzz():
                end = time.monotonic() + SECONDS
                while time.monotonic() < end:
                    fuzzOnce(port, rng)
                    sent[0] += 1

            samples_ = probe.during(fuzz)
            probe.close()
            server.checkAlive()
            log = lib.logText(server) if options.broker == "dallal" else b""
    tracebacks = log.count(b"Traceback") + log.count(b"Unhandled")
    delay = lib.median(samples_)
    figure = (
        f"{sent[0]} connections of mutated packets in {SECONDS:.0f} s: {tracebacks} tracebacks "
        f"logged ({log.count(b'event=protocol_error')} protocol_error events), the probe's median "
        f"round trip {lib.ms(delay)}"
    )
    return tracebacks == 0 and delay < 0.1, figure


def addArguments(parser):
    parser.add_argument("--seed", type=int, default=28, help="the random seed (default 28)")


if __name__ == "__main__":
    lib.runAttack(NAME, __doc__, attack, peers=("mosquitto",), addArguments=addArguments)
