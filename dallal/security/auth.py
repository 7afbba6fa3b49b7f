"""
Who may connect: logins with C{twisted.cred}, and the warning about a
broker anyone can reach.

The pieces are Twisted's:

 - L{PasswordFileChecker}, an C{ICredentialsChecker} of user names and
   passwords (C{IUsernamePassword}) against the password file
   (L{dallal.security.passwords}).  The scrypt check costs some tens of
   milliseconds and 16 MiB, so it runs on threads of its own
   (L{CheckThreads}): a client trying passwords never holds up the others'
   traffic.
 - L{BrokerRealm}, the C{IRealm} whose avatars (L{IBrokerUser}) carry the
   user's name and what the ACL lets it do (L{dallal.security.acl}).
 - A C{Portal} joining them, which L{Gatekeeper} wraps for the transports:
   it logs clients in, at most L{MAX_CONCURRENT_CHECKS} at a time, the
   others waiting in a L{CheckQueue} bounded per address and in all and
   served an address at a time in turn (so a crowd of wrong passwords from
   one address neither grows the broker's memory nor delays another
   address's login by more than a few checks), answers a failed login only after
   L{FAILURE_DELAY} seconds (so guessing passwords over one connection
   goes at one guess a second, as Mosquitto and SSH slow it), and hands
   anonymous clients their avatar when the broker takes no passwords.
   A connection has L{LOGIN_TIMEOUT} seconds to log in (MQTT asks the
   same of a CONNECT).
"""

import ipaddress
from collections import Counter, deque

from twisted.cred.checkers import ANONYMOUS, ICredentialsChecker
from twisted.cred.credentials import IUsernamePassword, UsernamePassword
from twisted.cred.error import UnauthorizedLogin
from twisted.cred.portal import IRealm, Portal
from twisted.internet.defer import Deferred, fail, maybeDeferred
from twisted.internet.task import deferLater
from twisted.internet.threads import deferToThreadPool
from twisted.python.threadpool import ThreadPool
from zope.interface import Attribute, Interface, implementer

from dallal.limits import (
    DEFAULT_MAX_PENDING_LOGINS,
    DEFAULT_MAX_PENDING_LOGINS_PER_IP,
    PENDING_LOGINS,
    PENDING_LOGINS_PER_IP,
)
from dallal.security.acl import AclError, loadAcl
from dallal.security.passwords import (
    DEFAULT_N,
    DEFAULT_P,
    DEFAULT_R,
    DIGEST_BYTES,
    PasswordFile,
    PasswordFileError,
    PasswordHash,
)

FAILURE_DELAY = 1.0
# Each scrypt check holds 16 MiB while it runs, and checks beyond the
# machine's cores gain no speed: two at a time bound a flood of wrong
# passwords to 32 MiB of the broker's memory.
MAX_CONCURRENT_CHECKS = 2
# Seconds a connection has to log in (time for a person typing into nc),
# after which it is closed: an idle connection that never logs in would
# otherwise hold a descriptor for ever by answering pings.
LOGIN_TIMEOUT = 60.0
# How the log shows a user name the password file does not know: it may be
# a password typed in the wrong field.
UNKNOWN_USER = "?"


class IBrokerUser(Interface):
    """
    A client as the broker knows it once it is logged in (or anonymous).
    """

    name = Attribute("The user name, or None for an anonymous client.")
    clientId = Attribute("The client id it logged in with, or None (the ACL's %c).")
    permissions = Attribute(
        "Its dallal.security.acl.Permissions, or None when the broker has no ACL."
    )
    mayBridge = Attribute(
        "Whether it may send bridge frames (PUB with origin=, SUB with bridge=1)."
    )


@implementer(IBrokerUser)
class BrokerUser:
    def __init__(self, name, permissions, mayBridge=True, clientId=None):
        self.name = name
        self.permissions = permissions
        self.mayBridge = mayBridge
        self.clientId = clientId

    def __repr__(self):
        return f"BrokerUser({self.name!r})"


