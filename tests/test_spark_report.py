"""
The report over a hand-written log (tests/conftest_spark.py) whose answers
are known: summary.json, the Parquet tables and the HTML page.
"""

import argparse
import json
import re

import pytest

pytest_plugins = ["conftest_spark"]
# Starting the JVM and its first queries take long on a busy machine.
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def report(spark, handWrittenLogs, tmp_path_factory):
    """
    The report of the hand-written log: its folder and summary.
    """
    import report as reportModule

    out = tmp_path_factory.mktemp("report")
    summary = reportModule.runReport(spark, [str(handWrittenLogs)], out, deliveries=True)
    return out, summary


def table(spark, out, name):
    return [row.asDict() for row in spark.read.parquet(str(out / "tables" / name)).collect()]


@pytest.mark.e2e
def test_summary_counts(report, handWrittenSummary):
    out, summary = report
    written = json.loads((out / "summary.json").read_text())
    assert written == summary
    for key, expected in handWrittenSummary.items():
        if key == "topics":
            assert {
                topic: {name: values[name] for name in ("publishes", "deliveries")}
                for topic, values in written["topics"].items()
            } == expected
        else:
            assert written[key] == expected, key


@pytest.mark.e2e
def test_loss_account_adds_up(report):
    _, summary = report
    assert summary["matched"] == sum(
        summary[name] for name in ("acked", "fired", "replaced", "dropped", "inflight")
    )
    assert summary["messages_without_publish"] == 0


def within(value, accuracy=None):
    """
    pytest.approx at the percentiles' documented accuracy: the middle of a
    fine logarithmic bucket.
    """
    from dallal_analytics.questions import SKETCH_RELATIVE_ERROR

    return pytest.approx(value, rel=accuracy or SKETCH_RELATIVE_ERROR)


@pytest.mark.e2e
def test_latency_percentiles(report):
    _, summary = report
    latency = summary["latency"]
    assert latency["acks"] == 4
    assert latency["p50"] == within(0.51)
    assert latency["p99"] == within(2.0)
    # Mean and max are exact.
    assert latency["mean"] == pytest.approx((0.004 + 2.0 + 0.51 + 1.0) / 4)
    assert latency["max"] == pytest.approx(2.0)


def test_latency_percentile_accuracy():
    """
    Every latency from a microsecond to a minute is within the documented
    relative error of the middle of its bucket, the value a percentile is
    reported as.
    """
    import math

    from dallal_analytics.questions import SKETCH_BUCKETS_PER_DECADE, SKETCH_RELATIVE_ERROR

    assert SKETCH_RELATIVE_ERROR < 0.006
    for exponent in range(-6000, 1800):
        latency = 10 ** (exponent / 1000)
        fine = math.floor(math.log10(latency) * SKETCH_BUCKETS_PER_DECADE)
        middle = 10 ** ((fine + 0.5) / SKETCH_BUCKETS_PER_DECADE)
        assert abs(middle - latency) / latency <= SKETCH_RELATIVE_ERROR * (1 + 1e-9)


@pytest.mark.e2e
def test_latency_per_topic_and_transport(spark, report):
    out, _ = report
    rows = {(row["topic"], row["transport"]): row for row in table(spark, out, "latency")}
    assert set(rows) == {("news", "tcp"), ("weather", "tcp")}
    assert rows["news", "tcp"]["acks"] == 2
    assert rows["news", "tcp"]["p50"] == within(0.004)
    assert rows["weather", "tcp"]["acks"] == 2
    assert rows["weather", "tcp"]["p95"] == within(1.0)


@pytest.mark.e2e
def test_story_of_every_subscriber(spark, report):
    out, _ = report
    stories = {
        (row["run"], row["mid"], row["session"]): (row["outcome"], row["drop_reason"])
        for row in table(spark, out, "deliveries")
    }
    assert stories == {
        (1, 1, 1): ("acked", None),
        (1, 1, 2): ("fired", None),
        (1, 2, 1): ("acked", None),
        (1, 2, 2): ("fired", None),
        (1, 3, 3): ("replaced", None),
        (1, 4, 3): ("acked", None),
        (1, 5, 1): ("dropped", "disconnected"),
        (1, 5, 2): ("fired", None),
        (2, 1, 1): ("acked", None),
        (2, 2, 1): ("inflight", None),
        (2, 3, 1): ("dropped", "queue_full"),
    }


