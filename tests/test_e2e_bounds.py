"""
A live broker (twistd) against clients that try to make it hold memory:
what it holds stays bounded, and it goes on serving everyone else.
"""

import json
import socket
import time

import pytest
from helpers import BrokerProcess, dallal
from test_e2e_auth import PASSWORDS, SecuredBroker, as_
from test_e2e_fuzz_network import vmRSS

from dallal.protocol import wire

pytestmark = pytest.mark.e2e

# Subscriptions of a client whose LIST answer is then some 50 kB.
FILTERS = 200
LISTS = 2000
# Without the output bound, the broker would hold every answer: some 100 MB.
RSS_GROWTH_LIMIT_KIB = 20 * 1024


@pytest.mark.timeout(120)
def test_pipelinedListsFromAClientThatDoesNotRead(tmp_path):
    """
    A client pipelines 2000 LISTs (each answered with some 50 kB) and never
    reads: the broker stops reading it once its socket is full, its memory
    grows by less than 20 MiB, and other clients are served meanwhile.
    """
    broker = BrokerProcess.plugin(tmp_path)
    try:
        before = vmRSS(broker.process.pid)
        flooder = socket.create_connection(("127.0.0.1", broker.port))
        flooder.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        filters = b"".join(
            b"SUB %d flood/%s/%d\r\n" % (number, b"x" * 200, number) for number in range(FILTERS)
        )
        flooder.sendall(filters)
        flooder.setblocking(False)
        requests = b"".join(b"LIST %d\r\n" % number for number in range(LISTS))
        sent = 0
        deadline = time.monotonic() + 10
        while sent < len(requests) and time.monotonic() < deadline:
            try:
                sent += flooder.send(requests[sent:])
            except BlockingIOError:
                time.sleep(0.05)
        time.sleep(1)
        result = dallal("127.0.0.1", broker.port, "publish", "other/topic", "still served")
        assert result.returncode == 0, result
        after = vmRSS(broker.process.pid)
        print(f"sent {sent} bytes of LISTs; broker VmRSS {before} -> {after} KiB")
        assert after - before < RSS_GROWTH_LIMIT_KIB, f"VmRSS grew by {after - before} KiB"
        flooder.close()
    finally:
        broker.stop()


FLOOD_LOGINS = 400
# What a real login may take during the flood (a check is some tens of
# milliseconds; the machine is shared).
LOGIN_DURING_FLOOD_SECONDS = 3.0


def hello(user, password):
    return b"HELLO h c1 %s\r\n" % b" ".join(
        b"%s=%s" % (key.encode(), value.encode())
        for key, value in wire.encodeCredentials(user, password).items()
    )


@pytest.mark.timeout(120)
def test_loginDuringAFloodOfWrongPasswordsFromAnotherAddress(tmp_path):
    """
    400 wrong-password HELLOs from 127.0.0.2, each on its own connection,
    then a real login from 127.0.0.1: it is answered within 3 seconds,
    while the flood's logins beyond the per-address bound are refused at
    once.
    """
    broker = SecuredBroker(tmp_path)
    flood = []
    try:
        for _ in range(FLOOD_LOGINS):
            connection = socket.create_connection(
                ("127.0.0.1", broker.port), source_address=("127.0.0.2", 0)
            )
            connection.sendall(hello("alice", b"wrong"))
            flood.append(connection)
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", broker.port), timeout=30) as real:
            real.sendall(hello("alice", PASSWORDS["alice"].encode()))
            answer = b""
            # (A PING of the sweep may come first.)
            while b"\nHELLO h " not in b"\n" + answer:
                received = real.recv(4096)
                assert received, answer
                answer += received
        took = time.monotonic() - started
        print(f"a login during a flood of {FLOOD_LOGINS} wrong passwords took {took:.2f} s")
        assert b" user=alice\r\n" in answer, answer
        assert took < LOGIN_DURING_FLOOD_SECONDS
        counters = json.loads(as_("alice", broker.port, "stats", "--json").stdout)
        assert counters["refused_pending_logins_per_ip"] > 0, counters
    finally:
        for connection in flood:
            connection.close()
        broker.process.stop()
