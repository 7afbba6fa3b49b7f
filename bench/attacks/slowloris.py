"""
slowloris: slow senders cannot hold memory or connections.

100 connections announce a 1 MB payload (PUB <id> <topic> 1000000) and
send it one byte per TCP segment, round-robin, as fast as they can for
8 s; 100 more send a control line that never ends, one byte every 0.5 s.
The broker's resident memory growth from 2 s to 8 s is divided by the
payload bytes it received meanwhile (what the connections cost by
themselves is left out); then every connection trickles one byte every
0.5 s. A broker
with --max-frame-seconds is run with 12 (its default, 60, is longer than
this attack).

PASS if the broker holds at most 8 bytes of memory per payload byte held
(the figure is resident memory, precise to some 100 KiB),
and cuts every slow connection within 30 s of its first byte (a partial
frame must complete within a deadline).

With --broker dallal-mqtt, the same over Dallal's --mqtt listener as
against Mosquitto. With --broker redis|nats|mosquitto, the same with each protocol's own
large-payload header (Redis's bulk string, NATS's PUB, an MQTT PUBLISH) and
unfinished line (an inline command, a NATS PUB line, an MQTT CONNECT).
"""

import socket
import time

import attacklib as lib

NAME = "slowloris"
PAYLOADS = 100
LINES = 100
FAST_SECONDS = 8.0
FIRST_LOOK = 2.0
DEADLINE = 30.0
# The fix's deadline option, set within the attack's time where it exists.
FRAME_SECONDS = {"--max-frame-seconds": 12}
BYTES_PER_BYTE_LIMIT = 8.0
SIZE = 1_000_000


def headers(kind, number):
    """
    (what opens connection C{number}, the large payload's header, the start
    of a line that never ends) in the broker's protocol.
    """
    from protocols import mqttPacket, mqttRemainingLength, mqttString

    if kind == "dallal":
        return b"", b"PUB 1 slow/topic %d\r\n" % SIZE, b"SUB 1 slow/"
    if kind == "redis":
        return b"", b"*3\r\n$7\r\nPUBLISH\r\n$4\r\nslow\r\n$%d\r\n" % SIZE, b"PUBLISH slow "
    if kind == "nats":
        return b'CONNECT {"verbose":false}\r\n', b"PUB slow %d\r\n" % SIZE, b"PUB slow "
    connect = mqttPacket(
        1, 0, mqttString(b"MQTT") + bytes([4, 2, 0, 60]) + mqttString(b"slow%d" % number)
    )
    publish = bytes([0x30]) + mqttRemainingLength(SIZE + 6) + mqttString(b"slow")
    # The line attack for MQTT: a CONNECT announcing 1000 bytes, never finished.
    return connect, publish, bytes([0x10]) + mqttRemainingLength(1000) + mqttString(b"MQTT")


class Slow:
    def __init__(self, port, opening, header):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.sendall(opening + header)
        self.sock.setblocking(False)
        self.started = time.monotonic()
        self.sent = 0
        self.open = True
        self.closedAfter = None

    def trickle(self):
        if not self.open:
            return
        try:
            # Whatever the broker says (an ERR, a PING) is read and forgotten;
            # an end of stream means it closed the connection.
            while True:
                data = self.sock.recv(65536)
                if not data:
                    self._closed()
                    return
        except BlockingIOError:
            pass
        except OSError:
            self._closed()
            return
        try:
            self.sent += self.sock.send(b"x")
        except BlockingIOError:
            pass
        except OSError:
            self._closed()

    def _closed(self):
        self.open = False
        self.closedAfter = time.monotonic() - self.started
        self.sock.close()


def heldBy(payloads):
    """
    The payload bytes the broker holds for the connections still open.
    """
    return sum(slow.sent for slow in payloads if slow.open)


def attack(kind):
    extra, note = lib.optionsIfPresent(FRAME_SECONDS) if kind.startswith("dallal") else ((), None)
    with lib.scratch() as directory, lib.brokerAndPort(kind, directory, extra) as (server, port):
        payloads = [Slow(port, *headers(kind, number)[:2]) for number in range(PAYLOADS)]
        lines = [Slow(port, *headers(kind, PAYLOADS + number)[::2]) for number in range(LINES)]
        start = time.monotonic()
        lastLine = 0.0
        # What the connections themselves cost is not what they hold: the
        # memory per byte is the slope between a first and a last look.
        first = None
        while time.monotonic() - start < FAST_SECONDS:
            if first is None and time.monotonic() - start >= FIRST_LOOK:
                first = (server.residentMemory(), heldBy(payloads))
            for slow in payloads:
                slow.trickle()
            if time.monotonic() - lastLine >= 0.5:
                lastLine = time.monotonic()
                for slow in lines:
                    slow.trickle()
            time.sleep(0.001)
        held = heldBy(payloads) - first[1]
        growth = server.residentMemory() - first[0]
        while time.monotonic() - start < DEADLINE + 1:
            for slow in payloads + lines:
                slow.trickle()
            time.sleep(0.5)
        openPayloads = sum(1 for slow in payloads if slow.open)
        openLines = sum(1 for slow in lines if slow.open)
        for slow in payloads + lines:
            if slow.open:
                slow.sock.close()
    perByte = growth / held if held > 0 else 0.0
    passed = perByte <= BYTES_PER_BYTE_LIMIT and not openPayloads and not openLines
    figure = (
        f"{kind}: {held / 1000:.0f} kB more payload held from {FIRST_LOOK:g} s to "
        f"{FAST_SECONDS:g} s, sent one byte per segment on {PAYLOADS} connections: RSS "
        f"+{lib.mib(growth)}, {perByte:.1f} bytes per byte held; "
        f"after {DEADLINE:g} s still open: {openPayloads}/{PAYLOADS} partial payloads, "
        f"{openLines}/{LINES} partial lines "
        f"(limits: <= {BYTES_PER_BYTE_LIMIT:g} bytes per byte, all cut within {DEADLINE:g} s)"
    )
    return passed, figure, note


if __name__ == "__main__":
    lib.runAttack(
        NAME, __doc__, lambda options: attack(options.broker), peers=("dallal-mqtt", *lib.PEERS)
    )
