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
    "mid",
    "bytes",
    "session",
    "subscribers",
    "seq",
    "attempt",
    "by",
    "missed",
    "subscriptions",
    "count",
    "hops",
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
MOST_INT = 2**40
MOST_TIME = 253402300799.0
MOST_SECONDS = 365 * 86400.0

# The fields of the per-message events in the order the broker logs them
# (docs/EVENTS.md): nearly every line of a busy broker's log is one of
# these.
MESSAGE_EVENT_FIELDS = {
    "publish": (
        "mid",
        "topic",
        "bytes",
        "session",
        "client",
        "transport",
        "subscribers",
        "origin",
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
# The per-message events' fields, each once, in the order of the catalogue.
MESSAGE_FIELDS = tuple(
    dict.fromkeys(
        name for names in MESSAGE_EVENT_FIELDS.values() for name in names if name in FIELD_TYPES
    )
)
# The column of splitLines that holds every other line's text.
OTHER_LINE = "line"

# Fields of the per-message events that no event holds two of, each group
# kept in one column of splitLines (and of the report's cache, see
# docs/ANALYTICS.md): a column per field was null on most rows, and each
# column costs the cache a null mark per row it does not hold.  Packed,
# parsing ten million lines into the cache took about a tenth less time
# (alternated in one JVM), the cache 934 MB instead of 1,095.
PACKED_FIELDS = {
    "amount": ("bytes", "attempt", "by"),
    "label": ("transport", "mode", "reason"),
}
_PACKED_COLUMN = {name: packed for packed, names in PACKED_FIELDS.items() for name in names}
# The fields of splitLines' rows by column: a field's own, or the packed
# column it shares.
SPLIT_COLUMNS = {
    column: [field for field in MESSAGE_FIELDS if _PACKED_COLUMN.get(field, field) == column]
    for column in dict.fromkeys(_PACKED_COLUMN.get(field, field) for field in MESSAGE_FIELDS)
}


def _isEventText(parts):
    """
    Whether a line split on its spaces is an event of the broker's
    namespace: C{[dallal#<level>]}, then C{event=<name>}.  (Its time is
    checked apart: cheaply by L{splitLines}, in full by L{parseOtherLines}.)
    """
    system = F.get(parts, SYSTEM_PART)
    return (
        system.startswith(f"[{EVENT_SYSTEM}")
        & system.endswith("]")
        & F.get(parts, EVENT_PART).startswith("event=")
    )


# What a coded text (L{nameCode}) not among the names coded is named back.
CODED_OTHER = "other"


def nameCode(column, names):
    """
    A text column as its position in C{names} (from 1), 0 for a name not in
    them: a number, cheaper to compare, cache and aggregate than text (an
    aggregation keeps it in a hash table).
    """
    return F.array_position(F.array(*map(F.lit, names)), column)


def codeName(code, names):
    """
    The inverse of L{nameCode}: L{CODED_OTHER} for 0.
    """
    return F.when(code > 0, F.element_at(F.array(*map(F.lit, names)), code.cast("int"))).when(
        code == 0, F.lit(CODED_OTHER)
    )


# The per-message events, numbered by nameCode: a laid-out line's event is
# compared by name once (comparing the names for every field took a fifth
# of the parse's time, see docs/ANALYTICS.md), and what depends on it
# compares the number.  The log's cache keeps the number (EVENT_NUMBER),
# cheaper to cache and to compare than text.
MESSAGE_EVENTS = tuple(MESSAGE_EVENT_FIELDS)
EVENT_NUMBER = "event_number"


def eventNumberOf(name):
    """
    The number L{splitLines} gives the per-message event C{name}.
    """
    return MESSAGE_EVENTS.index(name) + 1


def _laidOut(parts, number):
    """
    Whether a text event's space-separated fields are exactly those of the
    per-message event numbered C{number} (L{MESSAGE_EVENTS}), in order, then
    C{t}.
    """
    check = F.lit(False)
    for position, names in reversed(list(enumerate(MESSAGE_EVENT_FIELDS.values(), 1))):
        expected = (*names, "t")
        laidOut = F.size(parts) == EVENT_PART + 1 + len(expected)
        for index, field in enumerate(expected, EVENT_PART + 1):
            laidOut = laidOut & F.get(parts, index).startswith(f"{field}=")
        check = F.when(number == position, laidOut).otherwise(check)
    return check


def _valueAfterKey(part, key):
    """
    What follows C{key=} at the start of C{part}, cut as bytes: Spark cuts
    a string by characters, walking it to find where they start, and the
    key is ASCII, so its length in bytes is its length in characters (the
    parse of three million lines took 12% less CPU time).
    """
    return F.substring(part.cast("binary"), len(key) + 2, 1 << 30).cast("string")


def _positionalValue(parts, number, field):
    """
    The text of C{field} in a laid-out per-message event numbered
    C{number}: what follows its C{field=}, at its position in
    L{MESSAGE_EVENT_FIELDS}.  Events that hold it at the same place share
    one branch; a field every event holds at one place needs none.
    """
    places = {}
    for position, names in enumerate(MESSAGE_EVENT_FIELDS.values(), 1):
        if field in names:
            places.setdefault(names.index(field), []).append(position)
    value = None
    for place, numbers in places.items():
        text = _valueAfterKey(F.get(parts, EVENT_PART + 1 + place), field)
        if len(numbers) == len(MESSAGE_EVENT_FIELDS):
            return text
        held = number.isin(*numbers)
        value = F.when(held, text) if value is None else value.when(held, text)
    return value


def _believed(name, highest):
    """
    A typed field, or null if it is not from 0 to C{highest}: Spark 4 runs
    in ANSI mode, where one absurd value (t=1e300, bytes of 19 digits)
    would make a time or a sum overflow and fail the whole job.
    """
    value = F.col(name)
    return F.when(value.between(0, highest), value)


def _eventTime():
    """
    An event's C{t}, or twistd's one-second time (C{stamp}) when its own is
    missing, malformed or absurd.
    """
    return F.coalesce(
        _believed("t", MOST_TIME),
        F.unix_micros(F.try_to_timestamp(F.col("stamp"), F.lit(TWISTD_TIME_FORMAT))) / 1e6,
    )


def _believedField(name, column=None):
    """
    The typed field C{name} (in C{column}, by default its own), checked.
    """
    column = column or name
    if name in INT_FIELDS:
        return _believed(column, MOST_INT)
    if name in FLOAT_FIELDS:
        return _believed(column, MOST_SECONDS)
    return F.col(column)


def _holders(field):
    """
    The L{EVENT_NUMBER}s of the per-message events that hold C{field}.
    """
    return [
        position
        for position, names in enumerate(MESSAGE_EVENT_FIELDS.values(), 1)
        if field in names
    ]


def splitLines(lines):
    """
    Each line split on its spaces once.  A per-message event laid out as
    EVENTS.md documents it (the fields of L{MESSAGE_EVENT_FIELDS} in order,
    then C{t}: nearly every line of a busy broker) gets its
    L{EVENT_NUMBER}, C{level}, C{t} and L{MESSAGE_FIELDS}, typed, read by
    position (those of L{PACKED_FIELDS} in their shared column), and a null
    L{OTHER_LINE}; any other line keeps its text there, for
    L{parseOtherLines}.

    This is the work done on every line of the log, so it does as little
    as it can: no regular expression (the time's shape is checked by its
    length and its C{T}; a line that fails goes the other way, which checks
    it in full), no maps, and field values cut at the known length of their
    key.
    """
    value = F.col("value")
    parts = F.split(value, " ")
    split = lines.select("value", parts.alias("parts"))
    parts = F.col("parts")
    system = F.get(parts, SYSTEM_PART)
    eventPart = F.get(parts, EVENT_PART)
    time = F.get(parts, TIME_PART)
    name = F.substring_index(eventPart, "=", -1)
    named = split.select(
        "value", "parts", name.alias("name"), nameCode(name, MESSAGE_EVENTS).alias("number")
    )
    name = F.col("name")
    number = F.col("number")
    laidOut = F.coalesce(
        _isEventText(parts)
        & (F.length(time) == len("2026-11-21T20:28:19+0000"))
        & (F.substring(time, 11, 1) == "T")
        & _laidOut(parts, number),
        F.lit(False),
    )
    # Computed once, as a column of its own: written into each field's
    # expression, the check made the plan many times larger.
    checked = named.select("value", "parts", "name", "number", laidOut.alias("laid_out"))
    laidOut = F.col("laid_out")
    texts = checked.select(
        F.when(~laidOut, value).alias(OTHER_LINE),
        F.when(laidOut, number).alias(EVENT_NUMBER),
        F.when(laidOut, F.rtrim(F.substring_index(system, "#", -1), F.lit("]"))).alias("level"),
        F.when(laidOut, _valueAfterKey(F.element_at(parts, -1), "t")).alias("t"),
        F.when(laidOut, time).alias("stamp"),
        # A packed column holds whichever of its fields the line's event
        # holds: the others are null.
        *(
            F.when(
                laidOut, F.coalesce(*(_positionalValue(parts, number, field) for field in fields))
            ).alias(column)
            for column, fields in SPLIT_COLUMNS.items()
        ),
    )
    # Cast once, then checked (see parseOtherLines).  The fields packed in
    # one column have one type and one range.
    typed = texts.select(
        OTHER_LINE,
        EVENT_NUMBER,
        "level",
        "stamp",
        F.col("t").try_cast("DOUBLE").alias("t"),
        *(
            F.col(column).try_cast(FIELD_TYPES[fields[0]]).alias(column)
            for column, fields in SPLIT_COLUMNS.items()
        ),
    )
    return typed.select(
        OTHER_LINE,
        EVENT_NUMBER,
        "level",
        _eventTime().alias("t"),
        *(
            _believedField(fields[0], column).alias(column)
            for column, fields in SPLIT_COLUMNS.items()
        ),
    )


def _allColumns(columns):
    """
    L{parseLines}' columns, from C{columns} (name -> column) or null.
    """
    types = {"t": "DOUBLE", EVENT_NUMBER: "INT", **FIELD_TYPES, "stats": "map<string,bigint>"}
    return [
        (columns[name] if name in columns else F.lit(None).cast(types.get(name, "STRING"))).alias(
            name
        )
        for name in (
            "kind",
            "level",
            "event",
            EVENT_NUMBER,
            "t",
            *INT_FIELDS,
            *FLOAT_FIELDS,
            *BOOL_FIELDS,
            *TEXT_FIELDS,
            "stats",
            "raw",
        )
    ]


def messageEvents(split):
    """
    The laid-out per-message events of L{splitLines}, as L{parseLines}
    rows, each packed field in a column of its own again (null in the
    columns C{split} lacks: the report caches only those it reads).
    """
    columns = {name: F.col(name) for name in ("level", "t") if name in split.columns}
    for column, fields in SPLIT_COLUMNS.items():
        if column not in split.columns:
            continue
        if len(fields) == 1:
            columns[column] = F.col(column)
            continue
        # Each field of a packed column, on the rows of the events that
        # hold it.
        for field in fields:
            columns[field] = F.when(F.col(EVENT_NUMBER).isin(*_holders(field)), F.col(column))
    return split.where(F.col(OTHER_LINE).isNull()).select(
        *_allColumns(
            {
                "kind": F.lit(EVENT),
                "event": codeName(F.col(EVENT_NUMBER), MESSAGE_EVENTS),
                EVENT_NUMBER: F.col(EVENT_NUMBER),
                **columns,
            }
        )
    )


def parseOtherLines(split):
    """
    The lines of L{splitLines} that are not laid-out per-message events,
    as L{parseLines} rows: events' fields by name (C{str_to_map}, so that
    the last of a repeated key wins and unknown keys are ignored), JSON
    records, and the other kinds of line.
    """
    lines = split.where(F.col(OTHER_LINE).isNotNull()).select(F.col(OTHER_LINE).alias("value"))
    value = F.col("value")
    parts = F.split(value, " ")
    isJson = value.startswith(JSON_RECORD_SEPARATOR)
    split = lines.select(
        "value",
        parts.alias("parts"),
        (_isEventText(parts) & F.get(parts, TIME_PART).rlike(TWISTD_TIME)).alias("text_event"),
        F.when(isJson, F.from_json(F.substring(value, 2, 1 << 30), "map<string,string>")).alias(
            "record"
        ),
    )

    parts = F.col("parts")
    system = F.get(parts, SYSTEM_PART)
    isTextEvent = F.col("text_event")
    record = F.col("record")
    isJsonEvent = (record["log_namespace"] == NAMESPACE) & record["dallal_event"].isNotNull()
    isTwistdLine = value.rlike(TWISTD_PREFIX)
    isContinuation = value.startswith("\t")
    classified = split.select(
        F.when(isTextEvent | isJsonEvent, F.lit(EVENT))
        .when(isTwistdLine | record.isNotNull(), F.lit(OTHER))
        .when(isContinuation, F.lit(CONTINUATION))
        .otherwise(F.lit(UNPARSED))
        .alias("kind"),
        F.when(isTextEvent, F.rtrim(F.substring_index(system, "#", -1), F.lit("]")))
        .when(isJsonEvent, F.get_json_object(record["log_level"], "$.name"))
        .alias("level"),
        F.when(isTextEvent, F.substring_index(F.get(parts, EVENT_PART), "=", -1))
        .when(isJsonEvent, record["dallal_event"])
        .alias("event"),
        F.when(isTextEvent, F.get(parts, TIME_PART)).alias("stamp"),
        F.when(isJsonEvent, record)
        .when(
            isTextEvent,
            # The text from event= on.
            F.str_to_map(
                F.array_join(F.slice(parts, EVENT_PART + 1, 1 << 30), " "),
                F.lit(" "),
                F.lit("="),
            ),
        )
        .alias("fields"),
        # Events skip the regular expression.
        F.when(
            ~isTextEvent & ~isTwistdLine & ~isContinuation & record.isNull(),
            F.substring(value, 1, UNPARSED_EXAMPLE_LENGTH),
        ).alias("raw"),
    )
    event = F.col("event")
    fields = F.col("fields")
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
    texts = classified.select(
        "kind",
        "level",
        "event",
        "stamp",
        "raw",
        F.when(event == "stats", counters).alias("stats"),
        *(fields[name].alias(name) for name in ("t", *FIELD_TYPES)),
    )
    typed = texts.select(
        "kind",
        "level",
        "event",
        "stamp",
        "raw",
        "stats",
        *(
            F.col(name).try_cast(sqlType).alias(name)
            for name, sqlType in (("t", "DOUBLE"), *FIELD_TYPES.items())
        ),
    )
    return typed.select(
        *_allColumns(
            {
                "kind": F.col("kind"),
                "level": F.col("level"),
                "event": F.col("event"),
                EVENT_NUMBER: nameCode(F.col("event"), MESSAGE_EVENTS),
                "t": _eventTime(),
                **{name: _believedField(name) for name in FIELD_TYPES},
                "stats": F.col("stats"),
                "raw": F.col("raw"),
            }
        )
    )


def combine(split, others):
    """
    L{parseLines}' rows from L{splitLines}' and L{parseOtherLines}'.
    """
    return messageEvents(split).unionByName(others)


def parseLines(lines):
    """
    One row per input line: its C{kind}, and for events their C{event}
    name, its L{EVENT_NUMBER} (0 for an event that is not per-message),
    and their typed fields.

    A field missing from an event, or whose value does not parse as its
    type, is null.  C{t} falls back on twistd's one-second time when an
    event has none.  C{stats} is the counters of a C{stats} event; C{raw}
    the text of an unparsed line.  The rows are not in the lines' order.

    The report does the same in two steps (L{splitLines}, then
    L{parseOtherLines} of the few lines left), each cached, so that the
    log is read once.
    """
    split = splitLines(lines)
    return combine(split, parseOtherLines(split))
