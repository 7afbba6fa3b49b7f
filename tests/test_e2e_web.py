"""
End to end: the real C{twistd dallal --http}, scraped as Prometheus does
and parsed with C{prometheus_client}'s parser, its health checked while it
drains, behind its passwords, and its dashboard loaded in headless
Chromium while messages flow.  Every wait is bounded.
"""

import base64
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
from browser import CHROMIUM, Browser
from helpers import HTTP_LISTENING, LOOPBACK_ANY_PORT, BrokerProcess, dallal, subscriber
from prometheus_client.parser import text_string_to_metric_families
from test_web import sampleOf

from dallal.security.passwords import PasswordFile, PasswordHash

pytestmark = pytest.mark.e2e

WAIT = 30.0


class WebBroker:
    """
    A broker with a web listener on an ephemeral loopback port.
    """

    def __init__(self, folder, *options):
        self.process = BrokerProcess.plugin(folder, "--http", LOOPBACK_ANY_PORT, *options)
        try:
            self.httpPort = int(self.process.waitFor(HTTP_LISTENING).group(1))
        except BaseException:
            self.process.kill()
            raise
        self.port = self.process.port

    def url(self, path):
        return f"http://127.0.0.1:{self.httpPort}{path}"

    def get(self, path, user=None, password=None):
        """
        GET a path: C{(status, body)}.
        """
        request = urllib.request.Request(self.url(path))
        if user is not None:
            token = base64.b64encode(f"{user}:{password}".encode()).decode()
            request.add_header("Authorization", f"Basic {token}")
        try:
            with urllib.request.urlopen(request, timeout=WAIT) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as error:
            return error.code, error.read()


@pytest.fixture
def broker(tmp_path):
    running = WebBroker(tmp_path)
    yield running
    running.process.stop()


def rawClient(port):
    """
    A TCP connection to the broker, speaking its protocol by hand.
    """
    return socket.create_connection(("127.0.0.1", port), timeout=WAIT)


def test_metrics_are_the_stats(broker):
    """
    A scrape parsed with prometheus_client's parser shows every counter
    that C{dallal stats --json} shows, with the same values.
    """
    listener = subscriber(broker.port, "news")
    try:
        for n in range(3):
            assert dallal("127.0.0.1", broker.port, "publish", "news", f"m{n}").returncode == 0
        listener.waitFor(rb"news: m2\n", WAIT)
        result = dallal("127.0.0.1", broker.port, "stats", "--json")
        assert result.returncode == 0, result.stdout
        stats = json.loads(result.stdout)
        status, body = broker.get("/metrics")
    finally:
        listener.kill()
    assert status == 200
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
    }
    assert stats["published"] == stats["delivered"] == 3
    assert stats["bytes_in"] == 6
    for name, value in stats.items():
        if name not in ("dropped", "connections", "uptime"):
            assert samples[sampleOf(name)] == value, name
    # The stats command's own connection had gone by the scrape.
    assert samples[("dallal_connections", (("transport", "tcp"),))] == stats["connections"] - 1
    assert samples[("dallal_uptime_seconds", ())] >= stats["uptime"]


def test_health_turns_503_while_draining(tmp_path):
    """
    /health answers 200 while the broker serves, and 503 once SIGTERM has
    made it drain a message in flight.
    """
    running = WebBroker(tmp_path, "--shutdown-grace", "20")
    holder = rawClient(running.port)
    try:
        assert running.get("/health") == (200, b"ok\n")
        # A subscriber that never acks: the broker has a message in flight
        # to wait for when it stops.
        holder.sendall(b"SUB 1 news\r\n")
        assert dallal("127.0.0.1", running.port, "publish", "news", "x").returncode == 0
        running.process.process.terminate()
        deadline = time.monotonic() + WAIT
        while running.get("/health")[0] != 503:
            assert time.monotonic() < deadline, "/health never said the broker drains"
            time.sleep(0.1)
        assert running.get("/health") == (503, b"shutting down\n")
        # The subscriber gone, nothing is in flight: the broker stops
        # without waiting for the rest of its grace.
        holder.close()
        running.process.process.wait(WAIT)
    finally:
        holder.close()
        running.process.stop()


