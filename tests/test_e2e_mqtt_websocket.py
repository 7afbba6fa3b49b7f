"""
End to end: MQTT over WebSockets at C{/mqtt} on the real C{twistd dallal
--http}, with paho-mqtt's websocket transport and with the native
WebSocket of headless Chromium speaking MQTT bytes built by hand, each
against Dallal's own clients.  Every wait is bounded.
"""

import json
import socket

import paho.mqtt.client as paho
import pytest
from browser import CHROMIUM, Browser
from helpers import HTTP_LISTENING, BrokerProcess, dallal, subscriber
from test_e2e_mqtt import WAIT, pahoClient, subscribe, waitForMessages
from test_e2e_web import WebBroker
from test_tls import PKI

pytestmark = pytest.mark.e2e


@pytest.fixture
def broker(tmp_path):
    running = WebBroker(tmp_path)
    yield running
    running.process.stop()


@pytest.mark.parametrize("version", [paho.MQTTv311, paho.MQTTv5])
def test_pahoOverWebSocketsWithDallalsClients(broker, version):
    """
    paho-mqtt over WebSockets subscribes at QoS 1 and gets what C{dallal
    publish} sends; what it publishes at QoS 1 reaches C{dallal subscribe}.
    """
    client = pahoClient(broker.httpPort, "browser", version, transport="websockets")
    listening = subscriber(broker.port, "from/browser")
    try:
        subscribe(client, "to/browser", 1)
        result = dallal("127.0.0.1", broker.port, "publish", "to/browser", "hello websocket")
        assert result.returncode == 0, result.stderr
        (message,) = waitForMessages(client, 1)
        assert (message.topic, message.payload) == ("to/browser", b"hello websocket")
        assert message.qos == 1
        client.publish("from/browser", b"hello dallal", qos=1).wait_for_publish(WAIT)
        listening.waitFor(rb"from/browser: hello dallal\n", timeout=WAIT)
    finally:
        listening.kill()
        client.disconnect()
        client.loop_stop()
    output = broker.process.output
    assert b"event=connect session=" in output
    assert b"client=127.0.0.1:" in output and b"transport=mqtt" in output


def test_pahoOverSecureWebSockets(tmp_path):
    """
    C{wss://}: the web listener on an C{ssl:} endpoint carries MQTT too.
    """
    pki = PKI(tmp_path)
    endpoint = f"ssl:0:interface=127.0.0.1:privateKey={pki.key}:certKey={pki.certificate}"
    broker = BrokerProcess.plugin(tmp_path, "--http", endpoint)
    try:
        port = int(broker.waitFor(HTTP_LISTENING).group(1))
        client = pahoClient(port, "secure", transport="websockets", ca=pki.ca)
        try:
            subscribe(client, "secure/#", 1)
            client.publish("secure/a", b"over wss", qos=1).wait_for_publish(WAIT)
            (message,) = waitForMessages(client, 1)
            assert (message.topic, message.payload) == ("secure/a", b"over wss")
        finally:
            client.disconnect()
            client.loop_stop()
    finally:
        broker.stop()


def upgrade(port, protocol):
    """
    A connection that asked to upgrade C{/mqtt} to a WebSocket with the
    subprotocol C{protocol}, and the status line of the answer.
    """
    connection = socket.create_connection(("127.0.0.1", port), timeout=WAIT)
    connection.sendall(
        b"GET /mqtt HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\n"
        b"Connection: Upgrade\r\nSec-WebSocket-Key: c2l4dGVlbiBieXRlIGtleQ==\r\n"
        b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Protocol: " + protocol + b"\r\n\r\n"
    )
    answer = b""
    while b"\r\n\r\n" not in answer:
        chunk = connection.recv(4096)
        assert chunk, answer
        answer += chunk
    return connection, answer.split(b"\r\n", 1)[0]


def closeFrameArrives(connection):
    """
    Whether the broker sends a close frame (opcode 8, final) on
    C{connection} (after what it sent before, here never 0x88 itself).
    """
    received = b""
    while b"\x88" not in received:
        chunk = connection.recv(65536)
        if not chunk:
            return False
        received += chunk
    return True


