"""
The session table (L{dallal.broker.sessions}): clients attached, logged in,
and their permissions revised when the ACL changes.
"""

from helpers import RecordingSubscriber
from twisted.internet.task import Clock

from dallal.broker.core import Broker
from dallal.security.acl import parseAcl
from dallal.security.auth import BrokerUser


def test_attachAndDetachCountSessionsAndTheirSubscriptions():
    broker = Broker(Clock())
    first, second = RecordingSubscriber("127.0.0.1:1"), RecordingSubscriber("127.0.0.1:2")
    broker.attach(first)
    broker.attach(second)
    broker.subscribe(first, "a", "s1")
    broker.subscribe(first, "b", "s2")
    assert (broker.sessionId(first), broker.sessionId(second)) == (1, 2)
    broker.detach(first, "closed")
    broker.detach(first, "closed")
    counters = broker.counters
    assert (counters["connections"], counters["connections_total"]) == (1, 2)
    assert counters["subscriptions"] == 0
    assert broker.sessionId(first) == 0


def test_aNamedLoginIsCountedAndAnAclRestrictsTheBroker():
    """
    A login with a user name counts in C{logins}; an anonymous one does
    not.  Until a session has permissions, the broker skips the ACL.
    """
    broker = Broker(Clock())
    named, anonymous = RecordingSubscriber("127.0.0.1:1"), RecordingSubscriber("127.0.0.1:2")
    broker.attach(named)
    broker.attach(anonymous)
    broker.login(named, BrokerUser("alice", None))
    assert (broker.counters["logins"], broker.sessions.restricted) == (1, False)
    permissions = parseAcl("topic read a\n").permissionsFor(None, None)
    broker.login(anonymous, BrokerUser(None, permissions))
    assert (broker.counters["logins"], broker.sessions.restricted) == (1, True)


def test_aFailedLoginOfAClientWithoutASessionIsCounted():
    broker = Broker(Clock())
    broker.loginFailed(RecordingSubscriber("127.0.0.1:1"), "bob")
    assert broker.counters["logins_failed"] == 1


def test_theSubscriptionsAnAnonymousClientMayNoLongerReadEnd():
    """
    When the ACL changes, a session's subscriptions whose filter can no
    longer match a topic it may read end, and its client is told.
    """
    broker = Broker(Clock())
    client = RecordingSubscriber("127.0.0.1:1")
    broker.attach(client)
    broker.login(
        client, BrokerUser(None, parseAcl("topic read public/#\n").permissionsFor(None, None))
    )
    broker.subscribe(client, "public/news", "s1")
    broker.subscribe(client, "#", "s2")
    broker.revisePermissions(parseAcl("topic read other/#\n").permissionsFor)
    assert client.revoked == [
        ("s1", "anonymous clients may no longer read public/news: the subscription has ended")
    ]
    assert broker.subscriptions(client) == [("#", "latest")]
    assert broker.counters["subscriptions"] == 1
