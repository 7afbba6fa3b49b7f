"""
End to end: MQTT sessions that outlive their connections, and the broker,
with mosquitto_sub/mosquitto_pub and paho-mqtt against C{twistd dallal
--mqtt --data-dir}, and the same scenarios against Mosquitto (with
C{persistence true}) where it is installed.
"""

import shutil
import signal
import time

import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from test_e2e_mqtt import (  # noqa: F401 (anyBroker is a fixture)
    MOSQUITTO,
    WAIT,
    DallalMQTT,
    Mosquitto,
    anyBroker,
    mosquittoPub,
    mosquittoSub,
    needsClients,
    pahoClient,
    received,
    subscribe,
    waitForMessages,
)

pytestmark = pytest.mark.e2e


class Restartable:
    """
    A broker of the given kind in C{folder}, that keeps its sessions
    there across restarts.
    """

    def __init__(self, kind, folder):
        self.kind = kind
        self.folder = folder
        self.broker = None
        self.start()

    @property
    def port(self):
        return self.broker.port

    def start(self):
        if self.kind == "mosquitto":
            # As root, Mosquitto would write as its own user, which may not.
            settings = f"persistence true\npersistence_location {self.folder}/\nuser root\n"
            port = None if self.broker is None else self.broker.port
            self.broker = Mosquitto(self.folder, port, settings)
        else:
            self.broker = DallalMQTT(self.folder)

    def restart(self):
        self.broker.stop()
        self.start()

    def stop(self):
        self.broker.stop()


@pytest.fixture(params=["dallal", "mosquitto"])
def restartable(request, tmp_path):
    if request.param == "mosquitto" and not shutil.which(MOSQUITTO):
        pytest.skip("Mosquitto is not installed")
    broker = Restartable(request.param, tmp_path)
    try:
        yield broker
    finally:
        broker.stop()


def persistentSub(port, clientId):
    """
    C{mosquitto_sub -c}: a session that outlives its connection.
    """
    return mosquittoSub(port, "-c", "-i", clientId, "-q", "1", "-t", "kept/#")


def leftAway(broker):
    """
    A persistent subscriber, killed: its session waits for it.
    """
    away = persistentSub(broker.port, "keeper")
    away.process.send_signal(signal.SIGKILL)
    away.kill()


def publishedAtQos(broker, qos, payload):
    result = mosquittoPub(broker.port, "-q", qos, "-t", "kept/a", "-m", payload)
    assert result.returncode == 0, result.stderr


def comesBack(broker, payload):
    """
    The persistent subscriber comes back, and prints C{payload}.

    @return: what it printed.
    """
    back = persistentSub(broker.port, "keeper")
    try:
        received(back, b"kept/a " + payload.encode())
    finally:
        back.kill()
    return back.output


@needsClients
def test_aPersistentSessionAcrossAReconnection(restartable):
    leftAway(restartable)
    publishedAtQos(restartable, "1", "at qos 1")
    publishedAtQos(restartable, "0", "at qos 0")
    output = comesBack(restartable, "at qos 1")
    # QoS 0 is not kept for a client that is away.
    assert b"at qos 0" not in output


@needsClients
def test_aPersistentSessionAcrossABrokerRestart(restartable):
    leftAway(restartable)
    restartable.restart()
    publishedAtQos(restartable, "1", "while away")
    comesBack(restartable, "while away")


@needsClients
def test_messagesQueuedBeforeABrokerRestartAreDelivered(restartable):
    leftAway(restartable)
    publishedAtQos(restartable, "1", "before restart")
    restartable.restart()
    comesBack(restartable, "before restart")


def pahoSession(port, clientId, expiry, cleanStart=False):
    """
    A paho MQTT 5 client whose session outlives its connection by
    C{expiry} seconds; C{client.sessionPresent} is its CONNACK's flag.
    """
    properties = Properties(PacketTypes.CONNECT)
    properties.SessionExpiryInterval = expiry
    return pahoClient(port, clientId, cleanStart=cleanStart, properties=properties)


@pytest.fixture
def restartableDallal(tmp_path):
    broker = Restartable("dallal", tmp_path)
    try:
        yield broker
    finally:
        broker.stop()


