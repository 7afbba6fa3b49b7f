"""
The session table: the clients attached to the broker, and what it knows
of each -- its subscriptions, its outbox, who it logged in as and what the
ACL lets it do.

A L{Session} is the broker's record of one attached client, whatever its
transport (a TCP connection, a UDP client, an MQTT connection, a bridge).
The table attaches and detaches them, records logins, revises their
permissions when the ACL changes, and counts and logs what the ACL refuses
them.
"""

from twisted.logger import LogLevel

from dallal.broker.delivery import Outbox
from dallal.errors import FORBIDDEN, RequestError
from dallal.limits import (
    ERRORS_LOGGED_PER_CLIENT,
    SUBSCRIPTION_EVENTS_LOGGED_PER_CLIENT,
    LogWindow,
)
from dallal.security.acl import READ


class Session:
    """
    What the broker knows about one attached client.

    @ivar sid: its number, unique for the broker's lifetime.
    @ivar subscriber: its L{dallal.broker.interfaces.ISubscriber}.
    @ivar subscriptions: topic filter (for a shared subscription,
        C{(group name, filter)}) -> L{dallal.broker.delivery.Subscription}.
    @ivar outbox: the L{Outbox} of what is sent to it.
    @ivar user: the name it logged in with, or C{None} (anonymous).
    @ivar clientId: the client id it logged in with, or C{None}.
    @ivar permissions: what the ACL lets it read and write
        (L{dallal.security.acl.Permissions}), or C{None} when the broker has no ACL.
    @ivar mayBridge: whether it may send bridge frames: not when it logged
        in as a user that is no bridge (L{dallal.security.auth.BrokerRealm}).
    @ivar errorWindow: the L{LogWindow} of its C{protocol_error} events.
    @ivar subscriptionWindow: the L{LogWindow} of its C{subscribe} and
        C{unsubscribe} events.
    """

    __slots__ = (
        "sid",
        "subscriber",
        "subscriptions",
        "outbox",
        "user",
        "clientId",
        "permissions",
        "mayBridge",
        "errorWindow",
        "subscriptionWindow",
    )

    def __init__(self, sid, subscriber, outbox):
        self.sid = sid
        self.subscriber = subscriber
        self.subscriptions = {}
        self.outbox = outbox
        self.user = None
        self.clientId = None
        self.permissions = None
        self.mayBridge = True
        self.errorWindow = LogWindow(ERRORS_LOGGED_PER_CLIENT)
        self.subscriptionWindow = LogWindow(SUBSCRIPTION_EVENTS_LOGGED_PER_CLIENT)