@pytest.mark.e2e
def test_messages_account(spark, report):
    out, _ = report
    rows = {(row["run"], row["mid"]): row for row in table(spark, out, "messages")}
    assert len(rows) == 8
    second = rows[1, 2]
    assert (second["subscribers"], second["acked"], second["fired"], second["redeliveries"]) == (
        2,
        1,
        1,
        1,
    )
    assert second["bytes_out"] == 15
    assert rows[2, 2]["inflight"] == 1
    retained = rows[2, 1]
    assert (retained["retained"], retained["subscribers"], retained["acked"]) == (True, 1, 1)
    assert retained["publisher"] is None


@pytest.mark.e2e
def test_a_story_under_another_topic_is_told_apart(spark, logLines, tmp_path):
    """
    The broker names a message's own topic on every event of its story: a
    send that names another is not counted in that message's account, but
    as a story whose publish is not in the log.
    """
    import report as reportModule

    t = 1795292880.0
    path = logLines.write(
        tmp_path / "logs" / "twistd.log",
        [
            logLines.event(
                t,
                "publish",
                mid=1,
                topic="a",
                bytes=5,
                session=1,
                client="p",
                transport="tcp",
                subscribers=1,
                origin="here",
                hops=0,
            ),
            logLines.event(
                t + 1,
                "deliver",
                mid=1,
                topic="b",
                session=2,
                client="s",
                mode="all",
                seq=1,
                attempt=1,
            ),
            logLines.event(t + 2, "ack", mid=1, topic="b", session=2, latency=0.5),
        ],
    )
    summary = reportModule.runReport(spark, [str(path)], tmp_path / "out")
    rows = {row["topic"]: row for row in table(spark, tmp_path / "out", "messages")}
    assert (rows["a"]["publish_logged"], rows["a"]["sends"], rows["a"]["inflight"]) == (
        True,
        0,
        1,
    )
    assert (rows["b"]["publish_logged"], rows["b"]["sends"], rows["b"]["acked"]) == (
        False,
        1,
        1,
    )
    assert (summary["messages_without_publish"], summary["inflight"]) == (1, 1)


@pytest.mark.e2e
def test_traffic_per_window_topic_and_transport(spark, report, handWrittenStart):
    out, _ = report
    rows = {
        (row["window_start"].timestamp() - handWrittenStart, row["topic"], row["transport"]): row
        for row in table(spark, out, "traffic")
    }
    assert set(rows) == {
        (0, "news", "tcp"),
        (0, "news", "udp"),
        (0, "weather", "tcp"),
        (180, "news", "tcp"),
        (180, "weather", "tcp"),
    }
    news = rows[0, "news", "tcp"]
    assert (news["publishes"], news["deliveries"], news["redeliveries"]) == (3, 3, 1)
    assert (news["bytes_in"], news["bytes_out"]) == (36, 41)
    assert (news["publishers"], news["subscribers"]) == (1, 1)
    udp = rows[0, "news", "udp"]
    assert (udp["publishes"], udp["deliveries"], udp["subscribers"]) == (0, 3, 1)


@pytest.mark.e2e
def test_top_publishers(spark, report):
    out, _ = report
    rows = {(row["run"], row["session"]): row for row in table(spark, out, "publishers")}
    assert rows[1, 4]["publishes"] == 5
    assert rows[1, 4]["topics"] == 2
    assert rows[1, 4]["bytes"] == 46
    assert rows[2, 2]["client"] == "127.0.0.1:50102"


@pytest.mark.e2e
def test_sessions(spark, report):
    out, _ = report
    rows = {(row["run"], row["session"]): row for row in table(spark, out, "sessions")}
    dropped = rows[1, 2]
    assert dropped["transport"] == "udp"
    assert dropped["end_reason"] == "expired"
    assert dropped["pings_missed"] == 2
    assert dropped["dropped_for_pings"] is True
    assert dropped["duration"] == pytest.approx(38.501)
    assert rows[2, 1]["end_reason"] is None
    assert rows[1, 4]["errors"] == 2


