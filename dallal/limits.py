"""
The broker's limits: what each one refuses, how a refusal is counted and
logged, and the bookkeeping the connection and hello limits need.

Every limit's value is a field of L{dallal.broker.core.BrokerConfig} (a
C{twistd dallal --max-...} option; README.md, "Limits", lists them).  A
refusal costs the client a clear C{ERR} where there is a request to answer
(PROTOCOL.md, "Errors"), adds one to the limit's counter
(C{refused_<limit>}) and is logged as a C{limit_reached} event
(docs/EVENTS.md).  Refusals can come in floods (connections, spoofed
hellos), so each limit logs at most one event a second, saying how many
refusals it stands for; the counters miss none.
"""

import resource
from collections import Counter, OrderedDict

from twisted.logger import LogLevel

from dallal.errors import (
    BAD_TOPIC,
    FRAME_TIMEOUT,
    LINE_TOO_LONG,
    NO_ID,
    PAYLOAD_TOO_LARGE,
    STORE_FAILED,
    TOO_MANY_CLIENTS,
    TOO_MANY_ERRORS,
    TOO_MANY_SUBSCRIPTIONS,
    TOO_MANY_TOPICS,
    RequestError,
)

# Defaults for a small production broker; README.md, "Limits", says why.
DEFAULT_MAX_CONNECTIONS = 10_000
DEFAULT_MAX_CONNECTIONS_PER_IP = 1_000
DEFAULT_MAX_SUBSCRIPTIONS = 1_000
DEFAULT_MAX_TOPIC_LEVELS = 32
DEFAULT_MAX_LINE = 4096
# The longest request a client sends is under 512 bytes (a PUB with a
# 64-byte id, a 256-byte topic, its options and, over UDP, its identity);
# a line limit over 64 KiB would only let each connection make the broker
# buffer more.
MIN_CONTROL_LINE = 512
MAX_CONTROL_LINE = 65536
DEFAULT_MAX_UDP_CLIENTS = 10_000
# As for TCP connections: one address may hold a tenth of the sessions,
# so that it cannot take them all and lock every other address out.
DEFAULT_MAX_UDP_CLIENTS_PER_IP = 1_000
DEFAULT_MAX_HELLOS_PER_SECOND = 100
# Bytes written to a TCP connection whose transport is already full: the
# answers to the requests of one read (a LIST or TOPICS is at most a few
# hundred KiB) and pings fit many times over.
DEFAULT_MAX_OUTPUT_BYTES = 1024 * 1024
# Logins waiting for their password check (dallal.security.auth.CheckQueue), in all
# and from one address: each waits for at most a check per other address.
DEFAULT_MAX_PENDING_LOGINS = 256
DEFAULT_MAX_PENDING_LOGINS_PER_IP = 16
# Retained messages, and their payload bytes: each is kept in memory and on
# disk, and every new subscription matching many of them is sent them all.
# What UDP sessions remember of their answers (dallal.server.udp.AnswerCache),
# each counted with its bookkeeping: per session and in all.
DEFAULT_MAX_UDP_ANSWER_BYTES = 128 * 1024
DEFAULT_MAX_UDP_ANSWER_BYTES_TOTAL = 64 * 1024 * 1024
# Topics one publish to every matching topic (to-matching=1) may reach:
# each is a message routed while the broker serves nobody else.
DEFAULT_MAX_MATCHING_TOPICS = 1000
# Topics one TOPICS answer lists: each is a row of JSON built and written
# while the broker serves nobody else.
DEFAULT_MAX_LISTED = 1000
# MQTT sessions kept while their clients are away (Clean Session 0, a
# Session Expiry Interval): each may hold as much as a connected client's
# queue, --max-queued and --max-queued-bytes.
DEFAULT_MAX_OFFLINE_SESSIONS = 1_000
# Payload bytes all MQTT sessions whose clients are away may hold together:
# without it, what they hold grows with their number (1000 x 8 MiB).
DEFAULT_MAX_OFFLINE_BYTES = 256 * 1024 * 1024
DEFAULT_MAX_RETAINED = 100_000
DEFAULT_MAX_RETAINED_BYTES = 256 * 1024 * 1024
# Requests refused in a row on one TCP connection: a client that means well
# reads its errors long before, and a stream of garbage costs an ERR and a
# count each.
DEFAULT_MAX_CONSECUTIVE_ERRORS = 10
# Seconds a TCP client has to complete a frame it began (a line, or a 1 MiB
# payload at some 150 kbit/s): a client that sends a byte now and then
# cannot hold a partial frame for ever.
DEFAULT_MAX_FRAME_SECONDS = 60
# protocol_error events logged a second, per client and in all; the others
# are counted, and reported by code once a second.
ERRORS_LOGGED_PER_CLIENT = 10
ERRORS_LOGGED = 100
# subscribe and unsubscribe events logged a second, per client and in all:
# a SUB and UNSUB pair is some 40 bytes of request for two log lines, so a
# client repeating them could otherwise grow the log many times faster
# than it sends.  A client subscribing with its filters at start is under
# these; the others are counted, and reported by kind once a second.
SUBSCRIPTION_EVENTS_LOGGED_PER_CLIENT = 100
SUBSCRIPTION_EVENTS_LOGGED = 1000

