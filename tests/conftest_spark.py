"""
Shared fixtures of the Spark analytics tests: tests/test_spark_*.py load
this module with C{pytest_plugins} and reach what it holds through fixtures
(importing it as well would make pytest warn that it cannot rewrite it).

One SparkSession serves every test: starting a JVM costs seconds.
"""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest


def requireJava():
    if shutil.which("java") is None:
        pytest.skip("Spark needs a Java runtime (java on PATH)")


@pytest.fixture(scope="session")
def spark(tmp_path_factory):
    """
    A local[2] SparkSession with its scratch files under pytest's tmp path.
    """
    requireJava()
    from dallal_analytics.sparksession import buildSession

    session = buildSession(
        master="local[2]",
        appName="dallal-tests",
        shufflePartitions=2,
        tmpDir=tmp_path_factory.mktemp("spark"),
    )
    yield session
    session.stop()


@pytest.fixture(scope="session")
def reportCommand():
    """
    The installed dallal-report command, run as a user would.
    """
    requireJava()
    command = Path(sys.executable).parent / "dallal-report"
    if not command.exists():
        pytest.skip("the dallal-report command is not installed (pip install '.[analytics]')")
    return [str(command)]


def siteConfiguration(folder, settings):
    """
    A SPARK_CONF_DIR holding a spark-defaults.conf of C{settings}.
    """
    folder.mkdir()
    (folder / "spark-defaults.conf").write_text(
        "".join(f"{key} {value}\n" for key, value in settings.items())
    )
    return folder


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


# A site's Spark configuration: a collector of its choice in the driver's
# defaultJavaOptions, a system property in its extraJavaOptions, a job
# setting the report would otherwise set, and its shuffle partitions.
SITE_SETTINGS = {
    "spark.driver.defaultJavaOptions": "-XX:+UseG1GC",
    "spark.driver.extraJavaOptions": "-Dsite.marker=kept",
    "spark.sql.mapKeyDedupPolicy": "LAST_WIN",
    "spark.sql.shuffle.partitions": "3",
}
# A master, two workers and an executor JVM each, as on a real cluster.
LOCAL_CLUSTER = "local-cluster[2,1,1024]"


class SiteReport:
    """
    What the C{siteReport} fixture gives: the finished C{dallal-report}
    process (C{result}), its report folder (C{out}) and the SPARK_HOME its
    workers ran in (C{sparkHome}).
    """

    def __init__(self, result, out, sparkHome):
        self.result = result
        self.out = out
        self.sparkHome = sparkHome


@pytest.fixture(scope="session")
def siteReport(reportCommand, handWrittenLogs, tmp_path_factory):
    """
    C{dallal-report} of the hand-written log, run as a user would on a site
    with a Spark configuration of its own (L{SITE_SETTINGS} in
    SPARK_CONF_DIR) and a L{LOCAL_CLUSTER} master, from another working
    directory without this checkout on PYTHONPATH.  One process serves the
    tests of the site's settings and of the cluster: a JVM start and a
    report each would cost the suite a minute.
    """
    folder = tmp_path_factory.mktemp("site-report")
    elsewhere = folder / "elsewhere"
    elsewhere.mkdir()
    environment = {
        name: value
        for name, value in os.environ.items()
        if name not in ("PYTHONPATH", "SPARK_HOME")
    }
    sparkHome = privateSparkHome(folder / "spark-home")
    environment["SPARK_HOME"] = str(sparkHome)
    environment["SPARK_CONF_DIR"] = str(siteConfiguration(folder / "conf", SITE_SETTINGS))
    out = folder / "report"
    result = subprocess.run(
        [*reportCommand, str(handWrittenLogs), "--out", str(out), "--master", LOCAL_CLUSTER],
        cwd=elsewhere,
        env=environment,
        capture_output=True,
        text=True,
        timeout=420,
    )
    return SiteReport(result, out, sparkHome)