@implementer(IRealm)
class BrokerRealm:
    """
    Makes the avatar of a logged-in user, or of an anonymous client, with
    its permissions under the ACL.

    The C{mind} of a login is the client's id, which the ACL's C{%c}
    patterns need.

    @param bridgeUsers: the users that are other brokers' bridges: only
        they may send bridge frames on a broker that takes passwords.  An
        anonymous client (a broker without passwords) may send them.
    """

    def __init__(self, acl=None, bridgeUsers=frozenset()):
        self.acl = acl
        self.bridgeUsers = frozenset(bridgeUsers)

    def requestAvatar(self, avatarId, mind, *interfaces):
        if IBrokerUser not in interfaces:
            raise NotImplementedError("a Dallal broker only has IBrokerUser avatars")
        name = None if avatarId is ANONYMOUS else avatarId
        permissions = None if self.acl is None else self.acl.permissionsFor(name, mind)
        mayBridge = name is None or name in self.bridgeUsers
        return IBrokerUser, BrokerUser(name, permissions, mayBridge, mind), lambda: None


class UnknownUser(UnauthorizedLogin):
    """
    The password file has no such user.
    """


class CheckThreads:
    """
    The threads password checks run on: as many as run at once
    (L{MAX_CONCURRENT_CHECKS}), started with the first check and stopped
    with the reactor.  Each thread's allocator keeps the 16 MiB a check
    took for the thread's next one (glibc's arena per thread): checks
    spread over the reactor's pool of up to ten threads would leave up to
    ten times that resident after a flood of wrong passwords.
    """

    def __init__(self, reactor=None, size=MAX_CONCURRENT_CHECKS):
        if reactor is None:
            from twisted.internet import reactor
        self._reactor = reactor
        self._size = size
        self._pool = None

    def __call__(self, function, *arguments):
        """
        Run C{function(*arguments)} on one of the threads.

        @return: a Deferred of its result.
        """
        if self._pool is None:
            self._pool = ThreadPool(0, self._size, "dallal-password-checks")
            self._pool.start()
            self._reactor.addSystemEventTrigger("during", "shutdown", self._pool.stop)
        return deferToThreadPool(self._reactor, self._pool, function, *arguments)


@implementer(ICredentialsChecker)
class PasswordFileChecker:
    """
    Checks user names and passwords against the users of a password file.

    @param users: user name -> L{PasswordHash}.
    @param runHash: runs C{f(*args)} somewhere and returns a Deferred of its
        result: L{CheckThreads} by default, inline in tests.
    """

    credentialInterfaces = (IUsernamePassword,)

    def __init__(self, users, runHash=None):
        self._runHash = runHash if runHash is not None else CheckThreads()
        self.replaceUsers(users)

    def replaceUsers(self, users):
        """
        Check the logins from now on against C{users} (a password file
        read again); those under way finish against the old ones.
        """
        self.users = users
        typical = next(iter(users.values()), None)
        if typical is None:
            typical = PasswordHash(DEFAULT_N, DEFAULT_R, DEFAULT_P, b"", bytes(DIGEST_BYTES))
        self._decoy = typical.decoy()

    def requestAvatarId(self, credentials):
        """
        @return: a Deferred that fires with the user name (text), or fails
            with L{UnauthorizedLogin} (L{UnknownUser} for a name the file
            does not have).
        """
        try:
            name = credentials.username.decode("utf-8")
        except UnicodeDecodeError:
            name = None
        stored = self.users.get(name)
        expected = stored if stored is not None else self._decoy
        checked = self._runHash(expected.verify, credentials.password)
        return checked.addCallback(self._checked, name, stored is not None)

    def _checked(self, matches, name, known):
        if not known:
            raise UnknownUser()
        if not matches:
            raise UnauthorizedLogin()
        return name


class TooManyChecks(Exception):
    """
    A login was refused unchecked: as many are waiting for their check as
    the broker allows, from the client's address or in all.

    @ivar limit: the L{dallal.limits.Limit}, and C{maximum} its value.
    """

    def __init__(self, limit, maximum, reason):
        Exception.__init__(self, reason)
        self.limit = limit
        self.maximum = maximum
        self.reason = reason