@pytest.mark.e2e
def test_concurrent_connections(spark, report):
    out, _ = report
    levels = sorted((row["t"], row["connections"]) for row in table(spark, out, "connections"))
    # The first run closes its four sessions; the second starts from zero
    # and ends with one still connected.
    assert [level for _, level in levels] == [1, 2, 3, 4, 3, 2, 1, 0, 1, 2, 1]


@pytest.mark.e2e
def test_errors_and_health(spark, report):
    out, _ = report
    errors = {row["code"]: row for row in table(spark, out, "errors")}
    assert errors["BAD_FRAMING"]["fatal"] == 1
    assert errors["BAD_TOPIC"]["fatal"] == 0
    assert errors["BAD_TOPIC"]["client"] == "127.0.0.1:50004"
    health = table(spark, out, "health")
    assert [(row["pings_missed"], row["clients_dropped"], row["errors"]) for row in health] == [
        (2, 1, 2)
    ]


@pytest.mark.e2e
def test_runs_pair_with_stats(spark, report):
    out, _ = report
    runs = {row["run"]: row for row in table(spark, out, "runs")}
    assert runs[1]["addresses"] == ["127.0.0.1:1373", "[::1]:1234"]
    assert runs[1]["counters"]["published"] == 5
    assert runs[2]["counters"] is None


@pytest.mark.e2e
def test_html_report_is_self_contained(report):
    out, _ = report
    page = (out / "report.html").read_text()
    assert page.count("<svg") == 3
    for title in ("Traffic over time", "Publish-to-ack latency", "Concurrent connections"):
        assert f"<title>{title}</title>" in page
    assert "<script" not in page
    # The only URL is the SVG namespace: nothing is fetched.
    assert set(re.findall(r"https?://[^\"' ]+", page)) == {"http://www.w3.org/2000/svg"}
    assert "this line is no log line" in page


@pytest.mark.e2e
def test_odd_event_lines_are_never_fatal(spark, logLines, tmp_path):
    import report as reportModule

    t = 1795292880.0  # 2026-11-21T20:28:00Z
    path = logLines.write(
        tmp_path / "logs" / "twistd.log",
        [
            # No time at all: neither twistd's nor t=.
            "- [dallal#info] event=connect session=9 client=127.0.0.1:9 transport=tcp",
            # Values Spark 4 (ANSI) would overflow on in a time or a sum.
            logLines.stamp(t) + " [dallal#info] event=connect session=2 client=127.0.0.1:2"
            " transport=tcp t=1e300",
            logLines.event(t + 1, "publish", mid="x", bytes=10**30, session=1),
            logLines.event(t + 2, "deliver", mid=1, topic="a", session="s"),
            logLines.event(t + 3, "ack", mid=1, topic="a", session=1, latency="Infinity"),
            logLines.event(t + 4, "drop", "warn", mid=1, topic="a", session=1, reason="meteorite"),
            logLines.event(t + 5, "stats", published="many"),
            logLines.event(t + 6, "unheard_of", colour="blue"),
            logLines.stamp(t + 7) + " [dallal#info] event=",
        ],
    )
    summary = reportModule.runReport(spark, [str(path)], tmp_path / "out")
    assert summary["lines"] == {
        "lines": 9,
        "event": 9,
        "other": 0,
        "continuation": 0,
        "unparsed": 0,
    }
    assert (summary["publishes"], summary["deliveries"], summary["bytes_in"]) == (1, 1, 0)
    # mid 1's publish is unreadable: its story is counted apart from the account.
    assert (summary["messages_without_publish"], summary["dropped"]) == (1, 0)
    assert summary["sessions"] == 3
    assert summary["latency"]["acks"] == 0
    # The absurd t gave way to twistd's time.
    assert summary["first_event_at"] == "2026-11-21T20:28:00Z"
    assert "<svg" in (tmp_path / "out" / "report.html").read_text()


@pytest.mark.e2e
def test_events_are_told_by_number_or_by_name(spark):
    """
    The per-message events are chosen by their number, the others by name,
    an event of a name no broker logs included; lines that are no events
    are never chosen.
    """
    from dallal_analytics import questions

    frame = spark.createDataFrame(
        [("deliver", 3), ("publish", 1), ("connect", 0), ("unheard_of", 0), (None, None)],
        "event string, event_number int",
    )

    def chosen(*names):
        return sorted(row.event for row in frame.where(questions.isEvent(*names)).collect())

    assert chosen("deliver") == ["deliver"]
    assert chosen("deliver", "connect") == ["connect", "deliver"]
    assert chosen("publish", "unheard_of") == ["publish", "unheard_of"]
    assert chosen("connect", "disconnect") == ["connect"]


