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
    from dallal_analytics import report as reportModule

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
    from dallal_analytics import report as reportModule

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
    from dallal_analytics import report as reportModule

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
    from dallal_analytics import report as reportModule

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
    from dallal_analytics import report as reportModule

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
    from dallal_analytics import report as reportModule

    assert reportModule.windowSeconds(text) == seconds


@pytest.mark.parametrize("text", ["0", "-1m", "5 parsecs", ""])
def test_bad_window_durations(text):
    from dallal_analytics import report as reportModule

    with pytest.raises(argparse.ArgumentTypeError):
        reportModule.windowSeconds(text)


@pytest.mark.parametrize("text", ["0", "-4", "many", "2.5"])
def test_bad_shuffle_partitions(text, capsys):
    from dallal_analytics import report as reportModule

    with pytest.raises(SystemExit):
        reportModule.parseArguments(["logs", "--out", "out", "--shuffle-partitions", text])
    assert f"must be a whole number of at least 1, not {text!r}" in capsys.readouterr().err


def test_progress_lines_are_written_whole():
    """
    The report's stages run from two threads, so a progress line goes to
    the stream in one write: with two (the text, then the newline), another
    thread's line could come between them.
    """
    from dallal_analytics import report as reportModule

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
    from dallal_analytics import questions
    from dallal_analytics import report as reportModule

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
    from dallal_analytics import questions
    from dallal_analytics import report as reportModule

    run = dict.fromkeys(questions.COUNTERS_FROM_EVENTS.values(), 0)
    run.update(
        broker="hub",
        run=1,
        publishes=2,
        matched=2,
        acked=1,
        counters={"published": 3, "acked": 1, "inflight": 1},
    )
    assert reportModule.counterMismatches([run]) == [
        {"broker": "hub", "run": 1, "counter": "published", "counted": 3, "log": 2}
    ]


@pytest.mark.e2e
def test_suppressed_refusals_count_as_errors(spark, logLines, tmp_path):
    """
    Refusals the broker counted but did not log one by one (a flood of
    datagrams that named no session) are in the errors as its counter has
    them: no counter mismatch.
    """
    from dallal_analytics import report as reportModule

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
    from dallal.broker.counters import DROP_REASONS
    from dallal_analytics import questions

    assert set(questions.DROP_REASONS) == set(DROP_REASONS)
