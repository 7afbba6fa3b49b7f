"""
The broker's own topics (C{$SYS/...}): values the broker publishes about
itself (L{dallal.broker.sysstats}), which no client may publish on.  Their
last values are kept in memory as retained messages: they mean nothing
after a restart.
"""

from dallal.topictree import TopicMap


class OwnTopics:
    """
    The last value of each of the broker's own topics.
    """

    def __init__(self, counters, router):
        """
        @param counters: the broker's L{dallal.broker.counters.Counters}.
        @param router: the broker's L{dallal.broker.router.Router}.
        """
        self.counters = counters
        self.router = router
        self._last = TopicMap()

    def publish(self, topic, payload):
        """
        Set the value of one of the broker's own topics, and publish it to
        the topic's subscribers.

        A value nobody subscribes to is not published at all: it is no
        message, and is neither counted nor logged.
        """
        self._last[topic] = payload
        receivers = self.router.routeOf(topic)
        if not receivers:
            return
        self.counters.count("sys_published")
        self.router.publish(topic, payload, None, receivers)

    def match(self, topicFilter):
        """
        @return: the C{(topic, value)} pairs of the own topics C{topicFilter}
            matches, as a list.
        """
        return self._last.match(topicFilter)
