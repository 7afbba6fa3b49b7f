"""
Logins and topic permissions (L{dallal.security.auth}, L{dallal.security.acl} in the broker):
the C{twisted.cred} checker and gatekeeper, then the broker's TCP protocol
and UDP port on a clock with in-memory transports: what a client may do
before and after logging in, what it reads back, and what the broker logs
and counts.
"""

import base64
import threading

import pytest
import pytest_twisted
from helpers import (
    CHEAP_SCRYPT,
    PING_INTERVAL,
    TOKEN,
    BrokerHarness,
    MemoryRetained,
    UdpHarness,
    decodeFrames,
    makeGatekeeper,
    messages,
)
from twisted.cred.checkers import ANONYMOUS
from twisted.cred.credentials import UsernamePassword
from twisted.cred.error import UnauthorizedLogin
from twisted.internet import reactor
from twisted.internet.defer import Deferred, gatherResults
from twisted.internet.task import Clock
from twisted.python import usage

from dallal.security.acl import parseAcl
from dallal.security.auth import (
    FAILURE_DELAY,
    LOGIN_TIMEOUT,
    MAX_CONCURRENT_CHECKS,
    BrokerRealm,
    Gatekeeper,
    IBrokerUser,
    LoginFailed,
    PasswordFileChecker,
    UnknownUser,
    beyondLoopback,
)
from dallal.security.passwords import PasswordFile, PasswordFileError, PasswordHash
from dallal.server.tap import Options

USERS = {"alice": b"alice's secret", "bob": b"correct horse battery staple"}
ACL = """\
# Anonymous clients read the public topics.
topic read public/#

user alice
topic readwrite #

user bob
topic read news/#
topic write bob/#
topic deny news/secret

pattern readwrite users/%u/#
pattern read devices/%c/#
"""


def failureOf(deferred):
    """
    The exception a Deferred that has already failed failed with.
    """
    failures = []
    deferred.addErrback(failures.append)
    assert failures, "the Deferred has not failed"
    return failures[0].value


def resultOf(deferred):
    results = []
    deferred.addCallback(results.append)
    assert results, "the Deferred has not fired"
    return results[0]


# The checker, the realm and the gatekeeper


class PendingChecks:
    """
    A C{runHash} that runs nothing until told: the checks waiting for a
    thread.
    """

    def __init__(self):
        self.waiting = []

    def __call__(self, function, *arguments):
        deferred = Deferred()
        self.waiting.append((deferred, function, arguments))
        return deferred

    def runAll(self):
        waiting, self.waiting = self.waiting, []
        for deferred, function, arguments in waiting:
            deferred.callback(function(*arguments))


def cheapChecker(runHash):
    return PasswordFileChecker(
        {name: PasswordHash.make(password, **CHEAP_SCRYPT) for name, password in USERS.items()},
        runHash=runHash,
    )


@pytest.mark.parametrize(
    "username, password, outcome",
    [
        (b"alice", USERS["alice"], "alice"),
        (b"alice", b"alice's secreT", UnauthorizedLogin),
        (b"alice", b"", UnauthorizedLogin),
        (b"carol", USERS["alice"], UnknownUser),
        (b"\xff", b"x", UnknownUser),
    ],
)
def test_checker(username, password, outcome):
    checks = PendingChecks()
    checking = cheapChecker(checks).requestAvatarId(UsernamePassword(username, password))
    # Unknown users are checked against a decoy hash too: the same work.
    assert len(checks.waiting) == 1
    checks.runAll()
    if isinstance(outcome, str):
        assert resultOf(checking) == outcome
    else:
        error = failureOf(checking)
        assert type(error) is outcome


