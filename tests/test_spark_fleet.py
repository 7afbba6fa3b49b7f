"""
A fleet's logs analysed together: three real brokers bridged as a hub and
two leaves, traffic published at each, then the report over the three logs
at once.  Every figure, per broker and for the fleet, equals what the
brokers' own counters (`dallal stats --json`) say.
"""

import pytest
from helpers import dallal
from test_e2e_bridges import Brokers, expectEachMessageOnceEverywhere, freePorts

pytest_plugins = ["conftest_spark"]
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

# summary.json's figure -> the broker counter it must equal.
FIGURES = {
    "sessions": "connections_total",
    "publishes": "published",
    "sys_published": "sys_published",
    "bridged_published": "bridged_published",
    "bridged_delivered": "bridged_delivered",
    "bridged_dropped": "bridged_dropped",
    "deliveries": "delivered",
    "redeliveries": "redelivered",
    "bytes_in": "bytes_in",
    "bytes_out": "bytes_out",
    "errors": "errors",
}
# Figures of the fleet only (the loss account is per topic).
FLEET_FIGURES = {
    "matched": "matched",
    "acked": "acked",
    "fired": "fired",
    "dropped": "dropped",
    "replaced": "replaced",
}


@pytest.fixture
def fleetLogs(tmp_path):
    """
    Run the hub and its leaves, publish at each, and stop them.

    @return: the folder of their logs (one folder per broker) and each
        broker's last C{stats --json}.
    """
    brokers = Brokers(tmp_path / "brokers")
    (tmp_path / "brokers").mkdir()
    hub, leaf1, leaf2 = freePorts(3)
    bridge = ["--bridge", f"hub=tcp:127.0.0.1:{hub}"]
    try:
        brokers.start(("hub", hub, []), ("leaf1", leaf1, bridge), ("leaf2", leaf2, bridge))
        brokers.waitUp("leaf1", "hub")
        brokers.waitUp("leaf2", "hub")
        expectEachMessageOnceEverywhere(brokers)
        # A refused request, counted as an error.
        dallal("127.0.0.1", leaf1, "publish", "+bad", "x")
        # The last sessions of each broker: these stats themselves.
        stats = {name: brokers.stats(name) for name in ("hub", "leaf1", "leaf2")}
        logs = tmp_path / "logs"
        for name in list(brokers.processes):
            process = brokers.stop(name)
            (logs / name).mkdir(parents=True)
            (logs / name / "twistd.log").write_bytes(process.output)
    finally:
        brokers.stopAll()
    return logs, stats


def test_a_fleets_logs_read_together(spark, fleetLogs, tmp_path):
    from dallal_analytics import report

    logs, stats = fleetLogs
    summary = report.runReport(spark, [str(logs / "*")], tmp_path / "report")
    assert sorted(summary["brokers"]) == ["hub", "leaf1", "leaf2"]
    for name, counters in stats.items():
        broker = summary["brokers"][name]
        assert {figure: broker[figure] for figure in FIGURES} == {
            figure: counters[counter] for figure, counter in FIGURES.items()
        }, name
        assert broker["runs"] == 1
    for figure, counter in {**FIGURES, **FLEET_FIGURES}.items():
        assert summary[figure] == sum(each[counter] for each in stats.values()), figure
    assert summary["runs"] == 3
    assert summary["inflight"] == 0
    assert summary["counter_mismatches"] == []
    # The fleet's peak is at least each broker's.
    assert summary["peak_connections"] >= max(
        broker["peak_connections"] for broker in summary["brokers"].values()
    )
    html = (tmp_path / "report" / "report.html").read_text()
    for name in stats:
        assert f">{name}</td>" in html
