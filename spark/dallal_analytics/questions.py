"""
The report's questions, each a DataFrame computed from the parsed events.

Names and meanings follow docs/EVENTS.md.  Sessions and messages are
numbered from 1 at each broker start, so they are keyed by C{(run,
session)} and C{(run, mid)}, where C{run} counts the broker's starts (see
L{assignRuns}).  Every time is a double C{t} (seconds since the epoch, as
logged) and, for people, a UTC timestamp column beside it.

Only native functions are used: nothing here needs Python on executors.
"""

from pyspark.sql import Window, functions as F

from dallal_analytics.parse import EVENT

DROP_REASONS = (
    "queue_full", "slow_consumer", "disconnected", "redelivery_limit", "superseded",
    "too_large", "bridge_refused",
)
LATENCY_QUANTILES = (0.5, 0.95, 0.99)
# percentile_approx's accuracy: the rank error is at most 1/accuracy.
LATENCY_ACCURACY = 10_000
# The latency histogram has this many logarithmic buckets per decade.
BUCKETS_PER_DECADE = 10
# Latencies are logged to the microsecond; a zero one goes in the first
# bucket instead of breaking the logarithm.
SMALLEST_LATENCY = 1e-6
UNKNOWN_TRANSPORT = "unknown"

col = F.col


def isEvent(*names):
    return col("event").isin(*names)


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


def brokerStarts(lines, listening):
    """
    The times the broker started: the first C{listening} event of each
    group that no other event separates (one start logs one per listener).
    """
    if len(listening) <= 1:
        return list(listening)
    gap = _timesAtOrBefore(listening, col("t"))
    occupied = {
        row.gap
        for row in lines.where((col("kind") == EVENT) & ~isEvent("listening"))
        .select(gap.alias("gap"))
        .distinct()
        .collect()
    }
    # Gap i holds the events after the i-th listening event.
    return [
        t for position, t in enumerate(listening, 1)
        if position == 1 or (position - 1) in occupied
    ]


def assignRuns(lines, starts):
    """
    The events, each with its C{run}: how many broker starts are at or
    before it (0 for events logged before the first start in the log).
    """
    return lines.where(col("kind") == EVENT).select(
        _timesAtOrBefore(starts, col("t")).alias("run"),
        timestamp(col("t")).alias("at"),
        "*",
    ).drop("kind", "raw")


def lineSurvey(lines, kinds):
    """
    One row: how many lines in all and of each kind, and the sorted times
    of the C{listening} events (a broker logs one per listener at each
    start, so they are few).
    """
    return lines.agg(
        F.count(F.lit(1)).alias("lines"),
        *(F.count_if(col("kind") == kind).alias(kind) for kind in kinds),
        F.sort_array(
            F.collect_list(F.when((col("kind") == EVENT) & isEvent("listening"), col("t")))
        ).alias("listening"),
    )


# Sessions

def sessions(events, lastRun):
    """
    One row per client session: who, over what, from when to when, why it
    ended (null: still connected when the log ends), and what it did.

    C{closed_t} is when it stopped counting as connected: its disconnect,
    or for a run followed by another start, the run's last session event
    (the broker stopped without logging the disconnect).
    """
    perSession = (
        events.where(col("session").isNotNull() & (col("session") > 0))
        .groupBy("run", "session")
        .agg(
            F.any_value(col("client"), ignoreNulls=True).alias("client"),
            F.any_value(col("transport"), ignoreNulls=True).alias("transport"),
            F.min("t").alias("first_t"),
            F.max("t").alias("last_t"),
            F.max(F.when(isEvent("disconnect"), col("t"))).alias("disconnect_t"),
            F.max(F.when(isEvent("disconnect"), col("reason"))).alias("end_reason"),
            F.count_if(isEvent("subscribe")).alias("subscribes"),
            F.count_if(isEvent("ping_missed")).alias("pings_missed"),
            (F.count_if(isEvent("client_dropped")) > 0).alias("dropped_for_pings"),
            F.count_if(isEvent("publish")).alias("publishes"),
            F.count_if(isFirstSend()).alias("deliveries"),
            F.count_if(isEvent("ack")).alias("acks"),
            F.count_if(isEvent("protocol_error")).alias("errors"),
        )
    )
    runEnd = F.max("last_t").over(Window.partitionBy("run"))
    return perSession.select(
        "run",
        "session",
        "client",
        F.coalesce(col("transport"), F.lit(UNKNOWN_TRANSPORT)).alias("transport"),
        timestamp(col("first_t")).alias("first_seen"),
        timestamp(col("last_t")).alias("last_seen"),
        (col("last_t") - col("first_t")).alias("duration"),
        "end_reason",
        "subscribes",
        "pings_missed",
        "dropped_for_pings",
        "publishes",
        "deliveries",
        "acks",
        "errors",
        "first_t",
        F.coalesce(
            col("disconnect_t"), F.when(col("run") < lastRun, runEnd)
        ).alias("closed_t"),
    )


