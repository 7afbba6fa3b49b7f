"""
L{dallal.security.acl}: Mosquitto's C{acl_file} format read, and its decisions on
topics and filters.
"""

import itertools

import pytest
from hypothesis import given, settings, strategies

from dallal.security.acl import READ, AclError, covers, loadAcl, overlaps, parseAcl
from dallal.topictree import SubscriptionTree

MOSQUITTO_EXAMPLE = """\
# This affects access control for clients with no username.
topic read $SYS/#

# This only affects clients with username "roger".
user roger
topic foo/bar

# This affects all clients.
pattern write $SYS/broker/connection/%c/state
"""


def test_mosquittosExampleFile():
    """
    The example of Mosquitto's documentation reads as it does there, but
    for a logged-in user's %c, which is only a client id of its own.
    """
    acl = parseAcl(MOSQUITTO_EXAMPLE)
    anonymous = acl.permissionsFor(None, "bridge1")
    assert anonymous.mayRead("$SYS/broker/load")
    assert not anonymous.mayWrite("$SYS/broker/load")
    assert not anonymous.mayRead("foo/bar")
    assert anonymous.mayWrite("$SYS/broker/connection/bridge1/state")
    assert not anonymous.mayWrite("$SYS/broker/connection/bridge2/state")
    roger = acl.permissionsFor("roger", "roger-1")
    assert roger.mayRead("foo/bar") and roger.mayWrite("foo/bar")
    # The anonymous lines are not roger's.
    assert not roger.mayRead("$SYS/broker/load")
    assert roger.mayWrite("$SYS/broker/connection/roger-1/state")
    assert not acl.permissionsFor("roger", "r1").mayWrite("$SYS/broker/connection/r1/state")
    # A user with no block of its own has the patterns only.
    assert not acl.permissionsFor("stranger", "s").mayRead("foo/bar")


ACL = """\
topic read public/#
user alice
topic readwrite home/#
topic deny home/safe/#
topic write    logs/alice
user bob
topic read #
pattern readwrite users/%u/#
pattern deny users/%u/locked
pattern read devices/%c/+/status
"""


@pytest.mark.parametrize(
    "user, clientId, topic, read, write",
    [
        (None, "c", "public/a/b", True, False),
        (None, "c", "public", True, False),
        (None, "c", "home/x", False, False),
        ("alice", "c", "home/x", True, True),
        ("alice", "c", "home/safe/x", False, False),  # deny before the broader grant
        ("alice", "c", "home/safe", False, False),
        ("alice", "c", "logs/alice", False, True),
        ("alice", "c", "public/a", False, False),  # the anonymous lines are not hers
        ("alice", "c", "users/alice/notes", True, True),
        ("alice", "c", "users/bob/notes", False, False),
        ("alice", "c", "users/alice/locked", False, False),
        ("alice", "alice-tv", "devices/alice-tv/7/status", True, False),
        ("alice", "alice", "devices/alice/7/status", True, False),
        ("alice", "alice-tv", "devices/d/7/status", False, False),
        # A logged-in user gets %c only for a client id of its own: another
        # user's device id, chosen by the client, grants nothing.
        ("alice", "c", "devices/c/7/status", False, False),
        ("alice", "bob-tv", "devices/bob-tv/7/status", False, False),
        ("alice", "alicetv", "devices/alicetv/7/status", False, False),
        ("alice", "c", "users/alice/notes", True, True),
        # Without a login, the client id is all there is.
        (None, "c", "devices/c/7/status", True, False),
        ("bob", "c", "anything/at/all", True, False),
        # A user's own grant comes before the patterns' deny (Mosquitto's
        # order): bob reads #, so his locked topic too.
        ("bob", "c", "users/bob/locked", True, False),
        # '#' does not reach the broker's $ topics.
        ("bob", "c", "$SYS/load", False, False),
        # Anonymous clients get no %u pattern.
        (None, "c", "users/None/x", False, False),
    ],
)
def test_decisions(user, clientId, topic, read, write):
    permissions = parseAcl(ACL).permissionsFor(user, clientId)
    assert (permissions.mayRead(topic), permissions.mayWrite(topic)) == (read, write)


