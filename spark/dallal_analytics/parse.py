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
    "missed", "subscriptions", "count", "hops",
)
FLOAT_FIELDS = ("latency",)
BOOL_FIELDS = ("fatal", "bridge")
TEXT_FIELDS = ("topic", "client", "transport", "mode", "reason", "code", "address")
FIELD_TYPES = {
    **{name: "BIGINT" for name in INT_FIELDS},
    **{name: "DOUBLE" for name in FLOAT_FIELDS},
    **{name: "BOOLEAN" for name in BOOL_FIELDS},
    **{name: "STRING" for name in TEXT_FIELDS},
}
# Keys of every event rather than fields of some: not counters of `stats`.
ENVELOPE_KEYS = ("event", "t")

# The largest values believed: integers (a trillion messages or bytes, so
# that a sum over millions of them still fits in 64 bits), seconds since the
# epoch (the year 9999), durations (a year).
MOST_INT = 2 ** 40
MOST_TIME = 253402300799.0
MOST_SECONDS = 365 * 86400.0

# The fields of the per-message events in the order the broker logs them
# (docs/EVENTS.md): nearly every line of a busy broker's log is one of
# these.
MESSAGE_EVENT_FIELDS = {
    "publish": (
        "mid", "topic", "bytes", "session", "client", "transport", "subscribers", "origin",
        "hops",
    ),
    "retained": ("mid", "topic", "bytes", "session", "client"),
    "deliver": ("mid", "topic", "session", "client", "mode", "seq", "attempt"),
    "ack": ("mid", "topic", "session", "latency"),
    "replace": ("mid", "topic", "session", "by"),
    "drop": ("mid", "topic", "session", "reason"),
}

# Unparsed lines keep their text, cut to this, for the report's examples.
UNPARSED_EXAMPLE_LENGTH = 200


def readLines(spark, paths):
    """
    The lines of every file under C{paths}: files, globs or directories
    (every file in them); compressed files are read by their extension.
    """
    return spark.read.text(list(paths))


# A text event's line split on its spaces: twistd's time, [system], then
# event=<name> and the fields.
TIME_PART, SYSTEM_PART, EVENT_PART = 0, 1, 2
TWISTD_TIME = r"^(?:\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(?:[+-]\d{4})?|-)$"


def _fieldValue(name):
    """
    A field's text: by position in a per-message event laid out as
    documented (C{layout} is its position in L{MESSAGE_EVENT_FIELDS}, from
    1), else from the C{fields} map (see L{parseLines}).  Values hold no
    C{=}: a field's is what follows its last one.
    """
    position = None
    for layout, names in enumerate(MESSAGE_EVENT_FIELDS.values(), 1):
        if name in names:
            index = F.lit(EVENT_PART + 1 + names.index(name))
            condition = F.col("layout") == layout
            position = F.when(condition, index) if position is None else (
                position.when(condition, index)
            )
    if name == "t":
        position = F.size("parts") - 1
    if position is None:
        return F.col("fields")[name]
    return F.when(
        F.col("laid_out"), F.substring_index(F.get(F.col("parts"), position), "=", -1)
    ).otherwise(F.col("fields")[name])


def _laidOut(parts, layout):
    """
    Whether a text event's space-separated fields are exactly those of its
    C{layout} in L{MESSAGE_EVENT_FIELDS}, in order, then C{t}.
    """
    check = F.lit(False)
    for code, names in enumerate(MESSAGE_EVENT_FIELDS.values(), 1):
        expected = (*names, "t")
        laidOut = F.size(parts) == EVENT_PART + 1 + len(expected)
        for index, field in enumerate(expected, EVENT_PART + 1):
            laidOut = laidOut & F.get(parts, index).startswith(f"{field}=")
        check = F.when(layout == code, laidOut).otherwise(check)
    return check


def _believed(name, highest):
    """
    A typed field, or null if it is not from 0 to C{highest}: Spark 4 runs
    in ANSI mode, where one absurd value (t=1e300, bytes of 19 digits)
    would make a time or a sum overflow and fail the whole job.
    """
    value = F.col(name)
    return F.when(value.between(0, highest), value)


