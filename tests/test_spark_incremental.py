"""
Incremental runs: each parses only what the logs gained (across a rotation
by twistd), keeps the parsed lines as Parquet by broker and date, and
reports on all of them as a full run over the same logs would.
"""

import json

import pytest

pytest_plugins = ["conftest_spark"]
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

T = 1795292880.0


def connectAndPublish(logLines, t, session, broker="hub"):
    client = f"127.0.0.1:{50000 + session}"
    return [
        logLines.event(
            t, "connect", session=session, client=client, transport="tcp", broker=broker
        ),
        logLines.event(
            t + 0.5,
            "publish",
            mid=session,
            topic="news",
            bytes=5,
            session=session,
            client=client,
            transport="tcp",
            subscribers=0,
            origin=broker,
            hops=0,
            broker=broker,
        ),
    ]


def test_only_new_lines_are_parsed_across_a_rotation(spark, logLines, tmp_path):
    from dallal_analytics import incremental, report

    logs = tmp_path / "logs"
    out = tmp_path / "report"
    start = [logLines.event(T, "listening", transport="tcp", address="127.0.0.1:1373")]
    first = start + connectAndPublish(logLines, T + 1, 1)
    logLines.write(logs / "twistd.log", first)
    # The first run's parse (what --incremental does before it reports).
    _, added = incremental.update(spark, [str(logs)], out)
    assert added == 3

    # The broker logs more, then twistd rotates: twistd.log is twistd.log.1
    # (the same file), and a new twistd.log starts.
    with open(logs / "twistd.log", "a") as stream:
        stream.write("".join(line + "\n" for line in connectAndPublish(logLines, T + 2, 2)))
    (logs / "twistd.log").rename(logs / "twistd.log.1")
    logLines.write(
        logs / "twistd.log",
        connectAndPublish(logLines, T + 3, 3)
        + connectAndPublish(logLines, T + 4, 4, broker="leaf"),
    )
    parts, _ = incremental.newParts(
        [str(logs)],
        json.loads((out / incremental.CHECKPOINT).read_text()),
        tmp_path / "staging",
    )
    # The rotated file's new lines only, and the new file.
    assert sum(len(open(part).readlines()) for part in parts) == 2 + 4
    summary = report.runReport(spark, [str(logs)], out, incrementally=True)
    full = report.runReport(spark, [str(logs)], tmp_path / "full")
    for key in ("publishes", "sessions", "runs", "brokers", "lines", "topics"):
        assert summary[key] == full[key], key
    assert (summary["publishes"], summary["sessions"]) == (4, 4)
    # Kept by broker and date; a third run finds nothing new, and the
    # table holds every line once.
    table = out / incremental.EVENTS_TABLE
    assert {path.name for path in table.glob("broker=*")} >= {"broker=hub", "broker=leaf"}
    assert list(table.glob("broker=hub/date=2026-11-21"))
    kept, added = incremental.update(spark, [str(logs)], out)
    assert (added, kept.count()) == (0, full["lines"]["lines"])
