"""
The web listener's resources (dallal.server.web): /metrics, /health, the
dashboard and its events, and HTTP Basic authentication, served by a real
twisted.web Site over a StringTransport, on the harness's Clock.
"""

import base64
import json

import pytest
from helpers import BrokerHarness, runInline
from prometheus_client.parser import text_string_to_metric_families
from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred
from twisted.internet.error import ConnectionDone
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.logger import Logger, formatEvent
from twisted.python.failure import Failure

from dallal.broker import sysstats
from dallal.broker.core import BrokerConfig
from dallal.broker.delivery import DeliveryConfig
from dallal.security.auth import FAILURE_DELAY, MAX_CONCURRENT_CHECKS
from dallal.server import web
from dallal.server.tap import Options

USERS = {"alice": b"wonderland"}


class Response:
    """
    One HTTP/1.0 exchange with a Site: its response, as it is so far.
    """

    def __init__(self, site, path, headers=()):
        client = IPv4Address("TCP", "127.0.0.1", 50000)
        self.transport = StringTransport(peerAddress=client)
        self.channel = site.buildProtocol(client)
        self.channel.makeConnection(self.transport)
        lines = [b"GET " + path + b" HTTP/1.0", *headers, b"", b""]
        self.channel.dataReceived(b"\r\n".join(lines))

    @property
    def status(self):
        return int(self.transport.value().split(b" ", 2)[1])

    @property
    def headers(self):
        head = self.transport.value().split(b"\r\n\r\n", 1)[0]
        fields = (line.split(b": ", 1) for line in head.split(b"\r\n")[1:])
        return {name.lower(): value for name, value in fields}

    @property
    def body(self):
        return self.transport.value().split(b"\r\n\r\n", 1)[1]

    def events(self):
        """
        The server-sent events received so far, decoded.
        """
        return [
            json.loads(chunk[len(b"data: ") :])
            for chunk in self.body.split(b"\n\n")
            if chunk.startswith(b"data: ")
        ]


def basic(user, password):
    return b"Authorization: Basic " + base64.b64encode(f"{user}:{password}".encode())


def siteOf(harness, gatekeeper=None):
    return web.webSite(harness.broker, harness.clock, gatekeeper)


def metricsOf(site, *headers):
    response = Response(site, b"/metrics", headers)
    assert response.status == 200, response.transport.value()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.body.decode())
        for sample in family.samples
    }


def sampleOf(counter):
    """
    The sample that shows one of the broker's counters (but C{dropped},
    their sum, and C{connections}, shown by transport): its name and
    labels, as L{metricsOf} keys them.

    @raise AssertionError: no metric shows that counter.
    """
    if counter in web.COUNTERS:
        return (web.COUNTERS[counter][0] + "_total", ())
    if counter in web.GAUGES:
        return (web.GAUGES[counter][0], ())
    if counter.startswith("dropped_"):
        return ("dallal_messages_dropped_total", (("reason", counter[len("dropped_") :]),))
    assert counter.startswith("refused_"), f"counter {counter} is no metric"
    return ("dallal_refused_total", (("limit", counter[len("refused_") :]),))


def trafficWithDrops():
    """
    A broker where a subscriber in mode all, with room for one message in
    flight and one queued, was sent three and never acked: its publisher
    was held back until the stall timeout made it a slow consumer, then the
    oldest queued was dropped.
    """
    delivery = DeliveryConfig(maxInflight=1, maxQueued=1)
    harness = BrokerHarness(BrokerConfig(delivery=delivery))
    subscriber = harness.connect()
    subscriber.send(b"SUB 1 news mode=all\r\n")
    publisher = harness.connect()
    publisher.send(b"PUB 1 news 2\r\nhi\r\n" * 3)
    harness.clock.advance(delivery.stallTimeout)
    harness.clock.advance(0)
    return harness


def test_every_counter_is_a_metric():
    """
    Each counter of the broker's stats is exposed, with its value: a
    counter as dallal_..._total, dropped_<reason> and refused_<limit> as
    labels of one metric each, the connections by transport.
    """
    harness = trafficWithDrops()
    stats = harness.broker.stats()
    assert stats["dropped_queue_full"] == 1
    metrics = metricsOf(siteOf(harness))
    for name, value in stats.items():
        if name not in ("dropped", "connections"):
            assert metrics[sampleOf(name)] == pytest.approx(value, abs=0.01), name
    assert metrics[("dallal_connections", (("transport", "tcp"),))] == stats["connections"] == 2
    assert metrics[("dallal_messages_dropped_total", (("reason", "queue_full"),))] == 1
    assert metrics[("dallal_refused_total", (("limit", "queued_messages"),))] == 1
    assert metrics[("dallal_messages_published_total", ())] == 3
    assert ("process_resident_memory_bytes", ()) in metrics


