"""
A live broker (twistd) against clients that try to make it hold memory:
what it holds stays bounded, and it goes on serving everyone else.
"""

import socket
import time

import pytest

from helpers import BrokerProcess, dallal
from test_fuzz_network import vmRSS

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
