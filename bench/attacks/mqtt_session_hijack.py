"""
mqtt-session-hijack: an MQTT client id is not a credential either (issue
24's first property, over MQTT).

A broker with --passwords, --acl and --mqtt. Alice's device (user alice,
who may read secret/#) connects with client id alice-phone and Clean
Session 0, subscribes to secret/# at QoS 1 and goes away; alice then
publishes 4 QoS 1 messages there, which wait in the device's session.
Mallory, a user of the broker with her own password and no right to
secret/#, connects with client id alice-phone: first with Clean Session 0
(to resume the session and read what waits), then, while the device is
connected again, with Clean Session 1 (to kick it off and end its
session).

PASS if both of mallory's CONNECTs are refused, she reads nothing, the
device is not disconnected, and its session (subscription and the 4
messages) is the device's when it comes back. Mosquitto 2.0 hands a
session to any user that connects with its client id (unless client ids
are tied to user names, use_username_as_clientid): Dallal binds a session
to the user that made it.
"""

import time

import attacklib as lib

NAME = "mqtt-session-hijack"
MESSAGES = 4


def attack():
    with lib.scratch() as directory:
        with lib.dallal(directory, lib.aliceAndMallory(directory), mqtt=True) as broker:
            return run(broker.mqttPort)


def device(port, **options):
    client = lib.MqttClient(port, source=lib.OTHER_HOST)
    code = client.connect(
        "alice-phone", cleanStart=False, user="alice", password="alice-pw", **options
    )
    return client, code


def run(port):
    phone, _ = device(port)
    if phone.subscribe("secret/#", qos=1) != 1:
        raise lib.BenchError("alice's device could not subscribe")
    phone.close()
    time.sleep(0.3)
    publisher = lib.MqttClient(port)
    publisher.connect("alice-laptop", user="alice", password="alice-pw")
    for n in range(1, MESSAGES + 1):
        publisher.send(publisher.publishPacket("secret/plan", b"secret %d" % n, qos=1, packetId=n))
        publisher.waitFor(lambda kind, flags, body: kind == 4, 5)
    publisher.close()

    # Mallory resumes the session.
    mallory = lib.MqttClient(port)
    resumed = mallory.connect(
        "alice-phone", cleanStart=False, user="mallory", password="mallory-pw"
    )
    stolen = mallory.publishes(1.0) if resumed == 0 else []
    mallory.close()

    # The device comes back, then mallory tries to kick it off.
    phone, back = device(port)
    received = phone.publishes(1.5)
    kicker = lib.MqttClient(port)
    kicked = kicker.connect("alice-phone", cleanStart=True, user="mallory", password="mallory-pw")
    kicker.close()
    phone.send(b"\xc0\x00")
    stillConnected = phone.waitFor(lambda kind, flags, body: kind == 13, 3) is not None
    phone.close()

    refused = resumed not in (0, None) or resumed is None
    refusedKick = kicked != 0
    passed = (
        refused
        and refusedKick
        and not stolen
        and back == 0
        and stillConnected
        and len(received) == MESSAGES
    )
    figure = (
        f"mallory's CONNECT with alice's client id and Clean Session 0: "
        f"{'refused' if refused else 'accepted'} ({resumed}), she read {len(stolen)}/{MESSAGES} of "
        f"alice's messages; with Clean Session 1 while the device is on: "
        f"{'refused' if refusedKick else 'accepted'} ({kicked}), the device "
        f"{'stayed connected' if stillConnected else 'was disconnected'}; the device got "
        f"{len(received)}/{MESSAGES} back"
    )
    return passed, figure


if __name__ == "__main__":
    lib.runAttack(NAME, __doc__, lambda options: attack())
