"""
The report's questions, each a DataFrame computed from the parsed events.

Names and meanings follow docs/EVENTS.md.  Sessions and messages are
numbered from 1 at each broker start, so they are keyed by C{(run,
session)} and C{(run, mid)}, where C{run} counts the broker's starts (see
L{assignRuns}).  Every time is a double C{t} (seconds since the epoch, as
logged) and, for people, a UTC timestamp column beside it.

Only native functions are used: nothing here needs Python on executors.

The events are many (a busy broker logs millions an hour); sessions,
topics, windows and runs are few.  So the questions read the events as
few times as possible: L{eventSummary} sums them once per session, event
name, window, topic and the like, and the sessions, runs, traffic, errors
and health are sums of its few rows; only the acks (L{latencySketch}, from
which the latency tables derive) and the stories of messages
(L{messages}, and L{deliveries} when asked for) read the events again.
The events' aggregations sum numbers only, which Spark keeps in a hash
table: text in a sum's buffer would make it sort every event.  Text
(clients, transports, reasons) is a grouping key instead.
"""

import math

from pyspark.sql import Window
from pyspark.sql import functions as F

from dallal_analytics.parse import (
    BROKER,
    EVENT,
    EVENT_NUMBER,
    MESSAGE_EVENTS,
    codeName,
    eventNumberOf,
    nameCode,
)

DROP_REASONS = (
    "queue_full",
    "slow_consumer",
    "disconnected",
    "redelivery_limit",
    "superseded",
    "too_large",
    "bridge_refused",
    "expired",
)
MODES = ("fire", "latest", "all")
LATENCY_QUANTILES = (0.5, 0.95, 0.99)
# Latencies are counted in logarithmic buckets this fine: a bucket's middle
# is within 0.58% of every latency in it (10^(1/400) - 1), and that is the
# percentiles' accuracy.
SKETCH_BUCKETS_PER_DECADE = 200
SKETCH_RELATIVE_ERROR = 10 ** (1 / (2 * SKETCH_BUCKETS_PER_DECADE)) - 1
# The latency histogram has this many logarithmic buckets per decade.
BUCKETS_PER_DECADE = 10
# Latencies are logged to the microsecond; a zero one goes in the first
# bucket instead of breaking the logarithm.
SMALLEST_LATENCY = 1e-6
UNKNOWN_TRANSPORT = "unknown"
# The transport of the broker's own publishes on $SYS/... topics.
SYS_TRANSPORT = "sys"
# The transport of this broker's own bridge sessions (--bridge).
BRIDGE_TRANSPORT = "bridge"

# The columns of the parsed lines the questions read: what the report
# caches.
EVENT_COLUMNS = (
    "event",
    EVENT_NUMBER,
    BROKER,
    "t",
    "mid",
    "bytes",
    "session",
    "subscribers",
    "attempt",
    "by",
    "latency",
    "fatal",
    "count",
    "topic",
    "client",
    "transport",
    "mode",
    "reason",
    "code",
    "address",
    "stats",
    "hops",
    "bridge",
)

col = F.col


def cachedColumns(split):
    """
    What the questions read of L{parse.splitLines}' rows, which the report
    caches: not the level or C{seq}, and not the client of a send, nearly
    half the log, which L{eventSummary} leaves out (so Spark does not even
    cut it from the line).
    """
    return split.select(
        *(name for name in split.columns if name not in ("level", "seq", "client")),
        F.when(col(EVENT_NUMBER) != eventNumberOf("deliver"), col("client")).alias("client"),
    )


def isEvent(*names):
    """
    Whether an event is one of C{names}: the per-message events by their
    L{EVENT_NUMBER} (nearly every event is one, and comparing numbers is
    cheaper than comparing names), the others by name.
    """
    numbers = [eventNumberOf(name) for name in names if name in MESSAGE_EVENTS]
    others = [name for name in names if name not in MESSAGE_EVENTS]
    byNumber = col(EVENT_NUMBER).isin(*numbers)
    byName = (col(EVENT_NUMBER) == 0) & col("event").isin(*others)
    if not others:
        return byNumber
    if not numbers:
        return byName
    return byNumber | byName


# A send with no attempt (logs of brokers before acknowledged delivery) is a
# first send, and with no mode it was final, as in `fire` mode: those brokers
# never redelivered and nothing was acknowledged.
def isFirstSend():
    return isEvent("deliver") & (F.coalesce(col("attempt"), F.lit(1)) == 1)


def isRedelivery():
    return isEvent("deliver") & (col("attempt") > 1)


def isFired():
    return isFirstSend() & (F.coalesce(col("mode"), F.lit("fire")) == "fire")


def isStory():
    """
    The events that start messages' stories: a publish, or a retained
    message offered to one new subscription.
    """
    return isEvent("publish", "retained")


def isSysPublish():
    """
    The broker's own publishes ($SYS/...): part of its C{published} and
    C{bytes_in} counters, and counted apart in C{sys_published}.
    """
    return isEvent("publish") & col("transport").eqNullSafe(SYS_TRANSPORT)


def isErrorReport():
    """
    Refusals: one C{protocol_error} each, or C{count} of them in a
    C{protocol_errors_suppressed}.
    """
    return isEvent("protocol_error", "protocol_errors_suppressed")


