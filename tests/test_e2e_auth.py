"""
End to end: logins and topic permissions through the real C{twistd dallal
--passwords FILE --acl FILE} and the real C{dallal --user} command, over
TCP and UDP, in the shell and the chat, with the password from
C{DALLAL_PASSWORD} or typed on a terminal; the warning of a broker anyone
can reach; and no password in any log line.  Every wait is bounded.
"""

import base64
import os
import re
import subprocess

import pytest
import pytest_twisted
from helpers import (
    COMMAND_TIMEOUT,
    DALLAL,
    LOOPBACK_ANY_PORT,
    TWISTD,
    BrokerProcess,
    Conversation,
    OutputCollector,
    dallal,
    environmentWithout,
)
from test_auth import ACL
from test_tls import PKI
from twisted.internet import reactor

from dallal.client import ServerError, connect
from dallal.security.passwords import PasswordFile, PasswordHash

pytestmark = pytest.mark.e2e

PUBLISHED = b"your message published successfully\n"
PUBLISH_FAILED = b"your message publishing failed\n"
SUBSCRIBE_FAILED = b"subscribing failed\n"
WAIT = 30

# Alice's password could pass for a user name: typed in the wrong field, it
# must not reach the log either.
PASSWORDS = {"alice": "Xyzzy-42-plugh", "bob": "Tr0ub4dor&3 with=spaces"}
UDP_LISTENING = re.compile(rb"event=listening transport=udp address=127\.0\.0\.1:(\d+)")


def writeSecurityFiles(folder):
    passwords = PasswordFile(folder / "passwords")
    for user, password in PASSWORDS.items():
        passwords.set(user, PasswordHash.make(password.encode()))
    passwords.save()
    (folder / "acl").write_text(ACL)
    return folder / "passwords", folder / "acl"


class SecuredBroker:
    """
    A broker with the passwords of L{PASSWORDS} and the L{ACL}, on TCP and
    UDP ephemeral loopback ports.
    """

    def __init__(self, folder, *options):
        passwords, acl = writeSecurityFiles(folder)
        self.process = BrokerProcess.plugin(
            folder, "--udp", "0", "--passwords", passwords, "--acl", acl, *options
        )
        try:
            self.udpPort = int(self.process.waitFor(UDP_LISTENING).group(1))
        except BaseException:
            self.process.kill()
            raise
        self.port = self.process.port


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    broker = SecuredBroker(tmp_path_factory.mktemp("secured"))
    try:
        yield broker
    finally:
        broker.process.stop()


def withPassword(password):
    """
    This process's environment with C{DALLAL_PASSWORD}, or without it.
    """
    env = environmentWithout("DALLAL_PASSWORD")
    if password is not None:
        env["DALLAL_PASSWORD"] = password
    return env


def as_(user, port, *arguments, password=None, udp=False):
    """
    Run C{dallal --user USER} with the user's password (or C{password}).
    """
    transport = ["--udp"] if udp else []
    return dallal(
        *transport,
        "--user",
        user,
        "127.0.0.1",
        port,
        *arguments,
        env=withPassword(PASSWORDS[user] if password is None else password),
    )


def subscriberAs(user, port, *topics):
    process = OutputCollector(
        [DALLAL, "--user", user, "127.0.0.1", port, "subscribe", *topics],
        None,
        withPassword(PASSWORDS[user]),
    )
    try:
        process.waitFor(re.escape(b"subscribing on " + " ".join(topics).encode() + b"\n"), WAIT)
    except BaseException:
        process.kill()
        raise
    return process


def test_rightPasswordPublishesAndSubscribes(secured):
    listener = subscriberAs("bob", secured.port, "news/#")
    try:
        result = as_("alice", secured.port, "publish", "news/today", "hello bob")
        assert (result.stdout, result.stderr, result.returncode) == (PUBLISHED, b"", 0)
        listener.waitFor(re.escape(b"news/today: hello bob\n"), WAIT)
        assert listener.terminate() == 0
    finally:
        listener.kill()
    assert listener.output == b"subscribing on news/#\nnews/today: hello bob\n"


