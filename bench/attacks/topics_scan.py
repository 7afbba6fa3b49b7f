"""
topics-scan: TOPICS costs what it answers, not what the broker holds
(beyond the issue's list).

20 connections subscribe with 1000 distinct filters each (20,000 filters,
within the default limits: one address may hold 1000 connections of 1000
subscriptions), and the broker holds 5,000 retained topics. Then an
attacker asks `TOPICS <id> limit=1`, the smallest answer there is, 50 at a
time pipelined, reading the answers, for 10 s, while a probe client (from
127.0.0.2) times its publish -> deliver round trip every 50 ms.

PASS if the probe's median round trip stays under 100 ms and one TOPICS
limit=1 costs the broker less than 1 ms of CPU: today each sorts and
scans every filter (and looks each up in the retained store) to answer one
row.
"""

import time

import attacklib as lib

NAME = "topics-scan"
CONNECTIONS = 20
FILTERS = 1000
RETAINED = 5000
SECONDS = 10.0
LATENCY_LIMIT = 0.1
CPU_LIMIT = 0.001


def attack():
    with lib.scratch() as directory, lib.dallal(directory) as broker:
        holders = []
        for number in range(CONNECTIONS):
            connection = lib.Connection(broker.port, timeout=60)
            connection.send(
                b"".join(b"SUB s%d held/%d/%d\r\n" % (k, number, k) for k in range(FILTERS))
            )
            if connection.answer(b"s%d" % (FILTERS - 1), timeout=60) is None:
                raise lib.BenchError("the filters were not subscribed in 60 s")
            holders.append(connection)
        lib.fillRetained(broker.port, RETAINED, "kept")
        probe = lib.DallalProbe(broker.port)
        attacker = lib.Connection(broker.port, timeout=60)
        asked = [0]

        def ask():
            end = time.monotonic() + SECONDS
            while time.monotonic() < end:
                attacker.send(b"TOPICS t limit=1\r\n" * 50)
                for _ in range(50):
                    if attacker.waitFor(lambda line: line.startswith(b"TOPICS t "), 60) is None:
                        raise lib.BenchError("TOPICS was not answered in 60 s")
                asked[0] += 50

        cpuBefore = broker.cpuSeconds()
        samples = lib.probeDuring(probe, ask)
        cpu = broker.cpuSeconds() - cpuBefore
        asked = asked[0]
        probe.close()
        for connection in holders + [attacker]:
            connection.close()
    medianRtt = lib.median(samples)
    perRequest = cpu / max(asked, 1)
    passed = medianRtt < LATENCY_LIMIT and perRequest < CPU_LIMIT
    figure = (
        f"{asked} TOPICS limit=1 in {SECONDS:g} s over {CONNECTIONS * FILTERS} filters and "
        f"{RETAINED} retained topics: broker CPU {perRequest * 1000:.1f} ms per TOPICS; "
        f"probe median {lib.ms(medianRtt)}, max {lib.ms(max(samples))} "
        f"(limits: median < {lib.ms(LATENCY_LIMIT)}, < {CPU_LIMIT * 1000:g} ms per TOPICS)"
    )
    return passed, figure


if __name__ == "__main__":
    lib.runAttack(NAME, __doc__, lambda options: attack())