# Seconds between two limit_reached events of one limit.
LOG_INTERVAL = 1.0

# Descriptors kept for the broker's other files (listening ports, the log,
# the retained store, refused connections while they close), as Redis
# keeps 32 beside its maxclients.
RESERVED_DESCRIPTORS = 32


class Limit:
    """
    One kind of limit.

    @ivar name: the limit's name in the log (C{limit=<name>}) and in its
        counter, C{refused_<name>}.
    @ivar code: the error code of a refusal, or C{None} when a refusal is
        not answered.
    """

    __slots__ = ("name", "code", "counter")

    def __init__(self, name, code):
        self.name = name
        self.code = code
        self.counter = "refused_" + name

    def __repr__(self):
        return f"Limit({self.name!r})"


CONNECTIONS = Limit("connections", TOO_MANY_CLIENTS)
CONNECTIONS_PER_IP = Limit("connections_per_ip", TOO_MANY_CLIENTS)
SUBSCRIPTIONS = Limit("subscriptions", TOO_MANY_SUBSCRIPTIONS)
TOPIC_LENGTH = Limit("topic_length", BAD_TOPIC)
TOPIC_LEVELS = Limit("topic_levels", BAD_TOPIC)
PAYLOAD = Limit("payload", PAYLOAD_TOO_LARGE)
LINE = Limit("line", LINE_TOO_LONG)
UDP_CLIENTS = Limit("udp_clients", TOO_MANY_CLIENTS)
UDP_CLIENTS_PER_IP = Limit("udp_clients_per_ip", TOO_MANY_CLIENTS)
# Over the rate, a HELLO is dropped unanswered: an answer is what a forger
# of source addresses would want.
HELLO_RATE = Limit("hello_rate", None)
# A client's delivery queue (dallal.broker.delivery): a full one holds its
# publishers back; what it costs once its client is a slow consumer (or for
# a message nothing could hold back) is its slow-consumer policy's, seen as
# a gap in seq or a closed connection.
QUEUED_MESSAGES = Limit("queued_messages", None)
QUEUED_BYTES = Limit("queued_bytes", None)
# A TCP client that does not read its answers: it cannot read an ERR
# either, so the refusal is the closed connection (reason output_limit).
OUTPUT_BYTES = Limit("output_bytes", None)
CONSECUTIVE_ERRORS = Limit("consecutive_errors", TOO_MANY_ERRORS)
FRAME_SECONDS = Limit("frame_seconds", FRAME_TIMEOUT)
PENDING_LOGINS = Limit("pending_logins", TOO_MANY_CLIENTS)
PENDING_LOGINS_PER_IP = Limit("pending_logins_per_ip", TOO_MANY_CLIENTS)
# Answers forgotten early: a retry of their request is carried out again.
UDP_ANSWER_BYTES = Limit("udp_answer_bytes", None)
UDP_ANSWER_BYTES_TOTAL = Limit("udp_answer_bytes_total", None)
MATCHING_TOPICS = Limit("matching_topics", TOO_MANY_TOPICS)
# A TOPICS answer cut to the limit: it says truncated, and is no error.
LISTED = Limit("listed", None)
RETAINED = Limit("retained", STORE_FAILED)
RETAINED_BYTES = Limit("retained_bytes", STORE_FAILED)
# An MQTT session that would outlive its connection ends with it instead.
OFFLINE_SESSIONS = Limit("offline_sessions", None)
# An MQTT client left more QoS 2 publishes unreleased than the broker's
# Receive Maximum (--max-inflight): its connection closes.
RECEIVE_MAXIMUM = Limit("receive_maximum", None)
# A message for an MQTT session whose client is away, dropped as all such
# sessions hold --max-offline-bytes.
OFFLINE_BYTES = Limit("offline_bytes", None)