@pytest.mark.e2e
def test_sys_statistics_count_as_the_broker_counts_them(spark, tmp_path, logLines):
    """
    The broker's own $SYS publishes are part of its published and bytes_in
    counters, and of sys_published: the report counts them the same way,
    so that its totals agree with a stats event that has them.
    """
    import report as reportModule

    e = logLines.event
    t = 1795292880.0
    client = dict(session=1, client="127.0.0.1:1")
    path = logLines.write(
        tmp_path / "twistd.log",
        [
            e(t, "listening", transport="tcp", address="127.0.0.1:1373"),
            e(t + 1, "connect", **client, transport="tcp"),
            e(t + 2, "subscribe", **client, topic="$SYS/broker/clients", mode="fire"),
            e(
                t + 3,
                "publish",
                mid=1,
                topic="$SYS/broker/clients",
                bytes=1,
                session=0,
                client="$SYS",
                transport="sys",
                subscribers=1,
                origin="here",
                hops=0,
            ),
            e(
                t + 3,
                "deliver",
                mid=1,
                topic="$SYS/broker/clients",
                **client,
                mode="fire",
                seq=1,
                attempt=1,
            ),
            e(
                t + 4,
                "publish",
                mid=2,
                topic="a",
                bytes=5,
                **client,
                transport="tcp",
                subscribers=0,
                origin="here",
                hops=0,
            ),
            e(t + 5, "disconnect", **client, transport="tcp", reason="closed", subscriptions=1),
            e(
                t + 6,
                "stats",
                connections_total=1,
                published=2,
                sys_published=1,
                matched=1,
                delivered=1,
                fired=1,
                bytes_in=6,
                bytes_out=1,
            ),
        ],
    )
    summary = reportModule.runReport(spark, [str(path)], tmp_path / "out")
    assert (summary["publishes"], summary["sys_published"], summary["bytes_in"]) == (2, 1, 6)
    assert summary["counter_mismatches"] == []


@pytest.mark.e2e
def test_bridged_traffic_counts_as_the_broker_counts_it(spark, tmp_path, logLines):
    """
    Messages that came over a bridge (hops of 1 or more), and sends and
    drops to sessions that carry messages to another broker (this broker's
    own bridge, transport=bridge, or another's, which subscribes with
    bridge=True), add up to the broker's bridged_* counters.
    """
    import report as reportModule

    e = logLines.event
    t = 1795292880.0
    local = dict(session=1, client="127.0.0.1:1")
    ownBridge = dict(session=2, client="bridge:hub")
    remoteBridge = dict(session=3, client="10.0.0.9:2")
    path = logLines.write(
        tmp_path / "twistd.log",
        [
            e(t, "listening", transport="tcp", address="127.0.0.1:1373"),
            e(t + 1, "connect", **local, transport="tcp"),
            e(t + 1, "connect", **ownBridge, transport="bridge"),
            e(t + 1, "connect", **remoteBridge, transport="tcp"),
            e(t + 2, "subscribe", **local, topic="a", mode="all", bridge=False),
            e(t + 2, "subscribe", **ownBridge, topic="#", mode="all", bridge=True),
            e(t + 2, "subscribe", **remoteBridge, topic="a", mode="all", bridge=True),
            # Published here: it leaves over both bridges, and one copy is dropped.
            e(
                t + 3,
                "publish",
                mid=1,
                topic="a",
                bytes=2,
                **local,
                transport="tcp",
                subscribers=2,
                origin="leaf",
                hops=0,
            ),
            e(t + 3, "deliver", mid=1, topic="a", **ownBridge, mode="all", seq=1, attempt=1),
            e(t + 3, "drop", "warn", mid=1, topic="a", session=3, reason="bridge_refused"),
            # Came over this broker's own bridge: to the local subscriber only.
            e(
                t + 4,
                "publish",
                mid=2,
                topic="a",
                bytes=3,
                **ownBridge,
                transport="bridge",
                subscribers=1,
                origin="hub",
                hops=1,
            ),
            e(t + 4, "deliver", mid=2, topic="a", **local, mode="all", seq=1, attempt=1),
            e(
                t + 5,
                "stats",
                published=2,
                bridged_published=1,
                delivered=2,
                bridged_delivered=1,
                dropped=1,
                dropped_bridge_refused=1,
                bridged_dropped=1,
            ),
        ],
    )
    summary = reportModule.runReport(spark, [str(path)], tmp_path / "out")
    assert {
        name: summary[name]
        for name in (
            "publishes",
            "bridged_published",
            "deliveries",
            "bridged_delivered",
            "dropped",
            "bridged_dropped",
        )
    } == {
        "publishes": 2,
        "bridged_published": 1,
        "deliveries": 2,
        "bridged_delivered": 1,
        "dropped": 1,
        "bridged_dropped": 1,
    }
    assert summary["counter_mismatches"] == []
    sessions = spark.read.parquet(str(tmp_path / "out" / "tables" / "sessions"))
    assert {row.session: row.bridge for row in sessions.collect()} == {
        1: False,
        2: True,
        3: True,
    }


