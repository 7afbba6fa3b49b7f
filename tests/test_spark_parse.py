"""
Parsing twistd log lines into typed events (dallal_analytics/parse.py),
on lines written exactly per docs/EVENTS.md.  The lines of a real broker are
parsed in test_spark_end_to_end.py.
"""

import gzip

import pytest

pytest_plugins = ["conftest_spark"]
# Starting the JVM and its first queries take long on a busy machine.
pytestmark = pytest.mark.timeout(300)

T = 1795292899.729858  # 2026-11-21T20:28:19.729858Z


def parsedRows(spark, path):
    from dallal_analytics import parse

    return [row.asDict() for row in parse.parseLines(parse.readLines(spark, [str(path)])).collect()]


def events(spark, path):
    from dallal_analytics import parse

    return [row for row in parsedRows(spark, path) if row["kind"] == parse.EVENT]


@pytest.mark.e2e
def test_every_documented_event(spark, tmp_path, logLines):
    e = logLines.event
    client = dict(session=3, client="127.0.0.1:50124")
    lines = [
        e(T, "listening", transport="tcp", address="[::1]:1373"),
        e(T, "connect", **client, transport="tcp"),
        e(T, "disconnect", **client, transport="udp", reason="missed_pings", subscriptions=2),
        e(T, "subscribe", **client, topic="a/b", mode="latest"),
        e(T, "stats", connections=1, published=7, dropped_queue_full=2),
        e(T, "ping_missed", "warn", **client, missed=2),
        e(T, "client_dropped", "warn", **client, missed=3),
        e(T, "protocol_error", "warn", **client, code="BAD_FRAMING", fatal=True),
        e(T, "publish", mid=7, topic="a/b", bytes=11, **client, transport="tcp", subscribers=2),
        e(T, "deliver", mid=7, topic="a/b", **client, mode="all", seq=4, attempt=2),
        e(T, "ack", mid=7, topic="a/b", session=3, latency=0.004512),
        e(T, "replace", mid=7, topic="a/b", session=3, by=8),
        e(T, "drop", "warn", mid=7, topic="a/b", session=3, reason="redelivery_limit"),
    ]
    rows = {
        row["event"]: row for row in events(spark, logLines.write(tmp_path / "twistd.log", lines))
    }
    assert len(rows) == len(lines)
    assert all(row["t"] == pytest.approx(T, abs=1e-6) for row in rows.values())
    # The per-message events are numbered, the others are 0.
    from dallal_analytics import parse

    assert {name: row["event_number"] for name, row in rows.items()} == {
        name: parse.MESSAGE_EVENTS.index(name) + 1 if name in parse.MESSAGE_EVENTS else 0
        for name in rows
    }
    assert rows["listening"]["address"] == "[::1]:1373"
    assert (rows["disconnect"]["reason"], rows["disconnect"]["subscriptions"]) == (
        "missed_pings",
        2,
    )
    assert rows["subscribe"]["mode"] == "latest"
    assert rows["stats"]["stats"] == {"connections": 1, "published": 7, "dropped_queue_full": 2}
    assert (rows["ping_missed"]["level"], rows["ping_missed"]["missed"]) == ("warn", 2)
    assert (rows["protocol_error"]["code"], rows["protocol_error"]["fatal"]) == (
        "BAD_FRAMING",
        True,
    )
    publish = rows["publish"]
    assert (publish["mid"], publish["topic"], publish["bytes"], publish["subscribers"]) == (
        7,
        "a/b",
        11,
        2,
    )
    assert (publish["session"], publish["client"], publish["transport"]) == (
        3,
        "127.0.0.1:50124",
        "tcp",
    )
    deliver = rows["deliver"]
    assert (deliver["mode"], deliver["seq"], deliver["attempt"]) == ("all", 4, 2)
    assert deliver["client"] == "127.0.0.1:50124"
    # Read by position (all but the publish, which lacks origin and hops),
    # a field is found where each event holds it.
    assert {
        name: (rows[name]["mid"], rows[name]["topic"], rows[name]["session"])
        for name in ("publish", "deliver", "ack", "replace", "drop")
    } == dict.fromkeys(("publish", "deliver", "ack", "replace", "drop"), (7, "a/b", 3))
    assert rows["ack"]["latency"] == pytest.approx(0.004512)
    assert rows["replace"]["by"] == 8
    assert rows["drop"]["reason"] == "redelivery_limit"
    # Only stats events carry counters.
    assert all(row["stats"] is None for name, row in rows.items() if name != "stats")