def test_gatekeeperRunsAFewChecksAtATime():
    """
    However many clients try at once, at most L{MAX_CONCURRENT_CHECKS}
    scrypt checks (16 MiB each) run; the others wait their turn.
    """
    checks = PendingChecks()
    clock = Clock()
    gatekeeper = makeGatekeeper(clock, USERS, runHash=checks)
    attempts = [
        gatekeeper.login("bob", b"guess %d" % number, "c", f"10.0.0.{number}")
        for number in range(3 * MAX_CONCURRENT_CHECKS)
    ]
    assert len(checks.waiting) == MAX_CONCURRENT_CHECKS
    while checks.waiting:
        checks.runAll()
    clock.advance(FAILURE_DELAY)
    for attempt in attempts:
        assert type(failureOf(attempt)) is LoginFailed


class RecordingHash(PasswordHash):
    """
    A hash that notes the thread each check runs in.
    """

    threads = []

    def verify(self, password):
        self.threads.append(threading.get_ident())
        return PasswordHash.verify(self, password)


@pytest_twisted.ensureDeferred
async def test_checksRunOffTheReactorThread():
    """
    By default a check runs on the checks' own threads: a client trying
    passwords does not hold up the others' traffic, and however many
    checks run, they run on no more threads than run at once (each thread
    keeps the memory its checks took).
    """
    hashed = PasswordHash.make(b"pw", **CHEAP_SCRYPT)
    recording = RecordingHash(hashed.n, hashed.r, hashed.p, hashed.salt, hashed.digest)
    checker = PasswordFileChecker({"alice": recording})
    names = await gatherResults(
        [
            checker.requestAvatarId(UsernamePassword(b"alice", b"pw")).addTimeout(30, reactor)
            for _ in range(20)
        ]
    )
    assert names == ["alice"] * 20
    assert threading.get_ident() not in recording.threads
    assert 1 <= len(set(recording.threads)) <= MAX_CONCURRENT_CHECKS


def test_failedLoginIsAnsweredAfterADelay():
    """
    A refused login fails only after L{FAILURE_DELAY} seconds, naming the
    user only if the password file knows it (a password typed as a user
    name stays out of the log).
    """
    clock = Clock()
    gatekeeper = makeGatekeeper(clock, USERS)
    refused = []
    for user in ("alice", "my password"):
        attempt = gatekeeper.login(user, b"nope", "c1")
        attempt.addErrback(refused.append)
    right = gatekeeper.login("alice", USERS["alice"], "c3")
    assert resultOf(right).name == "alice"
    clock.advance(FAILURE_DELAY - 0.01)
    assert refused == []
    clock.advance(0.01)
    assert [(type(failure.value), failure.value.shownUser) for failure in refused] == [
        (LoginFailed, "alice"),
        (LoginFailed, "?"),
    ]


def test_realmGivesTheUsersPermissions():
    realm = BrokerRealm(parseAcl(ACL))
    gatekeeper = Gatekeeper(Clock(), realm, cheapChecker(lambda f, *a: Deferred()))
    anonymous = gatekeeper.anonymous("dev1")
    assert anonymous.name is None
    assert anonymous.permissions.mayRead("public/x")
    assert anonymous.permissions.mayRead("devices/dev1/x")
    assert not anonymous.permissions.mayWrite("public/x")
    assert Gatekeeper(Clock(), BrokerRealm()).anonymous().permissions is None
    with pytest.raises(NotImplementedError):
        realm.requestAvatar("alice", None, UsernamePassword)


def test_bridgeUsersAreTheOnlyUsersThatMayBridge(tmp_path):
    """
    --bridge-users names users of the password file: only they may send
    bridge frames; an anonymous client (no passwords) may.
    """
    path = tmp_path / "passwords"
    passwords = PasswordFile(path)
    for user, password in USERS.items():
        passwords.set(user, PasswordHash.make(password, **CHEAP_SCRYPT))
    passwords.save()
    realm = Gatekeeper.fromFiles(Clock(), str(path), bridgeUsers=("alice",)).realm
    mayBridge = {user: realm.requestAvatar(user, None, IBrokerUser)[1].mayBridge for user in USERS}
    assert mayBridge == {"alice": True, "bob": False}
    assert realm.requestAvatar(ANONYMOUS, None, IBrokerUser)[1].mayBridge
    with pytest.raises(PasswordFileError, match="has no user 'carol', named by --bridge-users"):
        Gatekeeper.fromFiles(Clock(), str(path), bridgeUsers=("carol",))
    with pytest.raises(usage.UsageError, match="give it too"):
        Options().parseOptions(["--bridge-users", "alice"])


