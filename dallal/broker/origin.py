"""
Where a bridged message comes from, so that brokers joined by bridges in any
shape (a star, a triangle, a ring) deliver each message once.

A message crossing a bridge carries its L{Origin}: the name of the broker a
client published it on, its id there, and how many bridges it has crossed.
A broker routes a bridged message only the first time it sees it: it drops
its own messages coming back, copies that arrive by another path (the
L{SeenMessages} table, by a digest of the origin, the id, the topic and
the payload), and messages that crossed more than L{MAX_HOPS} bridges (a
safety net should the table forget too soon).  The server carries it on
the wire (L{dallal.server.origins}, PROTOCOL.md, "Bridges").
"""

import hashlib
import os
import re
import secrets
from collections import OrderedDict
from dataclasses import dataclass

from dallal.errors import BAD_ARGUMENTS, RequestError
from dallal.names import BROKER_NAME, checkBrokerName

# Bridges a message may cross; a full mesh of this many brokers plus one
# never needs more.
MAX_HOPS = 8

# How long, and for how many messages at most, a broker remembers the
# bridged messages it routed.  A copy comes by another path within
# milliseconds, or after a link's outage and its resend: seconds.
SEEN_WINDOW = 60.0
SEEN_CAPACITY = 100_000

# The file in the data directory that keeps a broker's generated name.
NAME_FILE = "broker-name"

_MESSAGE_ID = re.compile(r"[!-~]{1,64}\Z")


def generatedName():
    """
    A name for a broker that was given none.
    """
    return "dallal-" + secrets.token_hex(4)


class BrokerNameError(Exception):
    """
    The broker's name cannot be read or kept; the message says why.
    """


def storedName(directory):
    """
    The name of the broker whose data directory is C{directory}: generated
    at its first start and kept there, so that it stays the same across
    restarts (a bridged message's origin must not change meaning).

    @raise BrokerNameError: the file cannot be read or written, or holds no
        valid name.
    """
    path = os.path.join(directory, NAME_FILE)
    try:
        with open(path, encoding="ascii") as file:
            name = file.read().strip()
    except FileNotFoundError:
        name = generatedName()
        try:
            with open(path, "x", encoding="ascii") as file:
                file.write(name + "\n")
        except OSError as error:
            raise BrokerNameError(
                f"cannot keep the broker's name in {path}: {error.strerror}"
            ) from error
        return name
    except (OSError, UnicodeDecodeError) as error:
        raise BrokerNameError(f"cannot read the broker's name from {path}: {error}") from error
    try:
        checkBrokerName(name)
    except ValueError as error:
        raise BrokerNameError(f"{path}: {error} (remove the file for a new one)") from error
    return name


@dataclass(frozen=True, slots=True)
class Origin:
    """
    @ivar broker: the name of the broker the message was first published on.
    @ivar messageId: its id there, unique across that broker's restarts.
    @ivar hops: the bridges it crossed to reach the broker that holds it
        (C{None} in an origin received that was no number:
        L{checkOrigin} refuses it).
    """

    broker: str
    messageId: str
    hops: int


def checkOrigin(origin, requestId):
    """
    Refuse an origin that names no broker, carries no message id (1 to 64
    printable ASCII characters) or whose hops are no number.

    @raise RequestError: C{BAD_ARGUMENTS}.
    """
    if (
        origin.hops is None
        or not BROKER_NAME.match(origin.broker)
        or not _MESSAGE_ID.match(origin.messageId)
    ):
        raise RequestError(
            BAD_ARGUMENTS,
            "a bridged message needs origin=<broker name> oid=<1 to 64 printable "
            "ASCII characters> hops=<number>",
            requestId,
        )


class SeenMessages:
    """
    The bridged messages a broker routed recently: a bounded, time-limited
    set.

    A message is known by a digest of its origin, its id there, its topic
    and its payload, not by its origin alone: a sender that forges the
    origin of a real message to come can then only suppress that very
    message (the same topic and payload), which it has just delivered
    itself, never a different one.

    Entries leave after C{window} seconds, or earlier, oldest first, when
    there are C{capacity} of them.
    """

    def __init__(self, clock, window=SEEN_WINDOW, capacity=SEEN_CAPACITY):
        self.clock = clock
        self.window = window
        self.capacity = capacity
        # Digest of the message -> when it was seen, oldest first.
        self._seen = OrderedDict()

    def __len__(self):
        return len(self._seen)

    def firstTime(self, origin, topic, payload):
        """
        Record a message, unless it was seen within the window.

        @param topic: text.
        @param payload: bytes.
        @return: C{True} if it was not.
        """
        now = self.clock.seconds()
        seen = self._seen
        horizon = now - self.window
        while seen:
            oldest = next(iter(seen.values()))
            if oldest > horizon and len(seen) < self.capacity:
                break
            seen.popitem(last=False)
        key = _digest(origin, topic, payload)
        if key in seen:
            return False
        seen[key] = now
        return True


def _digest(origin, topic, payload):
    """
    What identifies a bridged message in L{SeenMessages}: 16 bytes.  The
    origin's names and the topic hold no NUL, so NULs separate them without
    ambiguity, and the payload, last, may hold anything.
    """
    digest = hashlib.blake2b(digest_size=16)
    fields = (origin.broker.encode("ascii"), origin.messageId.encode("ascii"), topic.encode())
    digest.update(b"\0".join(fields) + b"\0")
    digest.update(payload)
    return digest.digest()