@pytest.mark.e2e
def test_message_events_by_position_or_by_name(spark, tmp_path, logLines):
    """
    A per-message event laid out as EVENTS.md documents it is read by
    position; with a field added (as a newer broker may), inserted, moved
    or repeated, by name, to the same values.
    """
    e = logLines.event
    client = dict(session=3, client="127.0.0.1:50124")
    lines = [
        e(T, "publish", mid=7, topic="a/b", bytes=11, **client, transport="tcp", subscribers=2),
        e(
            T,
            "publish",
            mid=8,
            topic="a/b",
            bytes=11,
            **client,
            transport="tcp",
            subscribers=2,
            origin="elsewhere",
            hops=1,
        ),
        e(
            T,
            "publish",
            mid=9,
            colour="red",
            topic="a/b",
            bytes=11,
            **client,
            transport="tcp",
            subscribers=2,
        ),
        e(T, "publish", topic="a/b", mid=10, bytes=11, **client, transport="tcp", subscribers=2),
        e(T, "publish", mid=0, topic="a/b", bytes=11, **client, transport="tcp", subscribers=2)
        + " mid=11",
        e(T, "deliver", mid=12, topic="a/b", **client, mode="all", seq=4, attempt=2),
        e(T, "deliver", mid=13, topic="a/b", **client, mode="all", attempt=2, seq=4),
        # Values are cut after their key as bytes: text that is not ASCII
        # stays whole.
        e(T, "deliver", mid=14, topic="météo/zürich", **client, mode="all", seq=4, attempt=1),
    ]
    # Rows are not in the lines' order: those read by position come first.
    rows = sorted(
        events(spark, logLines.write(tmp_path / "twistd.log", lines)), key=lambda row: row["mid"]
    )
    assert [
        (
            row["mid"],
            row["topic"],
            row["bytes"],
            row["session"],
            row["client"],
            row["transport"],
            row["subscribers"],
            row["t"],
        )
        for row in rows[:5]
    ] == [
        (mid, "a/b", 11, 3, "127.0.0.1:50124", "tcp", 2, pytest.approx(T, abs=1e-6))
        for mid in (7, 8, 9, 10, 11)
    ]
    assert [(row["mid"], row["mode"], row["seq"], row["attempt"]) for row in rows[5:]] == [
        (12, "all", 4, 2),
        (13, "all", 4, 2),
        (14, "all", 4, 1),
    ]
    assert (rows[7]["topic"], rows[7]["client"]) == ("météo/zürich", "127.0.0.1:50124")
    # By position or by name, an event has its number.
    assert [(row["event"], row["event_number"]) for row in rows] == [("publish", 1)] * 5 + [
        ("deliver", 3)
    ] * 3


def test_positions_are_those_of_the_catalogue():
    """
    The positions the parser reads per-message events' fields at are those
    of docs/EVENTS.md: a broker that logs a field more must be taught here
    too, or every such line takes the slower way.
    """
    from test_events_catalogue import catalogue

    from dallal_analytics import parse

    documented, _ = catalogue()
    assert {name: tuple(documented[name][1]) for name in parse.MESSAGE_EVENT_FIELDS} == (
        parse.MESSAGE_EVENT_FIELDS
    )


def test_packed_fields_are_never_held_together():
    """
    The fields packed in one column of the parse have one type, and no
    per-message event holds two of them: a broker that logs one of them
    beside another must have them unpacked, or one would hide the other.
    """
    from dallal_analytics import parse

    for packed, fields in parse.PACKED_FIELDS.items():
        assert len({parse.FIELD_TYPES[field] for field in fields}) == 1, packed
        for event, names in parse.MESSAGE_EVENT_FIELDS.items():
            assert len(set(fields) & set(names)) <= 1, (packed, event)


