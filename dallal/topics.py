"""
Topic names: what a topic may contain, and why the rest is refused.

A topic is UTF-8 text of 1 to C{maxLength} bytes, made of C{/}-separated
levels (at most C{maxLevels} of them, where the broker says so), with no whitespace or control characters (a topic is one token on
the control line).  C{+} and C{#} are reserved for subscription wildcards and
a leading C{$} for the broker's own topics, so a client cannot publish them.
"""

from dallal.limits import TOPIC_LENGTH, TOPIC_LEVELS

# The longest topic, and the default limit: a UDP datagram has room for a
# message's control line with a topic this long (dallal.protocol.datagram).
MAX_TOPIC_LENGTH = 256
SEPARATOR = "/"

WILDCARDS = frozenset("+#")


class TopicError(ValueError):
    """
    A topic that the broker refuses; the message says why.

    @ivar limit: the L{dallal.limits.Limit} it is over, and C{maximum} that
        limit's value, or C{None}s when it is malformed.
    """

    def __init__(self, reason, limit=None, maximum=None):
        ValueError.__init__(self, reason)
        self.limit = limit
        self.maximum = maximum


def checkTopicName(name, maxLength, what, maxLevels=None):
    """
    What topics and subscription filters have in common: 1 to C{maxLength}
    bytes of UTF-8, at most C{maxLevels} levels (if not C{None}), no
    whitespace, no control characters.

    @param what: C{"topic"} or C{"filter"}, for the reason.
    @raise TopicError: with a reason a person can act on.
    """
    if not name:
        raise TopicError(f"{what} is empty")
    size = len(name.encode("utf-8"))
    if size > maxLength:
        raise TopicError(
            f"{what} is {size} bytes, longer than {maxLength}", TOPIC_LENGTH, maxLength
        )
    if maxLevels is not None:
        levels = name.count(SEPARATOR) + 1
        if levels > maxLevels:
            raise TopicError(
                f"{what} has {levels} levels, more than the maximum of {maxLevels}",
                TOPIC_LEVELS,
                maxLevels,
            )
    # isprintable() lets the ASCII space through, and only that space.
    if not name.isprintable() or " " in name:
        raise TopicError(f"{what} contains a control or whitespace character")


def checkTopic(topic, maxLength=MAX_TOPIC_LENGTH, maxLevels=None):
    """
    Check a topic a client wants to publish to.

    @raise TopicError: with a reason a person can act on.
    """
    checkTopicName(topic, maxLength, "topic", maxLevels)
    if WILDCARDS.intersection(topic):
        raise TopicError("'+' and '#' are reserved for subscription wildcards")
    if topic.startswith("$"):
        raise TopicError("topics starting with '$' are reserved for the broker")