def errorsReported(each):
    """
    The refusals a row reports: C{each} for C{protocol_error} rows, their
    C{count} for C{protocol_errors_suppressed} ones.
    """
    return F.when(isEvent("protocol_error"), each).when(
        isEvent("protocol_errors_suppressed"), F.coalesce(col("count"), F.lit(0))
    )


def timestamp(seconds):
    return F.timestamp_seconds(seconds)


def windowStart(seconds, windowSeconds):
    """
    The start of the tumbling window of C{windowSeconds} holding C{seconds}.
    """
    return timestamp(F.floor(seconds / windowSeconds) * windowSeconds)


def _timesAtOrBefore(times, t):
    """
    How many of the driver-side C{times} (sorted) are at or before the
    column C{t}: a binary search as nested CASE WHENs, which Spark compiles
    (a lambda over an array of them would be interpreted for every row).
    A null C{t} counts as before them all.
    """

    def search(low, high):
        # times[:low] are at or before t, times[high:] after it.
        if low == high:
            return F.lit(low)
        middle = (low + high) // 2
        return F.when(t >= F.lit(times[middle]), search(middle + 1, high)).otherwise(
            search(low, middle)
        )

    return search(0, len(times))


# The broker of events that name none (logs of brokers before events
# carried their broker's name).
UNNAMED_BROKER = "unnamed"


def brokerName():
    return F.coalesce(col(BROKER), F.lit(UNNAMED_BROKER))


# What a broker logs as it starts (EVENTS.md): the MQTT sessions it took
# up from its data directory, then one `listening` per listener.
START_EVENTS = ("sessions_restored", "listening")


def isStart():
    """
    Whether an event is one of those a broker logs as it starts.
    """
    return isEvent(*START_EVENTS)


def _starts(lines, listening):
    """
    The times each broker started: the first L{START_EVENTS} event of each
    group of them (one start logs one per listener) that no other event of
    the broker separates.  One query finds the groups of every broker.

    @param listening: broker name -> the times of its start events, sorted.
    @return: broker name -> the times it started.
    """
    several = {broker: times for broker, times in listening.items() if len(times) > 1}
    occupied = set()
    if several:
        # The gap between start events each other event falls in, by
        # broker: gap i holds the events after the i-th start event.
        gap = None
        for broker, times in several.items():
            held = brokerName() == broker
            inGap = _timesAtOrBefore(times, col("t"))
            gap = F.when(held, inGap) if gap is None else gap.when(held, inGap)
        occupied = {
            (row[BROKER], row.gap)
            for row in lines.where(
                (col("kind") == EVENT) & ~isStart() & brokerName().isin(*several)
            )
            .select(brokerName().alias(BROKER), gap.alias("gap"))
            .distinct()
            .collect()
        }
    return {
        broker: [
            t
            for position, t in enumerate(times, 1)
            if position == 1 or (broker, position - 1) in occupied
        ]
        for broker, times in listening.items()
    }


class Runs:
    """
    The starts of each broker in a log, and the C{run} that numbers them:
    every broker's runs have numbers of their own, so that sessions and
    messages, numbered from 1 at each start, are told apart by
    C{(run, session)} and C{(run, mid)} across restarts and brokers.  A
    broker's first number is for its events logged before its first start
    in the log (its earlier files rotated away).

    @ivar starts: broker name -> the times it started, in order.
    """

    def __init__(self, starts):
        self.starts = dict(sorted(starts.items()))
        self.first = {}
        number = 0
        for broker, times in self.starts.items():
            self.first[broker] = number
            number += len(times) + 1

    @classmethod
    def find(cls, lines, brokers, starting):
        """
        The runs of C{lines}, from the L{lineSurvey}'s C{brokers} and
        C{starting} events.
        """
        times = {broker: [] for broker in brokers}
        for event in starting:
            times.setdefault(event["broker"], []).append(event["t"])
        return cls(
            _starts(lines, {broker: sorted(brokerTimes) for broker, brokerTimes in times.items()})
        )

    @classmethod
    def ofEvents(cls, events):
        """
        The runs of events that L{assignRuns} numbered: each broker's starts
        are the first start event (L{START_EVENTS}) of each of its runs.
        """
        brokers = [row[0] for row in events.select(BROKER).distinct().collect()]
        listening = (
            events.where(isStart()).groupBy(BROKER, "run").agg(F.min("t").alias("t")).collect()
        )
        starts = {broker: [] for broker in brokers}
        for row in sorted(listening, key=lambda row: row["run"]):
            starts[row[BROKER]].append(row["t"])
        return cls(starts)

    def __len__(self):
        return sum(len(times) for times in self.starts.values())

    def column(self):
        """
        The C{run} of an event, from its broker and time.
        """
        run = None
        for broker, times in self.starts.items():
            number = self.first[broker] + _timesAtOrBefore(times, col("t"))
            held = brokerName() == broker
            run = F.when(held, number) if run is None else run.when(held, number)
        return run if run is not None else F.lit(0)

    def brokerOf(self, run):
        """
        The broker whose run C{run} (a column) is.
        """
        name = None
        for broker, first in self.first.items():
            held = run.between(first, first + len(self.starts[broker]))
            name = F.when(held, broker) if name is None else name.when(held, broker)
        return name if name is not None else F.lit(UNNAMED_BROKER)

    def withBroker(self, frame):
        """
        C{frame}, keyed by C{run}, with the name of the run's broker first.
        """
        return frame.select(self.brokerOf(col("run")).alias(BROKER), "*")

    def last(self):
        """
        The last run of each broker: the one its log ends in.
        """
        return [first + len(self.starts[broker]) for broker, first in self.first.items()]


