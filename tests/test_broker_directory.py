"""
The topic directory (L{dallal.broker.directory}): the topics C{TOPICS}
lists, subscribed to or retained, and the named topics a publish to every
matching topic reaches.
"""

from helpers import MemoryRetained

from dallal.broker.directory import TopicDirectory


def test_rowsCountTheSessionsOfEachFilter():
    directory = TopicDirectory()
    directory.subscribed("b/#")
    directory.subscribed("a")
    directory.subscribed("a")
    assert directory.rows(10) == ([("a", None, 2), ("b/#", None, 1)], 2)
    assert directory.rows(1) == ([("a", None, 2)], 2)
    directory.unsubscribed("a")
    directory.unsubscribed("b/#")
    assert directory.rows(10) == ([("a", None, 1)], 1)
    directory.unsubscribed("a")
    assert directory.rows(10) == ([], 0)


def test_onlyFiltersWithoutWildcardsAreNamedTopics():
    directory = TopicDirectory()
    directory.subscribed("a/b")
    directory.subscribed("a/+")
    assert [topic for topic, _ in directory.namedTopics.match("#")] == ["a/b"]


def test_retainedTopicsAreListedWhileTheStoreHoldsThem():
    directory = TopicDirectory()
    store = MemoryRetained()
    store.set("kept", b"12345")
    directory.retained = store
    directory.subscribed("kept")
    directory.unsubscribed("kept")
    assert directory.rows(10) == ([("kept", 5, 0)], 1)
    store.set("other", b"1")
    store.set("kept", b"")
    assert directory.rows(10) == ([("other", 1, 0)], 1)