LIMITS = (
    CONNECTIONS,
    CONNECTIONS_PER_IP,
    SUBSCRIPTIONS,
    TOPIC_LENGTH,
    TOPIC_LEVELS,
    PAYLOAD,
    LINE,
    UDP_CLIENTS,
    UDP_CLIENTS_PER_IP,
    HELLO_RATE,
    QUEUED_MESSAGES,
    QUEUED_BYTES,
    OUTPUT_BYTES,
    CONSECUTIVE_ERRORS,
    FRAME_SECONDS,
    PENDING_LOGINS,
    PENDING_LOGINS_PER_IP,
    UDP_ANSWER_BYTES,
    UDP_ANSWER_BYTES_TOTAL,
    MATCHING_TOPICS,
    LISTED,
    RETAINED,
    RETAINED_BYTES,
    OFFLINE_SESSIONS,
    RECEIVE_MAXIMUM,
    OFFLINE_BYTES,
)


class LogWindow:
    """
    How many events of one kind may be logged: at most C{perWindow} in a
    window of C{seconds}, which starts with the first event after the last
    window ended.  What they report (refusals, errors) can come at any rate;
    the log must not.
    """

    __slots__ = ("perWindow", "seconds", "_start", "_spent")

    def __init__(self, perWindow=1, seconds=LOG_INTERVAL):
        self.perWindow = perWindow
        self.seconds = seconds
        self._start = None
        self._spent = 0

    def allow(self, now):
        """
        Whether an event at C{now} may be logged; if so, it is counted.
        """
        if self._start is None or now - self._start >= self.seconds:
            self._start = now
            self._spent = 0
        if self._spent >= self.perWindow:
            return False
        self._spent += 1
        return True


class RateLimitedLog:
    """
    Which events of one family (refused requests, subscription changes) are
    logged: at most C{perSecond} a second in all, and at most what each
    client's own L{LogWindow} allows.  They can come at any rate, from
    garbage on many connections or forged datagrams; the log must not.  The
    others are counted by kind and reported, one C{report} event per kind
    with its C{count}, a second after the first of them.
    """

    def __init__(self, clock, events, perSecond, report, kindField, level=LogLevel.warn):
        """
        @param report: the name of the event that reports those not logged.
        @param kindField: the name of its field that says of which kind they
            were.
        """
        self.clock = clock
        self.events = events
        self.report = report
        self.kindField = kindField
        self.level = level
        self._window = LogWindow(perSecond)
        self._suppressed = Counter()
        self._report = None

    def allow(self, clientWindow=None):
        """
        Whether one more event may be logged now.

        @param clientWindow: the client's L{LogWindow}, if it has one.
        """
        now = self.clock.seconds()
        return (clientWindow is None or clientWindow.allow(now)) and self._window.allow(now)

    def suppressed(self, kind):
        """
        An event of C{kind} was counted but not logged.
        """
        self._suppressed[kind] += 1
        if self._report is None:
            self._report = self.clock.callLater(LOG_INTERVAL, self.reportSuppressed)

    def reportSuppressed(self):
        """
        Log how many events were counted but not logged since the last
        report, by kind.
        """
        if self._report is not None and self._report.active():
            self._report.cancel()
        self._report = None
        for kind, count in sorted(self._suppressed.items()):
            self.events.emit(self.report, self.level, **{self.kindField: kind}, count=count)
        self._suppressed.clear()


class LimitLog:
    """
    Counts and logs the refusals of every limit of one broker: one event a
    second per limit at most, with the refusals since the last one.
    """

    def __init__(self, clock, counters, events):
        """
        @param counters: the broker's L{dallal.broker.counters.Counters},
            whose C{refused} counts each refusal.
        """
        self.clock = clock
        self.counters = counters
        self.events = events
        self._windows = {limit: LogWindow() for limit in LIMITS}
        # Limit -> refusals since its last event.
        self._unlogged = Counter()

    def refused(self, limit, maximum, client, transport, session=0, reason=None, requestId=NO_ID):
        """
        Count and log one refusal by C{limit}.

        @param maximum: the limit's value.
        @param client: the client's address, C{host:port}.
        @param session: the client's session, 0 when it has none.
        @param reason: what the client is told, for limits that answer.
        @return: the L{RequestError} to answer with, or C{None} for a limit
            whose refusals are not answered.
        """
        self.counters.refused(limit)
        self._unlogged[limit] += 1
        if self._windows[limit].allow(self.clock.seconds()):
            self.events.emit(
                "limit_reached",
                LogLevel.warn,
                limit=limit.name,
                max=maximum,
                session=session,
                client=client,
                transport=transport,
                refused=self._unlogged.pop(limit),
            )
        if limit.code is None:
            return None
        return RequestError(limit.code, reason, requestId)


