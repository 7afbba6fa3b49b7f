"""
Analytics over Dallal broker logs, on Spark.

    dallal-report LOGS... --out DIR [--window 1m] [--master URL]
    spark-submit --py-files dallal-*.whl $(python -c 'import dallal_analytics.report as r; print(r.__file__)') LOGS... --out DIR

LOGS are twistd log files (C{twistd --logfile=PATH dallal}), rotated ones
included, as files, globs or directories.  DIR receives a Parquet table per
question under C{tables/}, C{summary.json} and C{report.html}.
docs/ANALYTICS.md describes them.
"""

import argparse
import functools
import json
import math
import re
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from dallal.numbers import positiveNumber
from dallal_analytics import htmlreport, incremental, parse, questions
from dallal_analytics.sparksession import buildSession

DEFAULT_WINDOW_SECONDS = 60
UNPARSED_EXAMPLES = 5
TOP = 10
# The connections chart draws about this many steps, whatever --window is.
CHART_STEPS = 200

# The file of the report's folder that says how Spark ran it.
EFFECTIVE_SETTINGS = "spark-settings.json"
REPORTED_SETTINGS = (
    "spark.master",
    "spark.app.name",
    "spark.driver.memory",
    "spark.executor.memory",
    "spark.sql.session.timeZone",
    "spark.sql.mapKeyDedupPolicy",
)

UNITS = {"s": 1, "m": 60, "h": 3600}
WINDOW = re.compile(
    r"^\s*(\d+(?:\.\d+)?)\s*(s|sec|second|seconds|m|min|minute|minutes|h|hour|hours)?\s*$"
)

# The traffic measures of the brokers' periodic summaries, as the
# summary names them (questions.summarizedTraffic).
SUMMARIZED_MEASURES = tuple(questions.SUMMARIZED_MEASURES.values())
# What only per-message events (--message-events) tell.
MESSAGE_EVENT_FIGURES = (
    "sys_published",
    "bridged_published",
    "bridged_delivered",
    "bridged_dropped",
    "retained",
    "redeliveries",
    "matched",
    "acked",
    "fired",
    "replaced",
    "dropped",
    "dropped_by_reason",
    "inflight",
    "messages_without_publish",
    "latency",
)

# Traffic to and from other brokers over bridges (EVENTS.md).
BRIDGED_TOTALS = ("bridged_published", "bridged_delivered", "bridged_dropped")
TRANSPORT_MEASURES = ("publishes", "deliveries", "redeliveries", "bytes_in", "bytes_out")

# The broker counters still comparable for a run logged with
# --no-message-events: those that count no messages.
CONNECTION_COUNTERS = {"connections_total", "errors", "pings_missed", "clients_dropped"}


