"""
The soak of bench/soak.py, short: the same code path with 100 clients for
20 seconds instead of 1,000 for 10 minutes, and the same three checks (no
PubAck'd C{all}-mode message lost for a subscriber that stayed connected,
the broker's peak memory under the bound the script states, nothing
unhandled in its log and a clean stop).
"""

import sys

import pytest

from helpers import REPO

sys.path.insert(0, str(REPO / "bench"))

import soak  # noqa: E402

SHORT = soak.Settings(clients=100, seconds=20.0, rate=20.0, pingInterval=2.0)


@pytest.mark.timeout(240)
def test_shortSoak(tmp_path):
    result = soak.run(SHORT, tmp_path)
    # Shown by pytest -rP.
    soak.printResult(result)
    assert [check.name for check in result.checks] == [
        "no PubAck'd all-mode message lost",
        "memory",
        "no unhandled error, clean stop",
    ]
    for check in result.checks:
        assert check.ok, f"{check.name}: {check.detail}"
    figures = result.figures
    # The run did what it says: churn over both transports, stopped and
    # killed clients, slow and never-reading subscribers.
    assert figures["counters"]["connections_total"] > 2 * SHORT.clients
    counts = figures["workers"]["counts"]
    assert counts["connected udp"] > 0 and counts["never-reader connections"] > 0
    assert figures["stops"] > 0 and figures["kills"] > 0
    assert figures["workers"]["pubacked"] > SHORT.seconds * SHORT.rate / 2
