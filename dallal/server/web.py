"""
The broker's web listener (C{twistd dallal --http}): Prometheus metrics,
a health check and a live dashboard, on C{twisted.web}.

 - C{/metrics}: every counter and gauge of the broker in Prometheus's text
   format (or OpenMetrics, if the scraper asks for it), through a
   C{prometheus_client} collector that reads L{Broker.stats} at each scrape.
 - C{/health}: 200 while the broker serves, 503 while it drains on shutdown.
 - C{/}: a dashboard for people (C{dashboard.html}), which C{/events}
   keeps live with a server-sent event a second.

When the broker takes passwords, every page, C{/health} included, is
behind HTTP Basic authentication against the same password file, checked
as a client's login is (L{WebLogins}); a health check passes the
credentials as a scraper does.
"""

import base64
import hashlib
import heapq
import hmac
import json
import re
import secrets
from importlib import resources

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import choose_encoder
from twisted.cred import error as cred
from twisted.internet.defer import CancelledError
from twisted.internet.interfaces import IPushProducer
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.web import pages
from twisted.web.guard import BasicCredentialFactory
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Site
from twisted.web.util import DeferredResource
from zope.interface import implementer

from dallal.broker.counters import DROP_REASONS
from dallal.errors import NO_ID
from dallal.limits import LIMITS
from dallal.server.addresses import formatAddress
from dallal.server.login import TOO_MANY_CHECKS, WRONG_PASSWORD, LoginRefused, checkPassword

# The realm browsers show when they ask for a user name and password.
AUTH_REALM = "dallal"
# Seconds a user name and password that passed the scrypt check are taken
# again without one: a scraper every few seconds would otherwise cost the
# broker a scrypt check (tens of milliseconds, 16 MiB) each time.
LOGIN_REMEMBERED = 60.0
# At most this many logins are remembered at once.
LOGINS_REMEMBERED = 64

# Seconds between two samples of the dashboard's live figures.
SAMPLE_INTERVAL = 1.0
# The busiest topics the dashboard shows.
TOP_TOPICS = 10
# A dashboard that has not read its events for this many seconds (its
# connection's buffers full) is disconnected: a page that is gone, or a
# client that never reads, holds no memory of the broker's.
WATCHER_STALL_LIMIT = 10.0


# Counters of docs/EVENTS.md -> (metric name, help).  Each is exposed as
# a Prometheus counter, its name ending in _total.
COUNTERS = {
    "connections_total": ("dallal_connections_opened", "Sessions since start."),
    "published": (
        "dallal_messages_published",
        "Messages accepted, the broker's own $SYS messages with subscribers included.",
    ),
    "matched": ("dallal_messages_matched", "(message, subscription) pairs."),
    "delivered": ("dallal_messages_delivered", "First sends to a subscriber, all modes."),
    "fired": ("dallal_messages_fired", "First sends to fire subscriptions."),
    "redelivered": ("dallal_messages_redelivered", "Sends after the first."),
    "acked": ("dallal_messages_acked", "Deliveries acknowledged."),
    "replaced": ("dallal_messages_replaced", "Messages replaced in latest mode."),
    "bytes_in": ("dallal_payload_received_bytes", "Payload bytes published."),
    "bytes_out": (
        "dallal_payload_sent_bytes",
        "Payload bytes sent to subscribers, redeliveries included.",
    ),
    "errors": ("dallal_errors", "Requests refused with ERR."),
    "pings_missed": ("dallal_pings_missed", "Pings that went unanswered for an interval."),
    "clients_dropped": (
        "dallal_clients_dropped",
        "Clients disconnected for missed pings (TCP) or expired (UDP).",
    ),
    "duplicates": (
        "dallal_udp_duplicates",
        "Retried UDP requests answered again without being carried out again.",
    ),
    "unsent": ("dallal_udp_unsent", "Datagrams the broker did not send."),
    "bridged_published": (
        "dallal_bridged_published",
        "Messages that came over a bridge and were published here.",
    ),
    "bridged_delivered": (
        "dallal_bridged_delivered",
        "First sends to bridges' subscriptions: messages that left for another broker.",
    ),
    "bridged_dropped": (
        "dallal_bridged_dropped",
        "Messages dropped on their way to another broker.",
    ),
    "bridged_duplicates": (
        "dallal_bridged_duplicates",
        "Messages that came over a bridge and were discarded as already published here.",
    ),
    "bridged_hop_limit": (
        "dallal_bridged_hop_limit",
        "Messages that came over a bridge and were discarded for crossing too many bridges.",
    ),
    "bridged_refused": (
        "dallal_bridged_refused",
        "Messages that came over a bridge and were refused.",
    ),
    "sys_published": (
        "dallal_sys_published",
        "Messages the broker published on its own $SYS topics.",
    ),
    "logins": ("dallal_logins", "Logins that succeeded."),
    "logins_failed": ("dallal_logins_failed", "Logins refused."),
    "logins_abandoned": (
        "dallal_logins_abandoned",
        "UDP logins dropped unchecked: their HELLO was not resent while they waited.",
    ),
    "denied": ("dallal_denied", "Requests the ACL refused, and bridge frames from non-bridges."),
    "publishers_paused": (
        "dallal_publishers_paused",
        "Times a publisher was held back by a subscriber's full queue.",
    ),
    "publishes_busy": (
        "dallal_udp_publishes_busy",
        "UDP publishes answered BUSY (not published; the client resends).",
    ),
    "slow_consumers": (
        "dallal_slow_consumers",
        "Subscribers that held publishers back and made no progress for --stall-timeout.",
    ),
}

