"""
Tests for dallal.topictree: filter validation, the wildcard rules, and both
trees checked against a plain reference matcher.
"""

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dallal.topics import TopicError
from dallal.topictree import SubscriptionTree, TopicMap, checkFilter


def referenceMatches(topicFilter, topic):
    """
    The matching rules, written as plainly as possible: the reference the
    trees are compared with.
    """
    filterLevels = topicFilter.split("/")
    topicLevels = topic.split("/")
    if topicLevels[0].startswith("$") and filterLevels[0] in ("+", "#"):
        return False

    def levelsMatch(filterRest, topicRest):
        if not filterRest:
            return not topicRest
        if filterRest[0] == "#":
            return True
        if not topicRest:
            return False
        if filterRest[0] != "+" and filterRest[0] != topicRest[0]:
            return False
        return levelsMatch(filterRest[1:], topicRest[1:])

    return levelsMatch(filterLevels, topicLevels)


def treeMatches(topicFilter, topic):
    tree = SubscriptionTree()
    tree.add(topicFilter, "subscriber")
    return "subscriber" in tree.match(topic)


def mapMatches(topicFilter, topic):
    topics = TopicMap()
    topics[topic] = None
    return [name for name, _ in topics.match(topicFilter)] == [topic]


RULES = [
    # Exact levels.
    ("a/b", "a/b", True),
    ("a/b", "a/c", False),
    ("a/b", "a", False),
    ("a", "a/b", False),
    ("a/b", "a/b/", False),
    # '+' is exactly one level, possibly empty, never more.
    ("a/+", "a/b", True),
    ("a/+", "a/", True),
    ("a/+", "a", False),
    ("a/+", "a/b/c", False),
    ("a/+/c", "a/x/c", True),
    ("a/+/c", "a/x/y/c", False),
    ("+", "a", True),
    ("+", "a/b", False),
    ("+/+", "/", True),
    ("+/b", "/b", True),
    # '#' is every remaining level, including none.
    ("a/#", "a", True),
    ("a/#", "a/", True),
    ("a/#", "a/b/c", True),
    ("a/#", "ab", False),
    ("a/#", "b/a", False),
    ("a/+/#", "a/b", True),
    ("a/+/#", "a", False),
    ("+/#", "a", True),
    ("#", "a", True),
    ("#", "a/b/c", True),
    ("#", "/", True),
    # Wildcards in the first level do not reach '$' topics; names do.
    ("#", "$SYS/x", False),
    ("+/x", "$SYS/x", False),
    ("+", "$SYS", False),
    ("+/#", "$SYS/x", False),
    ("$SYS/#", "$SYS/x", True),
    ("$SYS/#", "$SYS", True),
    ("$SYS/+", "$SYS/x", True),
    ("$SYS/x", "$SYS/x", True),
    ("a/+", "a/$x", True),
    ("a/#", "a/$x/y", True),
]


@pytest.mark.parametrize("matches", [referenceMatches, treeMatches, mapMatches])
@pytest.mark.parametrize("topicFilter, topic, expected", RULES)
def test_rules(matches, topicFilter, topic, expected):
    """
    The reference and both trees follow the rules.
    """
    assert matches(topicFilter, topic) is expected


@pytest.mark.parametrize(
    "topicFilter",
    ["a", "a/b", "#", "+", "a/#", "a/+/c", "+/+", "/", "a//b", "$SYS/#", "é/ü", "x" * 256],
)
def test_validFilters(topicFilter):
    checkFilter(topicFilter)


@pytest.mark.parametrize(
    "topicFilter, reason",
    [
        ("", "filter is empty"),
        ("x" * 257, "filter is 257 bytes, longer than 256"),
        ("é" * 129, "filter is 258 bytes, longer than 256"),
        ("a b", "control or whitespace"),
        ("a\tb", "control or whitespace"),
        ("a\nb", "control or whitespace"),
        ("a\x00", "control or whitespace"),
        ("a/b#", "'#' must be alone in its level, not in 'b#'"),
        ("##", "'#' must be alone in its level"),
        ("#/a", "'#' must be the last level"),
        ("a/#/b", "'#' must be the last level"),
        ("a/#/", "'#' must be the last level"),
        ("a+/b", "'+' must be alone in its level, not in 'a+'"),
        ("a/+b", "'+' must be alone in its level, not in '+b'"),
        ("++", "'+' must be alone in its level"),
    ],
)
def test_invalidFilters(topicFilter, reason):
    with pytest.raises(TopicError, match=re.escape(reason)):
        checkFilter(topicFilter)


