"""
udp-answer-cache: what a UDP session remembers is bounded.

A UDP session remembers its answers so that a retried request is not
carried out twice. 100 sessions (no password needed: --udp without
--passwords), from 127.0.0.10 to 127.0.0.29, each send 1024 PUBs with
distinct 64-character request ids and an empty payload, so that each
session remembers as many answers as it can.

PASS if the broker's resident memory grows by at most 32 KiB per session
(which bounds 10,000 sessions, the default --max-udp-clients, to 320 MiB);
the figure extrapolates what it grew to 10,000 sessions. A broker with
--max-udp-answer-bytes and --max-udp-answer-bytes-total is run with 32 KiB
per session and 1 MiB in all, and must also grow by less than 1 MiB more
than that total (the sessions' own bookkeeping).
"""

import time

import attacklib as lib

NAME = "udp-answer-cache"
SESSIONS = 100
REQUESTS = 1024
BATCH = 64
PER_SESSION_LIMIT = 32 * lib.KiB
MAX_UDP_CLIENTS = 10_000
# The fix's bounds, where the broker has them.
ANSWER_BOUNDS = {"--max-udp-answer-bytes": 32 * lib.KiB, "--max-udp-answer-bytes-total": lib.MiB}
TOTAL_SLACK = lib.MiB


def requestId(session, number):
    return b"%s-%07d" % (b"%02d" % session * 28, number)  # 64 characters


def attack():
    extra, note = lib.optionsIfPresent(ANSWER_BOUNDS)
    with lib.scratch() as directory, lib.dallal(directory, extra, udp=True) as broker:
        clients = []
        for number in range(SESSIONS):
            client = lib.UdpClient(broker.udpPort, source=f"127.0.0.{10 + number % 20}")
            answer = client.hello(f"cache-{number}")
            if answer is None or b"session=" not in answer:
                raise lib.BenchError(f"session {number} did not start: {answer!r}")
            clients.append(client)
        time.sleep(0.5)
        baseline = broker.residentMemory()
        answered = 0
        start = time.monotonic()
        for session, client in enumerate(clients):
            for first in range(0, REQUESTS, BATCH):
                for number in range(first, first + BATCH):
                    client.sendRaw(client.frame(b"PUB %s u/t 0" % requestId(session, number), b""))
                last = requestId(session, first + BATCH - 1)
                client.waitFor(lambda d, last=last: d.split()[1:2] == [last], 5)
            answered += sum(1 for data in client.received if data.startswith(b"PUBACK"))
            client.received.clear()
        seconds = time.monotonic() - start
        time.sleep(0.5)
        growth = broker.residentMemory() - baseline
        for client in clients:
            client.close()
    perSession = growth / SESSIONS
    passed = perSession <= PER_SESSION_LIMIT
    if "--max-udp-answer-bytes-total" in extra:
        passed = passed and growth <= ANSWER_BOUNDS["--max-udp-answer-bytes-total"] + TOTAL_SLACK
    figure = (
        f"{SESSIONS} sessions x {REQUESTS} PUBs with 64-character ids ({answered} answered in "
        f"{seconds:.0f} s): RSS +{lib.mib(growth)}, {perSession / lib.KiB:.0f} KiB per session, "
        f"{perSession * MAX_UDP_CLIENTS / lib.MiB:.0f} MiB at {MAX_UDP_CLIENTS} sessions "
        f"(limit: <= {PER_SESSION_LIMIT / lib.KiB:.0f} KiB per session)"
    )
    return passed, figure, note


if __name__ == "__main__":
    lib.runAttack(NAME, __doc__, lambda options: attack())