# Counters that are now-values -> (metric name, help), exposed as gauges.
GAUGES = {
    "subscriptions": ("dallal_subscriptions", "Subscriptions now."),
    "inflight": ("dallal_messages_inflight", "Messages queued or sent and not yet acked now."),
    "publishers_held": ("dallal_publishers_held", "Publishers held back now."),
    "uptime": ("dallal_uptime_seconds", "Seconds since the broker started."),
}

# Counters one metric shows with a label: dropped_<reason> and
# refused_<limit>.  The broker's plain "dropped" is their sum, which
# Prometheus adds up itself; "connections" is shown by transport.
LABELLED = {"dropped_" + reason: ("reason", reason) for reason in DROP_REASONS} | {
    limit.counter: ("limit", limit.name) for limit in LIMITS
}

# A bridge's status field -> (metric name, whether a counter, help).
BRIDGE_METRICS = {
    "connects": ("dallal_bridge_connects", True, "Connections the bridge made to its remote."),
    "received": (
        "dallal_bridge_received",
        True,
        "Messages the bridge brought from its remote.",
    ),
    "forwarded": ("dallal_bridge_forwarded", True, "Messages the bridge carried to its remote."),
    "unacked": ("dallal_bridge_unacked", False, "Messages sent to the remote and not yet acked."),
}
BRIDGE_STATES = ("connecting", "up", "down")