class CheckQueue:
    """
    Runs password checks at most C{concurrent} at a time; the others wait,
    at most C{maxPendingPerSource} from one source (the client's IP
    address) and C{maxPending} in all, counting those running.

    The sources take turns: each turn runs the next check of the source
    whose last turn is the oldest (a new one first), so a client waits for
    at most a check of each other source, however many one of them sent.  A check
    cancelled while it waits leaves the queue; one cancelled while it runs
    (its thread cannot be stopped) still holds its place until it ends.
    """

    def __init__(self, concurrent, maxPending, maxPendingPerSource):
        self.concurrent = concurrent
        self.maxPending = maxPending
        self.maxPendingPerSource = maxPendingPerSource
        # source -> its checks waiting, [deferred, function, arguments].
        self._waiting = {}
        # source -> its checks waiting or running, and the number of its
        # last turn (turns are numbered from 1).
        self._pending = Counter()
        self._lastTurn = {}
        self._turns = 0
        self._running = 0

    def __len__(self):
        return sum(self._pending.values())

    def run(self, source, function, *arguments):
        """
        Call C{function(*arguments)}, which returns a Deferred, in its turn.

        @return: a Deferred of its result, which may be cancelled, or one
            that fails with L{TooManyChecks} at once.
        """
        if len(self) >= self.maxPending:
            return fail(
                TooManyChecks(
                    PENDING_LOGINS,
                    self.maxPending,
                    f"the broker is checking its maximum of {self.maxPending} logins: "
                    "try again later",
                )
            )
        if self._pending[source] >= self.maxPendingPerSource:
            return fail(
                TooManyChecks(
                    PENDING_LOGINS_PER_IP,
                    self.maxPendingPerSource,
                    f"the broker is checking its maximum of {self.maxPendingPerSource} "
                    f"logins from {source}: try again later",
                )
            )
        check = [None, function, arguments]
        check[0] = Deferred(lambda _: self._cancel(source, check))
        self._waiting.setdefault(source, deque()).append(check)
        self._pending[source] += 1
        self._startChecks()
        return check[0]

    def _startChecks(self):
        lastTurn = self._lastTurn
        while self._running < self.concurrent and self._waiting:
            source = min(self._waiting, key=lambda source: lastTurn.get(source, 0))
            checks = self._waiting[source]
            check = checks.popleft()
            if not checks:
                del self._waiting[source]
            self._turns += 1
            lastTurn[source] = self._turns
            self._running += 1
            deferred, function, arguments = check
            maybeDeferred(function, *arguments).addBoth(self._checked, source, deferred)

    def _checked(self, result, source, deferred):
        self._running -= 1
        self._release(source)
        if not deferred.called:
            deferred.callback(result)
        # Else it was cancelled: nobody waits for the result.
        self._startChecks()

    def _cancel(self, source, check):
        checks = self._waiting.get(source)
        if checks is not None and check in checks:
            checks.remove(check)
            if not checks:
                del self._waiting[source]
            self._release(source)

    def _release(self, source):
        self._pending[source] -= 1
        if not self._pending[source]:
            del self._pending[source]
            self._lastTurn.pop(source, None)


class LoginFailed(Exception):
    """
    A login was refused.

    @ivar shownUser: the user name for the log: the name tried if the
        password file knows it, L{UNKNOWN_USER} otherwise.
    """

    def __init__(self, shownUser):
        Exception.__init__(self, shownUser)
        self.shownUser = shownUser