@pytest.mark.e2e
def test_report_escapes_what_the_log_says(report):
    from dallal_analytics import htmlreport

    _, summary = report
    hostile = "<script>alert(1)</script>"
    page = htmlreport.render(
        dict(summary, errors_by_code={hostile: 1}),
        traffic=[],
        histogram=[],
        connections=[],
        connectionStep=1,
        topics=[{"topic": hostile, "publishes": 1}],
        publishers=[],
        latency=[],
        loss=[],
        errors=[],
        health=[],
        runs=[],
    )
    assert "<script" not in page
    assert page.count("&lt;script&gt;alert(1)&lt;/script&gt;") == 2


@pytest.mark.parametrize(
    "text, seconds",
    [("90", 90), ("30s", 30), ("5m", 300), ("1 minute", 60), ("2h", 7200), ("0.5s", 0.5)],
)
def test_window_durations(text, seconds):
    import report as reportModule

    assert reportModule.windowSeconds(text) == seconds


@pytest.mark.parametrize("text", ["0", "-1m", "5 parsecs", ""])
def test_bad_window_durations(text):
    import report as reportModule

    with pytest.raises(argparse.ArgumentTypeError):
        reportModule.windowSeconds(text)


@pytest.mark.parametrize("text", ["0", "-4", "many", "2.5"])
def test_bad_shuffle_partitions(text, capsys):
    import report as reportModule

    with pytest.raises(SystemExit):
        reportModule.parseArguments(["logs", "--out", "out", "--shuffle-partitions", text])
    assert f"expected a whole number above 0, got {text!r}" in capsys.readouterr().err


@pytest.mark.e2e
def test_the_jvm_runs_with_the_reports_options(spark):
    """
    The driver JVM compiles huge methods, collects garbage for throughput,
    keeps its optimizing compiler for the hottest code and from Spark's
    planning code (the compiler directives: a JVM does not start with a
    file it cannot read) and has room for Spark's generated classes up
    front (docs/ANALYTICS.md, "How it computes"): the options are in
    effect, not only on its command line.
    """
    from dallal_analytics.session import COMPILER_DIRECTIVES, JVM_OPTIONS

    jvm = spark._jvm
    arguments = list(
        jvm.java.lang.management.ManagementFactory.getRuntimeMXBean().getInputArguments()
    )
    assert set(JVM_OPTIONS) <= set(arguments)
    hotspot = jvm.java.lang.management.ManagementFactory.getPlatformMXBean(
        jvm.java.lang.Class.forName("com.sun.management.HotSpotDiagnosticMXBean")
    )
    values = {
        name: hotspot.getVMOption(name).getValue()
        for name in (
            "DontCompileHugeMethods",
            "UseParallelGC",
            "Tier4InvocationThreshold",
            "Tier4MinInvocationThreshold",
            "Tier4CompileThreshold",
            "Tier4BackEdgeThreshold",
            "ReservedCodeCacheSize",
            "MetaspaceSize",
            "CompilerDirectivesFile",
            "DisplayVMOutputToStderr",
        )
    }
    assert values == {
        "DontCompileHugeMethods": "false",
        "UseParallelGC": "true",
        "Tier4InvocationThreshold": "50000",
        "Tier4MinInvocationThreshold": "6000",
        "Tier4CompileThreshold": "150000",
        "Tier4BackEdgeThreshold": "400000",
        "ReservedCodeCacheSize": str(512 << 20),
        "MetaspaceSize": str(256 << 20),
        "CompilerDirectivesFile": str(COMPILER_DIRECTIVES),
        "DisplayVMOutputToStderr": "true",
    }


