"""
mqtt-offline-queues: sessions whose clients are away cannot hold memory
without a bound that does not grow with the number of sessions, nor
stall the publishers of other clients.

A. 100 MQTT 3.1.1 clients with Clean Session 0 each subscribe at QoS 1 to
a topic of their own and go away. A publisher then sends each of those
topics 32 distinct QoS 1 messages of 64 KiB (2 MiB a session, 200 MiB in
all, each message to one session only, so nothing is shared).
C. 1000 MQTT 5 clients connect with a will of 60 KiB (a will's payload
is at most 64 KiB) whose Will Delay
and Session Expiry are 0xFFFFFFFF (kept for ever), and go away.
B. One more such client subscribes to `#` and goes away; a publisher sends
3000 QoS 1 messages of 4 KiB on a topic of its own as fast as the broker
takes them, while a probe publishes at QoS 1 every 50 ms.

Memory held for offline sessions is offline sessions x queued messages
x payload: by default --max-offline-sessions (1000) x --max-queued-bytes
(8 MiB), 8 GiB. PASS if A grows the broker by less than 64 MiB, C (once A has taken
--max-offline-bytes) by less than 16 MiB (a bound on
all offline sessions together, --max-offline-bytes where the broker has
it) and in B the probe's median round trip stays under 100 ms. With
--broker mosquitto, the same against Mosquitto (its max_queued_messages
1000 and no byte limit by default).
"""

import threading
import time

import attacklib as lib

NAME = "mqtt-offline-queues"
SESSIONS = 100
MESSAGES = 32
PAYLOAD = 64 * lib.KiB
GROWTH_LIMIT = 64 * lib.MiB
FLOOD = 3000
WILL = 60 * lib.KiB
WILLS = 1000
WILL_GROWTH_LIMIT = 16 * lib.MiB


def attack(options):
    extra, note = (
        lib.optionsIfPresent({"--max-offline-bytes": 32 * lib.MiB})
        if options.broker == "dallal"
        else ([], None)
    )
    with lib.scratch() as directory:
        with lib.anyMqttBroker(options.broker, directory, extra) as (server, port):
            for n in range(SESSIONS):
                subscribeAndLeave(port, f"away-{n}", f"own/{n}")
            time.sleep(0.5)
            baseline = server.residentMemory()
            publishTo(port, [f"own/{n}" for n in range(SESSIONS)], MESSAGES, PAYLOAD)
            time.sleep(1.0)
            growth = server.residentMemory() - baseline
            before = server.residentMemory()
            for n in range(WILLS):
                dieLater(port, f"will-{n}")
            time.sleep(1.0)
            willGrowth = server.residentMemory() - before
            subscribeAndLeave(port, "away-all", "#")
            probe = lib.PeerPublishProbe("mosquitto", port)
            samples = probe.during(lambda: publishTo(port, ["flood/x"], FLOOD, 4 * lib.KiB))
            probe.close()
            server.checkAlive()
    delay = lib.median(samples)
    perSession = growth / SESSIONS
    figure = (
        f"A: {lib.mib(growth)} more for {SESSIONS} offline sessions sent "
        f"{lib.mib(MESSAGES * PAYLOAD)} each ({lib.mib(perSession)} a session); "
        f"B: the probe's median round trip {lib.ms(delay)} (max {lib.ms(max(samples))}) "
        f"while {FLOOD} messages went to an offline subscriber of #; C: {lib.mib(willGrowth)} "
        f"more for {WILLS} wills of {WILL // lib.KiB} KiB kept for ever"
    )
    passed = growth < GROWTH_LIMIT and willGrowth < WILL_GROWTH_LIMIT and delay < 0.1
    return passed, figure, note


def subscribeAndLeave(port, clientId, topicFilter):
    client = lib.MqttClient(port)
    if client.connect(clientId, cleanStart=False) != 0:
        raise lib.BenchError(f"{clientId} was not let in")
    if client.subscribe(topicFilter, qos=1) != 1:
        raise lib.BenchError(f"{clientId} could not subscribe to {topicFilter}")
    client.send(b"\xe0\x00")
    client.close()


def dieLater(port, clientId):
    client = lib.MqttClient(port, version=5)
    forever = b"\xff\xff\xff\xff"
    code = client.connect(
        clientId,
        cleanStart=False,
        sessionExpiry=0xFFFFFFFF,
        will=(b"wills/" + clientId.encode(), b"w" * WILL, b"\x18" + forever),
    )
    if code != 0:
        raise lib.BenchError(f"{clientId} was not let in: {code}")
    client.close()


def publishTo(port, topics, count, size, window=20):
    """
    Publish C{count} distinct QoS 1 messages of C{size} bytes to each of
    C{topics}, at most C{window} unacked at a time.
    """
    publisher = lib.MqttClient(port, timeout=60)
    publisher.connect(f"publisher-{threading.get_ident()}")
    unacked = 0
    packetId = 0
    for topic in topics:
        for n in range(count):
            packetId = packetId % 65535 + 1
            payload = (b"%s %d " % (topic.encode(), n)).ljust(size, b"x")
            publisher.send(publisher.publishPacket(topic, payload, qos=1, packetId=packetId))
            unacked += 1
            while unacked >= window:
                if publisher.waitFor(lambda kind, flags, body: kind == 4, 60) is None:
                    raise lib.BenchError("the publisher was not acked within 60 s")
                unacked -= 1
    while unacked:
        if publisher.waitFor(lambda kind, flags, body: kind == 4, 60) is None:
            raise lib.BenchError("the publisher was not acked within 60 s")
        unacked -= 1
    publisher.close()


if __name__ == "__main__":
    lib.runAttack(NAME, __doc__, attack, peers=("mosquitto",))
