"""
mqtt-overlap: overlapping MQTT 5 subscriptions with subscription
identifiers cost no more per publish than they do in Mosquitto.

Ten MQTT 5 clients each subscribe with the same 1000 overlapping wildcard
filters (fanout_freeze's: every one matches a/b/c/d/e/f/g/h/i/<n>), each
filter in a SUBSCRIBE of its own with its own subscription identifier, so
that every message to a client carries 1000 identifiers [MQTT-3.3.4-3],
and read what they get. Another client publishes at QoS 0 on
a/b/c/d/e/f/g/h/i/<n> (a new topic each time) at 200 messages a second for
10 s, while a probe publishes at QoS 1 every 50 ms.

PASS if the probe's median round trip stays under 100 ms and a publish
costs the broker less than 3 ms of CPU (ten deliveries of 1000 filters
and identifiers each; the figure says what Mosquitto takes with --broker
mosquitto).
"""

import attacklib as lib
from fanout_freeze import FILTER_CLIENTS, TOPIC, Drain, overlappingFilters, publishAtRate
from protocols import mqttRemainingLength

NAME = "mqtt-overlap"
CPU_PER_PUBLISH_LIMIT = 0.003


def subscriber(port, number, filters):
    client = lib.MqttClient(port, version=5, timeout=60)
    if client.connect(f"overlap-{number}") != 0:
        raise lib.BenchError("a subscriber was not let in")
    client.send(
        b"".join(
            client._packet(
                8,
                2,
                identifier.to_bytes(2, "big")
                + client.properties(b"\x0b" + mqttRemainingLength(identifier))
                + client._string(topicFilter.encode())
                + b"\x00",
            )
            for identifier, topicFilter in enumerate(filters, 1)
        )
    )
    acked = 0
    while acked < len(filters):
        if client.waitFor(lambda kind, flags, body: kind == 9, 60) is None:
            raise lib.BenchError("the SUBSCRIBEs were not all answered in 60 s")
        acked += 1
    return client


def attack(options):
    filters = overlappingFilters()
    with lib.scratch() as directory:
        with lib.anyMqttBroker(options.broker, directory) as (server, port):
            clients = [subscriber(port, n, filters) for n in range(FILTER_CLIENTS)]
            drain = Drain([client.sock for client in clients])
            drain.start()
            publisher = lib.MqttClient(port, timeout=60)
            publisher.connect("overlap-publisher")
            probe = lib.PeerPublishProbe("mosquitto", port)
            cpu = server.cpuSeconds()
            published = [0]

            def publish():
                published[0] = publishAtRate(
                    lambda n: publisher.send(publisher.publishPacket(f"{TOPIC}/{n}", b"x", qos=0)),
                    None,
                )

            samples = probe.during(publish)
            cpu = server.cpuSeconds() - cpu
            drain.running = False
            drain.join(5)
            probe.close()
            server.checkAlive()
    perPublish = cpu / max(1, published[0])
    delay = lib.median(samples)
    figure = (
        f"{options.broker}: {FILTER_CLIENTS} MQTT 5 clients x {len(filters)} overlapping filters, "
        f"each with its subscription identifier; {published[0]} publishes: "
        f"{perPublish * 1000:.2f} ms of broker CPU a publish, the probe's median "
        f"{lib.ms(delay)} (max {lib.ms(max(samples))}), {drain.received // 1024} KiB delivered"
    )
    return perPublish < CPU_PER_PUBLISH_LIMIT and delay < 0.1, figure


if __name__ == "__main__":
    lib.runAttack(NAME, __doc__, attack, peers=("mosquitto",))