def assignRuns(lines, runs):
    """
    The events, each with its C{run} (L{Runs}) and its broker's name.
    """
    return lines.where(col("kind") == EVENT).select(
        runs.column().alias("run"),
        brokerName().alias(BROKER),
        *(name for name in lines.columns if name not in ("kind", "raw", BROKER)),
    )


def lineSurvey(lines, kinds):
    """
    One row: how many lines in all and of each kind, how many messages
    they start (C{publish} and C{retained} events), the first and last
    events' times, the brokers that logged events, and the C{starting}
    events' broker and time (L{START_EVENTS}: a broker logs one per
    listener at each start, so they are few).
    """
    isEventLine = col("kind") == EVENT
    return lines.agg(
        F.count(F.lit(1)).alias("lines"),
        *(F.count_if(col("kind") == kind).alias(kind) for kind in kinds),
        F.count_if(isEventLine & isStory()).alias("messages"),
        timestamp(F.min(F.when(isEventLine, col("t")))).alias("first_event"),
        timestamp(F.max(F.when(isEventLine, col("t")))).alias("last_event"),
        F.collect_set(F.when(isEventLine, brokerName())).alias("brokers"),
        F.collect_list(
            F.when(
                isEventLine & isStart(),
                F.struct(brokerName().alias("broker"), col("t").alias("t")),
            )
        ).alias("starting"),
    )


# One pass over the events

# Each broker counter (the `stats` event) and the column of `runs` (and of
# L{sessionActivity}) that the log's events give for it.
COUNTERS_FROM_EVENTS = {
    "connections_total": "sessions",
    "published": "publishes",
    "sys_published": "sys_published",
    "bridged_published": "bridged_published",
    "bridged_delivered": "bridged_delivered",
    "bridged_dropped": "bridged_dropped",
    "matched": "matched",
    "delivered": "deliveries",
    "fired": "fired",
    "redelivered": "redeliveries",
    "acked": "acked",
    "replaced": "replaced",
    "dropped": "dropped",
    **{f"dropped_{reason}": f"dropped_{reason}" for reason in DROP_REASONS},
    "bytes_in": "bytes_in",
    "bytes_out": "bytes_out",
    "errors": "errors",
    "pings_missed": "pings_missed",
    "clients_dropped": "clients_dropped",
}

# Above this many messages, their sizes are joined with the sends by a
# shuffle rather than broadcast.
BROADCAST_MESSAGES = 5_000_000
# Runs and message ids packed in one 64-bit key (a hash join on one long is
# the cheapest); ids are below 2^40 (see parse.MOST_INT).
MID_BITS = 41


def _messageKey():
    return F.shiftleft(col("run").cast("bigint"), MID_BITS) + col("mid")


def messageSizes(events, messages):
    """
    C{message_key} -> C{message_bytes} of every message the log starts
    (C{message_key} packs its run and mid).

    Sends are joined with it; when the log's C{messages} are few enough
    for each task to hold their sizes (tens of bytes each), Spark is told
    to broadcast it, sparing a shuffle of every event.
    """
    sizes = events.where(isStory()).select(
        _messageKey().alias("message_key"), col("bytes").alias("message_bytes")
    )
    return F.broadcast(sizes) if messages <= BROADCAST_MESSAGES else sizes


def eventSummary(events, sizes, windowSeconds):
    """
    The events counted and summed per run, session, event (see L{isEvent}), and what
    the questions group them by, where it applies: client and transport,
    the window and topic of publishes, sends and trouble, and in C{detail}
    the reason of disconnects and drops, the code of refusals, the address
    listened on or the counters of C{stats} (as JSON).

    Every question but the latency and the stories of messages is a sum of
    these rows, which are few: a session's events fall in a
    handful of them per window and topic.  A send's C{bytes_out} are its
    message's, from C{sizes} (L{messageSizes}).
    """
    traffic = isEvent("publish", "deliver")
    trouble = _isTrouble()
    sends = events.select("*", F.when(isEvent("deliver"), _messageKey()).alias("message_key")).join(
        sizes, "message_key", "left"
    )
    return sends.groupBy(
        "run",
        "session",
        # The per-message events by their number only (their name is null
        # here: L{isEvent} does not read it): comparing their names in the
        # key cost more.
        EVENT_NUMBER,
        F.when(col(EVENT_NUMBER) == 0, col("event")).alias("event"),
        # A session's other events name its client: its sends, nearly half
        # the log, leave it out of their key, where comparing it cost a
        # quarter of this aggregation.  Without a session (older logs) the
        # client is the subscriber.
        F.when(~isEvent("deliver") | col("session").isNull(), col("client")).alias("client"),
        "transport",
        F.when(traffic | trouble, windowStart(col("t"), windowSeconds)).alias("window_start"),
        F.when(traffic, col("topic")).alias("topic"),
        # One key for these few events' text, since each has one.
        F.when(isEvent("disconnect", "drop"), col("reason"))
        .when(isErrorReport(), col("code"))
        .when(isEvent("listening"), col("address"))
        .when(isEvent("stats"), F.to_json("stats"))
        .alias("detail"),
    ).agg(
        F.count(F.lit(1)).alias("events"),
        F.count_if(isFirstSend()).alias("first_sends"),
        F.count_if(isRedelivery()).alias("redeliveries"),
        F.count_if(isFired()).alias("fired"),
        F.sum("subscribers").alias("subscribers"),
        F.sum("bytes").alias("bytes"),
        F.sum("message_bytes").alias("bytes_out"),
        F.sum("count").alias("count"),
        F.count_if(col("fatal")).alias("fatal"),
        F.count_if(isEvent("publish") & (col("hops") >= 1)).alias("bridged_publishes"),
        F.count_if(isEvent("subscribe") & col("bridge")).alias("bridge_subscribes"),
        F.min("t").alias("first_t"),
        F.max("t").alias("last_t"),
    )