def test_connections_of_a_transport_gone_stay_at_zero():
    """
    Once a transport's clients have all gone, its series is 0, not missing.
    """
    harness = BrokerHarness()
    site = siteOf(harness)
    client = harness.connect()
    assert metricsOf(site)[("dallal_connections", (("transport", "tcp"),))] == 1
    client.lose()
    assert metricsOf(site)[("dallal_connections", (("transport", "tcp"),))] == 0


def test_bridges_are_metrics():
    """
    Each bridge's state and counts are metrics labelled with its name.
    """

    class Link:
        def status(self):
            return dict(
                state="up",
                remote="tcp:hub:1373",
                direction="both",
                connects=2,
                received=5,
                forwarded=7,
                unacked=1,
            )

    harness = BrokerHarness()
    harness.broker.bridges["hub"] = Link()
    metrics = metricsOf(siteOf(harness))
    assert metrics[("dallal_bridge_state", (("bridge", "hub"), ("state", "up")))] == 1
    assert metrics[("dallal_bridge_state", (("bridge", "hub"), ("state", "down")))] == 0
    assert metrics[("dallal_bridge_connects_total", (("bridge", "hub"),))] == 2
    assert metrics[("dallal_bridge_received_total", (("bridge", "hub"),))] == 5
    assert metrics[("dallal_bridge_forwarded_total", (("bridge", "hub"),))] == 7
    assert metrics[("dallal_bridge_unacked", (("bridge", "hub"),))] == 1


def test_openmetrics_when_asked():
    """
    A scraper that asks for OpenMetrics gets it.
    """
    response = Response(
        siteOf(BrokerHarness()),
        b"/metrics",
        [b"Accept: application/openmetrics-text; version=1.0.0"],
    )
    assert response.headers[b"content-type"].startswith(b"application/openmetrics-text")
    assert response.body.endswith(b"# EOF\n")


def test_health_while_serving_and_draining():
    """
    /health answers 200 while the broker serves, 503 once it drains.
    """
    harness = BrokerHarness()
    site = siteOf(harness)
    serving = Response(site, b"/health")
    assert (serving.status, serving.body) == (200, b"ok\n")
    harness.broker.drain(5)
    draining = Response(site, b"/health")
    assert (draining.status, draining.body) == (503, b"shutting down\n")


def test_dashboard_page():
    """
    / is the dashboard: an HTML page that loads nothing from elsewhere.
    """
    response = Response(siteOf(BrokerHarness()), b"/")
    assert response.status == 200
    assert response.headers[b"content-type"] == b"text/html; charset=utf-8"
    assert b'new EventSource("events")' in response.body
    # Only its own script may run: a topic's name made HTML could run none.
    policy = response.headers[b"content-security-policy"]
    assert b"script-src 'sha256-" in policy and b"unsafe-inline" not in policy
    assert b"http://" not in response.body and b"https://" not in response.body


def test_events_stream_figures_each_second():
    """
    /events sends the figures at once, then each second with the rates
    since the last, and the busiest topics first.
    """
    harness = BrokerHarness()
    publisher = harness.connect()
    publisher.send(b"PUB 1 quiet 1\r\nx\r\n")
    response = Response(siteOf(harness), b"/events")
    assert response.headers[b"content-type"] == b"text/event-stream"
    [first] = response.events()
    assert first["rates"] is None
    assert first["topics"] == [["quiet", None, 1]]
    assert first["connections"] == {"tcp": 1}
    publisher.send(b"PUB 2 busy 1\r\nx\r\n" * 4)
    harness.clock.advance(web.SAMPLE_INTERVAL)
    second = response.events()[1]
    assert second["rates"]["published"] == 4.0
    assert second["totals"]["published"] == 5
    assert second["topics"] == [["busy", 4.0, 4], ["quiet", 0.0, 1]]


def test_late_watcher_gets_the_last_figures_at_once():
    """
    A second dashboard gets the last sample at once, not a second later.
    """
    harness = BrokerHarness()
    site = siteOf(harness)
    Response(site, b"/events")
    harness.clock.advance(web.SAMPLE_INTERVAL)
    late = Response(site, b"/events")
    [figures] = late.events()
    assert figures["rates"] is not None


def sampling(clock):
    """
    Whether the dashboard's figures are sampled on C{clock}.
    """
    return any("LiveFigures.sample" in repr(call) for call in clock.getDelayedCalls())


