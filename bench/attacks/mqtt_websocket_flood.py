"""
mqtt-websocket-flood: MQTT over WebSockets (`--http`'s `/mqtt`) holds
to what its frames cost.

A. Ping flood: a client opens `/mqtt`, connects, then with a 4 KiB receive
buffer sends 100,000 WebSocket PINGs of 125 bytes (each to be answered by
a PONG of 125 bytes) and never reads.
B. Fragments: 20 clients each send a PUBLISH of 256 KiB as one binary
message cut into frames of one byte (a continuation frame per byte), all
at once, while a probe publishes over `--mqtt` every 50 ms.

PASS if A grows the broker by less than 20 MiB (the PONGs count against
the connection's output bound, or it stops being read) and in B the
probe's median round trip stays under 100 ms and the broker holds at most
8 bytes of memory per payload byte received.
"""

import base64
import os
import socket
import sys
import threading
import time

import attacklib as lib

sys.path.insert(0, lib.BENCH)
from compare import freePort  # noqa: E402

NAME = "mqtt-websocket-flood"
PINGS = 100_000
GROWTH_LIMIT = 20 * lib.MiB
FRAGMENTED = 20
MESSAGE = 256 * lib.KiB
BYTES_PER_BYTE_LIMIT = 8.0


def frame(opcode, payload, final=True):
    """
    A client's WebSocket frame (masked, with a mask of zeros).
    """
    head = bytes([(0x80 if final else 0) | opcode])
    size = len(payload)
    if size < 126:
        head += bytes([0x80 | size])
    elif size < 65536:
        head += bytes([0x80 | 126]) + size.to_bytes(2, "big")
    else:
        head += bytes([0x80 | 127]) + size.to_bytes(8, "big")
    return head + b"\0\0\0\0" + payload


def openWebSocket(port, receiveBuffer=None):
    sock = socket.socket()
    if receiveBuffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receiveBuffer)
    sock.settimeout(10)
    sock.connect(("127.0.0.1", port))
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall(
        (
            f"GET /mqtt HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
            "Sec-WebSocket-Version: 13\r\nSec-WebSocket-Protocol: mqtt\r\n\r\n"
        ).encode()
    )
    answer = b""
    while b"\r\n\r\n" not in answer:
        data = sock.recv(4096)
        if not data:
            raise lib.BenchError("the broker closed the WebSocket handshake")
        answer += data
    if not answer.startswith(b"HTTP/1.1 101"):
        raise lib.BenchError(f"no WebSocket: {answer[:80]!r}")
    from protocols import mqttPacket, mqttString

    clientId = b"ws-" + base64.b16encode(os.urandom(6))
    sock.sendall(
        frame(2, mqttPacket(1, 0, mqttString(b"MQTT") + bytes([4, 2, 0, 0]) + mqttString(clientId)))
    )
    return sock


def pingFlood(port):
    sock = openWebSocket(port, receiveBuffer=4096)
    ping = frame(9, b"p" * 125)
    sock.settimeout(5)
    sent = 0
    try:
        for _ in range(PINGS // 1000):
            sock.sendall(ping * 1000)
            sent += 1000
    except (TimeoutError, OSError):
        pass
    return sock, sent


def fragmented(port, ready, go):
    from protocols import mqttPacket, mqttString

    sock = openWebSocket(port)
    packet = mqttPacket(3, 0, mqttString(b"ws/fragments") + b"x" * MESSAGE)
    data = frame(2, packet[:1], final=False) + b"".join(
        frame(0, packet[index : index + 1], final=index == len(packet) - 1)
        for index in range(1, len(packet))
    )
    ready.release()
    go.wait()
    try:
        sock.settimeout(30)
        sock.sendall(data)
    except OSError:
        pass
    return sock


def attack(options):
    httpPort = freePort()
    with lib.scratch() as directory:
        with lib.anyMqttBroker(
            "dallal", directory, ["--http", f"tcp:{httpPort}:interface=127.0.0.1"]
        ) as (server, port):
            time.sleep(0.5)
            baseline = server.residentMemory()
            flooder, sent = pingFlood(httpPort)
            time.sleep(3)
            pingGrowth = server.residentMemory() - baseline
            flooder.close()
            time.sleep(1)

            ready, go = threading.Semaphore(0), threading.Event()
            sockets = []
            threads = [
                threading.Thread(
                    target=lambda: sockets.append(fragmented(httpPort, ready, go)), daemon=True
                )
                for _ in range(FRAGMENTED)
            ]
            for thread in threads:
                thread.start()
            for _ in threads:
                ready.acquire(timeout=60)
            probe = lib.PeerPublishProbe("mosquitto", port)
            before = server.residentMemory()

            cpu = server.cpuSeconds()

            def send():
                go.set()
                for thread in threads:
                    thread.join(60)
                # Until the broker has taken it all: its CPU stops rising.
                last = server.cpuSeconds()
                while True:
                    time.sleep(0.5)
                    now = server.cpuSeconds()
                    if now - last < 0.05:
                        break
                    last = now

            samples = probe.during(send)
            fragmentGrowth = server.residentMemory() - before
            cpu = server.cpuSeconds() - cpu
            probe.close()
            for sock in sockets:
                sock.close()
            server.checkAlive()
    perByte = fragmentGrowth / (FRAGMENTED * MESSAGE)
    delay = lib.median(samples)
    figure = (
        f"A: {sent} PINGs never read: RSS +{lib.mib(pingGrowth)}; B: {FRAGMENTED} messages of "
        f"{MESSAGE // lib.KiB} KiB in 1-byte frames: RSS +{lib.mib(fragmentGrowth)} "
        f"({perByte:.1f} bytes per byte) and {cpu:.1f} s of broker CPU, the probe's median "
        f"{lib.ms(delay)} "
        f"(max {lib.ms(max(samples))})"
    )
    passed = pingGrowth < GROWTH_LIMIT and delay < 0.1 and perByte <= BYTES_PER_BYTE_LIMIT
    return passed, figure


if __name__ == "__main__":
    lib.runAttack(NAME, __doc__, attack)
