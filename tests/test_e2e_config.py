"""
End to end: the real C{twistd dallal --config FILE}, and SIGHUP reloading
the password and ACL files of a running broker while its clients stay
connected.  Every wait is bounded.
"""

import signal
import subprocess

import pytest
import pytest_twisted
from helpers import (
    COMMAND_TIMEOUT,
    DALLAL,
    TWISTD,
    BrokerProcess,
    OutputCollector,
    dallal,
    environmentWithout,
)
from twisted.internet import reactor, threads
from twisted.internet.defer import Deferred

from dallal.client import ServerError, connect
from dallal.security.passwords import PasswordHash

pytestmark = pytest.mark.e2e

PUBLISHED = b"your message published successfully\n"
WAIT = 30


def test_theBrokerRunsWithTheFilesValues(tmp_path):
    config = tmp_path / "dallal.toml"
    config.write_text("max-payload = 10\nmessage-events = true\n")
    broker = BrokerProcess.plugin(tmp_path, "--config", config)
    try:
        refused = dallal("127.0.0.1", broker.port, "publish", "news", "x" * 11)
        assert b"PAYLOAD_TOO_LARGE" in refused.stderr, refused
        taken = dallal("127.0.0.1", broker.port, "publish", "news", "x" * 10)
        assert taken.stdout == PUBLISHED, taken
        # message-events = true: the publish is logged.
        broker.waitFor(rb"event=publish mid=\d+ topic=news bytes=10 ")
    finally:
        broker.stop()


def test_aWrongFileStopsTheBrokerWithOneLine(tmp_path):
    config = tmp_path / "dallal.toml"
    config.write_text("max-queue = 5\n")
    stopped = subprocess.run(
        [TWISTD, "-n", "--pidfile=", "dallal", "--config", config],
        cwd=tmp_path,
        capture_output=True,
        timeout=COMMAND_TIMEOUT,
    )
    assert stopped.returncode == 1
    assert stopped.stdout == b""
    assert stopped.stderr.decode() == (
        f"dallal: cannot start: {config}: unknown key 'max-queue' (did you mean 'max-queued'?)\n"
    )


def passwordLines(**passwords):
    return "".join(
        f"{user}:{PasswordHash.make(password.encode())}\n" for user, password in passwords.items()
    )


def publishAs(port, user, password, topic, message):
    """
    C{dallal --user USER publish}, in a thread (the test's reactor keeps
    running its client meanwhile).
    """
    environment = environmentWithout("DALLAL_PASSWORD")
    environment["DALLAL_PASSWORD"] = password
    return threads.deferToThread(
        dallal, "--user", user, "127.0.0.1", port, "publish", topic, message, env=environment
    )


def receiver():
    """
    A message handler, and a Deferred of the first message it is handed.
    """
    received = Deferred()

    def handle(message):
        if not received.called:
            received.callback(message)

    return handle, received


@pytest_twisted.ensureDeferred
async def test_sighupReloadsPasswordsAndAclWhileClientsStayConnected(tmp_path):
    passwords, acl = tmp_path / "passwords", tmp_path / "acl"
    passwords.write_text(passwordLines(alice="pw-alice"))
    acl.write_text("user alice\ntopic readwrite news/#\ntopic readwrite alerts/#\n")
    broker = BrokerProcess.plugin(tmp_path, "--passwords", passwords, "--acl", acl)
    command = None
    try:
        alice = await connect(
            reactor, f"tcp:127.0.0.1:{broker.port}", ("alice", "pw-alice")
        ).addTimeout(WAIT, reactor)
        handle, received = receiver()
        ended = []
        await alice.subscribe(
            ["news/#", "alerts/#"], handle, onEnded=lambda *what: ended.append(what)
        ).addTimeout(WAIT, reactor)
        # And alice on the command line, in another session.
        environment = environmentWithout("DALLAL_PASSWORD")
        environment["DALLAL_PASSWORD"] = "pw-alice"
        command = OutputCollector(
            [
                DALLAL,
                "--user",
                "alice",
                "127.0.0.1",
                broker.port,
                "subscribe",
                "news/#",
                "alerts/#",
            ],
            None,
            env=environment,
        )
        command.waitFor(rb"subscribing on news/# alerts/#\n")

        # carol is added; alice may no longer touch news.
        passwords.write_text(passwordLines(alice="pw-alice", carol="pw-carol"))
        acl.write_text("user alice\ntopic readwrite alerts/#\n\nuser carol\ntopic write alerts/#\n")
        broker.process.send_signal(signal.SIGHUP)
        broker.waitFor(rb"event=reloaded file=acl ")
        assert b"event=reloaded file=passwords " in broker.output

        carol = await publishAs(broker.port, "carol", "pw-carol", "alerts/fire", "hot")
        assert carol.stdout == PUBLISHED, carol
        # alice's connection is the same one, and still receives.
        message = await received.addTimeout(WAIT, reactor)
        assert (message.topic, message.payload) == ("alerts/fire", b"hot")
        [(topic, error)] = ended
        assert (topic, error.code) == ("news/#", "FORBIDDEN")
        assert error.reason == "user alice may no longer read news/#: the subscription has ended"
        command.waitFor(
            rb"dallal: user alice may no longer read news/#: the subscription has ended\n"
        )
        command.waitFor(rb"alerts/fire: hot\n")
        assert command.process.poll() is None
        broker.waitFor(rb"event=subscription_revoked session=1 client=\S+ user=alice topic=news/# ")
        try:
            await alice.publish("news/x", b"no").addTimeout(WAIT, reactor)
        except ServerError as error:
            assert error.code == "FORBIDDEN"
        else:
            raise AssertionError("alice published on news after the new ACL")
        await alice.close().addTimeout(WAIT, reactor)

        # A broken ACL keeps the one in force, and says why.
        acl.write_text("user alice\nbogus\n")
        broker.process.send_signal(signal.SIGHUP)
        broker.waitFor(rb"event=reload_failed file=acl ")
        broker.waitFor(rb"cannot reload the acl file, what it set stays as it was: \S+:2: ")
        carol = await publishAs(broker.port, "carol", "pw-carol", "alerts/fire", "again")
        assert carol.stdout == PUBLISHED, carol
    finally:
        if command is not None:
            command.kill()
        broker.stop()