class ConnectionTable:
    """
    The clients of a listener (or several) now, in all and per host,
    against their limits: the connections of the stream listeners, or the
    sessions of the UDP port.

    @param limits: the L{Limit}s of the total and of a host's.
    @param clients: what the refusal says the broker holds its maximum of.
    """

    def __init__(
        self, maxTotal, maxPerHost, limits=(CONNECTIONS, CONNECTIONS_PER_IP), clients="connections"
    ):
        self.maxTotal = maxTotal
        self.maxPerHost = maxPerHost
        self.totalLimit, self.perHostLimit = limits
        self.clients = clients
        self.total = 0
        self.perHost = Counter()

    def refusal(self, host):
        """
        Whether one more client from C{host} would break a limit.

        @param host: the client's address, or C{None} for a transport
            without one (a UNIX socket): only the total applies.
        @return: C{(limit, maximum, reason)} if so, else C{None}.
        """
        if self.total >= self.maxTotal:
            maximum, limit, source = self.maxTotal, self.totalLimit, ""
        elif host is not None and self.perHost[host] >= self.maxPerHost:
            maximum, limit, source = self.maxPerHost, self.perHostLimit, f" from {host}"
        else:
            return None
        return (
            limit,
            maximum,
            f"the broker has its maximum of {maximum} {self.clients}{source}: try again later",
        )

    def opened(self, host):
        self.total += 1
        if host is not None:
            self.perHost[host] += 1

    def closed(self, host):
        self.total -= 1
        if host is not None:
            self.perHost[host] -= 1
            if not self.perHost[host]:
                del self.perHost[host]


class RateTable:
    """
    A token bucket per key (a source address): each key may do C{rate}
    things a second, and as many at once after a quiet second.

    The table keeps the C{size} keys seen most recently; a key forgotten
    starts again with a full bucket.  So a forger of source addresses cannot
    grow it, and gains nothing by cycling through addresses that it would
    not gain anyway from using each of them once.
    """

    def __init__(self, clock, rate, size=10_000):
        self.clock = clock
        self.rate = rate
        self.size = size
        # key -> [tokens, when they were counted]
        self._buckets = OrderedDict()

    def __len__(self):
        return len(self._buckets)

    def allow(self, key):
        """
        Take a token from C{key}'s bucket.

        @return: whether there was one.
        """
        now = self.clock.seconds()
        bucket = self._buckets.get(key)
        if bucket is None:
            if len(self._buckets) >= self.size:
                self._buckets.popitem(last=False)
            bucket = self._buckets[key] = [self.rate, now]
        else:
            self._buckets.move_to_end(key)
            bucket[0] = min(self.rate, bucket[0] + (now - bucket[1]) * self.rate)
            bucket[1] = now
        if bucket[0] < 1:
            return False
        bucket[0] -= 1
        return True


def fitToDescriptors(maxConnections, rlimit=resource):
    """
    Make room for C{maxConnections} connections in the process's descriptor
    limit (C{ulimit -n}), raising its soft limit towards its hard limit if
    need be, as Redis does for its C{maxclients}: a broker out of
    descriptors cannot even accept a connection to refuse it.

    @param rlimit: the C{resource} module (tests give a fake one).
    @return: C{(allowed, descriptors)}: how many connections fit, at most
        C{maxConnections}, and the descriptor limit they fit in.
    """
    wanted = maxConnections + RESERVED_DESCRIPTORS
    soft, hard = rlimit.getrlimit(rlimit.RLIMIT_NOFILE)
    if soft != rlimit.RLIM_INFINITY and soft < wanted:
        raised = wanted if hard == rlimit.RLIM_INFINITY else min(wanted, hard)
        try:
            rlimit.setrlimit(rlimit.RLIMIT_NOFILE, (raised, hard))
        except (ValueError, OSError):
            pass
        else:
            soft = raised
    if soft == rlimit.RLIM_INFINITY or soft >= wanted:
        return maxConnections, soft
    return max(1, soft - RESERVED_DESCRIPTORS), soft
