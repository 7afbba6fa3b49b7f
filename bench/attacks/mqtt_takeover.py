"""
mqtt-takeover: two connections that take one client id from each other in
a loop cost no more as it goes on, and stall no one.

A broker with --mqtt. Two pairs of attacking connections: in each pair,
two threads connect with the same client id, one pair with Clean Session
0 (its session outlives each connection, and goes from one to the other),
the other with Clean Session 1 (each CONNECT ends the session and starts
another). Each connection has a will (published when the other takes the
client id over), subscribes to pingpong/# at QoS 1, and waits until it is
closed, acking nothing; then it connects again at once, taking the client
id back. For the first 5 s a publisher sends 200 QoS 1 messages a second
to pingpong/data: the kept session holds what it can of them (its window
and its queue, 1100 by default), unacked, and each connection that takes
it over is sent them again (and the wills keep coming). A normal client
from 127.0.0.2 times a QoS 1 publish every 50 ms, for 45 s.

PASS if the probe's median round trip stays under 100 ms, the broker's
resident memory grows by less than 4 MiB from 5 s (the kept session holds
its messages) to 45 s (tens of thousands of takeovers later), and once the
attackers are gone the broker holds one session for the two client ids
(the Clean Session 0 one, whose client is away) besides the probe's:
nothing of the others is left. With --broker mosquitto, the same against
Mosquitto (its sessions not counted).

Each takeover publishes a will, queued for the kept session behind its
unacked messages: a message that kept a strong reference to its publisher
kept each closed connection's whole session alive while it waited, and
the broker grew by 5 to 12 MiB in the first 30 s until the queue was full
of them, then levelled off.  The figure also gives the growth from 25 s
to 45 s, the later half alone.
"""

import threading
import time

import attacklib as lib

NAME = "mqtt-takeover"
SECONDS = 45.0
PUBLISHING = 5.0
# Where the later half of the run begins, for the figure.
HALFWAY = 25.0
GROWTH_LIMIT = 4 * lib.MiB
LATENCY_LIMIT = 0.1
PAIRS = (("pingpong-kept", False), ("pingpong-clean", True))
PUBLISH_RATE = 200


class PingPong(threading.Thread):
    """
    One side of a pair: connect with C{clientId}, subscribe, wait to be
    closed, again, until stopped.
    """

    def __init__(self, port, clientId, cleanStart, stop):
        threading.Thread.__init__(self, daemon=True)
        self.port = port
        self.clientId = clientId
        self.cleanStart = cleanStart
        self.stop = stop
        self.accepted = 0
        self.refused = 0

    def run(self):
        while not self.stop.is_set():
            client = lib.MqttClient(self.port, timeout=5)
            try:
                code = client.connect(
                    self.clientId,
                    cleanStart=self.cleanStart,
                    will=(b"pingpong/will", b"taken over", b""),
                )
                if code != 0:
                    self.refused += 1
                    continue
                self.accepted += 1
                client.subscribe("pingpong/#", qos=1)
                # Read (the other side's wills, at QoS 0) until the other
                # side takes the id back: Closed.
                while not self.stop.is_set():
                    client.readPacket(0.5)
            except (lib.Closed, OSError):
                pass
            finally:
                client.close()


def publishing(port, stop):
    """
    QoS 1 messages to pingpong/data at L{PUBLISH_RATE} a second, their
    PUBACKs read and forgotten, until C{stop} is set or L{PUBLISHING}
    seconds have passed.
    """
    client = lib.MqttClient(port, timeout=5)
    try:
        client.connect("pingpong-publisher")
        number = 0
        start = time.monotonic()
        while not stop.is_set() and time.monotonic() - start < PUBLISHING:
            number += 1
            packetId = number % 65535 + 1
            client.send(client.publishPacket("pingpong/data", b"d%d" % number, 1, packetId))
            while client.readPacket(0) is not None:
                pass
            time.sleep(max(0.0, start + number / PUBLISH_RATE - time.monotonic()))
    except (lib.Closed, OSError):
        pass
    finally:
        client.close()


def attack(options):
    kind = options.broker
    with lib.scratch() as directory:
        with lib.anyMqttBroker(kind, directory) as (server, port):
            probe = lib.PeerPublishProbe("mosquitto", port)
            stop = threading.Event()
            sides = [
                PingPong(port, clientId, cleanStart, stop)
                for clientId, cleanStart in PAIRS
                for _ in range(2)
            ]
            looks = {}
            publisher = threading.Thread(target=publishing, args=(port, stop), daemon=True)

            def pingPong():
                start = time.monotonic()
                for side in sides:
                    side.start()
                publisher.start()
                time.sleep(PUBLISHING)
                looks["start"] = server.residentMemory()
                time.sleep(max(0.0, start + HALFWAY - time.monotonic()))
                looks["halfway"] = server.residentMemory()
                time.sleep(max(0.0, start + SECONDS - time.monotonic()))
                looks["last"] = server.residentMemory()
                stop.set()
                for side in sides:
                    side.join(10)
                publisher.join(10)

            samples = lib.probeDuring(probe, pingPong)
            probe.close()
            time.sleep(1.0)
            sessions = logged = None
            if kind == "dallal":
                sessions = server.counters()["connections"]
                logged = lib.logSize(server)
    connections = sum(side.accepted for side in sides)
    refused = sum(side.refused for side in sides)
    growth = looks["last"] - looks["start"]
    latency = lib.median(samples)
    passed = (
        latency < LATENCY_LIMIT
        and growth < GROWTH_LIMIT
        and connections > 100
        and (sessions is None or sessions == 2)
    )
    # Dallal counts its own STATS connection: 1 left over is the kept session.
    left = (
        ""
        if sessions is None
        else f"; sessions left: {sessions - 1} (the kept one: 1); "
        f"{logged / max(1, connections):.0f} bytes logged per CONNECT"
    )
    figure = (
        f"{kind}: {connections} CONNECTs accepted ({refused} refused) in {SECONDS:g} s, "
        f"each taking a client id over; probe median {lib.ms(latency)} "
        f"(p95 {lib.ms(lib.percentile(samples, 0.95))}); RSS +{lib.mib(growth)} from "
        f"{PUBLISHING:g} s to {SECONDS:g} s (+{lib.mib(looks['last'] - looks['halfway'])} from "
        f"{HALFWAY:g} s to {SECONDS:g} s){left} "
        f"(limits: median < {lib.ms(LATENCY_LIMIT)}, growth < {lib.mib(GROWTH_LIMIT)}, "
        f"one session left)"
    )
    return passed, figure


if __name__ == "__main__":
    lib.runAttack(NAME, __doc__, attack, peers=("mosquitto",))
