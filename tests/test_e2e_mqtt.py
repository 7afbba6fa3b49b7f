"""
End to end: MQTT clients Dallal did not write -- Debian's mosquitto_pub and
mosquitto_sub, and paho-mqtt -- against the real C{twistd dallal --mqtt}.
The scenarios that do not depend on Dallal run against a real Mosquitto
too, where it is installed, to show that what they expect is the
specification's (and Mosquitto's) behaviour, not Dallal's own.  Every wait
is bounded.
"""

import re
import shutil
import signal
import socket
import subprocess
import threading
import time

import paho.mqtt.client as paho
import pytest
from helpers import COMMAND_TIMEOUT, BrokerProcess, OutputCollector, dallal, subscriber
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from test_e2e_auth import PASSWORDS, writeSecurityFiles
from test_tls import PKI

pytestmark = pytest.mark.e2e

MOSQUITTO = "/usr/sbin/mosquitto"
MOSQUITTO_PUB = shutil.which("mosquitto_pub")
MOSQUITTO_SUB = shutil.which("mosquitto_sub")
STDBUF = shutil.which("stdbuf") or "/usr/bin/stdbuf"
MQTT_LISTENING = re.compile(rb"event=listening transport=mqtt address=127\.0\.0\.1:(\d+)")
LOOPBACK_MQTT = "tcp:0:interface=127.0.0.1"
WAIT = 20.0

needsClients = pytest.mark.skipif(
    MOSQUITTO_PUB is None or MOSQUITTO_SUB is None, reason="mosquitto-clients not installed"
)


class DallalMQTT:
    """
    C{twistd -n dallal --mqtt} on ephemeral loopback ports.
    """

    name = "dallal"

    def __init__(self, folder, *options, endpoint=LOOPBACK_MQTT):
        self.process = BrokerProcess.plugin(
            folder, "--mqtt", endpoint, "--data-dir", folder / "data", *options
        )
        try:
            self.port = int(self.process.waitFor(MQTT_LISTENING).group(1))
        except BaseException:
            self.process.kill()
            raise
        self.tcpPort = self.process.port

    def stop(self):
        self.process.stop()


def freePort():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Mosquitto:
    """
    A real Mosquitto on a free loopback port, for comparison.
    """

    name = "mosquitto"

    def __init__(self, folder, port=None, settings=""):
        """
        @param port: its port, if not a free one.
        @param settings: more lines of its configuration file.
        """
        self.port = freePort() if port is None else port
        config = folder / "mosquitto.conf"
        config.write_text(f"listener {self.port} 127.0.0.1\nallow_anonymous true\n{settings}")
        self.process = OutputCollector([MOSQUITTO, "-c", str(config)], folder)
        deadline = time.monotonic() + WAIT
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    self.process.kill()
                    raise
                time.sleep(0.05)

    def stop(self):
        self.process.terminate()


@pytest.fixture(params=["dallal", "mosquitto"])
def anyBroker(request, tmp_path):
    """
    Dallal over MQTT, and Mosquitto where it is installed: the same
    scenario must give the same result on both.
    """
    if request.param == "mosquitto":
        if not shutil.which(MOSQUITTO):
            pytest.skip("Mosquitto is not installed")
        broker = Mosquitto(tmp_path)
    else:
        broker = DallalMQTT(tmp_path)
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture
def mqttBroker(tmp_path):
    broker = DallalMQTT(tmp_path)
    try:
        yield broker
    finally:
        broker.stop()


def mosquittoSub(port, *arguments):
    """
    Start mosquitto_sub and wait until its subscription is acknowledged.
    """
    # Its debug lines are not flushed into a pipe unless told.
    process = OutputCollector(
        [
            STDBUF,
            "-oL",
            MOSQUITTO_SUB,
            "-p",
            str(port),
            "-d",
            "-v",
            "-W",
            str(int(WAIT)),
            *arguments,
        ],
        None,
    )
    try:
        process.waitFor(rb"received SUBACK", timeout=WAIT)
    except BaseException:
        process.kill()
        raise
    return process


