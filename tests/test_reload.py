"""
SIGHUP: the password file, the ACL file and the configuration file read
again by a running broker, without dropping a connection.
"""

import signal

import pytest
import pytest_twisted
from helpers import CHEAP_SCRYPT, BrokerHarness, decodeFrames
from twisted.internet import reactor
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactorClock
from twisted.logger import globalLogPublisher

from dallal.security.auth import Gatekeeper
from dallal.security.passwords import PasswordHash
from dallal.server.mqtt import PACKET_OVERHEAD
from dallal.server.service import RELOADABLE_FIELDS, DallalService
from dallal.server.tap import RELOADABLE_OPTIONS, Options, makeService

NEWS_ACL = "user alice\ntopic readwrite news/#\ntopic readwrite alerts/#\n"


def aclHarness(tmp_path, text=NEWS_ACL):
    """
    A broker whose gatekeeper reads its ACL from a file holding C{text},
    and a client logged in as alice, subscribed to C{news/#} and C{#}.
    """
    path = tmp_path / "acl.conf"
    path.write_text(text)
    harness = BrokerHarness(users={"alice": b"pw"}, acl=text)
    harness.gatekeeper.aclPath = str(path)
    client = harness.connect()
    client.login("alice", b"pw")
    client.send(b"SUB s1 news/# mode=all\r\nSUB s2 #\r\n")
    assert client.received() == b"SUBACK s1\r\nSUBACK s2\r\n"
    return harness, client, path


def published(harness, topic):
    publisher = harness.connect()
    publisher.login("alice", b"pw")
    publisher.send(b"PUB p %s 2\r\nhi\r\n" % topic.encode())
    return publisher.received()


def test_aSubscriptionTheNewAclForbidsEndsWithANotice(tmp_path):
    harness, client, path = aclHarness(tmp_path)
    path.write_text("user alice\ntopic readwrite alerts/#\n")
    harness.service.reload()
    [notice] = decodeFrames(client.received())
    assert notice.line == (
        b"ERR s1 FORBIDDEN user alice may no longer read news/#: the subscription has ended"
    )
    assert not client.closing
    assert harness.broker.subscriptions(client.protocol) == [("#", "latest")]
    [revoked] = harness.fields("subscription_revoked")
    assert revoked == {
        "session": 1,
        "client": client.address,
        "user": "alice",
        "topic": "news/#",
    }
    assert harness.fields("reloaded") == [{"file": "acl"}]
    assert harness.broker.counters["subscriptions"] == 1


def test_aWildcardSubscriptionStaysAndGetsOnlyWhatItMayRead(tmp_path):
    harness, client, path = aclHarness(tmp_path)
    path.write_text("user alice\ntopic readwrite alerts/#\n")
    harness.service.reload()
    client.received()
    # alice may no longer publish on news (the new ACL), nor read it.
    assert b"ERR p FORBIDDEN" in published(harness, "news/x")
    published(harness, "alerts/x")
    [message] = decodeFrames(client.received())
    assert message.line.startswith(b"MSG alerts/x 2 sub=s2")


def test_aWrongAclFileKeepsTheOldOne(tmp_path):
    harness, client, path = aclHarness(tmp_path)
    path.write_text("user alice\ntopic readwrite news/#\nbogus line\n")
    harness.service.reload()
    assert harness.fields("reload_failed") == [{"file": "acl"}]
    assert harness.fields("reloaded") == []
    assert harness.fields("subscription_revoked") == []
    published(harness, "news/x")
    assert client.received().startswith(b"MSG news/x 2 sub=s1")


def passwordLine(user, password):
    return f"{user}:{PasswordHash.make(password, **CHEAP_SCRYPT)}\n"


