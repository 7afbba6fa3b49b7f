"""
Who may connect: logins with C{twisted.cred}, and the warning about a
broker anyone can reach.

The pieces are Twisted's:

 - L{PasswordFileChecker}, an C{ICredentialsChecker} of user names and
   passwords (C{IUsernamePassword}) against the password file
   (L{dallal.security.passwords}).  The scrypt check costs some tens of
   milliseconds and 16 MiB, so it runs in the reactor's thread pool, at
   most L{MAX_CONCURRENT_CHECKS} at a time: a client trying passwords never
   holds up the others' traffic, and a crowd of them cannot make the
   broker's memory grow past those few checks.
 - L{BrokerRealm}, the C{IRealm} whose avatars (L{IBrokerUser}) carry the
   user's name and what the ACL lets it do (L{dallal.security.acl}).
 - A C{Portal} joining them, which L{Gatekeeper} wraps for the transports:
   it logs clients in, answers a failed login only after
   L{FAILURE_DELAY} seconds (so guessing passwords over one connection
   goes at one guess a second, as Mosquitto and SSH slow it), and hands
   anonymous clients their avatar when the broker takes no passwords.
   A connection has L{LOGIN_TIMEOUT} seconds to log in (MQTT asks the
   same of a CONNECT).
"""

import ipaddress

from twisted.cred.checkers import ANONYMOUS, ICredentialsChecker
from twisted.cred.credentials import IUsernamePassword, UsernamePassword
from twisted.cred.error import UnauthorizedLogin
from twisted.cred.portal import IRealm, Portal
from twisted.internet.defer import DeferredSemaphore
from twisted.internet.task import deferLater
from twisted.internet.threads import deferToThread
from zope.interface import Attribute, Interface, implementer

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
MAX_CONCURRENT_CHECKS = 4
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


@implementer(ICredentialsChecker)
class PasswordFileChecker:
    """
    Checks user names and passwords against the users of a password file.

    @param users: user name -> L{PasswordHash}.
    @param runHash: runs C{f(*args)} somewhere and returns a Deferred of its
        result: the reactor's thread pool by default, inline in tests.
    """

    credentialInterfaces = (IUsernamePassword,)

    def __init__(self, users, runHash=deferToThread, concurrent=MAX_CONCURRENT_CHECKS):
        self._runHash = runHash
        self._slots = DeferredSemaphore(concurrent)
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
        checked = self._slots.run(self._runHash, expected.verify, credentials.password)
        return checked.addCallback(self._checked, name, stored is not None)

    def _checked(self, matches, name, known):
        if not known:
            raise UnknownUser()
        if not matches:
            raise UnauthorizedLogin()
        return name


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
    ):
        self.clock = clock
        self.realm = realm
        self.checker = checker
        self.portal = Portal(realm, [checker]) if checker is not None else None
        self.failureDelay = failureDelay
        self.loginTimeout = loginTimeout
        self.passwordsPath = passwordsPath
        self.aclPath = aclPath

    @classmethod
    def fromFiles(cls, clock, passwords=None, acl=None, bridgeUsers=()):
        """
        The gatekeeper of C{twistd dallal --passwords FILE --acl FILE
        --bridge-users NAME,...}.

        @param bridgeUsers: users of the password file that may send bridge
            frames (L{BrokerRealm}).
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
        return cls(clock, realm, checker, passwordsPath=passwords, aclPath=acl)

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

    def login(self, user, password, clientId):
        """
        Check a user name (text) and password (bytes).

        @return: a Deferred that fires with the user's L{IBrokerUser}, or
            fails with L{LoginFailed} after L{FAILURE_DELAY} seconds.
        """
        attempt = self.portal.login(
            UsernamePassword(user.encode("utf-8"), password), clientId, IBrokerUser
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