def mosquittoPub(port, *arguments):
    return subprocess.run(
        [MOSQUITTO_PUB, "-p", str(port), *arguments],
        capture_output=True,
        timeout=COMMAND_TIMEOUT,
    )


def received(process, *lines):
    """
    Wait until mosquitto_sub has printed each of C{lines} (C{-v}: topic and
    payload).
    """
    for line in lines:
        process.waitFor(re.escape(line) + rb"\n", timeout=WAIT)


@needsClients
@pytest.mark.parametrize("version", ["mqttv311", "mqttv5"])
def test_qos012BothWays(anyBroker, version):
    sub = mosquittoSub(anyBroker.port, "-V", version, "-q", "2", "-t", "q/#")
    try:
        for qos in "012":
            result = mosquittoPub(
                anyBroker.port, "-V", version, "-q", qos, "-t", f"q/{qos}", "-m", f"at qos {qos}"
            )
            assert result.returncode == 0, result.stderr
        received(sub, b"q/0 at qos 0", b"q/1 at qos 1", b"q/2 at qos 2")
        # The subscriber saw each at its publish QoS.
        for qos in "012":
            assert re.search(rb"received PUBLISH \(d0, q%s, r0" % qos.encode(), sub.output)
    finally:
        sub.kill()


@needsClients
def test_retainedMessagesAndTheirDeletion(anyBroker):
    port = anyBroker.port
    assert mosquittoPub(port, "-r", "-q", "1", "-t", "kept/a", "-m", "first").returncode == 0
    sub = mosquittoSub(port, "-t", "kept/#", "-C", "1")
    try:
        received(sub, b"kept/a first")
        assert b"r1" in sub.output
    finally:
        sub.kill()
    # An empty retained payload deletes it: a new subscriber gets nothing.
    assert mosquittoPub(port, "-r", "-n", "-t", "kept/a").returncode == 0
    late = subprocess.run(
        [MOSQUITTO_SUB, "-p", str(port), "-t", "kept/#", "-v", "-W", "2"],
        capture_output=True,
        timeout=COMMAND_TIMEOUT,
    )
    assert late.stdout == b""


@needsClients
def test_theWillOfAKilledClient(anyBroker):
    watcher = mosquittoSub(anyBroker.port, "-t", "status/#", "-q", "1")
    doomed = mosquittoSub(
        anyBroker.port, "-t", "anything", "-i", "doomed", "-k", "60",
        "--will-topic", "status/doomed", "--will-payload", "offline", "--will-qos", "1",
    )  # fmt: skip
    try:
        doomed.process.send_signal(signal.SIGKILL)
        received(watcher, b"status/doomed offline")
    finally:
        doomed.kill()
        watcher.kill()


@needsClients
def test_noWillAfterACleanDisconnect(anyBroker):
    watcher = mosquittoSub(anyBroker.port, "-t", "status/#")
    result = mosquittoPub(
        anyBroker.port, "-t", "x", "-m", "y", "--will-topic", "status/pub", "--will-payload", "gone"
    )
    assert result.returncode == 0
    # A message after it proves that nothing came before it.
    mosquittoPub(anyBroker.port, "-t", "status/marker", "-m", "end")
    try:
        received(watcher, b"status/marker end")
        assert b"status/pub" not in watcher.output
    finally:
        watcher.kill()


@needsClients
def test_dollarTopicsAreNotMatchedByHash(anyBroker):
    sub = mosquittoSub(anyBroker.port, "-t", "#")
    try:
        mosquittoPub(anyBroker.port, "-t", "marker", "-m", "end")
        received(sub, b"marker end")
        assert b"$SYS" not in sub.output
    finally:
        sub.kill()