def connections(sessionTable):
    """
    Concurrent connections after each change: +1 when a session is first
    seen, -1 when it closes.  Runs are counted apart (a restart starts from
    zero); at equal times closes come first, so peaks are not inflated.
    """
    changes = sessionTable.select(
        "run", col("first_t").alias("t"), F.lit(1).alias("change")
    ).unionByName(
        sessionTable.where(col("closed_t").isNotNull()).select(
            "run", col("closed_t").alias("t"), F.lit(-1).alias("change")
        )
    )
    running = (
        Window.partitionBy("run")
        .orderBy("t", "change")
        .rowsBetween(Window.unboundedPreceding, Window.currentRow)
    )
    return changes.select(
        "run",
        timestamp(col("t")).alias("at"),
        "t",
        "change",
        F.sum("change").over(running).alias("connections"),
    )


def connectionsByWindow(connectionTable, windowSeconds):
    """
    Per window with a change: the peak (counting the level it started
    with) and the level at its end.
    """
    return (
        connectionTable.groupBy(windowStart(col("t"), windowSeconds).alias("window_start"))
        .agg(
            F.max(F.greatest("connections", col("connections") - col("change"))).alias("peak"),
            F.max_by("connections", F.struct("t", "change")).alias("at_end"),
            F.count_if(col("change") > 0).alias("connects"),
            F.count_if(col("change") < 0).alias("disconnects"),
        )
    )


# Traffic

def messageActivity(events, sessionTransports):
    """
    Publishes and sends, one row each: the message's topic and size, the
    acting session (the publisher, or the subscriber sent to) and its
    transport.  A session without a number (older logs) is known by its
    address.
    """
    sizes = events.where(isStory()).select(
        "run", "mid", col("bytes").alias("message_bytes")
    )
    sends = events.where(isEvent("deliver")).join(sizes, ["run", "mid"], "left")
    publishes = events.where(isEvent("publish")).withColumn(
        "message_bytes", col("bytes")
    )
    activity = publishes.unionByName(sends).join(
        sessionTransports, ["run", "session"], "left"
    )
    return activity.select(
        "run",
        "t",
        "event",
        "topic",
        F.coalesce("transport", "session_transport", F.lit(UNKNOWN_TRANSPORT)).alias(
            "transport"
        ),
        F.when(
            col("session").isNotNull(),
            F.concat_ws("/", col("run").cast("string"), col("session").cast("string")),
        )
        .otherwise(col("client"))
        .alias("actor"),
        "message_bytes",
        isFirstSend().alias("first_send"),
        isRedelivery().alias("redelivery"),
    )


def _trafficMeasures():
    publish = isEvent("publish")
    send = isEvent("deliver")
    return (
        F.count_if(publish).alias("publishes"),
        F.count_if(col("first_send")).alias("deliveries"),
        F.count_if(col("redelivery")).alias("redeliveries"),
        F.coalesce(F.sum(F.when(publish, col("message_bytes"))), F.lit(0)).alias("bytes_in"),
        F.coalesce(F.sum(F.when(send, col("message_bytes"))), F.lit(0)).alias("bytes_out"),
        F.count_distinct(F.when(publish, col("actor"))).alias("publishers"),
        F.count_distinct(F.when(send, col("actor"))).alias("subscribers"),
    )


