"""
Logging a client in, the same way over every transport (Dallal's over TCP
and UDP, MQTT): which clients need a password, checking it in the
L{dallal.security.auth.Gatekeeper}'s queue, and what the broker counts, logs
and answers when the check refuses it.

The transports differ only in how they ask (C{HELLO}, C{CONNECT}, HTTP
Basic credentials) and answer.
"""

from twisted.internet.defer import CancelledError
from twisted.logger import Logger

from dallal.errors import BAD_CREDENTIALS, NOT_AUTHORIZED, RequestError
from dallal.security.auth import LoginFailed, TooManyChecks

# What a client that tried a wrong password, or an unknown user, is told:
# nothing more, as Mosquitto does, which tells a guesser nothing.
WRONG_CREDENTIALS = "bad user name or password"
UNCHECKED = "the broker could not check the password (see its log)"

# What a client goes on as when it needs a password and gave none.
PASSWORD_NEEDED = object()

_log = Logger()


def userWithoutPassword(gatekeeper, clientId):
    """
    Who a client is when its login needs no password check.

    @param gatekeeper: the broker's L{dallal.security.auth.Gatekeeper}, or
        C{None} when it has neither passwords nor ACL.
    @return: C{None} (the broker knows no users), the anonymous user of the
        ACL with C{clientId} (the broker takes no passwords), or
        L{PASSWORD_NEEDED}.
    """
    if gatekeeper is None:
        return None
    if not gatekeeper.loginRequired:
        return gatekeeper.anonymous(clientId)
    return PASSWORD_NEEDED


def loginRequired(usage, requestId):
    """
    The refusal of a client that gave no credentials to a broker that takes
    passwords.

    @param usage: how a login is written over the client's transport.
    """
    return RequestError(NOT_AUTHORIZED, f"this broker requires a login: {usage}", requestId)


# Why a login was refused (L{LoginRefused.cause}): its password was
# checked and is wrong (or its user unknown), too many logins were waiting
# for their check, or the checker failed.
WRONG_PASSWORD = "wrong_password"
TOO_MANY_CHECKS = "too_many_checks"
CHECK_FAILED = "check_failed"


class LoginRefused(Exception):
    """
    A login the broker refused, counted and logged.

    @ivar error: the L{RequestError} to answer it with.
    @ivar cause: why: L{WRONG_PASSWORD}, L{TOO_MANY_CHECKS} or
        L{CHECK_FAILED}.
    """

    def __init__(self, error, cause):
        Exception.__init__(self, error)
        self.error = error
        self.cause = cause


def checkPassword(broker, gatekeeper, credentials, clientId, host, requestId, answering):
    """
    Check a client's credentials.

    @param credentials: C{(user, password)}: text and bytes.
    @param host: the client's IP address: its turn in the check queue.
    @param answering: called once the check refused the login, returns the
        client to name in the broker's counters and log (an
        L{dallal.broker.interfaces.ISubscriber}, or a stand-in with its
        C{peer}), or C{None} if nobody is left to answer.
    @return: a Deferred that fires with the user's
        L{dallal.security.auth.IBrokerUser}, or fails with L{LoginRefused},
        or with L{CancelledError} when there is nobody to answer (the check
        was cancelled, or C{answering} says so).  Cancel it when the client
        goes.
    """
    user, password = credentials
    checking = gatekeeper.login(user, password, clientId, host)
    return checking.addErrback(_refused, broker, requestId, answering)


def _refused(failure, broker, requestId, answering):
    if failure.check(CancelledError):
        return failure
    if failure.check(LoginFailed):
        cause = WRONG_PASSWORD
    elif failure.check(TooManyChecks):
        cause = TOO_MANY_CHECKS
    else:
        cause = CHECK_FAILED
        _log.failure("checking a password failed", failure)
    client = answering()
    if client is None:
        raise CancelledError("nobody is left to answer the login")
    if cause == TOO_MANY_CHECKS:
        busy = failure.value
        error = broker.refusedByLimit(client, busy.limit, busy.maximum, busy.reason, requestId)
    elif cause == WRONG_PASSWORD:
        broker.loginFailed(client, failure.value.shownUser)
        error = RequestError(BAD_CREDENTIALS, WRONG_CREDENTIALS, requestId)
    else:
        error = RequestError(BAD_CREDENTIALS, UNCHECKED, requestId)
    raise LoginRefused(error, cause)