@pytest.mark.parametrize(
    "host, beyond",
    [
        ("127.0.0.1", False),
        ("127.8.9.1", False),
        ("::1", False),
        ("0.0.0.0", True),
        ("::", True),
        ("192.168.1.5", True),
        ("fe80::1%eth0", True),
    ],
)
def test_beyondLoopback(host, beyond):
    class Address:
        pass

    address = Address()
    address.host = host
    assert beyondLoopback(address) is beyond


def test_aUnixSocketIsNotBeyondLoopback():
    from twisted.internet.address import UNIXAddress

    assert not beyondLoopback(UNIXAddress(b"/tmp/dallal.sock"))


# Logging in over TCP


def credentialOptions(user, password):
    return b"user=%s password=%s" % (user.encode(), base64.b64encode(password))


@pytest.fixture
def secured():
    """
    A broker that takes the passwords of L{USERS} and enforces L{ACL}.
    """
    return BrokerHarness(users=USERS, acl=ACL)


BEFORE_LOGIN = [
    (b"SUB 1 news\r\n", b"ERR 1 NOT_AUTHORIZED "),
    # The payload is skipped: what looks like a frame in it is not obeyed.
    (b"PUB 2 news 6\r\nPING\r\n\r\n", b"ERR 2 NOT_AUTHORIZED "),
    (b"STATS 3\r\n", b"ERR 3 NOT_AUTHORIZED "),
    (b"LIST 4\r\n", b"ERR 4 NOT_AUTHORIZED "),
    (b"TOPICS 5\r\n", b"ERR 5 NOT_AUTHORIZED "),
    (b"UNSUB 6 news\r\n", b"ERR 6 NOT_AUTHORIZED "),
    (b"ACK 7\r\n", b"ERR - NOT_AUTHORIZED "),
    (b"HELLO 8 me\r\n", b"ERR 8 NOT_AUTHORIZED this broker requires a login: "),
]


@pytest.mark.parametrize("sent, answer", BEFORE_LOGIN, ids=[a.decode() for _, a in BEFORE_LOGIN])
def test_nothingButHelloPingAndByeBeforeLogin(secured, sent, answer):
    """
    Before logging in a client can only log in, ping and say BYE; anything
    else is refused, and the connection stays open for the login.
    """
    client = secured.connect()
    client.send(sent, b"PING\r\n")
    received = client.received()
    assert received.startswith(answer) and received.endswith(b"\r\nPONG\r\n")
    assert received.count(b"\r\n") == 2
    assert not client.closing
    assert [fields["code"] for fields in secured.fields("protocol_error")] == ["NOT_AUTHORIZED"]
    assert client.login("alice", USERS["alice"]).startswith(b"HELLO h version=")
    client.send(b"BYE\r\n")
    assert client.received() == b"BYE\r\n" and client.closing


# The error codes of logins and permissions, on the side (open or closed)
# PROTOCOL.md gives them; test_server_tcp checks the table against this.
# (what is sent, having logged in as, seconds waited, the ERR, whether the
# connection closes)
AUTH_ERRORS = [
    (b"SUB 1 news\r\n", None, 0, b"ERR 1 NOT_AUTHORIZED ", False),
    (
        b"HELLO h c1 " + credentialOptions("alice", b"guess") + b"\r\n",
        None,
        FAILURE_DELAY,
        b"ERR h BAD_CREDENTIALS ",
        True,
    ),
    (b"PUB 2 news 2\r\nhi\r\n", "bob", 0, b"ERR 2 FORBIDDEN ", False),
    (b"", None, LOGIN_TIMEOUT, b"ERR - LOGIN_TIMEOUT no login within 60 seconds", True),
]