# Run in a process of its own: buildSession with the thread that
# initializes classes ahead watched.
INITIALIZED_AHEAD_SCRIPT = """
import sys
sys.path.insert(0, sys.argv[1])
from dallal_analytics import session
started = []
initializeAhead = session._initializeAhead
def watched(gateway):
    thread = initializeAhead(gateway)
    started.append(thread)
    return thread
session._initializeAhead = watched
spark = session.buildSession(master="local[1]", driverMemory="512m", tmpDir=sys.argv[2])
for thread in started:
    thread.join(60)
print(len(started), [thread.is_alive() for thread in started])
spark.stop()
"""


@pytest.mark.e2e
def test_a_session_starting_its_jvm_initializes_classes_ahead(spark, tmp_path):
    """
    buildSession, when it starts the JVM for a master whose tasks run in
    the driver, has the classes initialized ahead, from a thread that ends.
    (A JVM of its own, in another process: C{spark}, the suite's session,
    is asked for only so that the test is skipped where Java is missing.)
    """
    import subprocess
    import sys
    from pathlib import Path

    from dallal_analytics import session

    sparkFolder = Path(session.__file__).resolve().parent.parent
    result = subprocess.run(
        [sys.executable, "-c", INITIALIZED_AHEAD_SCRIPT, str(sparkFolder), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "1 [False]"


@pytest.mark.parametrize(
    "master, inDriver",
    [
        ("local", True),
        ("local[2]", True),
        ("local[*]", True),
        ("local[4, 2]", True),
        ("local-cluster[2,1,1024]", False),
        ("spark://host:7077", False),
        ("yarn", False),
    ],
)
def test_where_tasks_run(master, inDriver):
    """
    Only local masters run the tasks in the driver's JVM, where classes
    initialized ahead spare them the cost; local-cluster's executors are
    JVMs of their own.
    """
    from dallal_analytics.session import tasksRunInDriver

    assert tasksRunInDriver(master) == inDriver


@pytest.mark.e2e
def test_classes_initialized_ahead_exist_and_a_missing_one_is_skipped(spark, monkeypatch):
    """
    The classes whose first use costs a second are initialized from a
    thread while the JVM starts (docs/ANALYTICS.md, "How it computes"):
    this Spark has them (else that would silently do nothing), and one
    that a Spark lacks is skipped without an error.
    """
    import threading

    from dallal_analytics import session

    jvm = spark._jvm
    loader = jvm.java.lang.Thread.currentThread().getContextClassLoader()
    for name in session.CLASSES_TO_INITIALIZE_AHEAD:
        # Looked up without initializing it: the name has not changed in
        # this Spark.
        assert jvm.java.lang.Class.forName(name, False, loader).getName() == name
    monkeypatch.setattr(
        session,
        "CLASSES_TO_INITIALIZE_AHEAD",
        ("org.example.NoSuchClass", *session.CLASSES_TO_INITIALIZE_AHEAD),
    )
    uncaught = []
    monkeypatch.setattr(threading, "excepthook", uncaught.append)
    thread = session._initializeAhead(spark.sparkContext._gateway)
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert uncaught == []


@pytest.mark.e2e
def test_aggregations_work_outside_the_heap(spark):
    """
    On a local master the memory of aggregations, joins and sorts is taken
    outside the heap (docs/ANALYTICS.md, "How it computes"), so that the
    collector does not copy it: the context runs with it, and its executor
    has that memory.
    """
    context = spark.sparkContext
    assert context.getConf().get("spark.memory.offHeap.enabled") == "true"
    executor = context._jsc.sc().statusStore().executorList(True).head()
    assert executor.memoryMetrics().get().totalOffHeapStorageMemory() > 0


@pytest.mark.e2e
def test_columns_carry_no_python_call_site(spark):
    """
    PySpark's DataFrame debugging (each Column's Python call site sent to
    the JVM: seven calls in ten of those that build the parse) is off.
    """
    from pyspark.errors.utils import is_debugging_enabled

    assert spark.conf.get("spark.python.sql.dataFrameDebugging.enabled") == "false"
    assert not is_debugging_enabled()


def test_jvm_noise_is_filtered_from_standard_error():
    """
    The lines a JVM writes before logging exists (the incubator module
    Spark adds, on Java 25 a package it no longer has, and the count of
    compiler directives read) do not reach the user; anything else the JVM
    says does, in order.
    """
    import io

    from dallal_analytics.session import _forwardStderr

    said = (
        b"Error: Could not find or load main class\n"
        b"Could not load file: /tmp/compiler-directives.json\n"
        b"[0.1s] 1 compiler directives added\n"
        b"1 compiler directives added (of 2)\n"
        b"WARNING: something the user should see\n"
    )
    jvm = io.BytesIO(
        b"1 compiler directives added\n"
        b"WARNING: Using incubator modules: jdk.incubator.vector\n"
        b"WARNING: package sun.security.action not in java.base\n" + said
    )
    seen = io.BytesIO()
    _forwardStderr(jvm, seen)
    assert seen.getvalue() == said


@pytest.mark.e2e
def test_rotated_files_are_packed_into_few_tasks(spark, tmp_path, logLines):
    """
    On a local master, twistd's many small files are packed into tasks by
    their size rather than by Spark's 4 MB per file opened: 200 files of a
    line are 2 tasks, where Spark's default made them 7.
    """
    from dallal_analytics import parse
    from dallal_analytics.session import LOCAL_FILE_OPEN_COST

    line = logLines.event(1795292899.5, "ack", mid=1, topic="a/b", session=1, latency=0.001)
    folder = tmp_path / "logs"
    for index in range(200):
        logLines.write(folder / f"twistd.log.{index + 1}", [line])

    def tasks():
        return parse.readLines(spark, [str(folder)]).rdd.getNumPartitions()

    assert spark.conf.get("spark.sql.files.openCostInBytes") == str(LOCAL_FILE_OPEN_COST)
    assert tasks() == 2
    spark.conf.set("spark.sql.files.openCostInBytes", str(4 * 1024 * 1024))
    try:
        assert tasks() == 7
    finally:
        spark.conf.set("spark.sql.files.openCostInBytes", str(LOCAL_FILE_OPEN_COST))


@pytest.mark.e2e
def test_a_cached_aggregation_is_read_in_few_tasks(spark):
    """
    A small aggregation the report caches (per session, per actor) is read
    by as few tasks as its rows need, not one per shuffle partition.
    """
    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    spark.conf.set("spark.sql.shuffle.partitions", "8")
    try:
        perKey = spark.range(1000).groupBy((F.col("id") % 10).alias("key")).count()
        perKey.persist(StorageLevel.MEMORY_AND_DISK_DESER)
        try:
            assert perKey.count() == 10
            assert perKey.rdd.getNumPartitions() == 1
        finally:
            perKey.unpersist()
    finally:
        spark.conf.set("spark.sql.shuffle.partitions", "2")


@pytest.mark.e2e
def test_the_survey_fills_the_caches_as_it_counts(spark, tmp_path, logLines):
    """
    The survey, the first query to read the report's caches, is one Spark
    job: it parses the log, fills both caches and counts the lines in one
    pass (adaptive execution would have filled each cache in a job of its
    own, then read the log's again).  The session's setting is left as it
    was.
    """
    import report as reportModule
    from pyspark import StorageLevel

    from dallal_analytics import parse, questions

    path = logLines.write(
        tmp_path / "logs" / "twistd.log",
        [
            logLines.event(1795292880.0, "ack", mid=1, topic="a/b", session=1, latency=0.001),
            logLines.event(1795292880.5, "connect", session=2, client="c", transport="tcp"),
            "a line from elsewhere",
        ],
    )
    split = questions.cachedColumns(parse.splitLines(parse.readLines(spark, [str(path)])))
    split.persist(StorageLevel.MEMORY_AND_DISK_DESER)
    others = parse.parseOtherLines(split).persist(StorageLevel.MEMORY_AND_DISK_DESER)
    lines = parse.combine(split, others).select("kind", *questions.EVENT_COLUMNS, "raw")
    tracker = spark.sparkContext.statusTracker()
    before = set(tracker.getJobIdsForGroup())
    try:
        survey = reportModule.surveyLines(spark, lines)
        jobs = set(tracker.getJobIdsForGroup()) - before
        assert (survey["lines"], survey[parse.EVENT], survey[parse.UNPARSED]) == (3, 2, 1)
        assert len(jobs) == 1
        assert spark.conf.get("spark.sql.adaptive.enabled") == "true"
    finally:
        others.unpersist()
        split.unpersist()


def test_progress_lines_are_written_whole():
    """
    The report's stages run from two threads, so a progress line goes to
    the stream in one write: with two (the text, then the newline), another
    thread's line could come between them.
    """
    import report as reportModule

    class Stream:
        def __init__(self):
            self.writes = []

        def write(self, text):
            self.writes.append(text)

        def flush(self):
            pass

    stream = Stream()
    progress = reportModule.Progress(stream=stream)
    with progress.stage("parse"):
        progress.say("halfway")
    assert len(stream.writes) == 2
    assert stream.writes[0] == "dallal-report: halfway\n"
    assert re.fullmatch(r"dallal-report: parse done in \S+ s \(\S+ s in all\)\n", stream.writes[1])


@pytest.mark.e2e
@pytest.mark.parametrize("question", ["messages", "latencySketch"])
def test_an_error_of_the_background_thread_is_the_reports(
    spark, logLines, tmp_path, monkeypatch, question
):
    """
    The loss account and the latency are written from a thread of their
    own: what fails there fails the report, as it would have in the
    report's own thread.
    """
    import report as reportModule

    from dallal_analytics import questions

    def failing(frame):
        raise RuntimeError(f"no room for {question}")

    monkeypatch.setattr(questions, question, failing)
    path = logLines.write(
        tmp_path / "logs" / "twistd.log",
        [
            logLines.event(1795292880.0, "connect", session=1, client="c", transport="tcp"),
        ],
    )
    with pytest.raises(RuntimeError, match=f"no room for {question}"):
        reportModule.runReport(spark, [str(path)], tmp_path / "out")


def test_counter_mismatches_name_the_counter():
    import report as reportModule

    from dallal_analytics import questions

    run = dict.fromkeys(questions.COUNTERS_FROM_EVENTS.values(), 0)
    run.update(
        run=1, publishes=2, matched=2, acked=1, counters={"published": 3, "acked": 1, "inflight": 1}
    )
    assert reportModule.counterMismatches([run]) == [
        {"run": 1, "counter": "published", "broker": 3, "log": 2}
    ]


@pytest.mark.e2e
def test_suppressed_refusals_count_as_errors(spark, logLines, tmp_path):
    """
    Refusals the broker counted but did not log one by one (a flood of
    datagrams that named no session) are in the errors as its counter has
    them: no counter mismatch.
    """
    import report as reportModule

    t = 1795292880.0
    stranger = dict(session=0, client="10.0.0.9:7")
    logLines.write(
        tmp_path / "logs" / "twistd.log",
        [
            logLines.event(t, "listening", transport="udp", address="127.0.0.1:1234"),
            logLines.event(
                t + 1, "protocol_error", "warn", **stranger, code="BAD_TOKEN", fatal=False
            ),
            logLines.event(t + 2, "protocol_errors_suppressed", "warn", code="BAD_TOKEN", count=20),
            logLines.event(t + 3, "stats", connections=0, connections_total=0, errors=21),
        ],
    )
    summary = reportModule.runReport(spark, [str(tmp_path / "logs")], tmp_path / "out")
    assert summary["counter_mismatches"] == []
    [run] = table(spark, tmp_path / "out", "runs")
    assert run["errors"] == 21
    [window] = table(spark, tmp_path / "out", "health")
    assert window["errors"] == 21


def test_every_drop_reason_of_the_broker_is_counted():
    from dallal.broker.delivery import DROP_REASONS
    from dallal_analytics import questions

    assert set(questions.DROP_REASONS) == set(DROP_REASONS)
