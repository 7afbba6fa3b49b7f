"""
dallal-report on a local-cluster master: a master, two workers and an
executor JVM each, as on a real cluster.  It runs as a separate process
from another working directory without this checkout on PYTHONPATH, so it
proves the job needs nothing from the driver's directory or imports on the
executors.  (The process is tests/conftest_spark.py's C{siteReport}, which
tests/test_spark_session.py reads too.)
"""

import json

import pytest

pytest_plugins = ["conftest_spark"]
# Starting the JVMs (a local cluster's: four) and the first queries take
# long on a busy machine.
pytestmark = [pytest.mark.timeout(480), pytest.mark.e2e]


def test_report_on_a_local_cluster(siteReport, handWrittenSummary):
    result, out = siteReport.result, siteReport.out
    assert result.returncode == 0, result.stderr
    summary = json.loads((out / "summary.json").read_text())
    for key in (
        "publishes",
        "deliveries",
        "acked",
        "replaced",
        "dropped",
        "inflight",
        "sessions",
        "peak_connections",
        "unparsed_lines",
        "counter_mismatches",
    ):
        assert summary[key] == handWrittenSummary[key], key
    # The table of every (message, subscriber) only with --deliveries.
    tables = {path.name for path in (out / "tables").iterdir()}
    assert "messages" in tables and "deliveries" not in tables
    # No errors from the JVMs (Spark's own start-up lines may be there).
    assert " ERROR " not in result.stderr and "Traceback" not in result.stderr
    assert result.stdout.splitlines()[-2:] == [
        f"report: {out / 'report.html'}",
        f"summary: {out / 'summary.json'}",
    ]
    # The executors really ran apart, in the workers' folders.
    assert list((siteReport.sparkHome / "work").glob("app-*/*/stderr"))