def test_sampling_stops_when_nobody_watches():
    """
    Once the last dashboard has gone, the broker samples nothing.
    """
    harness = BrokerHarness()
    site = siteOf(harness)
    response = Response(site, b"/events")
    assert sampling(harness.clock)
    response.channel.connectionLost(Failure(ConnectionDone()))
    harness.clock.advance(web.SAMPLE_INTERVAL)
    assert site.figures.watchers == set()
    assert not sampling(harness.clock)


def test_stalled_watcher_is_skipped_then_disconnected():
    """
    A dashboard whose connection takes no more is written nothing while
    it is paused, and is disconnected after WATCHER_STALL_LIMIT seconds.
    """
    harness = BrokerHarness()
    response = Response(siteOf(harness), b"/events")
    response.transport.producer.pauseProducing()
    written = len(response.transport.value())
    harness.clock.advance(web.SAMPLE_INTERVAL)
    assert len(response.transport.value()) == written
    harness.clock.pump([web.SAMPLE_INTERVAL] * (int(web.WATCHER_STALL_LIMIT) - 1))
    assert not response.transport.disconnecting
    harness.clock.advance(web.SAMPLE_INTERVAL)
    assert response.transport.disconnecting


def test_resumed_watcher_gets_figures_again():
    harness = BrokerHarness()
    response = Response(siteOf(harness), b"/events")
    response.transport.producer.pauseProducing()
    harness.clock.advance(web.SAMPLE_INTERVAL)
    response.transport.producer.resumeProducing()
    harness.clock.advance(web.SAMPLE_INTERVAL)
    assert len(response.events()) == 2


def test_stop_ends_the_streams():
    harness = BrokerHarness()
    site = siteOf(harness)
    response = Response(site, b"/events")
    site.figures.stop()
    assert response.transport.disconnecting
    assert not sampling(harness.clock)


# Passwords


class CountingChecks:
    """
    Runs the broker's password checks inline, counting them.
    """

    def __init__(self):
        self.checks = 0

    def __call__(self, function, *arguments):
        self.checks += 1
        return runInline(function, *arguments)


def guardedSite(**config):
    checker = CountingChecks()
    harness = BrokerHarness(users=USERS, runHash=checker, **config)
    return harness, checker, siteOf(harness, harness.gatekeeper)


@pytest.mark.parametrize("path", [b"/", b"/metrics", b"/events", b"/health"])
def test_every_page_needs_the_password(path):
    """
    Without credentials, every page answers 401 and asks for Basic
    authentication.
    """
    _, _, site = guardedSite()
    response = Response(site, path)
    assert response.status == 401
    assert response.headers[b"www-authenticate"] == b'Basic realm="dallal", charset="UTF-8"'


def test_wrong_password_is_refused_after_the_failure_delay():
    """
    A wrong password is answered 401 after the failure delay, counted and
    logged as a client's failed login.
    """
    harness, _, site = guardedSite()
    response = Response(site, b"/metrics", [basic("alice", "guess")])
    assert response.transport.value() == b""
    harness.clock.advance(FAILURE_DELAY)
    assert response.status == 401
    assert harness.broker.counters["logins_failed"] == 1
    assert harness.logLines("login_failed") == [
        "event=login_failed session=0 client=127.0.0.1:50000 user=alice "
        f"broker=harness t={harness.clock.seconds():.6f}"
    ]


@pytest.mark.parametrize(
    "header",
    [b"Authorization: Bearer abc", b"Authorization: Basic !!!", b"Authorization: Basic YWxpY2U="],
)
def test_malformed_credentials_are_asked_again(header):
    harness, checker, site = guardedSite()
    assert Response(site, b"/metrics", [header]).status == 401
    assert checker.checks == 0


def test_a_client_gone_leaves_the_check_queue():
    """
    A web client that goes while its password waits for its check is
    checked no more.
    """
    harness, _, site = guardedSite()
    for n in range(MAX_CONCURRENT_CHECKS):
        harness.gatekeeper.checks.run(f"10.0.0.{n}", Deferred)
    response = Response(site, b"/metrics", [basic("alice", "wonderland")])
    assert len(harness.gatekeeper.checks) == MAX_CONCURRENT_CHECKS + 1
    response.channel.connectionLost(Failure(ConnectionDone()))
    assert len(harness.gatekeeper.checks) == MAX_CONCURRENT_CHECKS