class BrokerCollector:
    """
    A C{prometheus_client} collector of a broker's counters and gauges,
    read from L{Broker.stats} at each scrape.

    @ivar transports: the transports whose connections it has shown: one
        with none left is shown at 0, not missing (a missing series is no
        number to alert on).
    """

    def __init__(self, broker):
        self.broker = broker
        self.transports = set()

    def collect(self):
        stats = self.broker.stats()
        bridges = stats.pop("bridges", {})
        connections = GaugeMetricFamily(
            "dallal_connections", "Sessions now, by transport.", labels=["transport"]
        )
        byTransport = self.broker.connectionsByTransport()
        self.transports.update(byTransport)
        for transport in sorted(self.transports):
            connections.add_metric([transport], byTransport[transport])
        yield connections
        dropped = CounterMetricFamily(
            "dallal_messages_dropped",
            "Messages that will never reach a subscriber, by reason (docs/EVENTS.md).",
            labels=["reason"],
        )
        refused = CounterMetricFamily(
            "dallal_refused",
            "Refusals by one of the broker's limits (README.md, Limits), by limit.",
            labels=["limit"],
        )
        families = {"reason": dropped, "limit": refused}
        for name, value in sorted(stats.items()):
            if name in COUNTERS:
                metric, documentation = COUNTERS[name]
                yield CounterMetricFamily(metric, documentation, value=value)
            elif name in GAUGES:
                metric, documentation = GAUGES[name]
                yield GaugeMetricFamily(metric, documentation, value=value)
            elif name in LABELLED:
                label, labelValue = LABELLED[name]
                families[label].add_metric([labelValue], value)
        yield dropped
        yield refused
        yield from self._bridgeMetrics(bridges)

    def _bridgeMetrics(self, bridges):
        state = GaugeMetricFamily(
            "dallal_bridge_state",
            "1 for the state each bridge is in (connecting, up or down), 0 for the others.",
            labels=["bridge", "state"],
        )
        for name, status in sorted(bridges.items()):
            for each in BRIDGE_STATES:
                state.add_metric([name, each], int(status["state"] == each))
        yield state
        for field, (metric, isCounter, documentation) in BRIDGE_METRICS.items():
            kind = CounterMetricFamily if isCounter else GaugeMetricFamily
            family = kind(metric, documentation, labels=["bridge"])
            for name, status in sorted(bridges.items()):
                family.add_metric([name], status[field])
            yield family


class MetricsResource(Resource):
    """
    C{/metrics}: the broker's metrics, and the process's (memory, CPU,
    descriptors), as a Prometheus scraper asks for them.
    """

    isLeaf = True

    def __init__(self, broker):
        Resource.__init__(self)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(BrokerCollector(broker))
        ProcessCollector(registry=self.registry)

    def render_GET(self, request):
        encode, contentType = choose_encoder(request.getHeader("accept"))
        request.setHeader("content-type", contentType)
        return encode(self.registry)


class HealthResource(Resource):
    """
    C{/health}: 200 while the broker serves, 503 while it drains on
    shutdown, so that a load balancer sends no new client its way.
    """

    isLeaf = True

    def __init__(self, broker):
        Resource.__init__(self)
        self.broker = broker

    def render_GET(self, request):
        request.setHeader("content-type", "text/plain; charset=utf-8")
        request.setHeader("cache-control", "no-store")
        if self.broker.shuttingDown:
            request.setResponseCode(503)
            return b"shutting down\n"
        return b"ok\n"


def _rate(now, before, seconds):
    # A counter that went down restarted (the topic counts do, past their
    # bound): what it has now came since.
    return (now - before if now >= before else now) / seconds


