"""
mqtt-qos2-hoard: an MQTT client cannot make the broker hold packet
identifiers without bound (bounded memory per session).

An incoming QoS 2 PUBLISH holds its packet identifier from PUBLISH to
PUBREL, and a session that outlives its connection keeps them. 20 MQTT
3.1.1 clients with Clean Session 0 each send QoS 2 PUBLISHes on every
packet identifier, 1 to 65,535, and never a PUBREL, then go away: 20
offline sessions, each asked to remember 65,535 unreleased identifiers
(the default --max-offline-sessions is 1000).

PASS if the broker's resident memory grows by less than 256 KiB per
session (an in-flight window's worth: the broker's Receive Maximum,
--max-inflight, bounds what a client may leave unreleased; over it the
connection is closed, MQTT 5's "Receive Maximum exceeded"). The figure
extrapolates to --max-offline-sessions sessions. With --broker mosquitto,
the same clients against Mosquitto (its max_inflight_messages, 20).
"""

import time

import attacklib as lib

NAME = "mqtt-qos2-hoard"
SESSIONS = 20
IDENTIFIERS = 65535
BOUND = 256 * lib.KiB
OFFLINE_SESSIONS = 1000


def attack(options):
    with lib.scratch() as directory:
        with lib.anyMqttBroker(options.broker, directory) as (server, port):
            baseline = server.residentMemory()
            held = [hoard(port, n) for n in range(SESSIONS)]
            time.sleep(1.0)
            growth = server.residentMemory() - baseline
            server.checkAlive()
    perSession = growth / SESSIONS
    closed = sum(1 for taken in held if taken < IDENTIFIERS)
    figure = (
        f"{lib.mib(growth)} more for {SESSIONS} offline sessions that left up to "
        f"{IDENTIFIERS} QoS 2 identifiers unreleased: {perSession / lib.KiB:.0f} KiB a session, "
        f"{lib.mib(perSession * OFFLINE_SESSIONS)} at {OFFLINE_SESSIONS} offline sessions; "
        f"{closed}/{SESSIONS} connections closed before all their PUBLISHes were taken"
    )
    return perSession < BOUND, figure


def hoard(port, n):
    """
    One client's QoS 2 PUBLISHes on every identifier, no PUBREL.

    @return: how many were answered (a PUBREC) before the broker closed
        the connection, or all of them.
    """
    client = lib.MqttClient(port)
    if client.connect(f"hoarder-{n}", cleanStart=False) != 0:
        raise lib.BenchError("the hoarder was not let in")
    batch = 1000
    answered = 0
    try:
        for start in range(1, IDENTIFIERS + 1, batch):
            end = min(IDENTIFIERS + 1, start + batch)
            client.send(
                b"".join(
                    client.publishPacket("hoard/x", b"x", qos=2, packetId=packetId)
                    for packetId in range(start, end)
                )
            )
            while answered < end - 1:
                packet = client.readPacket(10)
                if packet is None:
                    raise lib.Closed()
                if packet[0] == 5:
                    answered += 1
    except (lib.Closed, OSError):
        pass
    client.close()
    return answered


if __name__ == "__main__":
    lib.runAttack(NAME, __doc__, attack, peers=("mosquitto",))
