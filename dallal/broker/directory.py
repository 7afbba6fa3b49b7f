"""
The topic directory: the topics the broker knows of, for C{TOPICS} and for
publishes to every matching topic -- those with a retained message, and
every filter clients are subscribed with, with how many sessions are.
"""

from collections import Counter

from dallal.sortednames import SortedNames
from dallal.topics import WILDCARDS
from dallal.topictree import TopicMap


class TopicDirectory:
    """
    The topics clients subscribed to and those the retained store holds.
    """

    def __init__(self):
        # filter -> number of sessions subscribed with it; and the filters
        # without wildcards, which are topics clients named.
        self._filterCounts = Counter()
        self.namedTopics = TopicMap()
        self.retained = None

    @property
    def retained(self):
        """
        The retained store (a L{dallal.broker.retained.RetainedStore}), or
        C{None} without one.
        """
        return self._retained

    @retained.setter
    def retained(self, store):
        self._retained = store
        names = set(self._filterCounts)
        if store is not None:
            names.update(store.topics())
            store.watch(self._retainedTopicChanged)
        # Every topic TOPICS lists, in order, so that listing the first few
        # costs what they are.
        self._listed = SortedNames(names)

    def subscribed(self, topicFilter):
        """
        One more session subscribed with C{topicFilter}.
        """
        self._filterCounts[topicFilter] += 1
        self._listed.add(topicFilter)
        if WILDCARDS.isdisjoint(topicFilter):
            self.namedTopics[topicFilter] = self._filterCounts[topicFilter]

    def unsubscribed(self, topicFilter):
        """
        One session less is subscribed with C{topicFilter}.
        """
        self._filterCounts[topicFilter] -= 1
        remaining = self._filterCounts[topicFilter]
        if not remaining:
            del self._filterCounts[topicFilter]
            if self._retained is None or self._retained.get(topicFilter) is None:
                self._listed.discard(topicFilter)
        if WILDCARDS.isdisjoint(topicFilter):
            if remaining:
                self.namedTopics[topicFilter] = remaining
            else:
                del self.namedTopics[topicFilter]

    def rows(self, limit):
        """
        The topics, sorted, with the size of their retained message and the
        number of subscribed sessions.

        @return: C{(rows, total)}: at most C{limit} rows
            C{(topic, retainedBytes or None, subscribers)}, and how many
            there are in all.
        """
        names = self._listed.first(limit)
        rows = [(name, self._retainedSize(name), self._filterCounts.get(name, 0)) for name in names]
        return rows, len(self._listed)

    def _retainedSize(self, topic):
        """
        @return: the size of C{topic}'s retained message, or C{None}.
        """
        payload = self._retained.get(topic) if self._retained is not None else None
        return len(payload) if payload is not None else None

    def _retainedTopicChanged(self, topic, held):
        """
        Keep the listed topics up to date as the store gains or loses a
        topic.
        """
        if held:
            self._listed.add(topic)
        elif topic not in self._filterCounts:
            self._listed.discard(topic)