def test_pahoSessionExpiryAcrossABrokerRestart(restartableDallal):
    """
    Dallal only: Mosquitto 2.0.11 (Debian's) starts an MQTT 5 session that
    disconnected with its expiry interval left afresh after a restart.
    """
    restartable = restartableDallal
    client = pahoSession(restartable.port, "paho-keeper", 300, cleanStart=True)
    subscribe(client, "kept/#", 1)
    client.disconnect()
    client.loop_stop()
    restartable.restart()
    publisher = pahoClient(restartable.port, "publisher")
    publisher.publish("kept/b", b"for paho", qos=1).wait_for_publish(WAIT)
    publisher.disconnect()
    publisher.loop_stop()
    client = pahoSession(restartable.port, "paho-keeper", 300)
    try:
        assert client.sessionPresent
        (message,) = waitForMessages(client, 1)
        assert (message.topic, message.payload, message.qos) == ("kept/b", b"for paho", 1)
    finally:
        client.disconnect()
        client.loop_stop()


def test_pahoSessionThatExpiredIsGone(restartable):
    client = pahoSession(restartable.port, "paho-brief", 1, cleanStart=True)
    subscribe(client, "kept/#", 1)
    client.disconnect()
    client.loop_stop()
    client = pahoSession(restartable.port, "paho-brief", 1)
    try:
        assert client.sessionPresent
    finally:
        client.disconnect()
        client.loop_stop()
    # Past its expiry interval, the session is no more.
    time.sleep(2.5)
    client = pahoSession(restartable.port, "paho-brief", 1)
    try:
        assert not client.sessionPresent
    finally:
        client.disconnect()
        client.loop_stop()


def dyingWithDelayedWill(port, clientId, delay, willQos="0"):
    """
    An MQTT 5 mosquitto_sub whose session outlives it (C{-c}: for ever),
    with a will delayed by C{delay} seconds, killed.
    """
    doomed = mosquittoSub(
        port, "-V", "mqttv5", "-c", "-i", clientId, "-t", "anything",
        "--will-topic", f"status/{clientId}", "--will-payload", "gone", "--will-qos", willQos,
        "-D", "will", "will-delay-interval", str(delay),
    )  # fmt: skip
    doomed.process.send_signal(signal.SIGKILL)
    doomed.kill()
    return time.monotonic()


@needsClients
def test_theWillWaitsForItsDelay(restartable):
    watcher = mosquittoSub(restartable.port, "-t", "status/#")
    try:
        killed = dyingWithDelayedWill(restartable.port, "slow", 2)
        received(watcher, b"status/slow gone")
        assert time.monotonic() - killed >= 1.5
    finally:
        watcher.kill()


@needsClients
def test_aDelayedWillIsNotLostAcrossABrokerRestart(restartable):
    """
    A client with a will delay is killed, and the broker restarts before
    the delay is over: a persistent watcher still gets the will (Mosquitto
    publishes it as it stops; Dallal keeps it in the data dir and
    publishes it when the delay is over).
    """

    def watching():
        return mosquittoSub(restartable.port, "-c", "-i", "watcher", "-q", "1", "-t", "status/#")

    watcher = watching()
    watcher.process.send_signal(signal.SIGKILL)
    watcher.kill()
    # At QoS 1: Mosquitto queues no QoS 0 message for a client that is away.
    dyingWithDelayedWill(restartable.port, "restarted", 3, willQos="1")
    restartable.restart()
    watcher = watching()
    try:
        received(watcher, b"status/restarted gone")
    finally:
        watcher.kill()


@needsClients
def test_aClientBackWithinTheDelayHasNoWill(restartable):
    watcher = mosquittoSub(restartable.port, "-t", "status/#")
    try:
        dyingWithDelayedWill(restartable.port, "back", 3)
        back = mosquittoSub(restartable.port, "-V", "mqttv5", "-c", "-i", "back", "-t", "anything")
        try:
            time.sleep(4)
            mosquittoPub(restartable.port, "-t", "status/marker", "-m", "end")
            received(watcher, b"status/marker end")
            assert b"status/back" not in watcher.output
        finally:
            back.kill()
    finally:
        watcher.kill()
