"""
The broker's structured log events.

Every event is a C{twisted.logger} event whose text, as twistd writes it, is
self-describing and machine-parseable::

    2026-11-21T20:28:19+0000 [dallal#info] event=publish mid=7 topic=a/b ...

The text is C{event=<name>} followed by C{key=value} fields, none of which
contains a space, and always a C{t=} field: the event's time in seconds
since the epoch with microseconds, because twistd's own timestamp has
one-second resolution.  The same fields are in the event dictionary (with
C{dallal_event} holding the name) for JSON observers.  docs/EVENTS.md is the
catalogue of names and fields; tests check the two agree.
"""

from twisted.logger import Logger, LogLevel

NAMESPACE = "dallal"


def formatFor(name, fieldNames):
    """
    The C{log_format} of an event: C{event=name} then each field in order,
    with C{t} (the time) last.
    """
    fields = " ".join(f"{field}={{{field}}}" for field in fieldNames)
    separator = " " if fields else ""
    return f"event={name}{separator}{fields} t={{t:.6f}}"


class EventLog:
    """
    Emits the broker's events with the time from an injected clock.

    @ivar messageEvents: whether per-message events (publish, deliver, ...)
        are emitted; the rest always are.
    """

    def __init__(self, clock, logger=None, messageEvents=True):
        self._clock = clock
        self._log = logger if logger is not None else Logger(namespace=NAMESPACE)
        self._formats = {}
        self.messageEvents = messageEvents

    def emit(self, name, level=LogLevel.info, **fields):
        key = (name, tuple(fields))
        logFormat = self._formats.get(key)
        if logFormat is None:
            logFormat = self._formats[key] = formatFor(name, fields)
        self._log.emit(level, logFormat, dallal_event=name, t=self._clock.seconds(), **fields)