@pytest.mark.parametrize(
    "sent, user, wait, error, closes",
    AUTH_ERRORS,
    ids=[error.decode() for *_, error, _ in AUTH_ERRORS],
)
def test_authErrors(secured, sent, user, wait, error, closes):
    client = secured.connect()
    if user is not None:
        client.login(user, USERS[user])
    client.send(sent)
    # The client answers the broker's pings while it waits.
    while wait > 0:
        secured.clock.advance(min(wait, PING_INTERVAL))
        wait -= PING_INTERVAL
        client.send(b"PONG\r\n")
    answer = client.received().replace(b"PING\r\n", b"")
    assert answer.startswith(error) and answer.count(b"\r\n") == 1
    assert client.closing is closes
    if not closes:
        client.send(b"PING\r\n")
        assert client.received() == b"PONG\r\n"


def test_loginInTimeIsNotClosed(secured):
    client = secured.connect()
    secured.clock.advance(LOGIN_TIMEOUT - 1)
    client.login("alice", USERS["alice"])
    secured.clock.advance(1)
    client.send(b"PONG\r\nPONG\r\n")
    assert not client.closing


def test_loginTimeoutWaitsForAPasswordBeingChecked():
    checks = PendingChecks()
    harness = BrokerHarness(users=USERS, runHash=checks)
    client = harness.connect()
    client.login("alice", USERS["alice"])
    # The deadline passes while the password is checked (in one step: the
    # client, whose reading is paused, could not answer pings meanwhile).
    harness.clock.advance(LOGIN_TIMEOUT)
    checks.runAll()
    answer = client.received()
    assert b"HELLO h version=" in answer and answer.endswith(b" user=alice\r\n")
    assert not client.closing


def test_loginThenServed(secured):
    client = secured.connect()
    answer = client.login("alice", USERS["alice"])
    assert answer.startswith(b"HELLO h version=") and answer.endswith(b" user=alice\r\n")
    client.send(b"SUB 1 news\r\nPUB 2 news 2\r\nhi\r\n")
    frames = decodeFrames(client.received())
    assert [frame.verb for frame in frames] == [b"SUBACK", b"MSG", b"PUBACK"]
    assert secured.fields("login") == [{"session": 1, "client": client.address, "user": "alice"}]
    assert secured.broker.stats()["logins"] == 1


def test_requestsPipelinedAfterTheHelloWaitForTheLogin():
    """
    The broker reads nothing more while it checks a password: a SUB sent in
    the same read as the HELLO is carried out once the login succeeds.
    """
    checks = PendingChecks()
    harness = BrokerHarness(users=USERS, runHash=checks)
    client = harness.connect()
    hello = b"HELLO h c1 " + credentialOptions("bob", USERS["bob"]) + b"\r\n"
    client.send(hello + b"SUB 1 news\r\nPING\r\n")
    assert client.received() == b""
    assert client.transport.producerState == "paused"
    checks.runAll()
    frames = decodeFrames(client.received())
    assert [frame.verb for frame in frames] == [b"HELLO", b"SUBACK", b"PONG"]
    assert client.transport.producerState == "producing"


def test_wrongPasswordClosesTheConnection(secured):
    """
    A refused login is answered after a second, and the connection closes
    (one try per connection, as Mosquitto); what was pipelined after it is
    not served.
    """
    client = secured.connect()
    hello = b"HELLO h c1 " + credentialOptions("alice", b"guess") + b"\r\n"
    client.send(hello + b"SUB 1 news\r\n")
    assert client.received() == b""
    secured.clock.advance(FAILURE_DELAY)
    assert client.received() == b"ERR h BAD_CREDENTIALS bad user name or password\r\n"
    assert client.closing
    client.lose()
    assert secured.fields("login_failed") == [
        {"session": 1, "client": client.address, "user": "alice"}
    ]
    assert secured.fields("protocol_error") == [
        {"session": 1, "client": client.address, "code": "BAD_CREDENTIALS", "fatal": True}
    ]
    assert secured.fields("disconnect")[0]["reason"] == "protocol_error"
    assert secured.fields("subscribe") == []
    assert secured.broker.stats()["logins_failed"] == 1


