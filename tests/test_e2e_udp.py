"""
End to end over UDP: a real C{twistd dallal --tcp ... --udp 0} and the real
C{dallal --udp} command, directly and through a relay that loses one
datagram in three.
"""

import os
import random
import re
import select
import signal
import socket
import string
import threading
import time

import pytest
from helpers import BrokerProcess, dallal, subscriber

pytestmark = pytest.mark.e2e

UDP_LISTENING = re.compile(rb"event=listening transport=udp address=127\.0\.0\.1:(\d+)")


class UdpBroker:
    """
    A broker serving TCP and UDP on ephemeral loopback ports.
    """

    def __init__(self, cwd, *options):
        self.process = BrokerProcess.plugin(cwd, "--udp", "0", *options)
        try:
            self.udpPort = int(self.process.waitFor(UDP_LISTENING).group(1))
        except BaseException:
            self.process.kill()
            raise
        self.tcpPort = self.process.port


@pytest.fixture
def broker(tmp_path):
    server = UdpBroker(tmp_path)
    try:
        yield server
    finally:
        server.process.stop()


def stopSubscriber(process):
    """
    Stop a subscriber as a person would, with SIGTERM: it exits with 0.
    """
    assert process.terminate() == 0, process.output


def udpPublish(port, topic, message):
    return dallal("--udp", "127.0.0.1", port, "publish", topic, message)


PUBLISHED = b"your message published successfully\n"


def test_udpPublishReachesATcpSubscriber(broker):
    listener = subscriber(broker.tcpPort, "news")
    try:
        result = udpPublish(broker.udpPort, "news", "from udp")
        assert (result.stdout, result.returncode) == (PUBLISHED, 0)
        listener.waitFor(rb"news: from udp\n")
    finally:
        listener.terminate()


def test_tcpPublishReachesAUdpSubscriber(broker):
    listener = subscriber(broker.udpPort, "news", "sport", udp=True)
    try:
        result = dallal("127.0.0.1", broker.tcpPort, "publish", "sport", "from tcp")
        assert (result.stdout, result.returncode) == (PUBLISHED, 0)
        listener.waitFor(rb"sport: from tcp\n")
    finally:
        stopSubscriber(listener)
    assert listener.output == b"subscribing on news sport\nsport: from tcp\n"


def test_60KBPayloadArrivesIntact(broker):
    payload = "".join(random.Random(7).choices(string.ascii_letters + string.digits, k=60_000))
    listener = subscriber(broker.udpPort, "big", udp=True)
    try:
        result = udpPublish(broker.udpPort, "big", payload)
        assert (result.stdout, result.returncode) == (PUBLISHED, 0)
        listener.waitFor(rb"big: [^\n]*\n")
    finally:
        stopSubscriber(listener)
    assert listener.output == b"subscribing on big\nbig: " + payload.encode() + b"\n"


def test_payloadTooLargeForADatagramIsRefusedBeforeSending(broker):
    result = udpPublish(broker.udpPort, "big", "x" * 65_001)
    assert (result.stdout, result.returncode) == (b"your message publishing failed\n", 1)
    assert b"larger than the 65000 bytes" in result.stderr


def test_pingIntervalFromTheBrokerKeepsTheClientAlive(tmp_path):
    """
    A broker started with --ping-interval 1 is kept alive by an unmodified
    client, which learns the interval from it; once the client is killed
    (no BYE), the broker expires it and says which client it was.
    """
    server = UdpBroker(tmp_path, "--ping-interval", "1")
    try:
        listener = subscriber(server.udpPort, "news", udp=True)
        try:
            time.sleep(4)
            connect = re.search(
                rb"event=connect session=(\d+) client=(127\.0\.0\.1:\d+) transport=udp",
                server.process.output,
            )
            assert connect, server.process.output
            session, address = connect.groups()
            assert b"event=ping_missed session=" + session + b" " not in server.process.output
        finally:
            listener.kill()
        server.process.waitFor(
            rb"event=client_dropped session=" + session + rb" client=" + re.escape(address)
        )
        server.process.waitFor(
            rb"event=disconnect session="
            + session
            + rb" client="
            + re.escape(address)
            + rb" transport=udp reason=expired subscriptions=1"
        )
    finally:
        server.process.stop()