def test_behind_the_passwords(tmp_path):
    """
    With --passwords, /metrics, the dashboard and /health ask for them
    (HTTP Basic).
    """
    passwords = PasswordFile(tmp_path / "passwords")
    passwords.set("prometheus", PasswordHash.make(b"scrape-me"))
    passwords.save()
    running = WebBroker(tmp_path, "--passwords", tmp_path / "passwords")
    try:
        assert running.get("/health")[0] == 401
        assert running.get("/health", "prometheus", "scrape-me") == (200, b"ok\n")
        assert running.get("/metrics")[0] == 401
        assert running.get("/")[0] == 401
        assert running.get("/metrics", "prometheus", "wrong")[0] == 401
        status, body = running.get("/metrics", "prometheus", "scrape-me")
        assert status == 200 and b"dallal_messages_published_total 0.0" in body
    finally:
        running.process.stop()


MARKUP = "x/<img/src=x/onerror=alert(1)>"


class Publisher(threading.Thread):
    """
    Publishes on a few topics, ten messages a second, until stopped.
    """

    def __init__(self, port):
        threading.Thread.__init__(self, daemon=True)
        self.connection = rawClient(port)
        self.stopped = threading.Event()

    # Topics, some more often than others; one whose name is HTML too.
    TOPICS = [b"sensors/kitchen/temp"] * 3 + [b"sensors/garage/door"] * 2 + [MARKUP.encode()]

    def run(self):
        n = 0
        while not self.stopped.wait(0.1):
            topic = self.TOPICS[n % len(self.TOPICS)]
            self.connection.sendall(b"PUB %d %s 4\r\n21.5\r\n" % (n, topic))
            n += 1

    def stop(self):
        self.stopped.set()
        self.join(WAIT)
        self.connection.close()


def figure(browser, elementId):
    return browser.evaluate(f"document.getElementById({elementId!r}).textContent")


@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (apt-get install chromium)")
def test_dashboard_in_chromium(broker, tmp_path):
    """
    The dashboard, loaded in headless Chromium at a phone's width while
    messages flow, shows the broker's figures and keeps them live.
    """
    listener = subscriber(broker.port, "sensors/#")
    publisher = Publisher(broker.port)
    publisher.start()
    browser = Browser(width=400, height=900)
    try:
        browser.open(broker.url("/"))
        browser.waitUntil(
            "document.getElementById('state').textContent === 'live'", WAIT, "live figures"
        )
        first = int(figure(browser, "published").replace(",", ""))
        browser.waitUntil(
            f"Number(document.getElementById('published').textContent.replace(/,/g, '')) > {first}"
            " && document.getElementById('published-rate').textContent !== '–'",
            WAIT,
            "more messages published, and a rate",
        )
        topics = browser.evaluate(
            "[...document.querySelectorAll('#topics td.topic')].map(cell => cell.textContent)"
        )
        # (Their order, by the messages of the last second, is the unit tests'.)
        assert sorted(topics) == sorted(topic.decode() for topic in set(Publisher.TOPICS))
        # Shown as text, never made HTML.
        assert browser.evaluate("document.querySelectorAll('#topics img').length") == 0
        assert float(figure(browser, "published-rate")) > 0
        assert figure(browser, "connections") == "2"
        assert figure(browser, "subscriptions") == "1"
        # Nothing overflows a phone's width.
        assert browser.evaluate("document.documentElement.scrollWidth") <= browser.evaluate(
            "window.innerWidth"
        )
        browser.screenshot(tmp_path / "dashboard.png")
    finally:
        browser.close()
        publisher.stop()
        listener.kill()