def test_maxLengthIsConfigurable():
    checkFilter("a/b", maxLength=3)
    with pytest.raises(TopicError, match="filter is 4 bytes, longer than 3"):
        checkFilter("a/bc", maxLength=3)


# SubscriptionTree


def test_addTellsNewFromReplaced():
    tree = SubscriptionTree()
    assert tree.add("a/+", "alice", 1) is True
    assert tree.add("a/+", "bob", 2) is True
    assert tree.add("a/+", "alice", 3) is False
    assert len(tree) == 2
    assert tree.match("a/x") == {"alice": [3], "bob": [2]}


def test_overlappingFiltersGiveOneEntryPerSubscriber():
    """
    A subscriber with several matching filters appears once, with the value
    of each of them.
    """
    tree = SubscriptionTree()
    tree.add("a/b", "alice", "exact")
    tree.add("a/+", "alice", "plus")
    tree.add("#", "alice", "all")
    tree.add("a/#", "bob", "bob's")
    found = tree.match("a/b")
    assert sorted(found) == ["alice", "bob"]
    assert sorted(found["alice"]) == ["all", "exact", "plus"]
    assert found["bob"] == ["bob's"]


def test_bestGivesTheHighestRankedFilterOfEachSubscriber():
    tree = SubscriptionTree(ranks=3)
    tree.add("a/b", "alice", "exact", 0)
    tree.add("a/+", "alice", "plus", 2)
    tree.add("#", "alice", "all", 1)
    tree.add("a/#", "bob", "bob's", 1)
    assert tree.best("a/b") == {"alice": "plus", "bob": "bob's"}
    # Adding again changes the rank, not the count.
    assert tree.add("a/+", "alice", "plus", 0) is False
    assert tree.best("a/b") == {"alice": "all", "bob": "bob's"}
    assert len(tree) == 4
    assert tree.remove("#", "alice") == "all"
    assert tree.best("a/b")["alice"] in ("exact", "plus")


def test_removeReturnsTheValue():
    tree = SubscriptionTree()
    tree.add("a/#", "alice", "options")
    tree.add("a/#", "bob", None)
    assert tree.remove("a/#", "alice") == "options"
    assert len(tree) == 1
    assert tree.match("a/b") == {"bob": [None]}


@pytest.mark.parametrize(
    "topicFilter, subscriber",
    [("a/b", "bob"), ("a", "alice"), ("a/b/c", "alice"), ("x", "alice")],
)
def test_removeUnknownRaisesKeyError(topicFilter, subscriber):
    """
    Removing a subscription that does not exist, even when its filter or its
    subscriber has others or its filter is a prefix of one, raises KeyError
    and changes nothing.
    """
    tree = SubscriptionTree()
    tree.add("a/b", "alice")
    nodes = tree.nodeCount
    with pytest.raises(KeyError):
        tree.remove(topicFilter, subscriber)
    assert len(tree) == 1
    assert tree.nodeCount == nodes
    assert tree.match("a/b") == {"alice": [None]}


def test_removePrunesOnlyEmptyNodes():
    tree = SubscriptionTree()
    tree.add("a/b/c", "alice")
    tree.add("a", "bob")
    assert tree.nodeCount == 3
    tree.remove("a/b/c", "alice")
    # 'a' still holds bob's subscription.
    assert tree.nodeCount == 1
    tree.remove("a", "bob")
    assert tree.nodeCount == 0
    assert tree.match("a") == {}


# TopicMap