def test_unknownUserIsNotNamedInTheLog(secured):
    client = secured.connect()
    client.login("hunter2", b"whatever")
    secured.clock.advance(FAILURE_DELAY)
    assert client.received().startswith(b"ERR h BAD_CREDENTIALS ")
    assert [fields["user"] for fields in secured.fields("login_failed")] == ["?"]
    assert not any("hunter2" in line for line in secured.logLines())


def test_connectionLostWhileThePasswordIsChecked():
    checks = PendingChecks()
    harness = BrokerHarness(users=USERS, runHash=checks)
    for password in (USERS["alice"], b"wrong"):
        client = harness.connect()
        client.login("alice", password)
        client.lose()
        checks.runAll()
        harness.clock.advance(FAILURE_DELAY)
        assert client.received() == b""
    assert harness.fields("login") == [] and harness.fields("login_failed") == []


@pytest.mark.parametrize(
    "options, reason",
    [
        (b"user=alice", b"a login needs both user=<name> and password=<base64>"),
        (b"password=eA==", b"a login needs both user=<name> and password=<base64>"),
        (b"user=alice password=not*base64", b"password= must be the password's bytes in base64"),
        (
            "user=alice password=\u00e9A==".encode(),
            b"password= must be the password's bytes in base64",
        ),
    ],
)
def test_malformedCredentials(secured, options, reason):
    client = secured.connect()
    client.send(b"HELLO h c1 " + options + b"\r\n")
    assert client.received() == b"ERR h BAD_ARGUMENTS " + reason + b"\r\n"
    assert not client.closing


def test_oneLoginPerConnection(secured):
    client = secured.connect()
    client.login("alice", USERS["alice"])
    assert client.login("bob", USERS["bob"]) == (
        b"ERR h BAD_ARGUMENTS already logged in as alice: connect again to log in "
        b"as another user\r\n"
    )
    client.send(b"HELLO 2 c1\r\n")
    assert client.received().endswith(b" user=alice\r\n")


def test_passwordsWithAnyBytes():
    """
    A password may hold spaces, '=', line ends and any byte: it travels in
    base64.
    """
    password = b"a b=c\r\n\x00\xff"
    harness = BrokerHarness(users={"carol": password})
    client = harness.connect()
    assert client.login("carol", password).endswith(b" user=carol\r\n")


# Permissions over TCP


def loggedIn(harness, user, clientId="c1"):
    client = harness.connect()
    client.login(user, USERS[user], clientId)
    return client


def test_publishRefusedByTheAcl(secured):
    bob = loggedIn(secured, "bob")
    bob.send(b"PUB 1 news 2\r\nhi\r\nPUB 2 bob/x 2\r\nhi\r\n")
    assert bob.received() == (b"ERR 1 FORBIDDEN user bob may not publish on news\r\nPUBACK 2\r\n")
    assert secured.fields("denied") == [
        {"session": 1, "client": bob.address, "user": "bob", "action": "publish", "topic": "news"}
    ]
    assert secured.broker.stats()["denied"] == 1
    assert [fields["code"] for fields in secured.fields("protocol_error")] == ["FORBIDDEN"]


@pytest.mark.parametrize(
    "topicFilter, allowed",
    [
        ("news", True),
        ("news/+", True),
        ("#", True),  # it reads news/#, and only that
        ("+/x", True),  # news/x
        ("secret", False),
        ("bob/#", False),  # bob may write there, not read
        ("news/secret", False),  # denied
        ("users/bob/inbox", True),  # pattern %u
        ("users/alice/inbox", False),
        ("devices/c1/#", False),  # pattern %c, but c1 is no client id of bob's
    ],
)
def test_subscribeRefusedWhenTheFilterCanReadNothing(secured, topicFilter, allowed):
    bob = loggedIn(secured, "bob")
    bob.send(b"SUB 1 %s\r\n" % topicFilter.encode())
    if allowed:
        assert bob.received() == b"SUBACK 1\r\n"
    else:
        assert bob.received() == (
            b"ERR 1 FORBIDDEN user bob may not subscribe to %s\r\n" % topicFilter.encode()
        )
        assert secured.fields("denied")[0]["action"] == "subscribe"