def traffic(activity, windowSeconds):
    """
    Per window, topic and transport: publishes, first sends, redeliveries,
    payload bytes in and out (redeliveries included, like the broker's
    C{bytes_out}), distinct publishing and receiving sessions.
    """
    return activity.groupBy(
        windowStart(col("t"), windowSeconds).alias("window_start"), "topic", "transport"
    ).agg(*_trafficMeasures())


def topics(activity):
    """
    The same measures per topic over the whole log, busiest first.
    """
    return activity.groupBy("topic").agg(*_trafficMeasures())


def publishers(events, sessionTransports):
    """
    Per publishing session: how much it published, on how many topics.
    """
    return (
        events.where(isEvent("publish"))
        .join(sessionTransports, ["run", "session"], "left")
        .groupBy("run", "session", "client")
        .agg(
            F.coalesce(
                F.any_value("transport", ignoreNulls=True),
                F.any_value("session_transport", ignoreNulls=True),
                F.lit(UNKNOWN_TRANSPORT),
            ).alias("transport"),
            F.count(F.lit(1)).alias("publishes"),
            F.sum("bytes").alias("bytes"),
            F.count_distinct("topic").alias("topics"),
        )
    )


# Delivery

def _latencyMeasures():
    return (
        F.count(F.lit(1)).alias("acks"),
        F.percentile_approx("latency", list(LATENCY_QUANTILES), LATENCY_ACCURACY).alias(
            "quantiles"
        ),
        F.avg("latency").alias("mean"),
        F.max("latency").alias("max"),
    )


def _withQuantiles(frame):
    return frame.select(
        *(name for name in frame.columns if name != "quantiles"),
        *(
            col("quantiles")[index].alias(f"p{round(quantile * 100)}")
            for index, quantile in enumerate(LATENCY_QUANTILES)
        ),
    )


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


def latency(ackFrame):
    """
    Publish-to-ack latency per topic and transport: count, p50, p95, p99
    (approximate: rank error under 1/10000), mean and max, in seconds.
    """
    return _withQuantiles(ackFrame.groupBy("topic", "transport").agg(*_latencyMeasures()))


def overallLatency(ackFrame):
    return _withQuantiles(ackFrame.agg(*_latencyMeasures()))


def latencyHistogram(ackFrame):
    """
    Acks per logarithmic latency bucket: C{[lower, upper)} seconds.
    """
    bucket = F.floor(
        F.log10(F.greatest("latency", F.lit(SMALLEST_LATENCY))) * BUCKETS_PER_DECADE
    )
    return (
        ackFrame.groupBy(bucket.alias("bucket"))
        .agg(F.count(F.lit(1)).alias("acks"))
        .select(
            "bucket",
            F.pow(F.lit(10.0), col("bucket") / BUCKETS_PER_DECADE).alias("lower"),
            F.pow(F.lit(10.0), (col("bucket") + 1) / BUCKETS_PER_DECADE).alias("upper"),
            "acks",
        )
    )