# Sessions and runs


def _sum(value):
    return F.coalesce(F.sum(value), F.lit(0))


def _sumWhere(condition, column="events"):
    """
    Over L{eventSummary} rows: the sum of C{column} where C{condition}.
    """
    return _sum(F.when(condition, col(column)))


def sessionActivity(summary):
    """
    Per run and session, what its events add up to, from the
    L{eventSummary}: the sessions and the runs tables derive from it.
    Events of no session (C{listening}, C{stats}, the broker's own
    publishes with session 0, ...) are gathered under a null or 0
    C{session}.
    """
    publish = isEvent("publish")
    retained = isEvent("retained")
    drop = isEvent("drop")
    return summary.groupBy("run", "session").agg(
        F.sum("events").alias("events"),
        F.min("first_t").alias("first_t"),
        F.max("last_t").alias("last_t"),
        F.min(F.when(isEvent("listening"), col("first_t"))).alias("started_t"),
        F.max(F.when(isEvent("disconnect"), col("last_t"))).alias("disconnect_t"),
        _sumWhere(isEvent("connect")).alias("sessions"),
        _sumWhere(isEvent("subscribe")).alias("subscribes"),
        _sumWhere(publish).alias("publishes"),
        _sumWhere(isSysPublish()).alias("sys_published"),
        _sum("bridged_publishes").alias("bridged_published"),
        _sum("bridge_subscribes").alias("bridge_subscribes"),
        _sumWhere(retained).alias("retained"),
        (_sumWhere(publish, "subscribers") + _sumWhere(retained)).alias("matched"),
        _sumWhere(publish, "bytes").alias("bytes_in"),
        _sum("first_sends").alias("deliveries"),
        _sum("fired").alias("fired"),
        _sum("redeliveries").alias("redeliveries"),
        _sumWhere(isEvent("ack")).alias("acked"),
        _sumWhere(isEvent("replace")).alias("replaced"),
        _sumWhere(drop).alias("dropped"),
        *(
            _sumWhere(drop & (col("detail") == reason)).alias(f"dropped_{reason}")
            for reason in DROP_REASONS
        ),
        _sum(errorsReported(col("events"))).alias("errors"),
        _sumWhere(isEvent("ping_missed")).alias("pings_missed"),
        _sumWhere(isEvent("client_dropped")).alias("clients_dropped"),
    )


def sessionNames(summary):
    """
    Per client session: its C{client} and C{transport} as its events name
    them (but its sends: see L{eventSummary}), and the C{end_reason} of its
    C{disconnect}, from the L{eventSummary}.
    """
    return (
        summary.where(col("session") > 0)
        .groupBy("run", "session")
        .agg(
            F.any_value("client", ignoreNulls=True).alias("client"),
            F.any_value("transport", ignoreNulls=True).alias("transport"),
            F.max(F.when(isEvent("disconnect"), col("detail"))).alias("end_reason"),
        )
    )


def sessions(activity, names, runs):
    """
    One row per client session: which broker, who, over what, from when to
    when, why it ended (null: still connected when the log ends), and what
    it did.

    C{closed_t} is when it stopped counting as connected: its disconnect,
    or for a run followed by another start of its broker, the run's last
    session event (the broker stopped without logging the disconnect).
    """
    perSession = activity.where(col("session") > 0).join(names, ["run", "session"], "left")
    runEnd = F.max("last_t").over(Window.partitionBy("run"))
    return perSession.select(
        "run",
        "session",
        "client",
        F.coalesce(col("transport"), F.lit(UNKNOWN_TRANSPORT)).alias("transport"),
        # It carries messages to another broker (EVENTS.md, "Local and
        # bridged traffic").
        ((col("transport") == BRIDGE_TRANSPORT) | (col("bridge_subscribes") > 0)).alias("bridge"),
        timestamp(col("first_t")).alias("first_seen"),
        timestamp(col("last_t")).alias("last_seen"),
        (col("last_t") - col("first_t")).alias("duration"),
        "end_reason",
        "subscribes",
        "pings_missed",
        (col("clients_dropped") > 0).alias("dropped_for_pings"),
        "publishes",
        "deliveries",
        col("acked").alias("acks"),
        "dropped",
        "errors",
        "first_t",
        F.coalesce(col("disconnect_t"), F.when(~col("run").isin(runs.last()), runEnd)).alias(
            "closed_t"
        ),
    ).transform(runs.withBroker)