@pytest.mark.parametrize("user, password", [("alice", "wrong"), ("carol", "anything")])
def test_wrongPasswordIsRefused(secured, user, password):
    """
    A wrong password and an unknown user read the same: the
    specification's failure line, one line of reason, exit status 1.
    """
    result = dallal(
        "--user", user, "127.0.0.1", secured.port, "publish", "news", "x",
        env=withPassword(password),
    )  # fmt: skip
    assert (result.stdout, result.returncode) == (PUBLISH_FAILED, 1)
    assert result.stderr == (
        b"dallal: the broker at 127.0.0.1:%d refused the login: bad user name or password\n"
        % secured.port
    )


def test_loginRequired(secured):
    result = dallal("127.0.0.1", secured.port, "subscribe", "public/x")
    assert (result.stdout, result.returncode) == (SUBSCRIBE_FAILED, 1)
    assert result.stderr == (
        b"dallal: the broker at 127.0.0.1:%d requires a login: give --user NAME (the "
        b"password from DALLAL_PASSWORD, or typed when asked)\n" % secured.port
    )


def test_noTerminalAndNoPassword(secured):
    result = dallal(
        "--user", "alice", "127.0.0.1", secured.port, "publish", "news", "x",
        env=withPassword(None),
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.endswith(
        b"dallal: error: --user: no terminal to type the password on: set DALLAL_PASSWORD\n"
    )


def test_aclRefusalsAreShownToTheUser(secured):
    result = as_("bob", secured.port, "publish", "news", "x")
    assert (result.stdout, result.returncode) == (PUBLISH_FAILED, 1)
    assert result.stderr == (
        b"dallal: the broker refused the request: FORBIDDEN: user bob may not publish on news\n"
    )
    result = as_("bob", secured.port, "subscribe", "news/#", "secret/#")
    assert (result.stdout, result.returncode) == (SUBSCRIBE_FAILED, 1)
    assert result.stderr == (
        b"dallal: the broker refused the request: FORBIDDEN: user bob may not subscribe "
        b"to secret/#\n"
    )


def test_wildcardSubscriberOnlyReceivesWhatItMayRead(secured):
    listener = subscriberAs("bob", secured.port, "#")
    try:
        for topic in ("news/a", "secret/x", "bob/x", "news/b"):
            result = as_("alice", secured.port, "publish", topic, f"on {topic}")
            assert result.stdout == PUBLISHED
        listener.waitFor(re.escape(b"news/b: on news/b\n"), WAIT)
        assert listener.terminate() == 0
    finally:
        listener.kill()
    assert listener.output == b"subscribing on #\nnews/a: on news/a\nnews/b: on news/b\n"


def test_loginOverUdp(secured):
    result = as_("alice", secured.udpPort, "publish", "public/x", "over udp", udp=True)
    assert (result.stdout, result.stderr, result.returncode) == (PUBLISHED, b"", 0)
    result = as_("alice", secured.udpPort, "publish", "public/x", "x", udp=True, password="no")
    assert (result.stdout, result.returncode) == (PUBLISH_FAILED, 1)
    assert result.stderr == (
        b"dallal: the broker at 127.0.0.1:%d refused the login: bad user name or password\n"
        % secured.udpPort
    )
    result = dallal("--udp", "127.0.0.1", secured.udpPort, "publish", "public/x", "x")
    assert b"requires a login" in result.stderr and result.returncode == 1


def test_shellAndChatLogIn(secured):
    shell = dallal(
        "--user", "bob", "127.0.0.1", secured.port, "shell",
        env=withPassword(PASSWORDS["bob"]),
        input=b"/sub news/#\n/pub news x\n/pub bob/x y\n/disc\n",
    )  # fmt: skip
    assert shell.stdout == b"subscribed to news/#\npublished on bob/x\ndisconnected\n"
    assert shell.stderr == b"error: user bob may not publish on news (FORBIDDEN)\n"
    chat = dallal(
        "--user", "alice", "127.0.0.1", secured.port, "chat", "--name", "al", "room",
        env=withPassword(PASSWORDS["alice"]),
        input=b"hello room\n",
    )  # fmt: skip
    assert (chat.stdout, chat.stderr, chat.returncode) == (
        b"chatting on room as al\ndisconnected\n",
        b"",
        0,
    )


def test_loginOverTls(tmp_path):
    """
    Where the password must not cross the network in clear: a TLS listener,
    and C{dallal --tls --user}.
    """
    pki = PKI(tmp_path)
    passwords, acl = writeSecurityFiles(tmp_path)
    broker = BrokerProcess(
        [
            TWISTD, "-n", "--pidfile=", "dallal", "--passwords", passwords,
            "--tcp", f"ssl:0:interface=127.0.0.1:privateKey={pki.key}:certKey={pki.certificate}",
        ],
        tmp_path,
    )  # fmt: skip
    try:
        for password, stdout in ((PASSWORDS["bob"], PUBLISHED), ("wrong", PUBLISH_FAILED)):
            result = dallal(
                "--tls", "--cafile", pki.ca, "--user", "bob", "localhost", broker.port,
                "publish", "news", "over tls",
                env=withPassword(password),
            )  # fmt: skip
            assert result.stdout == stdout
    finally:
        broker.stop()
    assert b"event=login session=1 " in broker.output
    assert b"event=login_failed session=2 " in broker.output


def test_passwordTypedOnATerminalIsNotEchoed(secured):
    master, terminal = os.openpty()
    process = subprocess.Popen(
        [DALLAL, "--user", "bob", "127.0.0.1", str(secured.port), "publish", "bob/t", "typed"],
        stdin=terminal,
        stdout=terminal,
        stderr=terminal,
        env=withPassword(None),
        start_new_session=True,
    )
    os.close(terminal)
    conversation = Conversation(process, master, master)
    try:
        conversation.expect(re.escape(b"password of bob at 127.0.0.1:%d: " % secured.port))
        conversation.type(PASSWORDS["bob"].encode() + b"\r")
        conversation.expect(re.escape(PUBLISHED.rstrip()))
        assert conversation.wait() == 0
    finally:
        process.kill()
        os.close(master)
    assert PASSWORDS["bob"].encode() not in conversation.output


def test_userGivenToABrokerWithoutPasswords(broker):
    result = as_("alice", broker.port, "publish", "news", "x")
    assert (result.stdout, result.returncode) == (PUBLISHED, 0)
    assert result.stderr == (
        b"dallal: the broker at 127.0.0.1:%d takes no passwords: connected anonymously, "
        b"not as alice\n" % broker.port
    )


@pytest_twisted.ensureDeferred
async def test_clientLibraryLogsIn(secured):
    endpoint = f"tcp:127.0.0.1:{secured.port}"
    client = await connect(reactor, endpoint, ("alice", PASSWORDS["alice"])).addTimeout(
        WAIT, reactor
    )
    try:
        assert client.user == "alice"
        await client.publish("anything", b"x").addTimeout(WAIT, reactor)
    finally:
        await client.close().addTimeout(WAIT, reactor)
    with pytest.raises(ServerError) as refused:
        await connect(reactor, endpoint, ("alice", "wrong")).addTimeout(WAIT, reactor)
    assert (refused.value.code, refused.value.reason) == (
        "BAD_CREDENTIALS",
        "bad user name or password",
    )


def test_noPasswordInAnyLogLine(tmp_path):
    """
    Logins that succeed and fail, over TCP and UDP, a password typed as a
    user name, every per-message event on: neither the broker's log nor
    anything the commands print holds a password, as typed or in base64.
    """
    broker = SecuredBroker(tmp_path, "--message-events")
    outputs = []
    try:
        for udp, port in ((False, broker.port), (True, broker.udpPort)):
            for user, password in (("alice", None), ("bob", None), ("alice", PASSWORDS["bob"])):
                result = as_(user, port, "publish", "bob/x", "m", udp=udp, password=password)
                outputs += [result.stdout, result.stderr]
        # Alice's password typed as the user name, and bob's as a password.
        result = dallal(
            "--user", PASSWORDS["alice"], "127.0.0.1", broker.port, "publish", "x", "m",
            env=withPassword(PASSWORDS["bob"]),
        )  # fmt: skip
        outputs += [result.stdout, result.stderr]
        assert b"refused the login" in result.stderr
    finally:
        broker.process.stop()
    log = broker.process.output
    assert log.count(b"event=login ") == 4 and log.count(b"event=login_failed ") == 3
    assert b"event=login_failed session=0 client=127.0.0.1:" in log  # over UDP
    assert b" user=? " in log
    everything = b"\n".join([log, *outputs])
    for password in PASSWORDS.values():
        for form in (password.encode(), base64.b64encode(password.encode())):
            assert form not in everything, form


# The warning of a broker anyone can reach, and files that are wrong


WARNING = re.compile(
    rb"\[dallal\.server\.service\.DallalService#warn\] WARNING: listening on (\S+) \((tcp|udp)\) "
    rb"beyond the loopback without --passwords: anyone who can reach it may publish and "
    rb"subscribe \(README\.md, Security\)\n"
)


@pytest.mark.parametrize(
    "options, warned",
    [
        (["--tcp", "0", "--interface", "0.0.0.0", "--udp", "0"], [b"tcp", b"udp"]),
        (["--tcp", "tcp:0:interface=0.0.0.0", "--tcp", LOOPBACK_ANY_PORT], [b"tcp"]),
        (["--tcp", "0", "--interface", "0.0.0.0", "--acl", "{acl}"], [b"tcp"]),
        (["--tcp", "0", "--interface", "0.0.0.0", "--udp", "0", "--passwords", "{pw}"], []),
        (["--tcp", LOOPBACK_ANY_PORT, "--udp", "0"], []),
    ],
    ids=["interface", "endpoint", "acl only", "passwords", "loopback"],
)
def test_warningWhenListeningBeyondLoopback(tmp_path, options, warned):
    passwords, acl = writeSecurityFiles(tmp_path)
    options = [option.format(pw=passwords, acl=acl) for option in options]
    broker = OutputCollector([TWISTD, "-n", "--pidfile=", "dallal", *options], tmp_path)
    try:
        # The warnings come right after the last listening event.
        listeners = options.count("--tcp") + options.count("--udp")
        broker.waitUntil(
            lambda output: output.count(b"event=listening ") == listeners, WAIT, "listening"
        )
        if warned:
            broker.waitUntil(
                lambda output: len(WARNING.findall(output)) == len(warned), WAIT, "warnings"
            )
        status = broker.terminate()
    finally:
        broker.kill()
    assert status in (0, -15), broker.output
    found = WARNING.findall(broker.output)
    assert [transport for _, transport in found] == warned, broker.output
    assert all(address.startswith(b"0.0.0.0:") for address, _ in found)


@pytest.mark.parametrize(
    "files, reason",
    [
        ({"passwords": "# users\nalice\n"}, "{folder}/passwords:2: expected <user>:<hash>"),
        ({"acl": "user alice\ntopic reed a\n"}, "{folder}/acl:2: expected: topic [read|"),
        ({"passwords": None}, "cannot read the password file {folder}/passwords: no such file"),
    ],
    ids=["password file", "acl", "missing"],
)
def test_wrongFilesStopTheBrokerAtStart(tmp_path, files, reason):
    options = []
    for option, text in files.items():
        if text is not None:
            (tmp_path / option).write_text(text)
        options += [f"--{option}", tmp_path / option]
    result = subprocess.run(
        [TWISTD, "-n", "--pidfile=", "dallal", "--tcp", LOOPBACK_ANY_PORT, *map(str, options)],
        cwd=tmp_path,
        capture_output=True,
        timeout=COMMAND_TIMEOUT,
    )
    output = (result.stdout + result.stderr).decode()
    assert result.returncode != 0
    assert f"dallal: cannot start: {reason.format(folder=tmp_path)}" in output, output
    assert "Traceback" not in output, output