def twistdStamp(t):
    """
    twistd's time prefix for an entry logged at C{t} (UTC).
    """
    return time.strftime("%Y-%m-%dT%H:%M:%S+0000", time.gmtime(int(t)))


# The broker of the hand-written logs.
BROKER = "hub"


def eventLine(t, name, level="info", broker=BROKER, **fields):
    """
    A broker event as twistd writes it, per docs/EVENTS.md: the fields in
    the order given, then C{broker} (none if C{None}, as older brokers
    logged them) and C{t}.
    """
    if broker is not None:
        fields = dict(fields, broker=broker)
    text = "".join(f" {key}={value}" for key, value in fields.items())
    return f"{twistdStamp(t)} [dallal#{level}] event={name}{text} t={t:.6f}"


def foreignLine(t, system, text):
    """
    An entry of another namespace (or the broker's, not an event).
    """
    return f"{twistdStamp(t)} [{system}] {text}"


def writeLog(path, lines):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines))
    return path


class LogLines:
    """
    What the C{logLines} fixture gives: the helpers that write log lines.
    """

    stamp = staticmethod(twistdStamp)
    event = staticmethod(eventLine)
    foreign = staticmethod(foreignLine)
    write = staticmethod(writeLog)


@pytest.fixture
def logLines():
    return LogLines


# A log written by hand per docs/EVENTS.md: two broker starts, every event
# and every end of a message's story, and what the report must find in it.
T0 = 1795292880.0  # 2026-11-21T20:28:00Z, the start of a minute

TWISTD = "twisted.scripts._twistd_unix.UnixAppLogger#info"