def test_subscriberReportsMissingPongsAndKeepsGoing(tmp_path):
    """
    While the broker is stopped (SIGSTOP), the subscriber reports missing
    pongs on standard error; when it resumes, messages arrive again.
    """
    server = UdpBroker(tmp_path, "--ping-interval", "1")
    try:
        listener = subscriber(server.udpPort, "news", udp=True)
        try:
            os.kill(server.process.process.pid, signal.SIGSTOP)
            try:
                listener.waitFor(rb"no pong from the broker at 127\.0\.0\.1:\d+ for 1 ", 10)
            finally:
                os.kill(server.process.process.pid, signal.SIGCONT)
            result = udpPublish(server.udpPort, "news", "still here")
            assert result.stdout == PUBLISHED
            listener.waitFor(rb"news: still here\n")
        finally:
            stopSubscriber(listener)
    finally:
        server.process.stop()


class LossyRelay:
    """
    A UDP relay in front of the broker that loses one datagram in three,
    in each direction: the third, sixth, ... datagram each client sends,
    and each the broker sends back to it.  Every client gets its own
    socket toward the broker, so the broker sees one address per client.
    """

    def __init__(self, brokerPort):
        self.broker = ("127.0.0.1", brokerPort)
        self.front = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.front.bind(("127.0.0.1", 0))
        self.port = self.front.getsockname()[1]
        self.upstreams = {}
        self.clients = {}
        self.counts = {}
        self.dropped = 0
        self.forwarded = 0
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._relay, daemon=True)
        self._thread.start()

    def _relay(self):
        while not self._stopping.is_set():
            sockets = [self.front, *self.upstreams.values()]
            readable, _, _ = select.select(sockets, [], [], 0.1)
            for sock in readable:
                data, source = sock.recvfrom(65535)
                if sock is self.front:
                    upstream = self.upstreams.get(source)
                    if upstream is None:
                        upstream = self.upstreams[source] = socket.socket(
                            socket.AF_INET, socket.SOCK_DGRAM
                        )
                        upstream.bind(("127.0.0.1", 0))
                        self.clients[upstream] = source
                    self._forward(("up", source), upstream, data, self.broker)
                else:
                    client = self.clients[sock]
                    self._forward(("down", client), self.front, data, client)

    def _forward(self, direction, sock, data, destination):
        count = self.counts[direction] = self.counts.get(direction, 0) + 1
        if count % 3 == 0:
            self.dropped += 1
            return
        self.forwarded += 1
        sock.sendto(data, destination)

    def close(self):
        self._stopping.set()
        self._thread.join(5)
        for sock in [self.front, *self.upstreams.values()]:
            sock.close()


def test_lossyRelayAllModeShowsEveryAckedMessageOnce(broker):
    """
    Through a relay that loses one datagram in three each way, every
    message whose publish was acknowledged appears on the screen of an
    C{all}-mode subscriber exactly once.
    """
    relay = LossyRelay(broker.udpPort)
    try:
        listener = subscriber(relay.port, "lossy", mode="all", udp=True)
        try:
            acked = []
            for number in range(8):
                message = f"message-{number}"
                if udpPublish(relay.port, "lossy", message).stdout == PUBLISHED:
                    acked.append(message)
            assert acked
            expected = [f"lossy: {message}\n".encode() for message in acked]
            listener.waitUntil(
                lambda output: all(line in output for line in expected), 30, "every message"
            )
            # Resends come every second: long enough for a duplicate to show.
            time.sleep(3)
        finally:
            stopSubscriber(listener)
    finally:
        relay.close()
    lines = listener.output.decode().splitlines()
    assert lines[0] == "subscribing on lossy"
    # Its standard error is in the output too: pings lost in a row are
    # reported (and the client keeps going); nothing else may be.
    shown = [line for line in lines[1:] if not line.startswith("dallal: no pong from ")]
    assert sorted(shown) == sorted(set(shown)), shown
    assert set(f"lossy: {message}" for message in acked) <= set(shown)
    assert all(re.fullmatch(r"lossy: message-\d", line) for line in shown)
    assert relay.dropped > 10