def parseLines(lines):
    """
    One row per input line: its C{kind}, and for events their typed fields.

    A field missing from an event, or whose value does not parse as its
    type, is null.  C{t} falls back on twistd's one-second time when an
    event has none.  C{stats} is the counters of a C{stats} event; C{raw}
    the text of an unparsed line.

    Each line is split on its spaces once.  A per-message event laid out as
    EVENTS.md documents it (the fields of L{MESSAGE_EVENT_FIELDS} in order,
    then C{t}: nearly every line of a busy broker) is read by position;
    any other event (an unknown field, a repeated one, an unknown event)
    goes through C{str_to_map}, dearer, so that the last of a repeated key
    wins and unknown keys are ignored.  Character positions are avoided:
    Spark finds them by walking the string.
    """
    value = F.col("value")
    parts = F.split(value, " ")
    system = F.get(parts, SYSTEM_PART)
    eventPart = F.get(parts, EVENT_PART)
    isJson = value.startswith(JSON_RECORD_SEPARATOR)
    split = lines.select(
        "value",
        parts.alias("parts"),
        (
            system.startswith(f"[{EVENT_SYSTEM}") & system.endswith("]")
            & eventPart.startswith("event=")
            & F.get(parts, TIME_PART).rlike(TWISTD_TIME)
        ).alias("text_event"),
        F.when(
            isJson, F.from_json(F.substring(value, 2, 1 << 30), "map<string,string>")
        ).alias("record"),
    )

    parts = F.col("parts")
    system = F.get(parts, SYSTEM_PART)
    isTextEvent = F.col("text_event")
    record = F.col("record")
    isJsonEvent = (record["log_namespace"] == NAMESPACE) & record["dallal_event"].isNotNull()
    isTwistdLine = value.rlike(TWISTD_PREFIX)
    isContinuation = value.startswith("\t")
    name = F.substring_index(F.get(parts, EVENT_PART), "=", -1)
    layout = F.array_position(F.array(*map(F.lit, MESSAGE_EVENT_FIELDS)), name)
    classified = split.select(
        F.when(isTextEvent | isJsonEvent, F.lit(EVENT))
        .when(isTwistdLine | record.isNotNull(), F.lit(OTHER))
        .when(isContinuation, F.lit(CONTINUATION))
        .otherwise(F.lit(UNPARSED))
        .alias("kind"),
        F.when(isTextEvent, F.rtrim(F.substring_index(system, "#", -1), F.lit("]")))
        .when(isJsonEvent, F.get_json_object(record["log_level"], "$.name"))
        .alias("level"),
        F.when(isTextEvent, parts).alias("parts"),
        F.when(isTextEvent, name).when(isJsonEvent, record["dallal_event"]).alias("event"),
        F.when(isTextEvent, layout).alias("layout"),
        F.when(isTextEvent, F.get(parts, TIME_PART)).alias("stamp"),
        F.when(isJsonEvent, record).alias("record"),
        # Events are most lines: they skip the regular expression.
        F.when(
            ~isTextEvent & ~isTwistdLine & ~isContinuation & record.isNull(),
            F.substring(value, 1, UNPARSED_EXAMPLE_LENGTH),
        ).alias("raw"),
    )

    laidOut = classified.select(
        "*", F.coalesce(_laidOut(F.col("parts"), F.col("layout")), F.lit(False)).alias("laid_out"),
    )
    withFields = laidOut.select(
        "*",
        F.when(F.col("record").isNotNull(), F.col("record"))
        .when(
            ~F.col("laid_out"),
            # The text from event= on.
            F.str_to_map(
                F.array_join(F.slice("parts", EVENT_PART + 1, 1 << 30), " "),
                F.lit(" "), F.lit("="),
            ),
        )
        .alias("fields"),
    )
    event = F.col("event")
    # The counters of a stats event: its fields but the event's own keys
    # (and in a JSON record, Twisted's).
    envelope = ", ".join(f"'{key}'" for key in ENVELOPE_KEYS)
    counters = F.expr(
        "transform_values(map_filter(fields, (k, v) -> NOT array_contains("
        f"array({envelope}, 'dallal_event'), k) AND NOT startswith(k, 'log_')),"
        " (k, v) -> try_cast(v AS BIGINT))"
    )
    # Each field's text is found once, cast once, then checked: a column
    # referenced more than once stays a column of its own (Spark does not
    # inline a cast into each use), where F.when(x.between(...), x) written
    # in one go would find and cast x up to three times.
    texts = withFields.select(
        "kind", "level", "event", "stamp", "raw",
        F.when(event == "stats", counters).alias("stats"),
        *(_fieldValue(name).alias(name) for name in ("t", *FIELD_TYPES)),
    )
    typed = texts.select(
        "kind", "level", "event", "stamp", "raw", "stats",
        *(F.col(name).try_cast(sqlType).alias(name)
          for name, sqlType in (("t", "DOUBLE"), *FIELD_TYPES.items())),
    )
    return typed.select(
        "kind",
        "level",
        "event",
        F.coalesce(
            _believed("t", MOST_TIME),
            F.unix_micros(
                F.try_to_timestamp(F.col("stamp"), F.lit(TWISTD_TIME_FORMAT))
            ) / 1e6,
        ).alias("t"),
        *(_believed(name, MOST_INT).alias(name) for name in INT_FIELDS),
        *(_believed(name, MOST_SECONDS).alias(name) for name in FLOAT_FIELDS),
        *BOOL_FIELDS,
        *TEXT_FIELDS,
        "stats",
        "raw",
    )