class LiveFigures:
    """
    What the dashboard shows, sampled once a second while someone watches
    it and sent to every watcher as a server-sent event.

    Each sample is computed once for all watchers.  A watcher is written
    to only while its connection takes more (C{twisted.web} pauses it when
    its buffers are full, and the next sample replaces the one it missed);
    one paused for longer than L{WATCHER_STALL_LIMIT} is disconnected.
    """

    _log = Logger()

    def __init__(self, broker, clock, interval=SAMPLE_INTERVAL):
        self.broker = broker
        self.clock = clock
        self.interval = interval
        self.watchers = set()
        self._loop = None
        self._previous = None

    def watch(self, request):
        """
        Send the samples to C{request} as server-sent events until it ends.
        """
        watcher = _Watcher(request, self.clock)
        request.registerProducer(watcher, True)
        request.notifyFinish().addBoth(lambda _: self.watchers.discard(watcher))
        self.watchers.add(watcher)
        if self._loop is None:
            self._loop = LoopingCall(self.sample)
            self._loop.clock = self.clock
            self._loop.start(self.interval).addErrback(self._samplingFailed)
        else:
            watcher.send(self._event(self._previous))

    def _samplingFailed(self, failure):
        # The next watcher starts sampling again.
        self._loop = None
        self._log.failure("the dashboard's sampling failed", failure)

    def stop(self):
        """
        End every watcher's stream, and stop sampling.
        """
        for watcher in list(self.watchers):
            watcher.request.unregisterProducer()
            watcher.request.finish()
        self.watchers.clear()
        self._stopSampling()

    def _stopSampling(self):
        if self._loop is not None:
            self._loop.stop()
            self._loop = None
        self._previous = None

    def sample(self):
        """
        Take a sample and send it to every watcher; stop sampling when
        nobody watches.
        """
        if not self.watchers:
            self._stopSampling()
            return
        sample = self.figures(self._previous)
        self._previous = sample
        event = self._event(sample)
        now = self.clock.seconds()
        for watcher in list(self.watchers):
            if watcher.pausedSince is None:
                watcher.send(event)
            elif now - watcher.pausedSince > WATCHER_STALL_LIMIT:
                self.watchers.discard(watcher)
                watcher.request.transport.abortConnection()

    @staticmethod
    def _event(sample):
        public = {key: value for key, value in sample.items() if not key.startswith("_")}
        return b"data: " + json.dumps(public, separators=(",", ":")).encode("utf-8") + b"\n\n"

    def figures(self, previous=None):
        """
        The dashboard's figures now, with rates per second since the
        C{previous} figures (none in the first ones).
        """
        broker = self.broker
        stats = broker.stats()
        now = self.clock.seconds()
        totals = {
            "published": stats["published"],
            "delivered": stats["delivered"] + stats["redelivered"],
            "bytesIn": stats["bytes_in"],
            "bytesOut": stats["bytes_out"],
            "dropped": stats["dropped"],
        }
        topicCounts = broker.publishedByTopic()
        if previous is None or now <= previous["_time"]:
            rates = None
            busiest = heapq.nlargest(TOP_TOPICS, topicCounts.items(), key=lambda item: item[1])
            topics = [[topic, None, count] for topic, count in busiest]
        else:
            seconds = now - previous["_time"]
            rates = {
                name: round(_rate(value, previous["totals"][name], seconds), 2)
                for name, value in totals.items()
            }
            before = previous["_topicCounts"]
            topicRates = (
                (topic, _rate(count, before.get(topic, 0), seconds), count)
                for topic, count in topicCounts.items()
            )
            busiest = heapq.nlargest(TOP_TOPICS, topicRates, key=lambda row: (row[1], row[2]))
            topics = [[topic, round(rate, 2), count] for topic, rate, count in busiest]
        return {
            "broker": broker.name,
            "uptime": stats["uptime"],
            "shuttingDown": broker.shuttingDown,
            "connections": dict(sorted(broker.connectionsByTransport().items())),
            "subscriptions": stats["subscriptions"],
            "inflight": stats["inflight"],
            "totals": totals,
            "rates": rates,
            "topics": topics,
            "drops": {reason: stats["dropped_" + reason] for reason in DROP_REASONS},
            "refused": {limit.name: stats[limit.counter] for limit in LIMITS},
            "bridges": stats.get("bridges", {}),
            "_time": now,
            "_topicCounts": topicCounts,
        }


@implementer(IPushProducer)
class _Watcher:
    """
    One dashboard's stream of events, paused while its connection's
    buffers are full.

    @ivar pausedSince: when it was paused, or C{None} while it takes more.
    """

    def __init__(self, request, clock):
        self.request = request
        self.clock = clock
        self.pausedSince = None

    def send(self, event):
        self.request.write(event)

    def pauseProducing(self):
        if self.pausedSince is None:
            self.pausedSince = self.clock.seconds()

    def resumeProducing(self):
        self.pausedSince = None

    def stopProducing(self):
        """
        The connection is gone: L{LiveFigures} forgets it once the request
        is finished.
        """


class EventsResource(Resource):
    """
    C{/events}: the dashboard's live figures, as server-sent events.
    """

    isLeaf = True

    def __init__(self, figures):
        Resource.__init__(self)
        self.figures = figures

    def render_GET(self, request):
        request.setHeader("content-type", "text/event-stream")
        request.setHeader("cache-control", "no-store")
        self.figures.watch(request)
        return NOT_DONE_YET