@pytest.mark.parametrize("clientId", [None, "", "a/b", "+", "x#"])
def test_clientIdsThatCannotGoInAPatternGetNothingFromThem(clientId):
    """
    A client id missing, or one that would span or fake levels, gets nothing
    from the patterns (Mosquitto refuses it too); its own lines still apply.
    """
    permissions = parseAcl(ACL).permissionsFor("alice", clientId)
    assert not permissions.mayRead("users/alice/notes")
    assert not permissions.mayRead("devices/a/b/status")
    assert permissions.mayRead("home/x")


def test_withoutClientIdPatternsAUserCanHaveAnyClientId():
    permissions = parseAcl("pattern read users/%u/#\n").permissionsFor("alice", "a/b")
    assert permissions.mayRead("users/alice/x")


@pytest.mark.parametrize(
    "user, topicFilter, allowed",
    [
        (None, "public/#", True),
        (None, "#", True),  # overlaps public/#: only public topics will come
        (None, "+/x", True),
        (None, "home/#", False),
        ("alice", "home/safe/#", False),  # all of it denied
        ("alice", "home/safe/+", False),
        ("alice", "home/+", True),
        ("alice", "logs/alice", False),  # write only
        ("alice", "users/+/notes", True),  # users/alice/notes
        ("alice", "devices/c/#", False),  # c is no client id of alice's
        ("bob", "$SYS/#", False),
    ],
)
def test_subscriptionFilters(user, topicFilter, allowed):
    permissions = parseAcl(ACL).permissionsFor(user, "c")
    assert permissions.mayMatch(topicFilter, READ) is allowed


def test_decisionsAreRemembered():
    permissions = parseAcl(ACL).permissionsFor("alice", "c")
    assert permissions.mayRead("home/x")
    permissions._stages = ()
    assert permissions.mayRead("home/x")


@pytest.mark.parametrize(
    "text, error",
    [
        ("topic\n", ":1: expected: topic [read|write|readwrite|deny] <filter>"),
        ("\n\ntopic reed a\n", ":3: expected: topic [read|write|readwrite|deny] <filter>"),
        ("topic read a b\n", ":1: expected: topic"),
        ("topic read a/#/b\n", ":1: bad filter 'a/#/b': '#' must be the last level"),
        ("user\n", ":1: expected: user <name>"),
        ("user a b\n", ":1: expected: user <name>"),
        ("pattern read a/x%u\n", ":1: %u must be a whole level of the filter, not 'x%u'"),
        ("topic read users/%u\n", ":1: %u only means something in a pattern line"),
        ("allow all\n", ":1: unknown keyword 'allow': expected user, topic or pattern"),
    ],
)
def test_errorsNameTheLine(text, error):
    with pytest.raises(AclError) as raised:
        parseAcl(text, "acl.conf")
    assert str(raised.value).startswith("acl.conf" + error), str(raised.value)


def test_commentsBlankLinesAndSpacesAreIgnored():
    acl = parseAcl("  # a comment\n\n   topic   read   a/b  \n\t\n")
    assert acl.permissionsFor(None, None).mayRead("a/b")


def test_loadErrors(tmp_path):
    with pytest.raises(AclError, match=r"cannot read the ACL file .*missing: No such file"):
        loadAcl(tmp_path / "missing")
    binary = tmp_path / "binary"
    binary.write_bytes(b"topic \xff\n")
    with pytest.raises(AclError, match="is not UTF-8 text"):
        loadAcl(binary)


# overlaps() and covers(), against the brute force: every topic of a small
# universe, matched through the broker's own subscription tree.

LEVELS = ["a", "b", "$s", ""]
UNIVERSE = [
    "/".join(levels) for depth in range(1, 4) for levels in itertools.product(LEVELS, repeat=depth)
]
filterLevels = strategies.sampled_from(["a", "b", "$s", "", "+"])
filters = strategies.builds(
    lambda levels, multi: "/".join(levels + (["#"] if multi else [])) or "#",
    strategies.lists(filterLevels, max_size=3),
    strategies.booleans(),
)


def matched(topicFilter):
    tree = SubscriptionTree()
    tree.add(topicFilter, "x")
    return {topic for topic in UNIVERSE if tree.match(topic)}


@settings(derandomize=True, max_examples=400, deadline=None)
@given(filters, filters)
def test_overlapsAndCoversAgreeWithMatching(first, second):
    mine, theirs = matched(first), matched(second)
    # The universe holds a witness for every overlap of filters this short
    # (levels up to 3 deep, and '#' one deeper).
    assert overlaps(first, second) == bool(mine & theirs), (first, second)
    if covers(first, second):
        assert theirs <= mine, (first, second)
