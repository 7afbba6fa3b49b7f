"""
A client's subscriptions: the messages they receive, and where each is in
its sequence.
"""

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ReceivedMessage:
    """
    A message delivered by the broker.

    @ivar seq: its sequence number in its subscription.
    @ivar redelivered: whether the broker sent it before (it was not acked
        in time); the client never hands the same message to its handler
        twice.
    @ivar options: all the frame's C{key=value} options, as text.
    @ivar retained: whether it is the topic's retained message, sent because
        the subscription is new rather than because it was just published.
    """

    topic: str
    payload: bytes
    seq: int
    redelivered: bool
    options: dict
    retained: bool = False


class SubscriptionState:
    """
    What the client tracks per subscription: who handles its messages,
    gaps and end, and where it is in the sequence.

    @ivar missing: the sequence numbers skipped and not seen since, oldest
        first, each with when its gap is to be reported (C{None} once it
        is).  Over UDP a lost message may still arrive, resent, after later
        ones; it is then handed over, not taken for a duplicate.
    """

    __slots__ = ("topic", "onMessage", "onGap", "onEnded", "lastSeq", "missing")

    # Holes remembered per subscription: in latest mode most are replaced
    # messages that will never come.
    MAX_MISSING = 1024

    def __init__(self, topic, onMessage, onGap, onEnded):
        self.topic = topic
        self.onMessage = onMessage
        self.onGap = onGap
        self.onEnded = onEnded
        self.lastSeq = 0
        self.missing = OrderedDict()

    def skipped(self, first, end, reportAt):
        """
        Sequence numbers C{first} to C{end - 1} were skipped.
        """
        for seq in range(max(first, end - self.MAX_MISSING), end):
            self.missing[seq] = reportAt
        while len(self.missing) > self.MAX_MISSING:
            self.missing.popitem(last=False)

    def arrivedLate(self, seq):
        """
        Whether C{seq} is one of the skipped numbers, now arrived.
        """
        return self.missing.pop(seq, False) is not False