@pytest.mark.e2e
def test_lines_that_are_not_events(spark, tmp_path, logLines):
    from dallal_analytics import parse

    lines = [
        logLines.foreign(
            T, "twisted.scripts._twistd_unix.UnixAppLogger#info", "twistd starting up."
        ),
        logLines.foreign(T, "-", "BrokerFactory starting on 1373"),
        logLines.event(T, "connect", session=1, client="127.0.0.1:1", transport="tcp"),
        # A failure logged by the broker's namespace is not an event, and its
        # traceback continues on tab-indented lines.
        logLines.foreign(T, "dallal.server.keepalive.PingSweep#critical", "ping sweep stopped"),
        logLines.foreign(T, "dallal#critical", "Unhandled Error"),
        "\tTraceback (most recent call last):",
        "\tbuiltins.ValueError: event=publish mid=1",
        # Neither a twistd line nor a continuation: counted, not fatal.
        "garbage event=publish mid=2",
        '\x1e{"dallal_event": "connect", "log_namesp',
        "",
        logLines.event(
            T + 1,
            "disconnect",
            session=1,
            client="127.0.0.1:1",
            transport="tcp",
            reason="closed",
            subscriptions=0,
        ),
    ]
    rows = parsedRows(spark, logLines.write(tmp_path / "twistd.log", lines))
    assert [row["kind"] for row in rows] == [
        parse.OTHER,
        parse.OTHER,
        parse.EVENT,
        parse.OTHER,
        parse.OTHER,
        parse.CONTINUATION,
        parse.CONTINUATION,
        parse.UNPARSED,
        parse.UNPARSED,
        parse.UNPARSED,
        parse.EVENT,
    ]
    assert [row["event"] for row in rows if row["kind"] == parse.EVENT] == ["connect", "disconnect"]
    assert rows[7]["raw"] == "garbage event=publish mid=2"
    assert all(row["event"] is None for row in rows if row["kind"] != parse.EVENT)


@pytest.mark.e2e
def test_missing_or_malformed_fields_are_null(spark, tmp_path, logLines):
    lines = [
        # A publish and a deliver as brokers before acknowledged delivery
        # logged them.
        logLines.event(
            T, "publish", mid=1, topic="news", bytes=11, client="127.0.0.1:2", subscribers=1
        ),
        logLines.event(T, "deliver", mid=1, topic="news", session=1, client="127.0.0.1:1"),
        logLines.event(T, "ack", mid="seven", topic="news", session=1, latency="fast"),
        # A repeated key: the last one counts.
        logLines.event(T, "ping_missed", "warn", session=1, client="127.0.0.1:1", missed=1)
        + " missed=2",
        # No t: twistd's own second is the time.
        "2026-11-21T20:28:19+0000 [dallal#info] event=connect session=4 client=127.0.0.1:4 transport=tcp",
        # A per-message event laid out as documented, but for its t.
        "2026-11-21T20:28:19+0000 [dallal#info] event=replace mid=3 topic=news session=1 by=4 t=soon",
    ]
    rows = {
        row["event"]: row for row in events(spark, logLines.write(tmp_path / "twistd.log", lines))
    }
    publish, deliver, ack, missed, connect, replace = (
        rows[name] for name in ("publish", "deliver", "ack", "ping_missed", "connect", "replace")
    )
    assert (publish["session"], publish["transport"], publish["mid"]) == (None, None, 1)
    assert (deliver["mode"], deliver["seq"], deliver["attempt"]) == (None, None, None)
    assert (ack["mid"], ack["latency"], ack["topic"]) == (None, None, "news")
    assert missed["missed"] == 2
    assert connect["t"] == 1795292899.0
    assert (replace["t"], replace["mid"], replace["by"]) == (1795292899.0, 3, 4)


@pytest.mark.e2e
def test_rotated_files_as_directory_glob_or_list(spark, tmp_path, logLines):
    from dallal_analytics import parse

    folder = tmp_path / "logs"
    for index, suffix in enumerate(("", ".1", ".2")):
        logLines.write(
            folder / f"twistd.log{suffix}",
            [
                logLines.event(
                    T - index, "connect", session=index + 1, client="127.0.0.1:1", transport="tcp"
                ),
            ],
        )
    # A rotated file compressed by logrotate is read as well.
    with gzip.open(folder / "twistd.log.3.gz", "wt") as compressed:
        compressed.write(
            logLines.event(T - 3, "connect", session=4, client="127.0.0.1:1", transport="tcp")
            + "\n"
        )

    def sessions(paths):
        frame = parse.parseLines(parse.readLines(spark, paths))
        return sorted(row.session for row in frame.where("kind = 'event'").collect())

    assert sessions([str(folder)]) == [1, 2, 3, 4]
    assert sessions([str(folder / "twistd.log*")]) == [1, 2, 3, 4]
    assert sessions([str(folder / "twistd.log.1"), str(folder / "twistd.log")]) == [1, 2]