@needsClients
def test_crossProtocol(mqttBroker):
    """
    mosquitto_pub to C{dallal subscribe}, C{dallal publish} to mosquitto_sub.
    """
    listening = subscriber(mqttBroker.tcpPort, "from/mqtt")
    try:
        assert (
            mosquittoPub(
                mqttBroker.port, "-t", "from/mqtt", "-m", "hello dallal", "-q", "1"
            ).returncode
            == 0
        )
        listening.waitFor(rb"from/mqtt: hello dallal\n", timeout=WAIT)
    finally:
        listening.kill()
    sub = mosquittoSub(mqttBroker.port, "-t", "from/dallal", "-q", "1")
    try:
        result = dallal("127.0.0.1", mqttBroker.tcpPort, "publish", "from/dallal", "hello mqtt")
        assert result.returncode == 0, result.stderr
        received(sub, b"from/dallal hello mqtt")
    finally:
        sub.kill()


@needsClients
def test_usernamePasswordAndAcl(tmp_path):
    passwords, acl = writeSecurityFiles(tmp_path)
    broker = DallalMQTT(tmp_path, "--passwords", passwords, "--acl", acl)
    try:
        port = broker.port
        wrong = mosquittoPub(port, "-u", "bob", "-P", "wrong", "-t", "bob/x", "-m", "m")
        assert wrong.returncode != 0
        # As Mosquitto answers it.
        assert b"Connection Refused: not authorised." in wrong.stderr
        anonymous = mosquittoPub(port, "-t", "public/x", "-m", "m")
        assert anonymous.returncode != 0
        sub = mosquittoSub(port, "-u", "bob", "-P", PASSWORDS["bob"], "-t", "news/#", "-q", "1")
        try:
            for topic in ("news/secret", "news/open"):
                assert (
                    mosquittoPub(
                        port,
                        "-u",
                        "alice",
                        "-P",
                        PASSWORDS["alice"],
                        "-t",
                        topic,
                        "-m",
                        "x",
                        "-q",
                        "1",
                    ).returncode
                    == 0
                )
            received(sub, b"news/open x")
            assert b"news/secret" not in sub.output
        finally:
            sub.kill()
    finally:
        broker.stop()
    assert b"event=login_failed" in broker.process.output
    assert b"transport=mqtt" in broker.process.output


def pahoClient(
    port,
    clientId,
    version=paho.MQTTv5,
    transport="tcp",
    ca=None,
    cleanStart=paho.MQTT_CLEAN_START_FIRST_ONLY,
    properties=None,
):
    """
    A connected paho-mqtt client with its network loop running, and the
    messages it receives collected; C{client.sessionPresent} is its
    CONNACK's flag.

    @param transport: C{websockets} for MQTT over WebSockets, to C{/mqtt}.
    @param ca: the file of the CA to trust, for TLS.
    @param cleanStart: MQTT 5's Clean Start.
    @param properties: the CONNECT's MQTT 5 properties.
    """
    client = paho.Client(
        paho.CallbackAPIVersion.VERSION2, client_id=clientId, protocol=version, transport=transport
    )
    client.ws_set_options(path="/mqtt")
    if ca is not None:
        client.tls_set(ca_certs=str(ca))
    client.messages = []
    client.arrived = threading.Condition()

    def onMessage(client, userdata, message):
        with client.arrived:
            client.messages.append(message)
            client.arrived.notify_all()

    client.on_message = onMessage
    client.subscribed = set()

    def onSubscribe(client, userdata, mid, reasonCodes, properties):
        with client.arrived:
            client.subscribed.add(mid)
            client.arrived.notify_all()

    client.on_subscribe = onSubscribe
    connected = threading.Event()

    def onConnect(client, userdata, flags, reasonCode, properties):
        client.sessionPresent = flags.session_present
        connected.set()

    client.on_connect = onConnect
    if version == paho.MQTTv5:
        client.connect("127.0.0.1", port, clean_start=cleanStart, properties=properties)
    else:
        client.connect("127.0.0.1", port)
    client.loop_start()
    assert connected.wait(WAIT)
    return client