def test_thePasswordFileIsReadAgain(tmp_path):
    path = tmp_path / "passwords.txt"
    harness = BrokerHarness(users={"alice": b"pw"})
    harness.gatekeeper.passwordsPath = str(path)
    path.write_text(passwordLine("bob", b"pw2"))
    harness.service.reload()
    assert harness.fields("reloaded") == [{"file": "passwords"}]
    assert b"HELLO h " in harness.connect().login("bob", b"pw2")
    refused = harness.connect()
    refused.login("alice", b"pw")
    harness.clock.advance(1.0)
    assert b"BAD_CREDENTIALS" in refused.received()


def test_aWrongPasswordFileKeepsTheOldOne(tmp_path):
    path = tmp_path / "passwords.txt"
    path.write_text("not a password line\n")
    harness = BrokerHarness(users={"alice": b"pw"})
    harness.gatekeeper.passwordsPath = str(path)
    harness.service.reload()
    assert harness.fields("reload_failed") == [{"file": "passwords"}]
    assert b"HELLO h " in harness.connect().login("alice", b"pw")


def test_aPasswordFileWithoutABridgeUserKeepsTheOldOne(tmp_path):
    path = tmp_path / "passwords.txt"
    path.write_text(passwordLine("hub", b"pw") + passwordLine("alice", b"pw"))
    gatekeeper = Gatekeeper.fromFiles(Clock(), str(path), bridgeUsers=["hub"])
    path.write_text(passwordLine("alice", b"pw") + passwordLine("bob", b"pw"))
    [(name, error)] = gatekeeper.reload()
    assert (name, str(error)) == ("passwords", f"{path} has no user 'hub', named by --bridge-users")
    assert set(gatekeeper.checker.users) == {"hub", "alice"}


def test_sighupIsHandledWhileTheServiceRuns():
    previous = signal.getsignal(signal.SIGHUP)
    service = DallalService(MemoryReactorClock(), sysInterval=0, reloadOnHangup=True)
    service.startService()
    try:
        assert signal.getsignal(signal.SIGHUP) == service._hangup
    finally:
        service.stopService()
    assert signal.getsignal(signal.SIGHUP) == previous


class ThreadCallReactor(MemoryReactorClock):
    """
    A reactor that keeps what C{callFromThread} asks for, to run later.
    """

    def __init__(self):
        MemoryReactorClock.__init__(self)
        self.threadCalls = []

    def callFromThread(self, function, *arguments):
        self.threadCalls.append((function, arguments))


def test_sighupReloadsOnTheReactorsNextTurn():
    reactor = ThreadCallReactor()
    service = DallalService(reactor, sysInterval=0)
    reloads = []
    service.reload = lambda: reloads.append(True)
    service._hangup(signal.SIGHUP, None)
    assert reloads == []
    [(call, arguments)] = reactor.threadCalls
    call(*arguments)
    assert reloads == [True]


@pytest.fixture
def capturedEvents():
    events = []
    globalLogPublisher.addObserver(events.append)
    yield lambda name: [
        {key: event[key] for key in ("option", "value", "file") if key in event}
        for event in events
        if event.get("dallal_event") == name
    ]
    globalLogPublisher.removeObserver(events.append)


@pytest.fixture
def configured():
    """
    Builds the service of C{twistd dallal --config dallal.toml} with a text
    in the file, as C{configured(directory, text, *argv)}, returning the
    service and the file; closes their retained stores at the end.
    """
    services = []

    def configured(directory, text, *argv):
        path = directory / "dallal.toml"
        path.write_text(text)
        options = Options()
        options.parseWithConfig(
            ["--config", str(path), "--data-dir", str(directory / "data"), "--tcp", "0", *argv]
        )
        # The real reactor, which the store's thread answers through; the
        # service is never started.
        service = makeService(options, reactor)
        services.append(service)
        return service, path

    yield configured
    for service in services:
        pytest_twisted.blockon(service.broker.retained.close().addTimeout(10, reactor))