def connections(sessionTable):
    """
    Concurrent connections after each change: +1 when a session is first
    seen, -1 when it closes.  C{connections} counts the run's (a restart
    starts from zero), C{fleet_connections} every broker's of the log
    together; at equal times closes come first, so peaks are not inflated.
    """
    changes = sessionTable.select(
        BROKER, "run", col("first_t").alias("t"), F.lit(1).alias("change")
    ).unionByName(
        sessionTable.where(col("closed_t").isNotNull()).select(
            BROKER, "run", col("closed_t").alias("t"), F.lit(-1).alias("change")
        )
    )
    inOrder = Window.orderBy("t", "change", "run").rowsBetween(
        Window.unboundedPreceding, Window.currentRow
    )
    return changes.select(
        BROKER,
        "run",
        timestamp(col("t")).alias("at"),
        "t",
        "change",
        F.sum("change").over(inOrder.partitionBy("run")).alias("connections"),
        # Sessions are few (two changes each): one task orders them all.
        F.sum("change").over(inOrder).alias("fleet_connections"),
    )


def connectionsByWindow(connectionTable, windowSeconds):
    """
    Per window with a change, over every broker of the log: the peak
    (counting the level it started with) and the level at its end.
    """
    level = col("fleet_connections")
    return connectionTable.groupBy(windowStart(col("t"), windowSeconds).alias("window_start")).agg(
        F.max(F.greatest(level, level - col("change"))).alias("peak"),
        F.max_by(level, F.struct("t", "change", "run")).alias("at_end"),
        F.count_if(col("change") > 0).alias("connects"),
        F.count_if(col("change") < 0).alias("disconnects"),
    )


def fleetPeak(connectionTable):
    """
    One row: the most connections at once over every broker of the log
    (C{peak_connections}), and the first time it was reached (C{peak_at}).
    """
    level = col("fleet_connections")
    return connectionTable.agg(
        F.max(level).alias("peak_connections"),
        F.max_by("at", F.struct(level, -col("t"))).alias("peak_at"),
    )


RUN_TOTALS = (
    "events",
    "sessions",
    "publishes",
    "sys_published",
    "bridged_published",
    "retained",
    "matched",
    "deliveries",
    "fired",
    "redeliveries",
    "acked",
    "replaced",
    "dropped",
    *(f"dropped_{reason}" for reason in DROP_REASONS),
    "bytes_in",
    "errors",
    "pings_missed",
    "clients_dropped",
)


def runs(summary, activity, sessionTable, messageTable, connectionTable, starts):
    """
    Per broker start (and its broker): when, where it listened, how long it
    ran, the totals
    of its events (named as in L{COUNTERS_FROM_EVENTS}), its peak of
    concurrent connections, and the counters of its last C{stats} event
    (null if it logged none).  C{starts}: the log's L{Runs}.
    """
    perRun = activity.groupBy("run").agg(
        timestamp(F.min("started_t")).alias("started"),
        timestamp(F.min("first_t")).alias("first_event"),
        timestamp(F.max("last_t")).alias("last_event"),
        *(F.sum(name).alias(name) for name in RUN_TOTALS),
    )
    isStats = isEvent("stats")
    marks = (
        summary.where(isEvent("listening") | isStats)
        .groupBy("run")
        .agg(
            F.sort_array(F.collect_set(F.when(isEvent("listening"), col("detail")))).alias(
                "addresses"
            ),
            F.from_json(
                F.max_by(F.when(isStats, col("detail")), F.when(isStats, col("last_t"))),
                "map<string,bigint>",
            ).alias("counters"),
        )
    )
    perRunMessages = messageTable.groupBy("run").agg(
        _sum("bytes_out").alias("bytes_out"),
        F.count_if(~col("publish_logged")).alias("messages_without_publish"),
    )
    perRunBridges = (
        sessionTable.where(col("bridge"))
        .groupBy("run")
        .agg(
            _sum("deliveries").alias("bridged_delivered"),
            _sum("dropped").alias("bridged_dropped"),
        )
    )
    perRunConnections = connectionTable.groupBy("run").agg(
        F.max("connections").alias("peak_connections"),
        # The first time the peak was reached.
        F.max_by("at", F.struct(col("connections"), -col("t"))).alias("peak_at"),
    )
    return (
        perRun.join(marks, "run", "left")
        .join(perRunMessages, "run", "left")
        .join(perRunBridges, "run", "left")
        .join(perRunConnections, "run", "left")
        .fillna(
            0,
            subset=[
                "bytes_out",
                "messages_without_publish",
                "bridged_delivered",
                "bridged_dropped",
                "peak_connections",
            ],
        )
    ).transform(starts.withBroker)


# Traffic

TRAFFIC_SUMS = ("publishes", "deliveries", "redeliveries", "bytes_in", "bytes_out")