def windowSeconds(text):
    """
    C{90}, C{30s}, C{5m}, C{1 minute}, C{2h}: seconds, for C{--window}.
    """
    match = WINDOW.match(text)
    if not match or float(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(
            f"window must be a positive duration such as 30s, 5m or 1h, got {text!r}"
        )
    unit = (match.group(2) or "s")[0]
    return float(match.group(1)) * UNITS[unit]


def positiveCount(text):
    """
    A whole number above zero, for C{--shuffle-partitions}.
    """
    return positiveNumber(text, error=argparse.ArgumentTypeError)


class Progress:
    """
    A line on standard error when each stage of the report ends, and while
    a stage runs longer than C{interval} seconds, a line every C{interval}
    with the tasks done of the Spark stages running.
    """

    def __init__(self, stream=None, enabled=True, statusTracker=None, interval=15):
        self.stream = stream
        self.enabled = enabled
        self.statusTracker = statusTracker
        self.interval = interval
        self.started = time.monotonic()
        # Stages run from more than one thread (see runReport): one line at
        # a time.
        self.writing = threading.Lock()

    def say(self, text):
        if self.enabled:
            stream = self.stream or sys.stderr
            with self.writing:
                stream.write(f"dallal-report: {text}\n")
                stream.flush()

    @contextmanager
    def stage(self, name):
        begun = time.monotonic()
        finished = threading.Event()
        watcher = None
        if self.enabled and self.statusTracker is not None:
            watcher = threading.Thread(
                target=self._watch, args=(name, begun, finished), daemon=True
            )
            watcher.start()
        try:
            yield
        finally:
            finished.set()
            if watcher is not None:
                watcher.join()
        now = time.monotonic()
        self.say(f"{name} done in {now - begun:.1f} s ({now - self.started:.1f} s in all)")

    def _watch(self, name, begun, finished):
        while not finished.wait(self.interval):
            stages = [
                info
                for info in map(
                    self.statusTracker.getStageInfo, self.statusTracker.getActiveStageIds()
                )
                if info is not None
            ]
            if stages:
                done = sum(info.numCompletedTasks for info in stages)
                running = sum(info.numActiveTasks for info in stages)
                total = sum(info.numTasks for info in stages)
                self.say(
                    f"{name}: {time.monotonic() - begun:.0f} s, Spark tasks: {done} done, "
                    f"{running} running, of {total}"
                )


class Tables:
    """
    Writes the report's Parquet tables and reads them back, so that what is
    derived from a table does not recompute it.
    """

    def __init__(self, spark, outDir):
        self.spark = spark
        self.root = Path(outDir) / "tables"

    def write(self, name, frame):
        path = str(self.root / name)
        frame.write.mode("overwrite").parquet(path)
        # With the schema given, reading back starts no job to infer it.
        return self.spark.read.schema(frame.schema).parquet(path)


def writeEffectiveSettings(spark, outDir):
    """
    L{EFFECTIVE_SETTINGS}: the Spark settings the report ran with (the
    site's and its own), and the driver JVM's arguments.
    """
    conf = spark.sparkContext.getConf()
    settings = {key: conf.get(key) for key in REPORTED_SETTINGS}
    settings["spark.sql.shuffle.partitions"] = spark.conf.get("spark.sql.shuffle.partitions")
    runtime = spark.sparkContext._jvm.java.lang.management.ManagementFactory.getRuntimeMXBean()
    settings["jvm_arguments"] = list(runtime.getInputArguments())
    (Path(outDir) / EFFECTIVE_SETTINGS).write_text(
        json.dumps(settings, indent=2, sort_keys=True) + "\n"
    )


def _rows(frame):
    return [row.asDict(recursive=True) for row in frame.collect()]


def surveyLines(lines):
    """
    L{questions.lineSurvey} of the parsed C{lines}, as a dict.
    """
    return _rows(questions.lineSurvey(lines, parse.KINDS))[0]


def collectTogether(frames):
    """
    The rows of several small DataFrames, collected by one query: a union
    of them, each row a struct in the column named for its frame.  Each
    query costs Spark its planning, its jobs and their scheduling whatever
    its size, and the report's last results are a few rows each: collected
    one by one, the fourteen of them took longer than the queries that
    computed them.

    @param frames: name -> DataFrame.
    @return: name -> its rows, as dicts, in no particular order.
    """
    from pyspark.sql import functions as F

    parts = [frame.select(F.struct(*frame.columns).alias(name)) for name, frame in frames.items()]
    union = functools.reduce(lambda one, other: one.unionByName(other, True), parts)
    rows = {name: [] for name in frames}
    for row in union.collect():
        name = next(name for name in frames if row[name] is not None)
        rows[name].append(row[name].asDict(recursive=True))
    return rows


def _sortedBy(rows, key):
    """
    The rows of a small table in C{key} order (nulls first), sorted here: a
    distributed sort would cost Spark a sampling job and a shuffle.
    """
    return sorted(rows, key=lambda row: (row[key] is not None, row[key]))


def chartStep(first, last):
    """
    Whole seconds that cut the log's time span, from C{first} to C{last}
    (datetimes, or C{None} for a log without events), into about
    L{CHART_STEPS}.
    """
    if first is None or last is None:
        return 1
    span = (last - first).total_seconds()
    return max(1, math.ceil(span / CHART_STEPS))


def counterMismatches(runRows):
    """
    Where a run's last C{stats} event disagrees with what its events add up
    to: C{[{"broker", "run", "counter", "counted", "log"}]} (C{counted}: the
    broker's counter, C{log}: what its events add up to).
    """
    names = dict(questions.COUNTERS_FROM_EVENTS, inflight="inflight")
    mismatches = []
    for run in runRows:
        counters = run["counters"]
        if not counters:
            continue
        fromLog = {column: run[column] for column in questions.COUNTERS_FROM_EVENTS.values()}
        fromLog["inflight"] = run["matched"] - sum(run[name] for name in questions.OUTCOME_COUNTS)
        messageEventsLogged = run["publishes"] > 0 or not counters.get("published")
        for counter, column in sorted(names.items()):
            if counter not in counters:
                continue
            if not messageEventsLogged and counter not in CONNECTION_COUNTERS:
                continue
            if counters[counter] != fromLog[column]:
                mismatches.append(
                    {
                        "broker": run["broker"],
                        "run": run["run"],
                        "counter": counter,
                        "counted": counters[counter],
                        "log": fromLog[column],
                    }
                )
    return mismatches


def _writeLossAccount(tables, events, deliveries, progress):
    """
    The C{messages} and C{loss_account} tables (and C{deliveries} if
    asked for), written; the first two returned, read back.
    """
    with progress.stage("loss account"):
        if deliveries:
            tables.write("deliveries", questions.deliveries(events))
        messageTable = tables.write("messages", questions.messages(events))
        return messageTable, tables.write("loss_account", questions.lossAccount(messageTable))


def _writeLatency(tables, events, sessionTransports, progress):
    """
    The C{latency} and C{latency_histogram} tables, written and returned
    read back, and the acks of the latency sketch per fine bucket, from
    which the overall latency figures derive (L{questions.overallLatency}).
    """
    from pyspark.sql import functions as F

    with progress.stage("latency"):
        sketch = questions.latencySketch(
            questions.acks(events, sessionTransports)
        ).localCheckpoint()
        latencyTable = tables.write("latency", questions.latency(sketch))
        histogramTable = tables.write("latency_histogram", questions.latencyHistogram(sketch))
        perBucket = sketch.groupBy("fine").agg(
            F.sum("acks").alias("acks"),
            F.sum("sum").alias("sum"),
            F.max("max").alias("max"),
        )
    return latencyTable, histogramTable, perBucket


def _writeHealth(tables, summary, starts, progress):
    """
    The C{errors} and C{health} tables, written and returned read back.
    """
    with progress.stage("health"):
        errorTable = tables.write("errors", starts.withBroker(questions.errors(summary)))
        return errorTable, tables.write("health", questions.health(summary))


def runReport(
    spark,
    paths,
    outDir,
    window=DEFAULT_WINDOW_SECONDS,
    progress=None,
    deliveries=False,
    incrementally=False,
):
    """
    Analyse the logs at C{paths} into C{outDir}; return the summary.
    C{deliveries}: also write the table of every (message, subscriber).
    C{incrementally}: parse only what is new since the last such run into
    the parsed lines kept in C{outDir}, and report on all of them (see
    L{dallal_analytics.incremental}).

    The logs are read and parsed once, into a cache of the columns the
    questions read; every question then reads that cache or smaller results
    derived from it (see L{questions}).
    """
    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    col = F.col
    progress = progress or Progress(enabled=False)
    outDir = Path(outDir)
    outDir.mkdir(parents=True, exist_ok=True)
    tables = Tables(spark, outDir)
    writeEffectiveSettings(spark, outDir)
    cached = []

    def cache(frame):
        # As DataFrame.cache() keeps it: PySpark's MEMORY_AND_DISK is the
        # serialized level (for Python objects), which cost a copy of every
        # batch into bytes and back at each read (reads 20% slower).
        cached.append(frame.persist(StorageLevel.MEMORY_AND_DISK_DESER))
        return frame

    with progress.stage("read and parse"):
        # The log is read once: split into the per-message events, read by
        # position, and the few other lines, parsed from that cache.
        if incrementally:
            parsed, added = incremental.update(spark, paths, outDir)
            progress.say(f"{added} new lines parsed")
            lines = cache(parsed.select("kind", *questions.EVENT_COLUMNS, "raw"))
            others = cache(parsed.where(F.coalesce(col(parse.EVENT_NUMBER), F.lit(0)) == 0))
        else:
            split = cache(questions.cachedColumns(parse.splitLines(parse.readLines(spark, paths))))
            others = cache(parse.parseOtherLines(split))
            lines = parse.combine(split, others).select("kind", *questions.EVENT_COLUMNS, "raw")
        survey = surveyLines(lines)
        # The connections chart's step, from the events' time span.
        connectionStep = chartStep(survey.pop("first_event"), survey.pop("last_event"))
        # Every run with clients logs their connects, which are among the
        # other lines: they tell the starts apart without reading the
        # per-message events again.
        starts = questions.Runs.find(others, survey.pop("brokers"), survey.pop("starting"))
        messages = survey.pop("messages")
        unparsedExamples = (
            [
                row.raw
                for row in others.where(col("kind") == parse.UNPARSED)
                .select("raw")
                .limit(UNPARSED_EXAMPLES)
                .collect()
            ]
            if survey[parse.UNPARSED]
            else []
        )
        events = questions.assignRuns(lines, starts)

    # Two threads beside this one write the tables that do not depend on
    # each other: each query's planning (on the driver) and its few tasks
    # (on the cores) overlap with the others'.
    background = ThreadPoolExecutor(max_workers=2, thread_name_prefix="background")
    try:
        with progress.stage("event summary and sessions"):
            # The loss account reads the events, not the summary: it is
            # written meanwhile, from a thread of its own.  The queries that
            # follow are small, and much of their time is the driver planning
            # them while the cores idle; the loss account's tasks use the
            # cores then (at ten million lines, the report was faster in six
            # of seven pairs of alternated runs, by 3.5 s in the median
            # pair).  Submitted before the event summary, its tasks also use
            # the cores while that is planned (faster in three of four pairs,
            # by 0.7 s in the median pair).  Its jobs, submitted first, get
            # the cores first.
            lossAccount = background.submit(_writeLossAccount, tables, events, deliveries, progress)
            # The event summary and the latency sketch are read by many
            # small queries: checkpointed (computed now, kept by the
            # executors, their lineage cut) rather than cached, so that Spark
            # does not analyse the whole parse again for each of them.  At a
            # million lines the report took 49.8 s instead of 56.6 (medians
            # of five runs, alternated).  Spark frees them once they are no
            # longer referenced, as it does cached RDDs.
            summary = questions.eventSummary(
                events, questions.messageSizes(events, messages), window
            ).localCheckpoint()
            # The errors and the health read only the summary.
            health = background.submit(_writeHealth, tables, summary, starts, progress)
            activity = cache(questions.sessionActivity(summary))
            sessionTable = tables.write(
                "sessions", questions.sessions(activity, questions.sessionNames(summary), starts)
            )
            sessionTransports = sessionTable.select(
                "run", "session", col("transport").alias("session_transport")
            )
            # The latency reads the events and the sessions' transports: it
            # is computed in a background thread, once the loss account or
            # the health is written, while this one goes on with the
            # connections and the traffic (at ten million lines, computed
            # in the background rather than here, the report was faster in
            # four of four pairs of alternated runs: after the parse,
            # 32.2-34.6 s instead of 34.8-36.9).
            latency = background.submit(_writeLatency, tables, events, sessionTransports, progress)
            connectionTable = tables.write("connections", questions.connections(sessionTable))
            tables.write(
                "connections_by_window", questions.connectionsByWindow(connectionTable, window)
            )

        with progress.stage("traffic"):
            actors = cache(questions.actorTraffic(summary, sessionTransports))
            trafficTable = tables.write("traffic", questions.traffic(actors))
            topicTable = tables.write("topics", questions.topics(actors))
            publisherTable = tables.write(
                "publishers", starts.withBroker(questions.publishers(actors))
            )

            summarizedTable = tables.write(
                "topic_traffic", questions.summarizedTraffic(others, window)
            )

        messageTable, lossTable = lossAccount.result()
        latencyTable, histogramTable, latencyPerBucket = latency.result()
        errorTable, healthTable = health.result()
    finally:
        # When a query fails (or the user interrupts the report), the
        # thread's query is not waited for: stopping the SparkContext ends
        # it, and what was still queued for the thread is cancelled.
        background.shutdown(wait=False, cancel_futures=True)

    with progress.stage("runs"):
        runTable = tables.write(
            "runs",
            questions.runs(summary, activity, sessionTable, messageTable, connectionTable, starts),
        )
    for frame in cached:
        frame.unpersist()

    with progress.stage("summary and HTML"):
        # Without per-message events, the traffic is the brokers' periodic
        # summaries'.
        messageEvents = messages > 0
        if not messageEvents:
            topicTable = summarizedTable.groupBy("topic").agg(
                *(F.sum(name).alias(name) for name in SUMMARIZED_MEASURES)
            )
            trafficTable = summarizedTable
        # What the summary and the page need of the tables, all small (the
        # per-topic, per-run and per-code tables whole): one query.
        small = {
            "runs": runTable,
            "topics": topicTable,
            "loss": lossTable,
            "errors": errorTable,
            "summarized_per_broker": summarizedTable.groupBy("broker").agg(
                *(F.sum(name).alias(name) for name in SUMMARIZED_MEASURES)
            ),
            "fleet_peak": questions.fleetPeak(connectionTable),
            "session_kinds": sessionTable.groupBy("transport", "end_reason").count(),
            "traffic": trafficTable.groupBy("window_start").agg(
                F.sum("publishes").alias("publishes"),
                F.sum("deliveries").alias("deliveries"),
            ),
            "histogram": histogramTable,
            "connections": questions.connectionsByWindow(connectionTable, connectionStep),
            "publishers": publisherTable.orderBy(
                col("publishes").desc(), col("bytes").desc()
            ).limit(TOP),
            "latency": latencyTable,
            "health": healthTable,
            "latency_per_bucket": latencyPerBucket,
        }
        if messageEvents:
            small["transports"] = trafficTable.groupBy("transport").agg(
                *(F.sum(name).alias(name) for name in TRANSPORT_MEASURES)
            )
        collected = collectTogether(small)
        runRows = _sortedBy(collected["runs"], "run")
        topicRows = collected["topics"]
        topicRows.sort(key=lambda row: (-row["publishes"], -row["deliveries"], row["topic"] or ""))
        lossRows = collected["loss"]
        errorRows = collected["errors"]
        summary = summarize(
            messageEvents=messageEvents,
            summarizedPerBroker=collected["summarized_per_broker"],
            window=window,
            survey=survey,
            starts=starts,
            fleetPeak=collected["fleet_peak"][0],
            unparsedExamples=unparsedExamples,
            runRows=runRows,
            topicRows=topicRows,
            lossRows=lossRows,
            errorRows=errorRows,
            overallLatency=questions.overallLatency(collected["latency_per_bucket"]),
            sessionKinds=collected["session_kinds"],
            transports=collected.get("transports", []),
        )
        (outDir / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
        htmlreport.write(
            outDir / "report.html",
            summary,
            traffic=_sortedBy(collected["traffic"], "window_start"),
            histogram=_sortedBy(collected["histogram"], "bucket"),
            connections=_sortedBy(collected["connections"], "window_start"),
            connectionStep=connectionStep,
            topics=topicRows[:TOP],
            # In the order of the query's: publishes, then bytes, the most
            # first (nulls last).
            publishers=sorted(
                collected["publishers"],
                key=lambda row: (-row["publishes"], row["bytes"] is None, -(row["bytes"] or 0)),
            ),
            latency=sorted(
                collected["latency"],
                key=lambda row: (-row["acks"], row["topic"] or "", row["transport"]),
            )[:TOP],
            loss=sorted(lossRows, key=lambda row: (-row["matched"], row["topic"] or ""))[:TOP],
            errors=sorted(errorRows, key=lambda row: -row["errors"])[:TOP],
            health=_sortedBy(collected["health"], "window_start"),
            runs=runRows,
        )
    return summary


# What the summary says of each broker, summed over its runs.
BROKER_TOTALS = (
    "sessions",
    "publishes",
    "sys_published",
    "bridged_published",
    "bridged_delivered",
    "bridged_dropped",
    "deliveries",
    "redeliveries",
    "bytes_in",
    "bytes_out",
    "errors",
    "pings_missed",
    "clients_dropped",
)


def brokerSummaries(runRows):
    """
    Per broker of the log: its runs and their totals, its peak of
    concurrent connections (its runs do not overlap: the largest of
    theirs) and when it was first reached, its first and last events.
    """
    brokers = {}
    for row in runRows:
        brokers.setdefault(row["broker"], []).append(row)
    summaries = {}
    for broker, rows in sorted(brokers.items()):
        peak = max(rows, key=lambda row: row["peak_connections"])
        summaries[broker] = {
            "runs": sum(1 for row in rows if row["started"] is not None),
            **{name: sum(row[name] or 0 for row in rows) for name in BROKER_TOTALS},
            "peak_connections": peak["peak_connections"],
            "peak_connections_at": htmlreport.isoformat(peak["peak_at"]),
            "first_event_at": htmlreport.isoformat(
                min((row["first_event"] for row in rows if row["first_event"]), default=None)
            ),
            "last_event_at": htmlreport.isoformat(
                max((row["last_event"] for row in rows if row["last_event"]), default=None)
            ),
        }
    return summaries


def withoutMessageEvents(summary, summarizedPerBroker):
    """
    A C{summary} of a log without per-message events: its traffic is the
    brokers' periodic summaries' (C{summarizedPerBroker}), and what only
    per-message events tell is null (L{MESSAGE_EVENT_FIGURES}), not zero.
    """
    perBroker = {row["broker"]: row for row in summarizedPerBroker}
    for name in SUMMARIZED_MEASURES:
        summary[name] = sum(row[name] or 0 for row in summarizedPerBroker)
    for name in MESSAGE_EVENT_FIGURES:
        summary[name] = None
    for broker, figures in summary["brokers"].items():
        for name in SUMMARIZED_MEASURES:
            figures[name] = (perBroker.get(broker) or {}).get(name) or 0
        for name in MESSAGE_EVENT_FIGURES:
            figures.pop(name, None)
    for figures in summary["transports"].values():
        for name in TRANSPORT_MEASURES:
            figures[name] = None
    return summary


def summarize(
    messageEvents,
    summarizedPerBroker,
    window,
    survey,
    starts,
    fleetPeak,
    unparsedExamples,
    runRows,
    topicRows,
    lossRows,
    errorRows,
    overallLatency,
    sessionKinds,
    transports,
):
    """
    summary.json: the totals, from the rows the report collected.
    C{messageEvents}: whether the log has per-message events; without,
    see L{withoutMessageEvents}.
    """
    summary = _summarize(
        window,
        survey,
        starts,
        fleetPeak,
        unparsedExamples,
        runRows,
        topicRows,
        lossRows,
        errorRows,
        overallLatency,
        sessionKinds,
        transports,
    )
    summary["message_events"] = messageEvents
    if messageEvents:
        return summary
    return withoutMessageEvents(summary, summarizedPerBroker)


def _summarize(
    window,
    survey,
    starts,
    fleetPeak,
    unparsedExamples,
    runRows,
    topicRows,
    lossRows,
    errorRows,
    overallLatency,
    sessionKinds,
    transports,
):
    def total(rows, name):
        return sum(row.get(name) or 0 for row in rows)

    def tally(rows, key, name):
        counts = {}
        for row in rows:
            counts[row[key]] = counts.get(row[key], 0) + row[name]
        return counts

    def jsonKey(value):
        # A malformed event may lack its topic or code; JSON keys are text.
        return "" if value is None else value

    sessionsByTransport = tally(sessionKinds, "transport", "count")
    trafficByTransport = {row["transport"]: row for row in transports}
    return {
        # The broker's own publishes ($SYS/...) included, as in its
        # counters, and counted apart too.
        "publishes": total(runRows, "publishes"),
        "sys_published": total(runRows, "sys_published"),
        **{name: total(runRows, name) for name in BRIDGED_TOTALS},
        "retained": total(runRows, "retained"),
        "deliveries": total(topicRows, "deliveries"),
        "redeliveries": total(topicRows, "redeliveries"),
        "bytes_in": total(runRows, "bytes_in"),
        "bytes_out": total(topicRows, "bytes_out"),
        "matched": total(lossRows, "matched"),
        **{name: total(lossRows, name) for name in questions.OUTCOME_COUNTS},
        "dropped_by_reason": {
            reason: total(lossRows, f"dropped_{reason}") for reason in questions.DROP_REASONS
        },
        "inflight": total(lossRows, "inflight"),
        "messages_without_publish": total(runRows, "messages_without_publish"),
        "sessions": total(sessionKinds, "count"),
        # Over every broker of the log at once.
        "peak_connections": fleetPeak["peak_connections"] or 0,
        "peak_connections_at": htmlreport.isoformat(fleetPeak["peak_at"]),
        "brokers": brokerSummaries(runRows),
        "session_end_reasons": {
            reason or "still_connected": count
            for reason, count in tally(sessionKinds, "end_reason", "count").items()
        },
        "errors": total(errorRows, "errors"),
        "errors_by_code": {
            jsonKey(code): count for code, count in tally(errorRows, "code", "errors").items()
        },
        "pings_missed": total(runRows, "pings_missed"),
        "clients_dropped": total(runRows, "clients_dropped"),
        "latency": {
            name: overallLatency[name] for name in ("acks", "p50", "p95", "p99", "mean", "max")
        },
        "unparsed_lines": survey[parse.UNPARSED],
        "lines": survey,
        "unparsed_examples": unparsedExamples,
        "runs": len(starts),
        "first_event_at": htmlreport.isoformat(
            min((row["first_event"] for row in runRows if row["first_event"]), default=None)
        ),
        "last_event_at": htmlreport.isoformat(
            max((row["last_event"] for row in runRows if row["last_event"]), default=None)
        ),
        "window_seconds": window,
        "topics": {
            jsonKey(row["topic"]): {name: value for name, value in row.items() if name != "topic"}
            for row in topicRows
        },
        "transports": {
            transport: dict(
                {
                    name: (trafficByTransport.get(transport) or {}).get(name, 0)
                    for name in TRANSPORT_MEASURES
                },
                sessions=sessionsByTransport.get(transport, 0),
            )
            for transport in sorted(set(trafficByTransport) | set(sessionsByTransport))
        },
        "counter_mismatches": counterMismatches(runRows),
    }


def parseArguments(argv):
    parser = argparse.ArgumentParser(
        prog="dallal-report",
        description="Analyse Dallal broker logs (twistd --logfile=...) with Spark: "
        "Parquet tables, summary.json and report.html in --out.",
    )
    parser.add_argument(
        "logs",
        nargs="+",
        metavar="LOGS",
        help="log files, globs or directories (twistd.log, twistd.log.1, ...)",
    )
    parser.add_argument("--out", required=True, help="the folder to write the report in")
    parser.add_argument(
        "--window",
        type=windowSeconds,
        default=DEFAULT_WINDOW_SECONDS,
        metavar="DURATION",
        help="the time window of the traffic and health tables: 30s, 1m, 1h (default 1m)",
    )
    parser.add_argument(
        "--deliveries",
        action="store_true",
        help="also write the deliveries table: how each (message, subscriber) ended, "
        "a row per send (at ten million lines it doubles the report's loss-account time)",
    )
    parser.add_argument(
        "--master",
        help="the Spark master URL (default: spark-submit's, or local[*] when run with python)",
    )
    parser.add_argument(
        "--shuffle-partitions",
        type=positiveCount,
        metavar="N",
        help="spark.sql.shuffle.partitions (default: the site's setting, else Spark's)",
    )
    parser.add_argument(
        "--driver-memory",
        metavar="SIZE",
        help="the driver JVM's heap (spark.driver.memory), e.g. 4g, when the report "
        "starts the JVM (default: the site's setting, else Spark's)",
    )
    parser.add_argument(
        "--incremental",
        action="store_true",
        help="parse only what the logs gained since the last --incremental run into "
        "--out (the parsed lines are kept there as Parquet, by broker and date), then "
        "report on all of them; the logs must be files of this machine",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress lines on standard error")
    return parser.parse_args(argv)


def main(argv=None):
    args = parseArguments(argv)
    from pyspark.errors import AnalysisException, PySparkRuntimeError

    try:
        spark = buildSession(
            master=args.master,
            shufflePartitions=args.shuffle_partitions,
            driverMemory=args.driver_memory,
        )
    except PySparkRuntimeError as error:
        # The JVM wrote its reason on standard error, above.
        print(f"dallal-report: Spark did not start: {error}", file=sys.stderr)
        return 1

    progress = Progress(enabled=not args.quiet, statusTracker=spark.sparkContext.statusTracker())
    try:
        summary = runReport(
            spark,
            args.logs,
            args.out,
            args.window,
            progress,
            deliveries=args.deliveries,
            incrementally=args.incremental,
        )
    except incremental.IncrementalError as error:
        print(f"dallal-report: {error}", file=sys.stderr)
        return 2
    except AnalysisException as error:
        if error.getCondition() != "PATH_NOT_FOUND":
            raise
        print(f"dallal-report: {error.getMessage()}", file=sys.stderr)
        return 2
    finally:
        spark.stop()
    out = Path(args.out)
    print(
        f"{summary['publishes']} publishes, {summary['deliveries']} deliveries, "
        f"{summary['sessions']} sessions, {summary['unparsed_lines']} unparsed lines"
    )
    print(f"report: {out / 'report.html'}")
    print(f"summary: {out / 'summary.json'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