def test_clientIdPatternsOnlyForTheUsersOwnClientIds(secured):
    """
    A logged-in user gets the %c patterns for its own client ids (its name,
    or its name and '-'), not for another user's that it chose to give.
    """
    bob = loggedIn(secured, "bob", "bob-phone")
    bob.send(b"SUB 1 devices/bob-phone/#\r\n")
    assert bob.received() == b"SUBACK 1\r\n"
    borrowed = loggedIn(secured, "bob", "alice-phone")
    borrowed.send(b"SUB 2 devices/alice-phone/#\r\n")
    assert borrowed.received() == (
        b"ERR 2 FORBIDDEN user bob may not subscribe to devices/alice-phone/#\r\n"
    )


def test_wildcardSubscriberOnlyReceivesWhatItMayRead(secured):
    """
    Read permission is checked per message, on its topic: a subscription to
    C{#} receives only the topics its user may read.
    """
    bob = loggedIn(secured, "bob")
    bob.send(b"SUB 1 # mode=fire\r\n")
    bob.received()
    alice = loggedIn(secured, "alice")
    for topic in (
        b"news/a",
        b"news/secret",
        b"secret",
        b"users/bob/x",
        b"users/carol/x",
        b"news/b",
    ):
        alice.send(b"PUB p %s 1\r\nx\r\n" % topic)
    assert [topic for topic, _ in messages(bob.received())] == [
        b"news/a",
        b"users/bob/x",
        b"news/b",
    ]
    publishes = secured.fields("publish")
    assert [fields["subscribers"] for fields in publishes] == [1, 0, 0, 1, 0, 1]
    # Nothing is dropped or left in flight for the messages it may not read.
    stats = secured.broker.stats()
    assert stats["matched"] == stats["fired"] == 3


def test_retainedMessagesRespectReadPermission(secured):
    secured.broker.retained = MemoryRetained()
    alice = loggedIn(secured, "alice")
    for topic in (b"news/a", b"news/secret", b"other"):
        alice.send(b"PUB p %s 1 retain=1\r\nr\r\n" % topic)
    bob = loggedIn(secured, "bob")
    bob.send(b"SUB 1 #\r\n")
    frames = decodeFrames(bob.received())
    assert frames[0].line == b"SUBACK 1"
    assert [frame.arguments[0] for frame in frames[1:]] == [b"news/a"]


def test_brokersOwnTopicsNeedReadPermissionToo():
    """
    The broker's C{$SYS} statistics reach only those who may read them: a
    rule must name the C{$} level (C{#} does not reach it).
    """
    harness = BrokerHarness(users=USERS, acl=ACL + "user alice\ntopic read $SYS/broker/#\n")
    alice, bob = loggedIn(harness, "alice"), loggedIn(harness, "bob")
    alice.send(b"SUB 1 $SYS/# mode=fire\r\n")
    bob.send(b"SUB 1 $SYS/# mode=fire\r\n")
    assert alice.received() == b"SUBACK 1\r\n"
    assert bob.received() == b"ERR 1 FORBIDDEN user bob may not subscribe to $SYS/#\r\n"
    harness.broker.publishOwn("$SYS/broker/uptime", b"5")
    harness.broker.publishOwn("$SYS/other", b"6")
    assert messages(alice.received()) == [(b"$SYS/broker/uptime", b"5")]


