"""
Topic names: what a topic may contain, and why the rest is refused.

A topic is UTF-8 text of 1 to C{maxLength} bytes, made of C{/}-separated
levels, with no whitespace or control characters (a topic is one token on
the control line).  C{+} and C{#} are reserved for subscription wildcards and
a leading C{$} for the broker's own topics, so a client cannot publish them.
"""

MAX_TOPIC_LENGTH = 256

WILDCARDS = frozenset("+#")


class TopicError(ValueError):
    """
    A topic that the broker refuses; the message says why.
    """


def checkName(name, maxLength, what):
    """
    What topics and subscription filters have in common: 1 to C{maxLength}
    bytes of UTF-8, no whitespace, no control characters.

    @param what: C{"topic"} or C{"filter"}, for the reason.
    @raise TopicError: with a reason a person can act on.
    """
    if not name:
        raise TopicError(f"{what} is empty")
    size = len(name.encode("utf-8"))
    if size > maxLength:
        raise TopicError(f"{what} is {size} bytes, longer than {maxLength}")
    # isprintable() lets the ASCII space through, and only that space.
    if not name.isprintable() or " " in name:
        raise TopicError(f"{what} contains a control or whitespace character")


def checkTopic(topic, maxLength=MAX_TOPIC_LENGTH):
    """
    Check a topic a client wants to publish to.

    @raise TopicError: with a reason a person can act on.
    """
    checkName(topic, maxLength, "topic")
    if WILDCARDS.intersection(topic):
        raise TopicError("'+' and '#' are reserved for subscription wildcards")
    if topic.startswith("$"):
        raise TopicError("topics starting with '$' are reserved for the broker")
