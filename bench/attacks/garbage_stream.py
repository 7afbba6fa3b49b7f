"""
garbage-stream: a protocol error stream cannot stall the broker.

For 20 s, 40 connections from 127.0.0.1 send random bytes as fast as they
can (reading and forgetting whatever comes back, connecting again when the
broker closes them). Meanwhile a normal client from 127.0.0.2 publishes
every 0.2 s and times the answer (PUBACK), and goes on for 3 s after the
attack stops.

PASS if 95% of the normal publishes are answered within 200 ms and none
is lost (15 s), and the broker logs less than 1 MiB of error lines
(`protocol_error`, `protocol_errors_suppressed`, `limit_reached`): its
error logging is rate-limited, not a line per bad line.

Only the error lines count, not the whole log: each time the broker closes
a garbage connection the attacker connects again, and every connection
logs its `connect` and `disconnect` lines (some 20,000 of each in 20 s
here, 6 MiB). Those are one pair per TCP connection the attacker
completed, a handshake each (what it costs is the connection rate, which
--max-connections-per-ip bounds only at once and a firewall's rate limit
bounds in time), and they are the record of who connected when that an
operator and the analytics need; Mosquitto and NATS log each connection
too. The figure still gives the whole log's growth. For the peers, whose
lines cannot be told apart here, the limit applies to the whole log.

With --broker redis|nats|mosquitto the same garbage, and the peer's own
publish answer as the probe (Redis PUBLISH, NATS PUB + PING, MQTT QoS 1).
"""

import os
import re
import select
import socket
import threading
import time

import attacklib as lib

NAME = "garbage-stream"
CONNECTIONS = 40
SECONDS = 20.0
AFTER = 3.0
ANSWER_LIMIT = 0.2
LOG_LIMIT = lib.MiB
ERROR_LINE = re.compile(rb"event=(protocol_error|limit_reached)")


class Garbage(threading.Thread):
    """
    Random bytes on many connections, until stopped.
    """

    def __init__(self, port):
        threading.Thread.__init__(self, daemon=True)
        self.port = port
        self.sent = 0
        self.reconnects = 0
        self.running = True

    def connect(self):
        sock = socket.socket()
        sock.setblocking(False)
        try:
            sock.connect(("127.0.0.1", self.port))
        except BlockingIOError:
            pass
        return sock

    def run(self):
        sockets = [self.connect() for _ in range(CONNECTIONS)]
        while self.running:
            readable, writable, _ = select.select(sockets, sockets, [], 0.1)
            for sock in readable:
                try:
                    data = sock.recv(1 << 16)
                except OSError:
                    data = b""
                if not data:
                    sockets.remove(sock)
                    sock.close()
                    sockets.append(self.connect())
                    self.reconnects += 1
            for sock in writable:
                if sock not in sockets:
                    continue
                try:
                    self.sent += sock.send(os.urandom(4096))
                except (BlockingIOError, InterruptedError):
                    pass
                except OSError:
                    sockets.remove(sock)
                    sock.close()
                    sockets.append(self.connect())
                    self.reconnects += 1
        for sock in sockets:
            sock.close()


def attack(kind):
    with lib.scratch() as directory, lib.anyBroker(kind, directory) as server:
        probe = lib.PeerPublishProbe(kind, server.port)
        logBefore = lib.logSize(server) if os.path.exists(server.logPath) else 0
        garbage = Garbage(server.port)
        samples = []
        garbage.start()
        start = time.monotonic()
        while time.monotonic() - start < SECONDS + AFTER:
            if garbage.running and time.monotonic() - start >= SECONDS:
                garbage.running = False
            took = probe.roundTrip(15.0)
            samples.append(took if took is not None else float("inf"))
            time.sleep(0.2)
        garbage.running = False
        garbage.join(5)
        logGrowth = (lib.logSize(server) if os.path.exists(server.logPath) else 0) - logBefore
        alive = server.alive()
        logged = ""
        errorBytes = logGrowth
        if kind == "dallal":
            text = lib.logText(server)
            errorBytes = sum(len(line) + 1 for line in text.splitlines() if ERROR_LINE.search(line))
            logged = (
                f" ({text.count(b'event=protocol_error ')} protocol_error, "
                f"{text.count(b'event=connect ')} connect lines; error lines "
                f"{errorBytes / lib.KiB:.0f} KiB)"
            )
        probe.close()
    lost = sum(1 for took in samples if took == float("inf"))
    answered = [took for took in samples if took != float("inf")]
    p95 = lib.percentile(samples, 0.95)
    passed = alive and not lost and p95 < ANSWER_LIMIT and errorBytes < LOG_LIMIT
    figure = (
        f"{kind}: {garbage.sent / lib.MiB:.0f} MiB of random bytes on {CONNECTIONS} connections "
        f"({garbage.reconnects} closed by the broker) in {SECONDS:g} s; a normal publish answered "
        f"in median {lib.ms(lib.median(answered))}, p95 {lib.ms(p95) if p95 != float('inf') else 'never'}, "
        f"max {lib.ms(max(answered)) if answered else '-'}, {lost} of {len(samples)} unanswered in 15 s; "
        f"log +{logGrowth / lib.KiB:.0f} KiB{logged}"
        f" (limits: p95 < {lib.ms(ANSWER_LIMIT)}, none lost, "
        f"{'error lines' if kind == 'dallal' else 'log'} < {lib.mib(LOG_LIMIT)})"
    )
    return passed, figure


if __name__ == "__main__":
    lib.runAttack(NAME, __doc__, lambda options: attack(options.broker), peers=tuple(lib.PEERS))