def actorTraffic(summary, sessionTransports):
    """
    Publishes and sends summed per window, topic, transport and actor: the
    publishing session (C{publishing} true), or the subscriber sent to.
    The traffic, topics and publishers tables are sums and counts of these
    few rows.  The transport of a send is the subscriber's; a session
    without a number (older logs) is known by its address.
    """
    publishing = isEvent("publish")
    return (
        summary.where(isEvent("publish", "deliver"))
        .join(sessionTransports, ["run", "session"], "left")
        .groupBy(
            "window_start",
            "topic",
            F.coalesce("transport", "session_transport", F.lit(UNKNOWN_TRANSPORT)).alias(
                "transport"
            ),
            publishing.alias("publishing"),
            "run",
            "session",
            F.when(publishing | col("session").isNull(), col("client")).alias("client"),
        )
        .agg(
            _sumWhere(publishing).alias("publishes"),
            _sum("first_sends").alias("deliveries"),
            _sum("redeliveries").alias("redeliveries"),
            _sumWhere(publishing, "bytes").alias("bytes_in"),
            _sum("bytes_out").alias("bytes_out"),
        )
    )


def _trafficMeasures():
    return (
        *(_sum(name).alias(name) for name in TRAFFIC_SUMS),
        # Each row is one actor: count them.
        F.count_if(col("publishing")).alias("publishers"),
        F.count_if(~col("publishing")).alias("subscribers"),
    )


def traffic(actors):
    """
    Per window, topic and transport: publishes, first sends, redeliveries,
    payload bytes in and out (redeliveries included, like the broker's
    C{bytes_out}), distinct publishing and receiving sessions.
    """
    return actors.groupBy("window_start", "topic", "transport").agg(*_trafficMeasures())


def topics(actors):
    """
    The same measures per topic over the whole log.
    """
    perActor = actors.groupBy("topic", "publishing", "run", "session", "client").agg(
        *(_sum(name).alias(name) for name in TRAFFIC_SUMS)
    )
    return perActor.groupBy("topic").agg(*_trafficMeasures())


def publishers(actors):
    """
    Per publishing session: how much it published, on how many topics.
    """
    perTopic = (
        actors.where(col("publishing"))
        .groupBy("run", "session", "client", "topic")
        .agg(
            F.any_value("transport").alias("transport"),
            _sum("publishes").alias("publishes"),
            F.sum("bytes_in").alias("bytes"),
        )
    )
    return perTopic.groupBy("run", "session", "client").agg(
        F.any_value("transport").alias("transport"),
        F.sum("publishes").alias("publishes"),
        F.sum("bytes").alias("bytes"),
        F.count(F.lit(1)).alias("topics"),
    )


# Delivery


def acks(events, sessionTransports):
    """
    The C{ack} events with a latency, with the subscriber's transport.
    """
    return (
        events.where(isEvent("ack") & col("latency").isNotNull())
        .join(sessionTransports, ["run", "session"], "left")
        .select(
            "topic",
            F.coalesce("session_transport", F.lit(UNKNOWN_TRANSPORT)).alias("transport"),
            "latency",
        )
    )


def _bucket(latency, perDecade):
    return F.floor(F.log10(F.greatest(latency, F.lit(SMALLEST_LATENCY))) * perDecade)


def latencySketch(ackFrame):
    """
    Acks per topic, transport and fine logarithmic latency bucket
    (L{SKETCH_BUCKETS_PER_DECADE}), with their sum and largest latency:
    the latency table, its percentiles and the histogram derive from
    these few rows.  Counting into buckets is a plain hash aggregation;
    percentile_approx kept a sorted sketch per group, dearer by far.
    """
    return ackFrame.groupBy(
        "topic", "transport", _bucket(col("latency"), SKETCH_BUCKETS_PER_DECADE).alias("fine")
    ).agg(
        F.count(F.lit(1)).alias("acks"),
        F.sum("latency").alias("sum"),
        F.max("latency").alias("max"),
    )


def bucketMiddle(fine):
    """
    The latency a fine bucket stands for: its geometric middle, within
    L{SKETCH_RELATIVE_ERROR} of every latency in it.
    """
    return F.pow(F.lit(10.0), (fine + 0.5) / SKETCH_BUCKETS_PER_DECADE)


def latency(sketch):
    """
    Publish-to-ack latency per topic and transport: count, p50, p95, p99,
    mean and max, in seconds.  A percentile is the middle of the fine
    bucket that holds it (the smallest latency with that share of the
    acks at or below it): within L{SKETCH_RELATIVE_ERROR} of the exact
    one; mean and max are exact.
    """
    group = ("topic", "transport")
    cumulative = F.sum("acks").over(
        Window.partitionBy(*group)
        .orderBy("fine")
        .rowsBetween(Window.unboundedPreceding, Window.currentRow)
    )
    total = F.sum("acks").over(Window.partitionBy(*group))
    ranked = sketch.select("*", cumulative.alias("cumulative"), total.alias("total"))
    return ranked.groupBy(*group).agg(
        F.sum("acks").alias("acks"),
        *(
            bucketMiddle(
                F.min(F.when(col("cumulative") >= F.ceil(col("total") * quantile), col("fine")))
            ).alias(f"p{round(quantile * 100)}")
            for quantile in LATENCY_QUANTILES
        ),
        (F.sum("sum") / F.sum("acks")).alias("mean"),
        F.max("max").alias("max"),
    )


