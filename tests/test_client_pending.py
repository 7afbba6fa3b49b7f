"""
The requests a client waits answers for (L{dallal.client.pending}).
"""

from twisted.internet.defer import CancelledError
from twisted.internet.error import ConnectionDone
from twisted.python.failure import Failure

from dallal.client.pending import PendingRequests


def outcomes(deferred):
    seen = []
    deferred.addBoth(seen.append)
    return seen


def test_anAnswerFiresItsRequestOnce():
    pending = PendingRequests()
    answered = outcomes(pending.add("1", lambda requestId: None))
    assert "1" in pending
    pending.take("1").callback("ack")
    assert answered == ["ack"]
    assert "1" not in pending
    assert pending.take("1") is None


def test_cancellingTellsTheClient():
    pending = PendingRequests()
    cancelled = []
    deferred = pending.add("7", cancelled.append)
    seen = outcomes(deferred)
    deferred.cancel()
    assert cancelled == ["7"]
    assert seen[0].check(CancelledError)


def test_losingTheConnectionFailsEveryRequest():
    pending = PendingRequests()
    first = outcomes(pending.add("1", lambda requestId: None))
    second = outcomes(pending.add("2", lambda requestId: None))
    pending.failAll(Failure(ConnectionDone()))
    assert first[0].check(ConnectionDone) and second[0].check(ConnectionDone)
    assert "1" not in pending and "2" not in pending