class SessionTable(dict):
    """
    The sessions of one broker: a dict of L{Session} by subscriber (a plain
    dict's item access, as every ack and publish looks its session up),
    whose entries only L{attach} adds.

    @ivar restricted: whether any session's topics are restricted by an
        ACL: until one is, publishing skips the permission checks
        altogether.
    """

    def __init__(self, clock, events, counters, ledger, flow, delivery):
        """
        @param counters: the broker's L{dallal.broker.counters.Counters}.
        @param ledger: the L{dallal.broker.delivery.Ledger} of every outbox.
        @param flow: the L{dallal.broker.delivery.FlowControl} of every outbox.
        @param delivery: the L{dallal.broker.delivery.DeliveryConfig} of the
            sessions whose transport brings none of its own.
        """
        self.clock = clock
        self.events = events
        self.counters = counters
        self.ledger = ledger
        self.flow = flow
        self.delivery = delivery
        self.restricted = False
        self._nextSid = 1

    def sessionId(self, subscriber):
        """
        The session id of a client for the log, 0 if it has no session.
        """
        session = self.get(subscriber)
        return session.sid if session else 0

    def attach(self, subscriber, delivery=None):
        """
        Give a client that has arrived a session, with an empty outbox.

        @param delivery: the L{dallal.broker.delivery.DeliveryConfig} of the
            client's transport, if not the broker's.
        """
        sid = self._nextSid
        self._nextSid += 1
        outbox = Outbox(
            subscriber,
            sid,
            self.delivery if delivery is None else delivery,
            self.clock,
            self.ledger,
            self.flow,
        )
        self[subscriber] = Session(sid, subscriber, outbox)
        self.counters.connected()
        self.events.emit(
            "connect",
            session=sid,
            client=subscriber.peer,
            transport=subscriber.transportName,
        )

    def close(self, session, reason):
        """
        End a session taken out of the table (C{pop}ped once its
        subscriptions are out of the routes): what it held back and what
        was queued for it go with it.
        """
        subscriber = session.subscriber
        self.flow.forget(subscriber)
        session.outbox.close(session.subscriptions.values())
        self.counters.disconnected(len(session.subscriptions))
        self.events.emit(
            "disconnect",
            session=session.sid,
            client=subscriber.peer,
            transport=subscriber.transportName,
            reason=reason,
            subscriptions=len(session.subscriptions),
        )

    def login(self, subscriber, user):
        """
        A client logged in, or goes on anonymously under the ACL: from now
        on its requests and deliveries are those of C{user}.

        @param user: its L{dallal.security.auth.IBrokerUser}.
        """
        session = self[subscriber]
        session.user = user.name
        session.clientId = user.clientId
        session.permissions = user.permissions
        session.mayBridge = user.mayBridge
        if user.permissions is not None:
            self.restricted = True
        if user.name is not None:
            self.counters.count("logins")
            self.events.emit("login", session=session.sid, client=subscriber.peer, user=user.name)

    def loginFailed(self, subscriber, shownUser):
        """
        Record a refused login.

        @param subscriber: the client, attached or not (a UDP client has no
            session before it logs in).
        @param shownUser: the user name for the log (see
            L{dallal.security.auth.LoginFailed}).
        """
        self.counters.count("logins_failed")
        self.events.emit(
            "login_failed",
            LogLevel.warn,
            session=self.sessionId(subscriber),
            client=subscriber.peer,
            user=shownUser,
        )

    def revisePermissions(self, permissionsFor):
        """
        The ACL has changed: give every session under it its new
        permissions.

        @param permissionsFor: returns the
            L{dallal.security.acl.Permissions} of a user name (C{None} for
            an anonymous client) and a client id.
        @return: the subscriptions that can no longer match a topic their
            session may read, as C{(session, key, subscription)}.
        """
        unreadable = []
        for session in self.values():
            if session.permissions is None:
                continue
            session.permissions = permissionsFor(session.user, session.clientId)
            for key, subscription in session.subscriptions.items():
                if not session.permissions.mayMatch(subscription.topic, READ):
                    unreadable.append((session, key, subscription))
        return unreadable

    def mayRead(self, subscriber, topic):
        """
        Whether the session of C{subscriber} may read C{topic}; C{True} for a
        subscriber without a session (a share group asks for its members).
        """
        session = self.get(subscriber)
        permissions = None if session is None else session.permissions
        return permissions is None or permissions.mayRead(topic)

    def logAclEvent(self, name, session, **fields):
        """
        Log an event of the ACL's about a session: its user is C{-} when
        anonymous.

        @return: how a refusal told to the client names it.
        """
        user = session.user
        self.events.emit(
            name,
            LogLevel.warn,
            session=session.sid,
            client=session.subscriber.peer,
            user="-" if user is None else user,
            **fields,
        )
        return "anonymous clients" if user is None else f"user {user}"

    def denied(self, session, action, topic):
        """
        Count and log a request its user may not make.

        @return: how a refusal told to the client names it.
        """
        self.counters.count("denied")
        return self.logAclEvent("denied", session, action=action, topic=topic)

    def forbid(self, session, action, topic, requestId):
        """
        Count and log a request the ACL refuses, and refuse it.

        @raise RequestError: C{FORBIDDEN}.
        """
        who = self.denied(session, action, topic)
        preposition = "on" if action == "publish" else "to"
        raise RequestError(FORBIDDEN, f"{who} may not {action} {preposition} {topic}", requestId)