def overallLatency(sketchRows):
    """
    The same measures over every ack, from the sketch's rows (collected:
    a few thousand at most), as a dict.
    """
    perBucket = {}
    for row in sketchRows:
        perBucket[row["fine"]] = perBucket.get(row["fine"], 0) + row["acks"]
    acks = sum(perBucket.values())
    result = {"acks": acks, "mean": None, "max": None}
    for quantile in LATENCY_QUANTILES:
        result[f"p{round(quantile * 100)}"] = None
    if not acks:
        return result
    result["mean"] = sum(row["sum"] for row in sketchRows) / acks
    result["max"] = max(row["max"] for row in sketchRows)
    cumulative = 0
    pending = list(LATENCY_QUANTILES)
    for fine in sorted(perBucket):
        cumulative += perBucket[fine]
        while pending and cumulative >= math.ceil(acks * pending[0]):
            result[f"p{round(pending.pop(0) * 100)}"] = 10 ** (
                (fine + 0.5) / SKETCH_BUCKETS_PER_DECADE
            )
    return result


def latencyHistogram(sketch):
    """
    Acks per logarithmic latency bucket: C{[lower, upper)} seconds, ten
    per decade.
    """
    ratio = SKETCH_BUCKETS_PER_DECADE // BUCKETS_PER_DECADE
    return (
        sketch.groupBy(F.floor(col("fine") / ratio).alias("bucket"))
        .agg(F.sum("acks").alias("acks"))
        .select(
            "bucket",
            F.pow(F.lit(10.0), col("bucket") / BUCKETS_PER_DECADE).alias("lower"),
            F.pow(F.lit(10.0), (col("bucket") + 1) / BUCKETS_PER_DECADE).alias("upper"),
            "acks",
        )
    )


OUTCOME_COUNTS = ("acked", "fired", "replaced", "dropped")


def deliveries(events):
    """
    One row per (message, subscriber) the log knows of: sends, and how the
    story ended: C{acked}, C{fired} (sent in C{fire} mode: final),
    C{replaced}, C{dropped} (with its reason) or C{inflight}: as many rows as
    the log has sends, so the report writes it only when asked
    (C{--deliveries}).  If a log says more than one outcome for a
    subscriber, the strongest evidence wins (an ack proves receipt), where
    L{messages} counts each event as the broker does.

    The story's events all name the message's topic, which is part of its
    key here: a hash aggregation cannot carry text in its sums.  For the
    same reason the mode and drop reason are summed as their position in
    L{MODES} and L{DROP_REASONS} (C{other} for one they do not list).
    """
    outcomes = ("ack", "replace", "drop")
    pairs = (
        events.where(isEvent("deliver", *outcomes) & col("session").isNotNull())
        # One shuffle of the events by message: a message's events are
        # rarely in the same task, so summing them there first would only
        # cost a hash table (measured: 15% slower).
        .repartition("run", "mid")
        .groupBy("run", "mid", "session", "topic")
        .agg(
            F.min(F.when(isEvent("deliver"), col("t"))).alias("first_sent_t"),
            F.max(F.when(isEvent("deliver"), nameCode(col("mode"), MODES))).alias("mode_code"),
            F.count_if(isFirstSend()).alias("first_sends"),
            F.count_if(isRedelivery()).alias("redeliveries"),
            F.count_if(isEvent("deliver")).alias("sends"),
            F.count_if(isFired()).alias("fired"),
            F.count_if(isEvent("ack")).alias("acks"),
            F.count_if(isEvent("replace")).alias("replaces"),
            F.count_if(isEvent("drop")).alias("drops"),
            F.max(F.when(isEvent("ack"), col("latency"))).alias("latency"),
            F.max(F.when(isEvent("replace"), col("by"))).alias("replaced_by"),
            F.max(F.when(isEvent("drop"), nameCode(col("reason"), DROP_REASONS))).alias(
                "reason_code"
            ),
        )
    )
    # Exactly one of these ends a story; if a log says more, the strongest
    # evidence wins: an ack proves receipt.
    outcome = (
        F.when(col("acks") > 0, "acked")
        .when(col("drops") > 0, "dropped")
        .when(col("replaces") > 0, "replaced")
        .when(col("fired") > 0, "fired")
        .otherwise("inflight")
    )
    return pairs.select(
        "run",
        "mid",
        "session",
        "topic",
        codeName(col("mode_code"), MODES).alias("mode"),
        timestamp(col("first_sent_t")).alias("first_sent"),
        "first_sends",
        "redeliveries",
        "sends",
        outcome.alias("outcome"),
        F.when(outcome == "dropped", codeName(col("reason_code"), DROP_REASONS)).alias(
            "drop_reason"
        ),
        "replaced_by",
        "latency",
    )