@pytest.mark.parametrize("topicFilter", ["#", "+", "a/+", "a/#"])
def test_topicMapMatchStopsPastItsLimit(topicFilter):
    """
    A match with a limit stops once it has found one more than the limit,
    whichever wildcard the filter ends with.
    """
    topics = TopicMap()
    for number in range(100):
        topics[f"t{number}"] = number
        topics[f"a/t{number}"] = number
    assert len(topics.match(topicFilter, limit=10)) == 11
    assert len(topics.match(topicFilter)) in (100, 101, 200)


def test_topicMapIsAMapping():
    topics = TopicMap()
    topics["a/b"] = 1
    topics["a"] = 2
    topics["a/b"] = 3
    assert len(topics) == 2
    assert topics["a/b"] == 3
    assert topics.get("a/c") is None
    assert "a" in topics
    assert "a/c" not in topics
    assert sorted(topics) == ["a", "a/b"]
    del topics["a"]
    assert dict(topics) == {"a/b": 3}
    with pytest.raises(KeyError):
        del topics["a"]
    with pytest.raises(KeyError):
        topics["a"]


def test_topicMapDeletePrunes():
    topics = TopicMap()
    topics["a/b/c"] = 1
    topics["a"] = 2
    del topics["a/b/c"]
    assert topics.nodeCount == 1
    assert topics.match("a/#") == [("a", 2)]
    del topics["a"]
    assert topics.nodeCount == 0


def test_topicMapMatchMayBeFollowedByChanges():
    """
    The caller may change the map while going through what match returned.
    """
    topics = TopicMap()
    for name in ["a/1", "a/2", "a/3"]:
        topics[name] = name
    for name, _ in topics.match("a/#"):
        del topics[name]
    assert len(topics) == 0
    assert topics.nodeCount == 0


# Properties, against the reference.

LEVELS = ["a", "b", "", "$x"]
topicLevels = st.lists(st.sampled_from(LEVELS), min_size=1, max_size=4)
topics = topicLevels.map("/".join).filter(bool)
filters = st.builds(
    lambda levels, multi: "/".join(levels + ["#"] if multi else levels),
    st.lists(st.sampled_from(LEVELS + ["+", "+"]), min_size=0, max_size=4),
    st.booleans(),
).filter(bool)
subscriptions = st.lists(st.tuples(filters, st.integers(0, 3)), max_size=30)

PROPERTY_SETTINGS = settings(max_examples=300, deadline=None)


def expectedMatches(pairs, topic):
    expected = {}
    for topicFilter, subscriber in pairs:
        if referenceMatches(topicFilter, topic):
            expected.setdefault(subscriber, []).append(topicFilter)
    return {subscriber: sorted(values) for subscriber, values in expected.items()}


def actualMatches(tree, topic):
    return {subscriber: sorted(values) for subscriber, values in tree.match(topic).items()}


@PROPERTY_SETTINGS
@given(filters)
def test_generatedFiltersAreValid(topicFilter):
    checkFilter(topicFilter)


@PROPERTY_SETTINGS
@given(subscriptions, st.lists(topics, min_size=1, max_size=10))
def test_subscriptionTreeAgreesWithReference(pairs, published):
    tree = SubscriptionTree()
    for topicFilter, subscriber in pairs:
        tree.add(topicFilter, subscriber, topicFilter)
    distinct = set(pairs)
    assert len(tree) == len(distinct)
    for topic in published:
        assert actualMatches(tree, topic) == expectedMatches(distinct, topic)


@PROPERTY_SETTINGS
@given(subscriptions, st.lists(topics, min_size=1, max_size=10))
def test_bestAgreesWithReference(pairs, published):
    """
    L{SubscriptionTree.best} gives each subscriber the value of its
    highest-ranked matching filter (here, the rank is the filter's length
    modulo 3; the value, the filter).
    """
    tree = SubscriptionTree(ranks=3)
    for topicFilter, subscriber in pairs:
        tree.add(topicFilter, subscriber, topicFilter, len(topicFilter) % 3)
    for topic in published:
        found = tree.best(topic)
        expected = expectedMatches(set(pairs), topic)
        assert set(found) == set(expected)
        for subscriber, topicFilter in found.items():
            assert topicFilter in expected[subscriber]
            assert len(topicFilter) % 3 == max(len(f) % 3 for f in expected[subscriber])


