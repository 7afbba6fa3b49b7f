"""
spark/report.py on a local-cluster master: a master, two workers and an
executor JVM each, as on a real cluster.  It runs as a separate process
from another working directory without this checkout on PYTHONPATH, so it
proves the job needs nothing from the driver's directory or imports on the
executors; and it checks the console stays quiet.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest

pytest_plugins = ["conftest_spark"]
# Starting the JVM and its first queries take long on a busy machine.
pytestmark = [pytest.mark.timeout(300), pytest.mark.e2e]

CLUSTER = "local-cluster[2,1,1024]"


def privateSparkHome(folder):
    """
    A SPARK_HOME that links to the installed PySpark's: local-cluster
    workers write their executors' folders and logs under SPARK_HOME/work,
    which must not be the installed package.
    """
    import pyspark

    installed = Path(pyspark.__file__).parent
    folder.mkdir()
    for name in ("bin", "jars", "python"):
        (folder / name).symlink_to(installed / name)
    return folder


def test_report_on_a_local_cluster(reportCommand, handWrittenLogs, handWrittenSummary, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    environment = {
        name: value
        for name, value in os.environ.items()
        if name not in ("PYTHONPATH", "SPARK_HOME")
    }
    environment["SPARK_HOME"] = str(privateSparkHome(tmp_path / "spark-home"))
    out = tmp_path / "report"
    # Without the archive of the driver's classes: writing one would cost
    # the suite some 10 s (test_spark_classdata.py tests it).
    result = subprocess.run(
        [
            *reportCommand,
            str(handWrittenLogs),
            "--out",
            str(out),
            "--master",
            CLUSTER,
            "--no-jvm-cache",
        ],
        cwd=elsewhere,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
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
    # Quiet: the report's progress lines and nothing from the JVMs.
    noise = [line for line in result.stderr.splitlines() if not line.startswith("dallal-report: ")]
    assert noise == []
    assert result.stdout.splitlines()[-2:] == [
        f"report: {out / 'report.html'}",
        f"summary: {out / 'summary.json'}",
    ]
    # The executors really ran apart, in the workers' folders.
    assert list((tmp_path / "spark-home" / "work").glob("app-*/*/stderr"))
