"""
The one login path of the broker's transports (L{dallal.server.login}): who
needs a password, and what a refused check counts, logs and answers.
"""

import pytest
from twisted.internet.defer import CancelledError, Deferred, fail, succeed

from dallal.errors import BAD_CREDENTIALS, NOT_AUTHORIZED, RequestError
from dallal.security.auth import LoginFailed, TooManyChecks
from dallal.server.login import (
    CHECK_FAILED,
    PASSWORD_NEEDED,
    TOO_MANY_CHECKS,
    UNCHECKED,
    WRONG_CREDENTIALS,
    WRONG_PASSWORD,
    LoginRefused,
    checkPassword,
    loginRequired,
    userWithoutPassword,
)


class FakeGatekeeper:
    def __init__(self, loginRequired=True, outcome=None):
        self.loginRequired = loginRequired
        self.outcome = outcome
        self.logins = []

    def anonymous(self, clientId=None):
        return ("anonymous", clientId)

    def login(self, user, password, clientId, source=None):
        self.logins.append((user, password, clientId, source))
        return self.outcome


class FakeBroker:
    def __init__(self):
        self.failed = []
        self.limited = []

    def loginFailed(self, client, shownUser):
        self.failed.append((client, shownUser))

    def refusedByLimit(self, client, limit, maximum, reason=None, requestId=None):
        self.limited.append((client, limit, maximum))
        return RequestError("LIMIT", reason, requestId)


def refusal(deferred):
    failures = []
    deferred.addErrback(failures.append)
    assert len(failures) == 1
    return failures[0]


def test_whoNeedsNoPassword():
    assert userWithoutPassword(None, "c") is None
    assert userWithoutPassword(FakeGatekeeper(loginRequired=False), "c") == ("anonymous", "c")
    assert userWithoutPassword(FakeGatekeeper(), "c") is PASSWORD_NEEDED


def test_loginRequired():
    error = loginRequired("HELLO ...", "7")
    assert (error.code, error.reason, error.requestId) == (
        NOT_AUTHORIZED,
        "this broker requires a login: HELLO ...",
        "7",
    )


def test_rightPassword():
    gatekeeper = FakeGatekeeper(outcome=succeed("alice's avatar"))
    checked = checkPassword(
        FakeBroker(), gatekeeper, ("alice", b"pw"), "c", "10.0.0.1", "1", lambda: "client"
    )
    assert checked.result == "alice's avatar"
    assert gatekeeper.logins == [("alice", b"pw", "c", "10.0.0.1")]


def test_wrongPasswordIsCountedAndAnsweredAsBadCredentials():
    broker = FakeBroker()
    gatekeeper = FakeGatekeeper(outcome=fail(LoginFailed("alice")))
    failure = refusal(
        checkPassword(broker, gatekeeper, ("alice", b"x"), "c", None, "1", lambda: "client")
    )
    assert failure.check(LoginRefused)
    error = failure.value.error
    assert (error.code, error.reason, error.requestId, failure.value.cause) == (
        BAD_CREDENTIALS,
        WRONG_CREDENTIALS,
        "1",
        WRONG_PASSWORD,
    )
    assert broker.failed == [("client", "alice")]


def test_tooManyChecksIsRefusedByItsLimit():
    broker = FakeBroker()
    gatekeeper = FakeGatekeeper(outcome=fail(TooManyChecks("pending_logins", 5, "too many")))
    failure = refusal(
        checkPassword(broker, gatekeeper, ("alice", b"x"), "c", None, "1", lambda: "client")
    )
    assert (failure.value.error.code, failure.value.cause) == ("LIMIT", TOO_MANY_CHECKS)
    assert broker.limited == [("client", "pending_logins", 5)]
    assert broker.failed == []


def test_aCheckerThatFailsIsLoggedAndAnsweredUnchecked():
    broker = FakeBroker()
    gatekeeper = FakeGatekeeper(outcome=fail(ZeroDivisionError()))
    failure = refusal(
        checkPassword(broker, gatekeeper, ("alice", b"x"), "c", None, "1", lambda: "client")
    )
    assert (failure.value.error.reason, failure.value.cause) == (UNCHECKED, CHECK_FAILED)
    assert broker.failed == []


@pytest.mark.parametrize("outcome", [LoginFailed("alice"), TooManyChecks("l", 1, "r")])
def test_nobodyToAnswer(outcome):
    """
    A client gone while its password was checked is not answered, nor is
    its failure counted against anyone.
    """
    broker = FakeBroker()
    gatekeeper = FakeGatekeeper(outcome=fail(outcome))
    failure = refusal(
        checkPassword(broker, gatekeeper, ("alice", b"x"), "c", None, "1", lambda: None)
    )
    assert failure.check(CancelledError)
    assert broker.failed == broker.limited == []


def test_cancellingDropsTheCheck():
    waiting = Deferred()
    gatekeeper = FakeGatekeeper(outcome=waiting)
    checked = checkPassword(
        FakeBroker(), gatekeeper, ("alice", b"x"), "c", None, "1", lambda: "client"
    )
    checked.cancel()
    assert refusal(checked).check(CancelledError)