@PROPERTY_SETTINGS
@given(st.sets(topics, max_size=30), st.lists(filters, min_size=1, max_size=10))
def test_topicMapAgreesWithReference(names, queries):
    topicMap = TopicMap()
    for name in names:
        topicMap[name] = name.upper()
    for topicFilter in queries:
        found = topicMap.match(topicFilter)
        assert len(found) == len(set(found))
        assert dict(found) == {
            name: name.upper() for name in names if referenceMatches(topicFilter, name)
        }


@PROPERTY_SETTINGS
@given(st.data(), subscriptions, st.lists(topics, min_size=1, max_size=5))
def test_subscriptionChurnLeavesNothing(data, pairs, published):
    """
    Removing subscriptions in any order keeps the answers right, and
    removing them all leaves no node behind.
    """
    tree = SubscriptionTree()
    for topicFilter, subscriber in pairs:
        tree.add(topicFilter, subscriber, topicFilter)
    remaining = set(pairs)
    for topicFilter, subscriber in data.draw(st.permutations(sorted(remaining))):
        assert tree.remove(topicFilter, subscriber) == topicFilter
        remaining.discard((topicFilter, subscriber))
        for topic in published:
            assert actualMatches(tree, topic) == expectedMatches(remaining, topic)
    assert len(tree) == 0
    assert tree.nodeCount == 0


# Topics may use names no filter uses, which a shape leaves out.
unnamedTopics = (
    st.lists(st.sampled_from(LEVELS + ["c", "d", "$y"]), min_size=1, max_size=5)
    .map("/".join)
    .filter(bool)
)


@PROPERTY_SETTINGS
@given(st.data(), subscriptions, st.lists(unnamedTopics, min_size=2, max_size=12))
def test_topicsOfOneShapeHaveTheSameSubscribers(data, pairs, published):
    """
    Whatever filters come and go, two topics of the same shape are matched
    by the same filters, so a broker may route a new topic by its shape.
    """
    tree = SubscriptionTree()
    for topicFilter, subscriber in pairs:
        tree.add(topicFilter, subscriber, topicFilter)
    remaining = set(pairs)
    removals = data.draw(st.permutations(sorted(remaining)))
    for step in range(len(removals) + 1):
        byShape = {}
        for topic in published:
            byShape.setdefault(tree.shape(topic), []).append(topic)
        for sameShape in byShape.values():
            first = actualMatches(tree, sameShape[0])
            for topic in sameShape[1:]:
                assert actualMatches(tree, topic) == first, (sameShape[0], topic)
        if step < len(removals):
            tree.remove(*removals[step])
    assert tree.shape("a/b/c") == (None, None, None)


def test_shapeKeepsOnlyTheNamesFiltersUse():
    tree = SubscriptionTree()
    tree.add("sensors/+/temperature", "s")
    tree.add("+/kitchen/#", "t")
    assert tree.shape("sensors/hall/temperature") == ("sensors", None, "temperature")
    assert tree.shape("sensors/kitchen/temperature/raw") == (
        "sensors",
        "kitchen",
        "temperature",
        None,
    )
    # A '$' topic's first level is never a wildcard's: it keeps its name.
    assert tree.shape("$SYS/hall") == ("$SYS", None)
    tree.remove("+/kitchen/#", "t")
    assert tree.shape("sensors/kitchen/temperature") == ("sensors", None, "temperature")


@PROPERTY_SETTINGS
@given(st.data(), st.sets(topics, max_size=30), st.lists(filters, min_size=1, max_size=5))
def test_topicChurnLeavesNothing(data, names, queries):
    topicMap = TopicMap()
    for name in names:
        topicMap[name] = None
    remaining = set(names)
    for name in data.draw(st.permutations(sorted(names))):
        del topicMap[name]
        remaining.discard(name)
        for topicFilter in queries:
            assert {found for found, _ in topicMap.match(topicFilter)} == {
                other for other in remaining if referenceMatches(topicFilter, other)
            }
    assert len(topicMap) == 0
    assert topicMap.nodeCount == 0
