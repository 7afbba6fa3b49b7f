"""
The report's SparkSession honours the site's Spark configuration
(spark-defaults.conf in SPARK_CONF_DIR): it adds only the settings the job
needs where the site has none, replaces no JVM option, and a JVM that cannot
start says why.  Each test reads a `dallal-report` run in a process of its
own, as a user would, with a configuration folder of its own.
"""

import json
import os
import subprocess

import pytest

pytest_plugins = ["conftest_spark"]
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(480)]


def test_the_sites_settings_are_kept(siteReport, handWrittenSummary):
    """
    A site's JVM options (a collector of its choice in defaultJavaOptions, a
    system property in extraJavaOptions) are in effect in the driver, and a
    job setting the site chose is not replaced (conftest_spark's
    C{SITE_SETTINGS}).
    """
    from dallal_analytics.report import EFFECTIVE_SETTINGS

    result, out = siteReport.result, siteReport.out
    assert result.returncode == 0, result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["publishes"] == handWrittenSummary["publishes"]
    settings = json.loads((out / EFFECTIVE_SETTINGS).read_text())
    assert "-XX:+UseG1GC" in settings["jvm_arguments"]
    assert "-Dsite.marker=kept" in settings["jvm_arguments"]
    assert settings["spark.sql.shuffle.partitions"] == "3"
    # Set by the report: the site did not choose.
    assert settings["spark.sql.session.timeZone"] == "UTC"


def test_a_jvm_that_cannot_start_says_why(reportCommand, handWrittenLogs, tmp_path):
    """
    The JVM's own reason reaches the user, and one line of the report's;
    no traceback.  (Spark has the JVM ignore unknown options: two
    collectors at once is a setting a JVM refuses.)
    """
    confDir = tmp_path / "conf"
    confDir.mkdir()
    (confDir / "spark-defaults.conf").write_text(
        "spark.driver.extraJavaOptions -XX:+UseG1GC -XX:+UseParallelGC\n"
    )
    result = subprocess.run(
        [
            *reportCommand,
            str(handWrittenLogs),
            "--out",
            str(tmp_path / "report"),
            "--master",
            "local[1]",
            "--quiet",
        ],
        env=dict(os.environ, SPARK_CONF_DIR=str(confDir)),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 1
    # HotSpot writes why it did not start on standard output.
    assert "Multiple garbage collectors selected" in result.stdout + result.stderr
    assert result.stderr.splitlines()[-1].startswith("dallal-report: Spark did not start: ")
    assert "Traceback" not in result.stderr