class Gatekeeper:
    """
    What the broker's transports ask about a client: whether it must log
    in, and with which avatar it goes on.

    @param checker: the L{PasswordFileChecker}, or C{None} when the broker
        takes no passwords (every client is anonymous).
    @param clock: the C{IReactorTime} that delays failed logins and times
        the connections that have yet to log in.
    @param passwordsPath: the password file the checker's users came
        from, read again by L{reload}; likewise C{aclPath}, the realm's ACL.
    @param maxPendingChecks: logins waiting for their password check (or
        being checked) at once, in all; C{maxPendingChecksPerIp}, from one
        address.
    """

    def __init__(
        self,
        clock,
        realm,
        checker=None,
        failureDelay=FAILURE_DELAY,
        loginTimeout=LOGIN_TIMEOUT,
        passwordsPath=None,
        aclPath=None,
        maxPendingChecks=DEFAULT_MAX_PENDING_LOGINS,
        maxPendingChecksPerIp=DEFAULT_MAX_PENDING_LOGINS_PER_IP,
    ):
        self.clock = clock
        self.realm = realm
        self.checker = checker
        self.portal = Portal(realm, [checker]) if checker is not None else None
        self.failureDelay = failureDelay
        self.loginTimeout = loginTimeout
        self.passwordsPath = passwordsPath
        self.aclPath = aclPath
        self.checks = CheckQueue(MAX_CONCURRENT_CHECKS, maxPendingChecks, maxPendingChecksPerIp)

    @classmethod
    def fromFiles(cls, clock, passwords=None, acl=None, bridgeUsers=(), **limits):
        """
        The gatekeeper of C{twistd dallal --passwords FILE --acl FILE
        --bridge-users NAME,...}.

        @param bridgeUsers: users of the password file that may send bridge
            frames (L{BrokerRealm}).
        @param limits: the bounds of its L{CheckQueue} (C{maxPendingChecks},
            C{maxPendingChecksPerIp}).

        @return: a L{Gatekeeper}, or C{None} when neither file is given.
        @raise dallal.security.passwords.PasswordFileError: the password file is
            wrong, or lacks one of C{bridgeUsers}.
        @raise dallal.security.acl.AclError: the ACL file is wrong.
        """
        if passwords is None and acl is None:
            return None
        checker = None
        if passwords is not None:
            checker = PasswordFileChecker(_loadUsers(passwords, bridgeUsers))
        realm = BrokerRealm(loadAcl(acl) if acl is not None else None, bridgeUsers)
        return cls(clock, realm, checker, passwordsPath=passwords, aclPath=acl, **limits)

    def reload(self):
        """
        Read the password and ACL files again (SIGHUP).  A file that cannot
        be read, or is wrong, leaves the one in force as it was.

        @return: C{(file, error)} for each file: C{file} is C{"passwords"}
            or C{"acl"}, C{error} the L{PasswordFileError} or L{AclError} it
            failed with, or C{None} if it is now in force.
        """
        outcomes = []
        if self.passwordsPath is not None:
            try:
                users = _loadUsers(self.passwordsPath, self.realm.bridgeUsers)
            except PasswordFileError as error:
                outcomes.append(("passwords", error))
            else:
                self.checker.replaceUsers(users)
                outcomes.append(("passwords", None))
        if self.aclPath is not None:
            try:
                self.realm.acl = loadAcl(self.aclPath)
            except AclError as error:
                outcomes.append(("acl", error))
            else:
                outcomes.append(("acl", None))
        return outcomes

    @property
    def loginRequired(self):
        return self.portal is not None

    def anonymous(self, clientId=None):
        """
        The avatar of an anonymous client (on a broker without passwords).
        """
        return self.realm.requestAvatar(ANONYMOUS, clientId, IBrokerUser)[1]

    def login(self, user, password, clientId, source=None):
        """
        Check a user name (text) and password (bytes), in the turn of the
        client's address.

        @param source: the client's IP address, for L{CheckQueue}.
        @return: a Deferred that fires with the user's L{IBrokerUser}, or
            fails with L{LoginFailed} after L{FAILURE_DELAY} seconds, or
            with L{TooManyChecks} at once.  Cancel it when the client goes:
            a check still waiting is dropped.
        """
        attempt = self.checks.run(
            source,
            self.portal.login,
            UsernamePassword(user.encode("utf-8"), password),
            clientId,
            IBrokerUser,
        )
        return attempt.addCallbacks(lambda result: result[1], self._refused, errbackArgs=(user,))

    def _refused(self, failure, user):
        failure.trap(UnauthorizedLogin)
        shown = UNKNOWN_USER if failure.check(UnknownUser) else user

        def refuse():
            raise LoginFailed(shown)

        return deferLater(self.clock, self.failureDelay, refuse)


def _loadUsers(path, bridgeUsers):
    """
    The users of a password file, which must have every bridge user.

    @raise PasswordFileError: the file is wrong, or lacks a bridge user.
    """
    users = PasswordFile.load(path).users
    for name in bridgeUsers:
        if name not in users:
            raise PasswordFileError(f"{path} has no user {name!r}, named by --bridge-users")
    return users


def beyondLoopback(address):
    """
    Whether a listening port's address (C{port.getHost()}) can be reached
    from other machines: any IP address but the loopback ones (0.0.0.0
    and :: listen on every interface).  A UNIX socket cannot.
    """
    host = getattr(address, "host", None)
    if not isinstance(host, str):
        return False
    try:
        return not ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return True