def _firstRun(t):
    s1 = dict(session=1, client="127.0.0.1:50001")
    s2 = dict(session=2, client="127.0.0.1:50002")
    s3 = dict(session=3, client="127.0.0.1:50003")
    s4 = dict(session=4, client="127.0.0.1:50004")
    return [
        foreignLine(t, TWISTD, "twistd 26.10.0 (/usr/bin/python3 3.11.7) starting up."),
        foreignLine(t, TWISTD, "reactor class: twisted.internet.epollreactor.EPollReactor."),
        eventLine(t + 0.1, "listening", transport="tcp", address="127.0.0.1:1373"),
        eventLine(t + 0.2, "listening", transport="udp", address="[::1]:1234"),
        eventLine(t + 1, "connect", **s1, transport="tcp"),
        eventLine(t + 1.1, "subscribe", **s1, topic="news", mode="all"),
        eventLine(t + 1.5, "connect", **s2, transport="udp"),
        eventLine(t + 1.6, "subscribe", **s2, topic="news", mode="fire"),
        eventLine(t + 2, "connect", **s3, transport="tcp"),
        eventLine(t + 2.1, "subscribe", **s3, topic="weather", mode="latest"),
        eventLine(t + 3, "connect", **s4, transport="tcp"),
        # mid 1: acked by s1, fired to s2.
        eventLine(
            t + 4, "publish", mid=1, topic="news", bytes=11, **s4, transport="tcp", subscribers=2
        ),
        eventLine(t + 4.001, "deliver", mid=1, topic="news", **s1, mode="all", seq=1, attempt=1),
        eventLine(t + 4.002, "deliver", mid=1, topic="news", **s2, mode="fire", seq=1, attempt=1),
        eventLine(t + 4.004, "ack", mid=1, topic="news", session=1, latency=0.004),
        # mid 2: redelivered once to s1, then acked.
        eventLine(
            t + 5, "publish", mid=2, topic="news", bytes=5, **s4, transport="tcp", subscribers=2
        ),
        eventLine(t + 5.001, "deliver", mid=2, topic="news", **s1, mode="all", seq=2, attempt=1),
        eventLine(t + 5.002, "deliver", mid=2, topic="news", **s2, mode="fire", seq=2, attempt=1),
        eventLine(t + 6.5, "deliver", mid=2, topic="news", **s1, mode="all", seq=2, attempt=2),
        eventLine(t + 7, "ack", mid=2, topic="news", session=1, latency=2.0),
        # mid 3 waits for slow s3 and mid 4 replaces it.
        eventLine(
            t + 8, "publish", mid=3, topic="weather", bytes=7, **s4, transport="tcp", subscribers=1
        ),
        eventLine(
            t + 8.5,
            "publish",
            mid=4,
            topic="weather",
            bytes=3,
            **s4,
            transport="tcp",
            subscribers=1,
        ),
        eventLine(t + 8.501, "replace", mid=3, topic="weather", session=3, by=4),
        eventLine(t + 9, "deliver", mid=4, topic="weather", **s3, mode="latest", seq=1, attempt=1),
        eventLine(t + 9.01, "ack", mid=4, topic="weather", session=3, latency=0.51),
        # mid 5: fired to s2, never acked by s1, dropped when s1 leaves.
        eventLine(
            t + 10, "publish", mid=5, topic="news", bytes=20, **s4, transport="tcp", subscribers=2
        ),
        eventLine(t + 10.001, "deliver", mid=5, topic="news", **s1, mode="all", seq=3, attempt=1),
        eventLine(t + 10.002, "deliver", mid=5, topic="news", **s2, mode="fire", seq=3, attempt=1),
        foreignLine(t + 11, "dallal#critical", "Unhandled Error"),
        "\tTraceback (most recent call last):",
        '\t  File "dallal/server/tcp.py", line 80, in lineReceived',
        "\tbuiltins.ValueError: boom",
        foreignLine(t + 12, "-", "(UDP Port 1234 Closed)"),
        "this line is no log line",
        eventLine(t + 20, "ping_missed", "warn", **s2, missed=1),
        eventLine(t + 30, "ping_missed", "warn", **s2, missed=2),
        eventLine(t + 40, "client_dropped", "warn", **s2, missed=3),
        eventLine(
            t + 40.001, "disconnect", **s2, transport="udp", reason="expired", subscriptions=1
        ),
        eventLine(t + 41, "protocol_error", "warn", **s4, code="BAD_TOPIC", fatal=False),
        eventLine(t + 42, "protocol_error", "warn", **s4, code="BAD_FRAMING", fatal=True),
        eventLine(
            t + 42.001,
            "disconnect",
            **s4,
            transport="tcp",
            reason="protocol_error",
            subscriptions=0,
        ),
        eventLine(t + 43, "drop", "warn", mid=5, topic="news", session=1, reason="disconnected"),
        eventLine(
            t + 43.001, "disconnect", **s1, transport="tcp", reason="closed", subscriptions=1
        ),
        foreignLine(t + 50, "twisted.internet.base#info", "Received SIGTERM, shutting down."),
        eventLine(
            t + 50.001, "disconnect", **s3, transport="tcp", reason="shutdown", subscriptions=1
        ),
        eventLine(
            t + 50.002,
            "stats",
            connections=0,
            connections_total=4,
            subscriptions=0,
            published=5,
            matched=8,
            delivered=7,
            fired=3,
            redelivered=1,
            acked=3,
            replaced=1,
            dropped=1,
            dropped_queue_full=0,
            dropped_slow_consumer=0,
            dropped_disconnected=1,
            dropped_redelivery_limit=0,
            dropped_superseded=0,
            dropped_too_large=0,
            inflight=0,
            bytes_in=46,
            bytes_out=80,
            errors=2,
            pings_missed=2,
            clients_dropped=1,
            duplicates=0,
            unsent=0,
        ),
        foreignLine(t + 50.003, TWISTD, "Server Shut Down."),
    ]