def test_publishToMatchingReachesOnlyWritableTopics(secured):
    alice = loggedIn(secured, "alice")
    alice.send(b"SUB 1 bob/x\r\nSUB 2 bob/y\r\nSUB 3 news/z\r\n")
    alice.received()
    bob = loggedIn(secured, "bob")
    bob.send(b"PUB 1 +/+ 1 to-matching=1\r\nm\r\n")
    assert bob.received() == b"PUBACK 1 topics=2\r\n"
    bob.send(b"PUB 2 news/# 1 to-matching=1\r\nm\r\n")
    assert bob.received() == b"ERR 2 FORBIDDEN user bob may not publish on news/#\r\n"


def test_anonymousClientsUnderAnAcl():
    """
    With an ACL and no passwords everyone is anonymous: the lines before
    any C{user} apply, and the C{%c} patterns once a HELLO gives a client
    id; credentials are not checked.
    """
    harness = BrokerHarness(acl=ACL)
    client = harness.connect()
    client.send(b"SUB 1 public/#\r\nSUB 2 devices/d7/#\r\nPUB 3 public/x 1\r\nx\r\n")
    assert client.received() == (
        b"SUBACK 1\r\n"
        b"ERR 2 FORBIDDEN anonymous clients may not subscribe to devices/d7/#\r\n"
        b"ERR 3 FORBIDDEN anonymous clients may not publish on public/x\r\n"
    )
    answer = client.login("alice", b"not checked", clientId="d7")
    assert b" user=" not in answer
    client.send(b"SUB 2 devices/d7/#\r\nSUB 3 users/alice/#\r\n")
    assert client.received() == (
        b"SUBACK 2\r\nERR 3 FORBIDDEN anonymous clients may not subscribe to users/alice/#\r\n"
    )
    assert harness.fields("login") == []


def test_passwordsWithoutAclAllowEverything():
    harness = BrokerHarness(users=USERS)
    bob = loggedIn(harness, "bob")
    bob.send(b"SUB 1 #\r\nPUB 2 anything 1\r\nx\r\n")
    frames = decodeFrames(bob.received())
    assert [frame.verb for frame in frames] == [b"SUBACK", b"MSG", b"PUBACK"]


# Logging in over UDP


def udpHello(peer, clientId, credentials=b"", requestId=b"2"):
    """
    Both HELLOs, the second with C{credentials}; the answers to the second.
    """
    peer.send(b"HELLO 1 %s\r\n" % clientId)
    [answer] = peer.received()
    peer.token = TOKEN.search(answer).group(1)
    peer.clientId = clientId.decode()
    extra = b" " + credentials if credentials else b""
    peer.send(b"HELLO %s %s token=%s%s\r\n" % (requestId, clientId, peer.token, extra))
    return peer.received()


def test_udpLoginInTheHelloThatEchoesTheToken():
    checks = PendingChecks()
    harness = UdpHarness(users=USERS, runHash=checks)
    peer = harness.peer(40001)
    peer.send(b"HELLO 1 me " + credentialOptions("alice", USERS["alice"]) + b"\r\n")
    # The first HELLO only gets a token: nothing costly for an address that
    # has not proved it receives.
    assert TOKEN.search(peer.received()[0])
    assert checks.waiting == []
    assert udpHello(peer, b"me", credentialOptions("alice", USERS["alice"])) == []
    # A resend while the password is checked is not checked again.
    peer.send(
        b"HELLO 2 me token=%s %s\r\n" % (peer.token, credentialOptions("alice", USERS["alice"]))
    )
    assert len(checks.waiting) == 1
    checks.runAll()
    [answer] = peer.received()
    assert answer.endswith(b" session=new user=alice\r\n")
    assert harness.fields("login") == [{"session": 1, "client": "127.0.0.1:40001", "user": "alice"}]
    peer.request(b"SUB 3 news")
    assert peer.received() == [b"SUBACK 3\r\n"]


