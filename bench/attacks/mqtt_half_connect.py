"""
mqtt-half-connect: connections that never complete their CONNECT cost
little, stall no one, and are closed.

A broker with --mqtt. From 127.0.0.1 the attacker opens 900 TCP
connections to it and sends nothing; from 127.0.0.3, 900 more that each
send half a CONNECT (its fixed header, announcing 60 bytes, and the first
10). For 15 s a normal client from 127.0.0.2 connects afresh every 0.25 s,
subscribes at QoS 1, publishes at QoS 1 on its own topic and times the
message's arrival. Then the attacker's connections wait, open, for the
broker's connect timeout (Dallal's: 60 s, the login timeout of its own
protocol).

PASS if the fresh client's median round trip (connect, subscribe, publish,
deliver) stays under 100 ms, the broker's resident memory grows by less
than 32 KiB per attacking connection, every attacking connection is
closed by the broker within 75 s of being opened, and (Dallal) each
closure is counted: a protocol_error with code LOGIN_TIMEOUT, logged or
counted in protocol_errors_suppressed. With --broker mosquitto, the same
against Mosquitto (no count asked of it).
"""

import re
import socket
import time

import attacklib as lib
from protocols import mqttRemainingLength, mqttString

NAME = "mqtt-half-connect"
SILENT = 900
HALF = 900
HALF_HOST = "127.0.0.3"
HOLD = 15.0
PROBE_INTERVAL = 0.25
LATENCY_LIMIT = 0.1
PER_CONNECTION_LIMIT = 32 * lib.KiB
CLOSED_WITHIN = 75.0
# The protocol errors over the log's rate are reported a second after the
# first of them (protocol_errors_suppressed): the count waits for them.
REPORTED_WITHIN = 2.0
TIMED_OUT = re.compile(rb"event=protocol_error .*?code=LOGIN_TIMEOUT")
SUPPRESSED = re.compile(rb"event=protocol_errors_suppressed code=LOGIN_TIMEOUT count=(\d+)")

# Half of a CONNECT of 60 bytes: its fixed header and the first 10.
HALF_CONNECT = bytes([0x10]) + mqttRemainingLength(60) + mqttString(b"MQTT") + bytes([4, 2, 0, 60])


def freshClientRoundTrip(port, number):
    """
    A new client connects, subscribes at QoS 1 to a topic of its own,
    publishes on it at QoS 1 and waits for the message.

    @return: the seconds it all took, or C{None} if it did not complete.
    """
    start = time.monotonic()
    client = lib.MqttClient(port, source=lib.OTHER_HOST, timeout=10)
    try:
        if client.connect(f"probe-{number}") != 0:
            return None
        topic = f"probe/{number}"
        if client.subscribe(topic, qos=1) != 1:
            return None
        client.send(client.publishPacket(topic, b"x", qos=1, packetId=2))
        got = client.waitFor(lambda kind, flags, body: kind == 3, 10)
        return None if got is None else time.monotonic() - start
    except (lib.Closed, OSError):
        return None
    finally:
        client.close()


def opened(port, source, first):
    sock = socket.socket()
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", port))
    if first:
        sock.sendall(first)
    sock.setblocking(False)
    return sock


def closedByBroker(sock):
    """
    Whether the broker closed C{sock} (an end of stream or a reset).
    """
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def timeoutsCounted(server):
    text = lib.logText(server)
    return len(TIMED_OUT.findall(text)) + sum(int(n) for n in SUPPRESSED.findall(text))


def attack(options):
    kind = options.broker
    with lib.scratch() as directory:
        with lib.anyMqttBroker(kind, directory) as (server, port):
            if freshClientRoundTrip(port, 0) is None:
                raise lib.BenchError("the probe could not complete a round trip before the attack")
            baseline = server.residentMemory()
            start = time.monotonic()
            attackers = [opened(port, lib.ATTACKER_HOST, b"") for _ in range(SILENT)]
            attackers += [opened(port, HALF_HOST, HALF_CONNECT) for _ in range(HALF)]
            openedIn = time.monotonic() - start
            samples, failed = [], 0
            holdStart = time.monotonic()
            number = 0
            while time.monotonic() - holdStart < HOLD:
                number += 1
                took = freshClientRoundTrip(port, number)
                if took is None:
                    failed += 1
                else:
                    samples.append(took)
                time.sleep(PROBE_INTERVAL)
            growth = server.residentMemory() - baseline
            stillOpen = list(attackers)
            while stillOpen and time.monotonic() - start < CLOSED_WITHIN:
                time.sleep(1.0)
                stillOpen = [sock for sock in stillOpen if not closedByBroker(sock)]
            closedAfter = time.monotonic() - start
            for sock in attackers:
                sock.close()
            counted = None
            if kind == "dallal":
                time.sleep(REPORTED_WITHIN)
                counted = timeoutsCounted(server)
    total = SILENT + HALF
    perConnection = growth / total
    latency = lib.median(samples)
    passed = (
        latency < LATENCY_LIMIT
        and not failed
        and perConnection < PER_CONNECTION_LIMIT
        and not stillOpen
        and (counted is None or counted == total)
    )
    countedText = "" if counted is None else f", {counted}/{total} counted as LOGIN_TIMEOUT"
    figure = (
        f"{kind}: {SILENT} silent connections and {HALF} with half a CONNECT opened in "
        f"{openedIn:.1f} s; a fresh client's connect+subscribe+publish+deliver median "
        f"{lib.ms(latency)} (p95 {lib.ms(lib.percentile(samples, 0.95))}, {failed} failed of "
        f"{len(samples) + failed}); RSS +{lib.mib(growth)} "
        f"({perConnection / lib.KiB:.1f} KiB per connection); "
        f"{total - len(stillOpen)}/{total} closed by the broker "
        f"{'within' if not stillOpen else 'after'} {closedAfter:.0f} s{countedText} "
        f"(limits: median < {lib.ms(LATENCY_LIMIT)}, none failed, "
        f"< {PER_CONNECTION_LIMIT // lib.KiB} KiB per connection, all closed within "
        f"{CLOSED_WITHIN:g} s, each counted)"
    )
    return passed, figure


if __name__ == "__main__":
    lib.runAttack(NAME, __doc__, attack, peers=("mosquitto",))