def test_too_many_logins_waiting_are_answered_503():
    """
    Web logins wait in the same bounded queue as the clients': over its
    bound, a request is answered 503 at once, counted and logged as a
    refusal of the limit.
    """
    harness, _, site = guardedSite(config=BrokerConfig(maxPendingLoginsPerIp=1))
    harness.gatekeeper.checks.run("127.0.0.1", lambda: Deferred())
    response = Response(site, b"/metrics", [basic("alice", "wonderland")])
    assert response.status == 503
    assert response.headers[b"retry-after"] == b"1"
    assert harness.broker.counters["refused_pending_logins_per_ip"] == 1


def test_a_password_that_passed_is_remembered():
    """
    A scraper logging in every few seconds costs one scrypt check a
    minute, not one per scrape; the password file read again, or a
    minute gone, makes it checked again.
    """
    harness, checker, site = guardedSite()
    for _ in range(3):
        assert Response(site, b"/metrics", [basic("alice", "wonderland")]).status == 200
    assert checker.checks == 1
    assert Response(site, b"/metrics", [basic("alice", "wrong")]).transport.value() == b""
    assert checker.checks == 2
    harness.clock.advance(web.LOGIN_REMEMBERED)
    assert Response(site, b"/metrics", [basic("alice", "wonderland")]).status == 200
    assert checker.checks == 3
    harness.gatekeeper.checker.replaceUsers(dict(harness.gatekeeper.checker.users))
    assert Response(site, b"/metrics", [basic("alice", "wonderland")]).status == 200
    assert checker.checks == 4


# The option


def test_http_option_listens_on_the_interface():
    options = Options()
    options.parseOptions(["--http", "8080", "--interface", "::1"])
    assert options["http"] == "tcp:8080:interface=\\:\\:1"


def test_http_option_takes_an_endpoint():
    options = Options()
    options.parseOptions(["--http", "ssl:8443:privateKey=k.pem"])
    assert options["http"] == "ssl:8443:privateKey=k.pem"


def test_http_option_refuses_nonsense():
    from twisted.python.usage import UsageError

    with pytest.raises(UsageError, match="--http: 'web' is neither a port number"):
        Options().parseOptions(["--http", "web"])


def test_web_listener_stops_after_the_drain():
    """
    A stopping broker keeps its web listener until it has drained, so
    that /health can say it drains; its client listeners stop at once.
    """
    harness = BrokerHarness(shutdownGrace=5, clock=MemoryReactorClock())
    service = harness.service
    web_ = service.listenHTTP("tcp:0:interface=127.0.0.1")
    tcp = service.listenTCP("tcp:0:interface=127.0.0.1")
    harness.connect().send(b"SUB 1 news\r\n")
    harness.connect().send(b"PUB 1 news 2\r\nhi\r\n")
    assert harness.broker.counters["inflight"] == 1
    stopped = []
    web_.stopService = lambda: stopped.append("http")
    tcp.stopService = lambda: stopped.append("tcp")
    service.stopService()
    assert stopped == ["tcp"]
    harness.clock.advance(5)
    assert stopped == ["tcp", "http"]


def test_unknown_path_is_not_found():
    assert Response(siteOf(BrokerHarness()), b"/nothing").status == 404


def test_web_listener_open_to_all_is_warned():
    """
    A web listener beyond the loopback without passwords is warned about,
    saying what it lets anyone do.
    """
    logged = []
    harness = BrokerHarness(clock=MemoryReactorClock())
    harness.service._log = Logger(observer=logged.append)
    harness.service.listenHTTP("tcp:8080:interface=0.0.0.0")
    harness.service._warnIfOpenToAll()
    [line] = [formatEvent(event) for event in logged]
    assert line == (
        "WARNING: listening on 0.0.0.0:8080 (http) beyond the loopback without "
        "--passwords: anyone who can reach it may read the broker's metrics and "
        "dashboard, and publish and subscribe over /mqtt (README.md, Security)"
    )


def test_topic_counts_are_bounded(monkeypatch):
    """
    Past TOPICS_REMEMBERED topics, the broker's counts of messages per
    topic start again: a client publishing on ever new topics does not
    grow them; the dashboard's rates take the restart as a new count.
    """
    monkeypatch.setattr(sysstats, "TOPICS_PUBLISHED", 3)
    harness = BrokerHarness()
    publisher = harness.connect()
    publisher.send(b"PUB 1 a 1\r\nx\r\n" * 5)
    response = Response(siteOf(harness), b"/events")
    for topic in (b"b", b"c", b"d"):
        publisher.send(b"PUB 2 %s 1\r\nx\r\n" % topic)
    assert harness.broker.topicTraffic.published == {"d": 1}
    harness.clock.advance(web.SAMPLE_INTERVAL)
    assert response.events()[1]["topics"] == [["d", 1.0, 1]]