def test_udpLoginRefused():
    harness = UdpHarness(users=USERS)
    peer = harness.peer(40001)
    assert udpHello(peer, b"me", credentialOptions("alice", b"guess")) == []
    harness.clock.advance(FAILURE_DELAY)
    assert peer.received() == [b"ERR 2 BAD_CREDENTIALS bad user name or password\r\n"]
    assert harness.fields("connect") == []
    assert harness.fields("login_failed") == [
        {"session": 0, "client": "127.0.0.1:40001", "user": "alice"}
    ]
    peer.request(b"SUB 3 news")
    assert peer.received()[0].startswith(b"ERR 3 NO_SESSION ")


def test_udpLoginRequired():
    harness = UdpHarness(users=USERS)
    peer = harness.peer(40001)
    [answer] = udpHello(peer, b"me")
    assert answer.startswith(b"ERR 2 NOT_AUTHORIZED this broker requires a login: ")
    assert harness.fields("connect") == []


def aliceOverUdp(clientId):
    """
    A broker that takes passwords, checking them when the test says, with
    alice logged in over UDP as C{clientId}.

    @return: the L{UdpHarness}, its L{PendingChecks}, and alice's peer.
    """
    checks = PendingChecks()
    harness = UdpHarness(users=USERS, runHash=checks)
    alice = harness.peer(40001)
    udpHello(alice, clientId, credentialOptions("alice", USERS["alice"]))
    checks.runAll()
    alice.received()
    return harness, checks, alice


def test_udpResumeWithTheSameCredentials():
    """
    A client whose address changed says both HELLOs again with its
    credentials: the session resumes without the password being checked
    again.  Another user's credentials cannot take the session over.
    """
    harness, checks, _ = aliceOverUdp(b"me")
    moved = harness.peer(40002)
    [answer] = udpHello(moved, b"me", credentialOptions("alice", USERS["alice"]))
    assert answer.endswith(b" session=resumed user=alice\r\n")
    assert checks.waiting == []
    intruder = harness.peer(40003)
    assert udpHello(intruder, b"me", credentialOptions("bob", USERS["bob"])) == []
    checks.runAll()
    [answer] = intruder.received()
    assert answer.startswith(b"ERR 2 NOT_AUTHORIZED this client id names another user's session")
    assert len(harness.fields("connect")) == 1


@pytest.mark.parametrize(
    "request_", [b"SUB 3 #", b"PUB 3 alice/x 6\r\nforged", b"ACK 1", b"PING", b"BYE"]
)
def test_udpClientIdIsNotACredential(request_):
    """
    Issue 24's hijack on a broker with passwords: a sender that knows
    alice's client id gets a token for it at its own address and signs
    requests with it, without a password.  They are refused, and alice's
    session stays hers, where it is.
    """
    harness, checks, alice = aliceOverUdp(b"alice-phone")
    alice.request(b"SUB 1 alice/#")
    assert alice.received() == [b"SUBACK 1\r\n"]
    mallory = harness.peer(40666, host="127.0.0.66")
    [answer] = udpHello(mallory, b"alice-phone")
    assert answer.startswith(b"ERR 2 NOT_AUTHORIZED ")
    line, _, payload = request_.partition(b"\r\n")
    mallory.request(line, payload or None)
    [refusal] = mallory.received()
    assert refusal.split(b" ", 3)[2] == b"BAD_TOKEN"
    assert checks.waiting == []
    alice.publish(b"4", b"alice/x", b"still mine")
    assert alice.received() == [
        b"MSG alice/x 10 sub=1 seq=1 id=1\r\nstill mine\r\n",
        b"PUBACK 4\r\n",
    ]
    assert mallory.received() == []
    assert harness.fields("disconnect") == []


def test_udpAclAppliesToAnonymousSessions():
    harness = UdpHarness(acl=ACL)
    peer = harness.peer(40001)
    [answer] = udpHello(peer, b"d9")
    assert answer.endswith(b" session=new\r\n")
    peer.request(b"SUB 3 devices/d9/x")
    peer.request(b"SUB 4 devices/d8/x")
    assert peer.received() == [
        b"SUBACK 3\r\n",
        b"ERR 4 FORBIDDEN anonymous clients may not subscribe to devices/d8/x\r\n",
    ]
