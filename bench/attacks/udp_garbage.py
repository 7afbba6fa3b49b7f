"""
udp-garbage: a UDP session's errors are rate-limited too (beyond the
issue's list).

The broker rate-limits the log lines of refused datagrams that name no
session (PROTOCOL.md's strangers), but not those of a session. On --udp
(no password needed), the attacker starts a session and, for 10 s, sends
as fast as it can datagrams that carry its valid identity and a bad
request (an unknown verb, a bad topic, a bad mode), reading nothing.
Meanwhile a normal TCP client publishes every 0.2 s.

PASS if the broker's log grows by less than 1 MiB and the normal publish
is answered in under 200 ms (95th percentile), as garbage-stream asks of
TCP.
"""

import random
import time

import attacklib as lib

NAME = "udp-garbage"
SECONDS = 10.0
LOG_LIMIT = lib.MiB
ANSWER_LIMIT = 0.2
BAD_REQUESTS = [b"XYZZY %d", b"SUB %d +bad# mode=all", b"SUB %d t mode=sideways", b"PUB %d t/x 5"]


def attack():
    with lib.scratch() as directory, lib.dallal(directory, udp=True) as broker:
        attacker = lib.UdpClient(broker.udpPort, source="127.0.0.1")
        if attacker.hello("garbage") is None:
            raise lib.BenchError("the attacker's session did not start")
        frames = [
            attacker.frame(template % number) for number, template in enumerate(BAD_REQUESTS * 250)
        ]
        random.Random(24).shuffle(frames)
        probe = lib.PeerPublishProbe("dallal", broker.port)
        logBefore = lib.logSize(broker)
        samples, sent = [], 0
        start = time.monotonic()
        nextProbe = start
        while time.monotonic() - start < SECONDS:
            for _ in range(200):
                try:
                    attacker.sendRaw(frames[sent % len(frames)])
                except OSError:
                    pass
                sent += 1
            if time.monotonic() >= nextProbe:
                took = probe.roundTrip(15.0)
                samples.append(took if took is not None else float("inf"))
                nextProbe = time.monotonic() + 0.2
            time.sleep(0.001)
        time.sleep(1)
        logGrowth = lib.logSize(broker) - logBefore
        probe.close()
        attacker.close()
    p95 = lib.percentile(samples, 0.95)
    passed = logGrowth < LOG_LIMIT and p95 < ANSWER_LIMIT
    figure = (
        f"{sent} bad requests from one UDP session in {SECONDS:g} s: log +{lib.mib(logGrowth)}; "
        f"a normal TCP publish answered in median {lib.ms(lib.median(samples))}, p95 "
        f"{lib.ms(p95)} (limits: log < {lib.mib(LOG_LIMIT)}, p95 < {lib.ms(ANSWER_LIMIT)})"
    )
    return passed, figure


if __name__ == "__main__":
    lib.runAttack(NAME, __doc__, lambda options: attack())