class DashboardResource(Resource):
    """
    C{/}: the dashboard, one HTML page with its style and script and no
    other file (nothing from the internet either: the broker may have none).
    """

    isLeaf = True

    def __init__(self):
        Resource.__init__(self)
        self.page = resources.files(__package__).joinpath("dashboard.html").read_bytes()
        # Only the page's own script and style may run, and it may only
        # connect back here: should a topic's name ever reach the page as
        # HTML, it could run nothing.
        script, style = (
            _digest(re.search(rb"<%s>(.*?)</%s>" % (tag, tag), self.page, re.DOTALL).group(1))
            for tag in (b"script", b"style")
        )
        self.policy = (
            f"default-src 'none'; script-src '{script}'; style-src '{style}'; "
            "connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; "
            "frame-ancestors 'none'"
        )

    def render_GET(self, request):
        request.setHeader("content-type", "text/html; charset=utf-8")
        request.setHeader("content-security-policy", self.policy)
        return self.page


def _digest(source):
    """
    The source's hash as a Content-Security-Policy allows it.
    """
    return "sha256-" + base64.b64encode(hashlib.sha256(source).digest()).decode()


class WebClient:
    """
    The client of one web request, as the broker's counters and log name
    it (L{Broker.loginFailed}, L{Broker.refusedByLimit}).
    """

    transportName = "http"

    def __init__(self, request):
        address = request.getClientAddress()
        self.host = getattr(address, "host", None)
        self.peer = formatAddress(address)


class LoginRequired(Resource):
    """
    401: the request needs a user name and password of the broker's.
    """

    isLeaf = True

    def render(self, request):
        request.setResponseCode(401)
        request.setHeader("www-authenticate", f'Basic realm="{AUTH_REALM}", charset="UTF-8"')
        request.setHeader("content-type", "text/plain; charset=utf-8")
        return b"a user name and password of the broker's are needed\n"


class _Busy(Resource):
    """
    503: too many logins wait for their password check; try again soon.
    """

    isLeaf = True

    def __init__(self, reason):
        Resource.__init__(self)
        self.reason = reason

    def render(self, request):
        request.setResponseCode(503)
        request.setHeader("retry-after", "1")
        request.setHeader("content-type", "text/plain; charset=utf-8")
        return self.reason.encode("utf-8") + b"\n"


def basicCredentials(request):
    """
    The user name (text) and password (bytes) of a request's HTTP Basic
    C{Authorization} header, or C{None} if it has none that is valid.
    """
    scheme, _, encoded = (request.getHeader("authorization") or "").partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        credentials = BasicCredentialFactory(AUTH_REALM).decode(encoded.encode(), request)
        return credentials.username.decode("utf-8"), credentials.password
    except (cred.LoginFailed, UnicodeDecodeError):
        return None