def _secondRun(t):
    # Numbers start again from 1; the log ends with mid 2 unacked and s1 on.
    s1 = dict(session=1, client="127.0.0.1:50101")
    s2 = dict(session=2, client="127.0.0.1:50102")
    return [
        foreignLine(t, TWISTD, "twistd 26.10.0 (/usr/bin/python3 3.11.7) starting up."),
        eventLine(t + 0.1, "listening", transport="tcp", address="127.0.0.1:1373"),
        eventLine(t + 0.2, "listening", transport="udp", address="[::1]:1234"),
        eventLine(t + 1, "connect", **s1, transport="tcp"),
        eventLine(t + 1.1, "subscribe", **s1, topic="news", mode="all"),
        eventLine(t + 1.2, "subscribe", **s1, topic="weather/#", mode="all"),
        # The retained message of `weather` offered to the new subscription.
        eventLine(t + 1.3, "retained", mid=1, topic="weather", bytes=9, **s1),
        eventLine(t + 1.301, "deliver", mid=1, topic="weather", **s1, mode="all", seq=1, attempt=1),
        eventLine(t + 2, "connect", **s2, transport="tcp"),
        eventLine(t + 2.3, "ack", mid=1, topic="weather", session=1, latency=1.0),
        eventLine(
            t + 3, "publish", mid=2, topic="news", bytes=4, **s2, transport="tcp", subscribers=1
        ),
        eventLine(t + 3.001, "deliver", mid=2, topic="news", **s1, mode="all", seq=1, attempt=1),
        eventLine(
            t + 4, "publish", mid=3, topic="news", bytes=6, **s2, transport="tcp", subscribers=1
        ),
        eventLine(t + 4.001, "drop", "warn", mid=3, topic="news", session=1, reason="queue_full"),
        eventLine(t + 4.5, "unsubscribe", **s1, topic="weather/#"),
        eventLine(t + 5, "disconnect", **s2, transport="tcp", reason="closed", subscriptions=0),
    ]


@pytest.fixture(scope="session")
def handWrittenLogs(tmp_path_factory):
    """
    The hand-written log as twistd would have rotated it: the first run in
    twistd.log.1, the second in twistd.log.  Its directory.
    """
    directory = tmp_path_factory.mktemp("hand-written-logs")
    writeLog(directory / "twistd.log.1", _firstRun(T0))
    writeLog(directory / "twistd.log", _secondRun(T0 + 180))
    return directory


@pytest.fixture(scope="session")
def handWrittenStart():
    """
    When the first run of the hand-written log starts (a minute's start).
    """
    return T0


@pytest.fixture(scope="session")
def handWrittenSummary():
    return HAND_WRITTEN_SUMMARY


# What summary.json says about the hand-written log.
HAND_WRITTEN_SUMMARY = {
    "publishes": 7,
    "deliveries": 9,
    "redeliveries": 1,
    "matched": 11,
    "acked": 4,
    "fired": 3,
    "replaced": 1,
    "dropped": 2,
    "dropped_by_reason": {
        "disconnected": 1,
        "queue_full": 1,
        "redelivery_limit": 0,
        "slow_consumer": 0,
        "superseded": 0,
        "expired": 0,
        "too_large": 0,
        "bridge_refused": 0,
    },
    "inflight": 1,
    "bytes_in": 56,
    "bytes_out": 93,
    "retained": 1,
    "sessions": 6,
    "peak_connections": 4,
    "peak_connections_at": "2026-11-21T20:28:03Z",
    "session_end_reasons": {
        "closed": 2,
        "expired": 1,
        "protocol_error": 1,
        "shutdown": 1,
        "still_connected": 1,
    },
    "errors": 2,
    "errors_by_code": {"BAD_TOPIC": 1, "BAD_FRAMING": 1},
    "pings_missed": 2,
    "clients_dropped": 1,
    "unparsed_lines": 1,
    "runs": 2,
    "topics": {
        "news": {"publishes": 5, "deliveries": 7},
        "weather": {"publishes": 2, "deliveries": 2},
    },
    "counter_mismatches": [],
}