def subscribe(client, topic, qos):
    """
    Subscribe, and wait for the SUBACK.
    """
    _, mid = client.subscribe(topic, qos=qos)
    with client.arrived:
        assert client.arrived.wait_for(lambda: mid in client.subscribed, WAIT)


def waitForMessages(client, count):
    with client.arrived:
        assert client.arrived.wait_for(lambda: len(client.messages) >= count, WAIT)
    return client.messages


def test_pahoRequestResponseWithProperties(mqttBroker):
    """
    MQTT 5 request/response: the response topic, correlation data and
    user properties reach the responder as they were sent.
    """
    responder = pahoClient(mqttBroker.port, "responder")
    requester = pahoClient(mqttBroker.port, "requester")
    try:
        subscribe(responder, "service/request", 2)
        subscribe(requester, "service/reply/requester", 1)
        properties = Properties(PacketTypes.PUBLISH)
        properties.ResponseTopic = "service/reply/requester"
        properties.CorrelationData = b"\x00\x01request-1"
        properties.UserProperty = [("app", "test")]
        requester.publish(
            "service/request", b"what time is it", qos=2, properties=properties
        ).wait_for_publish(WAIT)
        (request,) = waitForMessages(responder, 1)
        assert request.qos == 2 and request.payload == b"what time is it"
        assert request.properties.ResponseTopic == "service/reply/requester"
        assert request.properties.CorrelationData == b"\x00\x01request-1"
        assert request.properties.UserProperty == [("app", "test")]
        reply = Properties(PacketTypes.PUBLISH)
        reply.CorrelationData = request.properties.CorrelationData
        responder.publish(request.properties.ResponseTopic, b"noon", qos=1, properties=reply)
        (response,) = waitForMessages(requester, 1)
        assert response.payload == b"noon"
        assert response.properties.CorrelationData == b"\x00\x01request-1"
    finally:
        for client in (responder, requester):
            client.disconnect()
            client.loop_stop()


@needsClients
def test_mqttOverTls(tmp_path):
    pki = PKI(tmp_path)
    broker = DallalMQTT(
        tmp_path,
        endpoint=f"ssl:0:interface=127.0.0.1:privateKey={pki.key}:certKey={pki.certificate}",
    )
    try:
        tls = ("-h", "localhost", "--cafile", str(pki.ca))
        sub = mosquittoSub(broker.port, *tls, "-t", "secure/#", "-q", "1")
        try:
            result = mosquittoPub(broker.port, *tls, "-t", "secure/a", "-m", "over tls", "-q", "1")
            assert result.returncode == 0, result.stderr
            received(sub, b"secure/a over tls")
        finally:
            sub.kill()
        untrusted = mosquittoPub(
            broker.port, "-h", "localhost", "--cafile", str(pki.otherCA), "-t", "x", "-m", "y"
        )
        assert untrusted.returncode != 0
    finally:
        broker.stop()


@needsClients
def test_sharedSubscriptionGivesEachMessageToOneMember(anyBroker):
    members = [
        mosquittoSub(anyBroker.port, "-V", "mqttv5", "-t", "$share/workers/jobs/#", "-q", "1")
        for _ in range(2)
    ]
    watcher = mosquittoSub(anyBroker.port, "-t", "jobs/#", "-q", "1")
    try:
        for number in range(10):
            assert (
                mosquittoPub(
                    anyBroker.port, "-q", "1", "-t", "jobs/a", "-m", f"job {number}"
                ).returncode
                == 0
            )
        received(watcher, *(b"jobs/a job %d" % number for number in range(10)))
        # Each job reached exactly one member.
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            jobs = [re.findall(rb"jobs/a (job \d+)\n", member.output) for member in members]
            if sum(map(len, jobs)) >= 10:
                break
            time.sleep(0.05)
        assert sorted(job for share in jobs for job in share) == sorted(
            b"job %d" % number for number in range(10)
        )
    finally:
        for process in (*members, watcher):
            process.kill()