def deliveries(events):
    """
    One row per (message, subscriber) the log knows of: sends, and how the
    story ended: C{acked}, C{fired} (sent in C{fire} mode: final),
    C{replaced}, C{dropped} (with its reason) or C{inflight}.
    """
    outcomes = ("ack", "replace", "drop")
    pairs = (
        events.where(
            isEvent("deliver", *outcomes) & col("session").isNotNull()
        )
        .groupBy("run", "mid", "session")
        .agg(
            F.any_value("topic", ignoreNulls=True).alias("topic"),
            F.min(F.when(isEvent("deliver"), col("t"))).alias("first_sent_t"),
            F.max(F.when(isEvent("deliver"), col("mode"))).alias("mode"),
            F.count_if(isFirstSend()).alias("first_sends"),
            F.count_if(isRedelivery()).alias("redeliveries"),
            F.count_if(isEvent("deliver")).alias("sends"),
            F.count_if(isFired()).alias("fired"),
            F.count_if(isEvent("ack")).alias("acks"),
            F.count_if(isEvent("replace")).alias("replaces"),
            F.count_if(isEvent("drop")).alias("drops"),
            F.max(F.when(isEvent("ack"), col("latency"))).alias("latency"),
            F.max(F.when(isEvent("replace"), col("by"))).alias("replaced_by"),
            F.max(F.when(isEvent("drop"), col("reason"))).alias("drop_reason"),
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
        "mode",
        timestamp(col("first_sent_t")).alias("first_sent"),
        "first_sends",
        "redeliveries",
        "sends",
        outcome.alias("outcome"),
        F.when(outcome == "dropped", col("drop_reason")).alias("drop_reason"),
        "replaced_by",
        "latency",
    )


OUTCOME_COUNTS = ("acked", "fired", "replaced", "dropped")


def messages(events, deliveryTable):
    """
    The loss account per published message: of its C{subscribers} (the
    sessions it matched), how many were acked, fired, replaced or dropped
    (and why); the rest were in flight when the log ends.  A C{retained}
    offer is a message of its own with one subscriber and no publisher.

    Stories whose C{publish} is not in the log (it was in a file rotated
    away) have C{publish_logged} false and no account.
    """
    retained = isEvent("retained")
    published = events.where(isStory()).select(
        "run",
        "mid",
        col("topic").alias("published_topic"),
        col("at").alias("published"),
        retained.alias("retained"),
        F.when(~retained, col("session")).alias("publisher_session"),
        F.when(~retained, col("client")).alias("publisher"),
        "bytes",
        F.when(retained, F.lit(1)).otherwise(col("subscribers")).alias("subscribers"),
        F.lit(True).alias("publish_logged"),
    )
    outcome = col("outcome")
    perMessage = deliveryTable.groupBy("run", "mid").agg(
        F.any_value("topic", ignoreNulls=True).alias("story_topic"),
        F.sum("first_sends").alias("delivered"),
        F.sum("redeliveries").alias("redeliveries"),
        F.sum("sends").alias("sends"),
        *(F.count_if(outcome == name).alias(name) for name in OUTCOME_COUNTS),
        *(
            F.count_if(col("drop_reason") == reason).alias(f"dropped_{reason}")
            for reason in DROP_REASONS
        ),
    )
    counts = ("delivered", "redeliveries", "sends", *OUTCOME_COUNTS) + tuple(
        f"dropped_{reason}" for reason in DROP_REASONS
    )
    joined = published.join(perMessage, ["run", "mid"], "full").fillna(0, subset=list(counts))
    resolved = sum((col(name) for name in OUTCOME_COUNTS), F.lit(0))
    return joined.select(
        "run",
        "mid",
        F.coalesce("published_topic", "story_topic").alias("topic"),
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
        "subscribers", "delivered", "redeliveries", *OUTCOME_COUNTS,
        *(f"dropped_{reason}" for reason in DROP_REASONS), "inflight", "bytes", "bytes_out",
    )
    names = {"subscribers": "matched", "bytes": "bytes_in"}
    return (
        messageTable.where(col("publish_logged"))
        .groupBy("topic")
        .agg(
            F.count(F.lit(1)).alias("messages"),
            *(
                F.coalesce(F.sum(name), F.lit(0)).alias(names.get(name, name))
                for name in summed
            ),
        )
    )


# Health

def errors(events):
    """
    Refused requests per code and client session, fatal ones apart.
    """
    return (
        events.where(isEvent("protocol_error"))
        .groupBy("code", "run", "session", "client")
        .agg(
            F.count(F.lit(1)).alias("errors"),
            F.count_if(col("fatal")).alias("fatal"),
        )
    )


def refusalCount():
    """
    Refused requests, as the broker's C{errors} counter counts them: one per
    C{protocol_error}, plus those a C{protocol_errors_suppressed} reports
    (refusals of datagrams that named no session, beyond those logged).
    """
    return F.count_if(isEvent("protocol_error")) + F.coalesce(
        F.sum(F.when(isEvent("protocol_errors_suppressed"), col("count"))), F.lit(0)
    )


def health(events, windowSeconds):
    """
    Per window with trouble: pings missed, clients dropped for them, errors.
    """
    return (
        events.where(
            isEvent("ping_missed", "client_dropped", "protocol_error", "protocol_errors_suppressed")
        )
        .groupBy(windowStart(col("t"), windowSeconds).alias("window_start"))
        .agg(
            F.count_if(isEvent("ping_missed")).alias("pings_missed"),
            F.count_if(isEvent("client_dropped")).alias("clients_dropped"),
            refusalCount().alias("errors"),
        )
    )


# Runs

# Each broker counter (the `stats` event) and the column of `runs` that
# the log's events give for it.
COUNTERS_FROM_EVENTS = {
    "connections_total": "sessions",
    "published": "publishes",
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


def runs(events, messageTable, connectionTable):
    """
    Per broker start: when, where it listened, how long it ran, the totals
    of its events (named as in L{COUNTERS_FROM_EVENTS}), its peak of
    concurrent connections, and the counters of its last C{stats} event
    (null if it logged none).
    """
    isStats = isEvent("stats")
    perRun = events.groupBy("run").agg(
        timestamp(F.min(F.when(isEvent("listening"), col("t")))).alias("started"),
        F.sort_array(F.collect_set(F.when(isEvent("listening"), col("address")))).alias(
            "addresses"
        ),
        timestamp(F.min("t")).alias("first_event"),
        timestamp(F.max("t")).alias("last_event"),
        F.count(F.lit(1)).alias("events"),
        F.count_if(isEvent("connect")).alias("sessions"),
        F.count_if(isEvent("publish")).alias("publishes"),
        F.count_if(isEvent("retained")).alias("retained"),
        (
            F.coalesce(F.sum(F.when(isEvent("publish"), col("subscribers"))), F.lit(0))
            + F.count_if(isEvent("retained"))
        ).alias("matched"),
        F.count_if(isFirstSend()).alias("deliveries"),
        F.count_if(isFired()).alias("fired"),
        F.count_if(isRedelivery()).alias("redeliveries"),
        F.count_if(isEvent("ack")).alias("acked"),
        F.count_if(isEvent("replace")).alias("replaced"),
        F.count_if(isEvent("drop")).alias("dropped"),
        *(
            F.count_if(isEvent("drop") & (col("reason") == reason)).alias(f"dropped_{reason}")
            for reason in DROP_REASONS
        ),
        F.coalesce(F.sum(F.when(isEvent("publish"), col("bytes"))), F.lit(0)).alias("bytes_in"),
        refusalCount().alias("errors"),
        F.count_if(isEvent("ping_missed")).alias("pings_missed"),
        F.count_if(isEvent("client_dropped")).alias("clients_dropped"),
        F.max_by(F.when(isStats, col("stats")), F.when(isStats, col("t"))).alias("counters"),
    )
    perRunMessages = messageTable.groupBy("run").agg(
        F.coalesce(F.sum("bytes_out"), F.lit(0)).alias("bytes_out"),
        F.count_if(~col("publish_logged")).alias("messages_without_publish"),
    )
    perRunConnections = connectionTable.groupBy("run").agg(
        F.max("connections").alias("peak_connections"),
        # The first time the peak was reached.
        F.max_by("at", F.struct(col("connections"), -col("t"))).alias("peak_at"),
    )
    return (
        perRun.join(perRunMessages, "run", "left")
        .join(perRunConnections, "run", "left")
        .fillna(0, subset=["bytes_out", "messages_without_publish", "peak_connections"])
    )
