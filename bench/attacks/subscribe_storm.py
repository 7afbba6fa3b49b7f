"""
subscribe-storm: a subscription's cost is bounded too (beyond the issue's
list).

Two attacks a client may make with nothing but SUB and UNSUB, while a probe
client (from 127.0.0.2) times its publish -> deliver round trip every
50 ms:

 A. retained replay: the broker holds 20,000 retained topics; the attacker
    sends, every second for 10 s, 30 pipelined UNSUB+SUB pairs with
    distinct filters that each match all of them (#, retained/#,
    retained/+, +/+, +/#, ...), mode fire, and reads nothing. Each SUB
    replays every matching retained message: one request costs 20,000
    deliveries.
 B. churn: for 10 s, the attacker pipelines SUB x / UNSUB x pairs (each
    also empties the broker's route cache and logs an event), reading the
    answers.

PASS if the probe's median round trip stays under 100 ms in both, and B
grows the broker's log by less than 1 MiB (as errors, subscription events
a client can make at will need a rate limit or a lower level).

With --broker mosquitto, A on Mosquitto (its probe times a QoS 1 publish
until its PUBACK).
"""

import socket
import time

import attacklib as lib

NAME = "subscribe-storm"
RETAINED = 20_000
LATENCY_LIMIT = 0.1
LOG_LIMIT = lib.MiB
CHURN_SECONDS = 10.0
REPLAY_SECONDS = 10.0
REPLAY_FILTERS = ["#", "retained/#", "retained/+", "+/+", "+/#", "+/+/#"] + [
    "+/" * depth + "#" for depth in range(3, 27)
]


def everySecond(sock, data, result):
    """
    Send C{data} on C{sock} once a second for L{REPLAY_SECONDS}, reading
    nothing; count the rounds in C{result}.
    """
    rounds = 0
    start = time.monotonic()
    while time.monotonic() - start < REPLAY_SECONDS:
        sock.sendall(data)
        rounds += 1
        time.sleep(max(0.0, start + rounds - time.monotonic()))
    sock.close()
    result["rounds"] = rounds


def retainedReplay(broker, result):
    attacker = lib.Connection(broker.port, receiveBuffer=4096, timeout=60)
    subscribe = b"".join(
        b"UNSUB u%d %s\r\nSUB s%d %s mode=fire\r\n" % (k, f.encode(), k, f.encode())
        for k, f in enumerate(REPLAY_FILTERS)
    )
    everySecond(attacker.sock, subscribe, result)


def churn(broker, result):
    attacker = lib.Connection(broker.port, timeout=60)
    pairs = 0
    end = time.monotonic() + CHURN_SECONDS
    while time.monotonic() < end:
        attacker.send(b"SUB s churn/x\r\nUNSUB u churn/x\r\n" * 100)
        for _ in range(100):
            if attacker.waitFor(lambda line: line == b"UNSUBACK u", 30) is None:
                raise lib.BenchError("the churn's UNSUBs were not answered in 30 s")
        pairs += 100
    attacker.close()
    result["pairs"] = pairs


def attack():
    with lib.scratch() as directory, lib.dallal(directory) as broker:
        lib.fillRetained(broker.port, RETAINED)
        probe = lib.DallalProbe(broker.port)
        result = {}
        samplesA = lib.probeDuring(probe, lambda: retainedReplay(broker, result))
        logBefore = lib.logSize(broker)
        samplesB = lib.probeDuring(probe, lambda: churn(broker, result))
        logGrowth = lib.logSize(broker) - logBefore
        probe.close()
    medianA, medianB = lib.median(samplesA), lib.median(samplesB)
    passed = medianA < LATENCY_LIMIT and medianB < LATENCY_LIMIT and logGrowth < LOG_LIMIT
    figure = (
        f"A ({result['rounds']} rounds of {len(REPLAY_FILTERS)} pipelined UNSUB+SUB over "
        f"{RETAINED} retained topics, in mode fire): probe "
        f"median {lib.ms(medianA)}, max {lib.ms(max(samplesA))}; B ({result['pairs']} SUB/UNSUB "
        f"pairs in {CHURN_SECONDS:g} s): probe median {lib.ms(medianB)}, max "
        f"{lib.ms(max(samplesB))}, log +{logGrowth / lib.MiB:.1f} MiB "
        f"(limits: median < {lib.ms(LATENCY_LIMIT)}, log < {lib.mib(LOG_LIMIT)})"
    )
    return passed, figure


def attackMosquitto():
    """
    A on Mosquitto: its retained messages replayed to each SUBSCRIBE (QoS
    0), by an attacker that reads nothing.
    """
    from protocols import mqttPacket, mqttString

    def connect(clientId, receiveBuffer=None):
        sock = socket.socket()
        if receiveBuffer:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receiveBuffer)
        sock.connect(("127.0.0.1", server.port))
        sock.sendall(
            mqttPacket(1, 0, mqttString(b"MQTT") + bytes([4, 2, 0, 60]) + mqttString(clientId))
        )
        return sock

    with lib.scratch() as directory, lib.peer("mosquitto", directory) as server:
        filler = connect(b"filler")
        filler.sendall(
            b"".join(
                mqttPacket(3, 1, mqttString(b"retained/%d" % k) + b"x") for k in range(RETAINED)
            )
        )
        time.sleep(1)
        filler.close()
        # Check they are retained: a subscriber to them all gets them all.
        checker = connect(b"checker")
        checker.sendall(mqttPacket(8, 2, b"\x00\x01" + mqttString(b"retained/#") + b"\x00"))
        received = b""
        checker.settimeout(2)
        try:
            while received.count(b"retained/") < RETAINED:
                data = checker.recv(1 << 20)
                if not data:
                    break
                received += data
        except TimeoutError:
            pass
        checker.close()
        if received.count(b"retained/") < RETAINED:
            raise lib.BenchError(
                f"mosquitto kept {received.count(b'retained/')} of {RETAINED} retained messages"
            )
        probe = lib.PeerPublishProbe("mosquitto", server.port)
        attacker = connect(b"replayer", receiveBuffer=4096)
        rounds = b"".join(
            mqttPacket(10, 2, (2 * k + 1).to_bytes(2, "big") + mqttString(f.encode()))
            + mqttPacket(8, 2, (2 * k + 2).to_bytes(2, "big") + mqttString(f.encode()) + b"\x00")
            for k, f in enumerate(REPLAY_FILTERS)
        )
        result = {}
        samples = lib.probeDuring(probe, lambda: everySecond(attacker, rounds, result))
        probe.close()
    passed = lib.median(samples) < LATENCY_LIMIT
    figure = (
        f"mosquitto: A ({result['rounds']} rounds of {len(REPLAY_FILTERS)} UNSUBSCRIBE+SUBSCRIBE "
        f"over {RETAINED} retained topics, QoS 0, never reading): probe QoS 1 publish->PUBACK "
        f"median {lib.ms(lib.median(samples))}, max {lib.ms(max(samples))} "
        f"(limit: median < {lib.ms(LATENCY_LIMIT)})"
    )
    return passed, figure


if __name__ == "__main__":
    lib.runAttack(
        NAME,
        __doc__,
        lambda options: attack() if options.broker == "dallal" else attackMosquitto(),
        peers=("mosquitto",),
    )
