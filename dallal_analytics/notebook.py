"""
The report's questions one at a time, for a notebook or a PySpark shell::

    import dallal_analytics as da
    events = da.load(spark, ["logs/"]).cache()
    da.topics(events).orderBy("publishes", ascending=False).show()

L{load} reads and parses the logs into the events DataFrame; every other
function takes it and returns a DataFrame of its own, needing nothing else
to have run first.  The report (L{dallal_analytics.report}) answers the same
questions, sharing their intermediate results.
"""

from pyspark.sql import functions as F

from dallal_analytics import parse, questions

DEFAULT_WINDOW_SECONDS = 60


def load(spark, paths):
    """
    The events of the broker logs at C{paths} (files, globs or folders,
    rotated files included): one row per event, its C{broker}, C{run} (see
    L{questions.Runs}), C{event} name, C{t} and typed fields
    (docs/EVENTS.md).  Not cached: call C{.cache()} to ask several
    questions.
    """
    lines = parse.parseLines(parse.readLines(spark, list(paths)))
    survey = questions.lineSurvey(lines, parse.KINDS).first()
    runs = questions.Runs.find(lines, survey["brokers"], survey["starting"])
    return questions.assignRuns(lines, runs)


def _summary(events, windowSeconds):
    # Sizes joined without a broadcast: a notebook's log may be any size.
    sizes = questions.messageSizes(events, questions.BROADCAST_MESSAGES + 1)
    return questions.eventSummary(events, sizes, windowSeconds)


def sessions(events):
    """
    One row per client session (L{questions.sessions}).
    """
    summary = _summary(events, DEFAULT_WINDOW_SECONDS)
    return questions.sessions(
        questions.sessionActivity(summary),
        questions.sessionNames(summary),
        questions.Runs.ofEvents(events),
    )


def _actors(events, windowSeconds):
    sessionTransports = sessions(events).select(
        "run", "session", F.col("transport").alias("session_transport")
    )
    return questions.actorTraffic(_summary(events, windowSeconds), sessionTransports)


def traffic(events, windowSeconds=DEFAULT_WINDOW_SECONDS):
    """
    Per window, topic and transport, from the per-message events
    (L{questions.traffic}).
    """
    return questions.traffic(_actors(events, windowSeconds))


def topics(events):
    """
    Per topic over the whole log, from the per-message events
    (L{questions.topics}).
    """
    return questions.topics(_actors(events, DEFAULT_WINDOW_SECONDS))


def topicTraffic(events, windowSeconds=DEFAULT_WINDOW_SECONDS):
    """
    Per window, broker and topic, from the brokers' periodic traffic
    summaries, which every broker logs (L{questions.summarizedTraffic}).
    """
    return questions.summarizedTraffic(events, windowSeconds)


def messages(events):
    """
    The loss account of every message (L{questions.messages}).
    """
    return questions.messages(events)


def lossAccount(events):
    """
    The loss account per topic (L{questions.lossAccount}).
    """
    return questions.lossAccount(questions.messages(events))


def latency(events):
    """
    Publish-to-ack latency per topic and transport (L{questions.latency}).
    """
    sessionTransports = sessions(events).select(
        "run", "session", F.col("transport").alias("session_transport")
    )
    return questions.latency(questions.latencySketch(questions.acks(events, sessionTransports)))


def errors(events):
    """
    Refused requests per code and session (L{questions.errors}).
    """
    return questions.Runs.ofEvents(events).withBroker(
        questions.errors(_summary(events, DEFAULT_WINDOW_SECONDS))
    )


def health(events, windowSeconds=DEFAULT_WINDOW_SECONDS):
    """
    Per window with trouble: pings missed, clients dropped, errors
    (L{questions.health}).
    """
    return questions.health(_summary(events, windowSeconds))