class WebLogins:
    """
    Admits a web request once its HTTP Basic credentials are a user's of
    the broker's password file, checked by the broker's gatekeeper as a
    client's login is: in the turn of its address, within the same bounds
    on the checks waiting, a failure answered after
    L{dallal.security.auth.FAILURE_DELAY} seconds, counted and logged.

    A user name and password that passed are taken again without a check
    for L{LOGIN_REMEMBERED} seconds, until the password file is read
    again: a scraper every few seconds would otherwise cost the broker a
    scrypt check each time.  They are remembered as keyed hashes, with a
    key of this process's.
    """

    def __init__(self, gatekeeper, broker, remember=LOGIN_REMEMBERED):
        self.gatekeeper = gatekeeper
        self.broker = broker
        self.remember = remember
        self._key = secrets.token_bytes(32)
        # (user name, keyed hash of the password) -> (the users it was
        # checked against, until when it is remembered).
        self._passed = {}

    def admit(self, request, resource):
        """
        C{resource} if the request may have it, else what it gets instead:
        a 401, or a 503 while too many logins wait for their check.
        """
        credentials = basicCredentials(request)
        if credentials is None:
            return LoginRequired()
        user, password = credentials
        key = (user, hmac.digest(self._key, password, hashlib.sha256))
        users = self.gatekeeper.checker.users
        passed = self._passed.get(key)
        if passed is not None:
            checkedAgainst, until = passed
            if checkedAgainst is users and self.broker.clock.seconds() < until:
                return resource
        client = WebClient(request)
        checking = checkPassword(
            self.broker, self.gatekeeper, credentials, None, client.host, NO_ID, lambda: client
        )
        # A client gone while its check waits leaves the queue.
        request.notifyFinish().addErrback(lambda _: checking.cancel())
        checking.addCallbacks(
            self._passedCheck, self._failedCheck, callbackArgs=(key, users, resource)
        )
        return DeferredResource(checking)

    def _passedCheck(self, user, key, users, resource):
        if len(self._passed) >= LOGINS_REMEMBERED:
            self._passed.clear()
        self._passed[key] = (users, self.broker.clock.seconds() + self.remember)
        return resource

    def _failedCheck(self, failure):
        if failure.check(CancelledError):
            return _Gone()
        failure.trap(LoginRefused)
        refused = failure.value
        if refused.cause == WRONG_PASSWORD:
            return LoginRequired()
        if refused.cause == TOO_MANY_CHECKS:
            return _Busy(refused.error.reason)
        return pages.errorPage(500, "Error", "The broker could not check the password.")


class _Gone(Resource):
    """
    What a client gone while its password waited for its check gets:
    nothing, its connection is closed.
    """

    isLeaf = True

    def render(self, request):
        return NOT_DONE_YET


class Pages(Resource):
    """
    A folder of pages, whose unknown paths are answered 404.
    """

    def getChild(self, path, request):
        return pages.notFound()


class WebRoot(Pages):
    """
    The web listener's root: every page under L{guarded}, behind the
    broker's passwords if it takes any.

    @ivar guarded: the resource whose children are behind the passwords
        (C{/metrics}, C{/events}, the dashboard).  A child that logs its
        clients in itself, such as MQTT over WebSockets, goes on the root
        with C{putChild}.
    """

    def __init__(self, guarded, logins=None):
        """
        @param logins: the L{WebLogins} of a broker that takes passwords,
            or C{None}.
        """
        Pages.__init__(self)
        self.guarded = guarded
        self.logins = logins

    def getChild(self, path, request):
        # The guarded resource finds the child, once the request may have it.
        request.postpath.insert(0, request.prepath.pop())
        if self.logins is None:
            return self.guarded
        return self.logins.admit(request, self.guarded)


def webSite(broker, clock, gatekeeper=None):
    """
    The web listener's site for a broker.

    @param gatekeeper: the broker's L{dallal.security.auth.Gatekeeper}, or
        C{None}: its passwords, if it takes any, guard every page.
    @return: a C{Site}; its C{resource} is the L{WebRoot}, and its
        C{figures} the dashboard's L{LiveFigures}, to L{LiveFigures.stop}
        when the listener stops.
    """
    figures = LiveFigures(broker, clock)
    guarded = Pages()
    guarded.putChild(b"", DashboardResource())
    guarded.putChild(b"metrics", MetricsResource(broker))
    guarded.putChild(b"events", EventsResource(figures))
    guarded.putChild(b"health", HealthResource(broker))
    logins = None
    if gatekeeper is not None and gatekeeper.loginRequired:
        logins = WebLogins(gatekeeper, broker)
    root = WebRoot(guarded, logins)
    site = _QuietSite(root, reactor=clock)
    site.figures = figures
    return site


class _QuietSite(Site):
    """
    A C{Site} that logs no line per request, nor its start and stop: a
    scraper every few seconds would fill the broker's log, which is for
    the broker's events.
    """

    noisy = False

    def log(self, request):
        pass