@pytest.mark.e2e
def test_sessions_are_told_apart_across_broker_starts(spark, tmp_path, logLines):
    """
    Sessions are numbered from 1 at each start of each broker: a run per
    start of a broker, one for what a broker logged before its first start
    in the log, and each broker's runs its own, whether the logs are read
    together or not; events of brokers that did not name themselves are
    one broker's.
    """
    from dallal_analytics import parse, questions

    def start(t, broker, restored=False):
        # One start logs a listening event per listener, nothing between;
        # a broker with a data directory first says what MQTT sessions it
        # took up from it.
        restoring = [
            logLines.event(t - 0.001, "sessions_restored", count=0, path="data", broker=broker)
        ]
        return [
            *(restoring if restored else []),
            logLines.event(
                t, "listening", transport="tcp", address="127.0.0.1:1373", broker=broker
            ),
            logLines.event(
                t + 0.001, "listening", transport="udp", address="127.0.0.1:1234", broker=broker
            ),
        ]

    def session(t, broker):
        return logLines.event(
            t, "connect", session=1, client="127.0.0.1:1", transport="tcp", broker=broker
        )

    hub = [
        session(T - 5, "hub"),
        *start(T, "hub"),
        session(T + 1, "hub"),
        *start(T + 10, "hub"),
        session(T + 11, "hub"),
    ]
    # The leaf starts between the hub's starts, and an older broker too.
    leaf = [*start(T + 5.001, "leaf", restored=True), session(T + 6, "leaf")]
    older = [*start(T + 2, None), session(T + 3, None)]
    logLines.write(tmp_path / "hub" / "twistd.log", hub)
    logLines.write(tmp_path / "leaf" / "twistd.log", leaf)
    logLines.write(tmp_path / "older" / "twistd.log", older)
    parsed = parse.parseLines(parse.readLines(spark, [str(tmp_path / "*")]))
    survey = questions.lineSurvey(parsed, parse.KINDS).first()
    runs = questions.Runs.find(parsed, survey.brokers, survey.starting)
    assert runs.starts == {
        "hub": pytest.approx([T, T + 10]),
        "leaf": pytest.approx([T + 5]),
        questions.UNNAMED_BROKER: pytest.approx([T + 2]),
    }
    assert len(runs) == 4
    connects = questions.assignRuns(parsed, runs).where("event = 'connect'")
    # The hub's session before its first start belongs to a run the log
    # missed.
    assert sorted((row.broker, row.run, row.session) for row in connects.collect()) == [
        ("hub", 0, 1),
        ("hub", 1, 1),
        ("hub", 2, 1),
        ("leaf", 4, 1),
        (questions.UNNAMED_BROKER, 6, 1),
    ]


@pytest.mark.e2e
def test_json_log_records(spark, tmp_path):
    """
    Records of Twisted's jsonFileLogObserver, as the broker's EventLog
    emits them.
    """
    from twisted.internet.task import Clock
    from twisted.logger import Logger, LogLevel, jsonFileLogObserver

    from dallal.broker.events import EventLog
    from dallal_analytics import parse

    path = tmp_path / "dallal.json"
    with open(path, "w") as stream:
        observer = jsonFileLogObserver(stream)
        clock = Clock()
        clock.advance(T)
        events = EventLog(clock, logger=Logger(namespace="dallal", observer=observer))
        client = dict(session=3, client="127.0.0.1:50124")
        events.emit(
            "publish", mid=7, topic="a/b", bytes=11, **client, transport="tcp", subscribers=2
        )
        events.emit("protocol_error", LogLevel.warn, **client, code="BAD_TOPIC", fatal=True)
        events.emit("ack", mid=7, topic="a/b", session=3, latency=0.0045)
        events.emit("stats", published=1, acked=1)
        Logger(namespace="twisted.internet", observer=observer).info("not an event")
        stream.write("\x1e{this is not JSON\n")
    rows = parsedRows(spark, path)
    assert [row["kind"] for row in rows] == [
        parse.EVENT,
        parse.EVENT,
        parse.EVENT,
        parse.EVENT,
        parse.OTHER,
        parse.UNPARSED,
    ]
    publish, error, ack, stats = rows[:4]
    assert (publish["event"], publish["level"], publish["mid"], publish["topic"]) == (
        "publish",
        "info",
        7,
        "a/b",
    )
    assert publish["t"] == pytest.approx(T, abs=1e-6)
    assert (publish["transport"], publish["subscribers"]) == ("tcp", 2)
    assert (error["level"], error["code"], error["fatal"]) == ("warn", "BAD_TOPIC", True)
    assert ack["latency"] == pytest.approx(0.0045)
    assert stats["stats"] == {"published": 1, "acked": 1}