def messages(events):
    """
    The loss account per published message: of its C{subscribers} (the
    sessions it matched), how many were acked, fired, replaced or dropped
    (and why); the rest were in flight when the log ends.  A C{retained}
    offer is a message of its own with one subscriber and no publisher.

    The outcomes are its events counted, as the broker counts them in its
    C{acked}, C{fired}, C{replaced} and C{dropped} counters.  A message's
    events are logged within moments of each other, so nearly all fall in
    the same task: Spark counts them there, and moves a row per message
    rather than every event (derived from L{deliveries}, which moves every
    event and writes a row per send, the loss account took 39 s of the
    report at ten million lines; this way, 17).

    Stories whose C{publish} is not in the log (it was in a file rotated
    away) have C{publish_logged} false and no account, as do events that
    name another topic than their message's C{publish} (the broker logs
    each message's own on all of them).
    """
    retained = isEvent("retained")
    published = events.where(isStory()).select(
        "run",
        "mid",
        "topic",
        timestamp(col("t")).alias("published"),
        retained.alias("retained"),
        F.when(~retained, col("session")).alias("publisher_session"),
        F.when(~retained, col("client")).alias("publisher"),
        "bytes",
        F.when(retained, F.lit(1)).otherwise(col("subscribers")).alias("subscribers"),
        F.lit(True).alias("publish_logged"),
    )
    drop = isEvent("drop")
    counts = ("delivered", "redeliveries", "sends", *OUTCOME_COUNTS) + tuple(
        f"dropped_{reason}" for reason in DROP_REASONS
    )
    # The topic is a key, not a sum (a hash aggregation cannot carry text in
    # its sums): a message's events all name it.  It is a key of the join
    # too, so that the counts, already spread over the tasks by message and
    # topic, are joined where they are: joined by message alone, they were
    # moved a second time (930,000 rows at ten million lines).
    perMessage = (
        events.where(isEvent("deliver", "ack", "replace", "drop"))
        .groupBy("run", "mid", "topic")
        .agg(
            F.count_if(isFirstSend()).alias("delivered"),
            F.count_if(isRedelivery()).alias("redeliveries"),
            F.count_if(isEvent("deliver")).alias("sends"),
            F.count_if(isEvent("ack")).alias("acked"),
            F.count_if(isFired()).alias("fired"),
            F.count_if(isEvent("replace")).alias("replaced"),
            F.count_if(drop).alias("dropped"),
            *(
                F.count_if(drop & (col("reason") == reason)).alias(f"dropped_{reason}")
                for reason in DROP_REASONS
            ),
        )
    )
    joined = published.join(perMessage, ["run", "mid", "topic"], "full").fillna(
        0, subset=list(counts)
    )
    resolved = sum((col(name) for name in OUTCOME_COUNTS), F.lit(0))
    return joined.select(
        "run",
        "mid",
        "topic",
        "published",
        "retained",
        "publisher_session",
        "publisher",
        "bytes",
        "subscribers",
        *counts,
        (col("subscribers") - resolved).alias("inflight"),
        (col("bytes") * col("sends")).alias("bytes_out"),
        F.coalesce("publish_logged", F.lit(False)).alias("publish_logged"),
    )


def lossAccount(messageTable):
    """
    The loss account per topic, over the messages whose publish is logged:
    C{matched = acked + fired + replaced + dropped + inflight}.
    """
    summed = (
        "subscribers",
        "delivered",
        "redeliveries",
        *OUTCOME_COUNTS,
        *(f"dropped_{reason}" for reason in DROP_REASONS),
        "inflight",
        "bytes",
        "bytes_out",
    )
    names = {"subscribers": "matched", "bytes": "bytes_in"}
    return (
        messageTable.where(col("publish_logged"))
        .groupBy("topic")
        .agg(
            F.count(F.lit(1)).alias("messages"),
            *(_sum(name).alias(names.get(name, name)) for name in summed),
        )
    )


# Traffic per topic, from the broker's periodic summaries

TRAFFIC_SUMMARIES = ("topic_traffic", "topic_traffic_other")
# The topic of topic_traffic_other's traffic: the topics past the busiest.
OTHER_TOPICS = "(other topics)"
SUMMARIZED_MEASURES = {
    "messages_in": "publishes",
    "messages_out": "deliveries",
    "bytes_in": "bytes_in",
    "bytes_out": "bytes_out",
}


def summarizedTraffic(lines, windowSeconds):
    """
    Per window, broker and topic: messages and bytes in and out, from the
    C{topic_traffic} summaries a broker logs each C{--sys-interval}
    whether or not it logs an event per message (each summary counts in
    the window where its interval ends).  C{lines}: parsed lines or events
    (the report gives the lines that are not per-message events, where
    these summaries are).
    """
    return (
        lines.where(col("event").isin(*TRAFFIC_SUMMARIES))
        .groupBy(
            windowStart(col("t"), windowSeconds).alias("window_start"),
            brokerName().alias(BROKER),
            F.when(col("event") == "topic_traffic", col("topic"))
            .otherwise(F.lit(OTHER_TOPICS))
            .alias("topic"),
        )
        .agg(*(_sum(field).alias(name) for field, name in SUMMARIZED_MEASURES.items()))
    )


# Health


def _isTrouble():
    return isErrorReport() | isEvent("ping_missed", "client_dropped")


def errors(summary):
    """
    Refused requests per code and client session, fatal ones apart.
    Refusals counted but not logged one by one (C{protocol_errors_suppressed})
    have no session.
    """
    return (
        summary.where(isErrorReport())
        .groupBy(col("detail").alias("code"), "run", "session", "client")
        .agg(
            _sum(errorsReported(col("events"))).alias("errors"),
            _sum("fatal").alias("fatal"),
        )
    )


def health(summary):
    """
    Per window with trouble: pings missed, clients dropped for them, errors.
    """
    return (
        summary.where(_isTrouble())
        .groupBy("window_start")
        .agg(
            _sumWhere(isEvent("ping_missed")).alias("pings_missed"),
            _sumWhere(isEvent("client_dropped")).alias("clients_dropped"),
            _sum(errorsReported(col("events"))).alias("errors"),
        )
    )