def test_badRequestsAreRefusedWithoutATraceback(tmp_path):
    """
    Another subprotocol, a plain GET, a text message, garbage and a frame
    over the largest packet: each refused, the broker serving on (and
    logging no traceback, which L{BrokerProcess.stop} checks).
    """
    broker = WebBroker(tmp_path, "--max-payload", "1000")
    try:
        port = broker.httpPort
        connection, status = upgrade(port, b"wamp.2.json")
        connection.close()
        assert status.startswith(b"HTTP/1.1 400 ")
        assert broker.get("/mqtt")[0] // 100 == 4
        for frame in (
            b"\x81\x80\x00\x00\x00\x00",  # an empty text message
            b"\x82\x84\x00\x00\x00\x00\xff\xff\xff\xff",  # no MQTT packet
            b"\x82\xff" + (1 << 40).to_bytes(8, "big") + b"\x00" * 4,  # a terabyte
        ):
            connection, status = upgrade(port, b"mqtt")
            with connection:
                assert status.startswith(b"HTTP/1.1 101 ")
                connection.sendall(frame)
                assert closeFrameArrives(connection)
        connection, status = upgrade(port, b"mqtt")
        connection.close()
        assert status.startswith(b"HTTP/1.1 101 ")
    finally:
        broker.process.stop()
    assert broker.process.output.count(b"event=protocol_error") == 3


# A page's MQTT 3.1.1 client over the browser's own WebSocket: CONNECT and
# SUBSCRIBE (QoS 1) built by hand, PUBLISHes received (and PUBACKed)
# into window.received, and window.publish(topic, text) for QoS 0.
BROWSER_CLIENT = """
(() => {
  const bytes = text => [...new TextEncoder().encode(text)];
  const field = text => [bytes(text).length >> 8, bytes(text).length & 255, ...bytes(text)];
  const packet = (header, body) => new Uint8Array([header, body.length, ...body]);
  window.received = [];
  window.subscribed = false;
  const socket = new WebSocket("ws://127.0.0.1:%(port)d/mqtt", "mqtt");
  socket.binaryType = "arraybuffer";
  socket.onopen = () => {
    socket.send(packet(0x10, [...field("MQTT"), 4, 2, 0, 60, ...field("chromium")]));
    socket.send(packet(0x82, [0, 1, ...field("to/chromium"), 1]));
  };
  const text = array => new TextDecoder().decode(new Uint8Array(array));
  let stream = [];
  socket.onmessage = event => {
    stream.push(...new Uint8Array(event.data));
    // Packets under 128 bytes: a one-byte remaining length.
    while (stream.length >= 2 && stream.length >= 2 + stream[1]) {
      const header = stream[0], body = stream.slice(2, 2 + stream[1]);
      stream = stream.slice(2 + stream[1]);
      if (header >> 4 === 9) window.subscribed = true;
      if (header >> 4 === 3) {
        const topicLength = (body[0] << 8) | body[1];
        let payload = body.slice(2 + topicLength);
        if ((header >> 1) & 3) {
          socket.send(new Uint8Array([0x40, 2, payload[0], payload[1]]));
          payload = payload.slice(2);
        }
        window.received.push(text(body.slice(2, 2 + topicLength)) + " " + text(payload));
      }
    }
  };
  window.publish = (topic, text) => socket.send(packet(0x30, [...field(topic), ...bytes(text)]));
})();
"""


@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (apt-get install chromium)")
def test_chromiumsOwnWebSocketSpeaksMQTT(broker):
    """
    A page in headless Chromium speaks MQTT over the browser's native
    WebSocket, as MQTT.js does: it subscribes, gets what C{dallal publish}
    sends, and publishes to C{dallal subscribe}.
    """
    listening = subscriber(broker.port, "from/chromium")
    browser = Browser()
    try:
        browser.open("about:blank")
        browser.evaluate(BROWSER_CLIENT % {"port": broker.httpPort})
        browser.waitUntil("window.subscribed", WAIT, "a SUBACK")
        result = dallal("127.0.0.1", broker.port, "publish", "to/chromium", "hello browser")
        assert result.returncode == 0, result.stderr
        browser.waitUntil("window.received.length > 0", WAIT, "a PUBLISH")
        assert browser.evaluate("window.received") == ["to/chromium hello browser"]
        browser.evaluate(f"window.publish('from/chromium', {json.dumps('hello dallal')})")
        listening.waitFor(rb"from/chromium: hello dallal\n", timeout=WAIT)
    finally:
        browser.close()
        listening.kill()
