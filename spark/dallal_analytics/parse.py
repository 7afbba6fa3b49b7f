"""
Broker log lines to typed events, with Spark's native functions only.

The input is the text twistd writes (docs/EVENTS.md, "Format"): one entry
per line, C{<time> [<system>] <text>}, where the broker's events are the
entries of system C{dallal#<level>} whose text starts with C{event=}.
Continuation lines of multi-line entries (tracebacks) start with a tab.
Records of Twisted's JSON log observer (C{\x1e{...}}, one per line) are
read too: the broker's are those of namespace C{dallal} with a
C{dallal_event}.  Every line is classified as one of L{KINDS}; only events
carry fields.

No Python runs on executors: everything here is a Catalyst expression, so
the job needs nothing shipped to them and runs at JVM speed.
"""

from pyspark.sql import functions as F

EVENT = "event"
OTHER = "other"
CONTINUATION = "continuation"
UNPARSED = "unparsed"
KINDS = (EVENT, OTHER, CONTINUATION, UNPARSED)

# twistd's classic text format: time to the second with the UTC offset (or
# "-" for an entry without a time), the system in brackets, the text.  Only
# the start of a line is checked: the rest is cut with plain string functions,
# cheaper than more regular expressions.
TWISTD_PREFIX = r"^(?:\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(?:[+-]\d{4})?|-) \[[^\]]*\]( |$)"
TWISTD_TIME_FORMAT = "yyyy-MM-dd'T'HH:mm:ssZ"
NAMESPACE = "dallal"
EVENT_SYSTEM = f"{NAMESPACE}#"
# Twisted's jsonFileLogObserver starts each record with this.
JSON_RECORD_SEPARATOR = "\x1e"

INT_FIELDS = (
    "mid", "bytes", "session", "subscribers", "seq", "attempt", "by",
    "missed", "subscriptions", "count",
)
FLOAT_FIELDS = ("latency",)
BOOL_FIELDS = ("fatal",)
TEXT_FIELDS = ("topic", "client", "transport", "mode", "reason", "code", "address")
# Keys of every event rather than fields of some: not counters of `stats`.
ENVELOPE_KEYS = ("event", "t")

# The largest values believed: integers (a trillion messages or bytes, so
# that a sum over millions of them still fits in 64 bits), seconds since the
# epoch (the year 9999), durations (a year).
MOST_INT = 2 ** 40
MOST_TIME = 253402300799.0
MOST_SECONDS = 365 * 86400.0

# Unparsed lines keep their text, cut to this, for the report's examples.
UNPARSED_EXAMPLE_LENGTH = 200


def readLines(spark, paths):
    """
    The lines of every file under C{paths}: files, globs or directories
    (every file in them); compressed files are read by their extension.
    """
    return spark.read.text(list(paths))


def _typed(name, sqlType, highest):
    """
    A field as C{sqlType}, or null if it is not one from 0 to C{highest}:
    Spark 4 runs in ANSI mode, where one absurd value (t=1e300, bytes of
    19 digits) would make a time or a sum overflow and fail the whole job.
    """
    value = F.expr(f"try_cast(fields['{name}'] AS {sqlType})")
    return F.when(value.between(0, highest), value)


def parseLines(lines):
    """
    One row per input line: its C{kind}, and for events their typed fields.

    A field missing from an event, or whose value does not parse as its
    type, is null.  C{t} falls back on twistd's one-second time when an
    event has none.  C{stats} is the counters of a C{stats} event; C{raw}
    the text of an unparsed line.
    """
    value = F.col("value")
    isJson = value.startswith(JSON_RECORD_SEPARATOR)
    withRecords = lines.select(
        "value",
        F.when(
            isJson, F.from_json(F.substring(value, 2, 1 << 30), "map<string,string>")
        ).alias("record"),
    )

    isTwistdLine = value.rlike(TWISTD_PREFIX)
    # The system ends at the first "] ": it holds no "]".
    head = F.substring_index(value, "] ", 1)
    system = F.substring_index(head, " [", -1)
    text = F.substring(value, F.length(head) + 3, 1 << 30)
    isTextEvent = (
        isTwistdLine & system.startswith(EVENT_SYSTEM) & text.startswith("event=")
    )
    record = F.col("record")
    isJsonEvent = (record["log_namespace"] == NAMESPACE) & record["dallal_event"].isNotNull()
    isContinuation = value.startswith("\t")
    classified = withRecords.select(
        F.when(isTextEvent | isJsonEvent, F.lit(EVENT))
        .when(isTwistdLine | record.isNotNull(), F.lit(OTHER))
        .when(isContinuation, F.lit(CONTINUATION))
        .otherwise(F.lit(UNPARSED))
        .alias("kind"),
        F.when(isTextEvent, F.substring(system, len(EVENT_SYSTEM) + 1, 1 << 30))
        .when(isJsonEvent, F.get_json_object(record["log_level"], "$.name"))
        .alias("level"),
        F.when(isTextEvent, F.str_to_map(text, F.lit(" "), F.lit("=")))
        .when(
            isJsonEvent,
            # The same fields, beside Twisted's log_* keys, with the name in
            # dallal_event.
            F.map_concat(
                F.create_map(F.lit("event"), record["dallal_event"]),
                F.map_filter(
                    record,
                    lambda key, _: ~key.startswith("log_") & (key != "dallal_event"),
                ),
            ),
        )
        .alias("fields"),
        F.when(isTextEvent, F.substring_index(value, " ", 1)).alias("stamp"),
        F.when(
            ~isTwistdLine & ~isContinuation & record.isNull(),
            F.substring(value, 1, UNPARSED_EXAMPLE_LENGTH),
        ).alias("raw"),
    )
    envelope = ", ".join(f"'{key}'" for key in ENVELOPE_KEYS)
    return classified.select(
        "kind",
        "level",
        F.col("fields")["event"].alias("event"),
        F.coalesce(
            _typed("t", "DOUBLE", MOST_TIME),
            F.unix_micros(
                F.try_to_timestamp(F.col("stamp"), F.lit(TWISTD_TIME_FORMAT))
            ) / 1e6,
        ).alias("t"),
        *(_typed(name, "BIGINT", MOST_INT).alias(name) for name in INT_FIELDS),
        *(_typed(name, "DOUBLE", MOST_SECONDS).alias(name) for name in FLOAT_FIELDS),
        *(F.expr(f"try_cast(fields['{name}'] AS BOOLEAN)").alias(name) for name in BOOL_FIELDS),
        *(F.col("fields")[name].alias(name) for name in TEXT_FIELDS),
        F.when(
            F.col("fields")["event"] == "stats",
            F.expr(
                "transform_values("
                f"map_filter(fields, (k, v) -> NOT array_contains(array({envelope}), k)),"
                " (k, v) -> try_cast(v AS BIGINT))"
            ),
        ).alias("stats"),
        "raw",
    )