def test_theConfigFileIsReadAgain(tmp_path, capturedEvents, configured):
    service, path = configured(tmp_path, "max-queued = 5\nmax-payload = 100\n")
    path.write_text(
        "max-queued = 7\nmax-payload = 100\nmessage-events = true\nshutdown-grace = 0\n"
        'tcp = ["1400"]\n'
    )
    service.reload()
    config = service.broker.config
    assert config.delivery.maxQueued == 7
    assert service.broker.events.messageEvents
    assert service.shutdownGrace == 0
    assert capturedEvents("option_changed") == [
        {"option": "max-queued", "value": 7},
        {"option": "message-events", "value": 1},
        {"option": "shutdown-grace", "value": 0.0},
    ]
    # The command line's --tcp overrides the file: it has not changed.
    assert capturedEvents("restart_needed") == []
    assert capturedEvents("reloaded") == [{"file": "config"}]


def test_theWebSocketPacketBoundFollowsAReloadedMaxPayload(tmp_path, configured):
    """
    MQTT over WebSockets (C{/mqtt}) refuses frames over the largest packet
    the broker takes: a new C{max-payload} moves that bound for the
    connections that open next, as it does for C{--mqtt}'s.
    """
    service, path = configured(tmp_path, "max-payload = 100\n")
    path.write_text("max-payload = 5000\n")
    service.reload()
    options = service.mqttWebSocketFactory
    assert options.maxFramePayloadSize == options.maxMessagePayloadSize == 5000 + PACKET_OVERHEAD


def test_aBrokerWithoutAWebListenerMakesNoWebSocketFactoryOnReload(tmp_path, configured):
    """
    The web and WebSocket modules are imported with the first web listener:
    a reload of a broker without one does not make the MQTT-over-WebSockets
    factory (which imports them) just to move its bound.
    """
    service, path = configured(tmp_path, "max-payload = 100\n")
    path.write_text("max-payload = 5000\n")
    service.reload()
    assert "mqttWebSocketFactory" not in vars(service)
    (tmp_path / "web").mkdir()
    withWeb, _ = configured(tmp_path / "web", "max-payload = 100\n", "--http", "0")
    assert "mqttWebSocketFactory" in vars(withWeb)


def test_anOptionThatNeedsARestartIsLoggedAndKept(tmp_path, capturedEvents, configured):
    service, path = configured(tmp_path, "max-connections = 50\n")
    path.write_text("max-connections = 60\nmax-line = 1024\n")
    service.reload()
    assert capturedEvents("restart_needed") == [
        {"option": "max-connections"},
        {"option": "max-line"},
    ]
    assert service.broker.config.maxConnections == 50
    assert service.broker.config.maxControlLine == 4096


def test_aWrongConfigFileChangesNothing(tmp_path, capturedEvents, configured):
    service, path = configured(tmp_path, "max-queued = 5\n")
    path.write_text("max-queued = 'x'\n")
    service.reload()
    assert capturedEvents("reload_failed") == [{"file": "config"}]
    assert service.broker.config.delivery.maxQueued == 5


def test_everyReloadableOptionReachesTheBroker(tmp_path, configured):
    """
    Each option said to be reloaded changes the running service: none is
    listed without a field of the broker's that it changes.
    """
    changes = {
        "max-payload": 10,
        "max-topic-length": 10,
        "max-topic-levels": 3,
        "max-subscriptions": 3,
        "max-udp-clients": 3,
        "max-udp-clients-per-ip": 3,
        "max-inflight": 3,
        "max-queued": 3,
        "max-queued-bytes": 3,
        "slow-consumer": '"disconnect"',
        "ack-timeout": 3,
        "max-attempts": 3,
        "message-events": "true",
        "shutdown-grace": 3,
    }
    assert set(changes) == RELOADABLE_OPTIONS
    for name, value in changes.items():
        directory = tmp_path / name
        directory.mkdir()
        service, path = configured(directory, "")
        before = (service.broker.config, service.shutdownGrace, service.broker.events.messageEvents)
        path.write_text(f"{name} = {value}\n")
        service.reload()
        after = (service.broker.config, service.shutdownGrace, service.broker.events.messageEvents)
        assert after != before, name
    assert "maxConnections" not in RELOADABLE_FIELDS
