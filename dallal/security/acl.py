"""
Topic permissions: C{twistd dallal --acl FILE}, in Mosquitto's C{acl_file}
format, so that an operator's existing file carries over.

    # Lines before any 'user' line are for anonymous clients.
    topic read public/#

    user alice
    topic readwrite alice/#
    topic write sensors/+/alice
    topic deny sensors/secret

    # For every client: %u is its user name, %c its client id.
    pattern read devices/%c/commands
    pattern write users/%u/status

A C{topic} line grants its access (C{read}, C{write}, C{readwrite}: the
default when none is given) on a filter (wildcards allowed) to the user of
the C{user} block it is in; C{deny} takes away what a broader line grants.
A C{pattern} line applies to every client wherever it is; C{%u} and C{%c}
must each be a whole level.  Everything not granted is refused.

Mosquitto's order of decision is kept: first the client's own lines (its
user's block, or the anonymous lines): a C{deny} that matches refuses, a
grant that matches allows; then the patterns, likewise; then refusal.  A
pattern with C{%u} does not apply to an anonymous client.  A client whose
client id is missing or holds C{/}, C{+} or C{#} gets nothing from the
patterns if any of them uses C{%c} (it could otherwise reach another's
level).  A client id is chosen by the client, so it grants nothing by
itself: a logged-in user gets the C{%c} patterns only for a client id it
owns, its user name or one that begins with its user name and C{-}
(C{alice}, C{alice-phone}); for another client id, the patterns that use
C{%c} are left out.  Read permission is checked for each message delivered, on its
topic: a subscription with wildcards receives only the topics it may read.
A subscription is refused outright when its filter can match no topic the
client may read (or when a C{deny} covers all it matches).
"""

from dataclasses import dataclass

from dallal.topics import SEPARATOR, TopicError
from dallal.topictree import (
    MULTI_LEVEL,
    RESERVED_PREFIX,
    SINGLE_LEVEL,
    SubscriptionTree,
    checkFilter,
)

READ = 1
WRITE = 2
DENY = 0
_ACCESS = {"read": READ, "write": WRITE, "readwrite": READ | WRITE, "deny": DENY}

USER_SUBSTITUTE = "%u"
CLIENT_SUBSTITUTE = "%c"
_UNSAFE_IN_LEVEL = frozenset("/+#")

# Topics whose decision each client's permissions remember.
CACHED_TOPICS = 4096


class AclError(Exception):
    """
    The ACL file cannot be read, or a line of it is wrong: the message
    names the file and line and says why.
    """


@dataclass(frozen=True)
class Rule:
    """
    One C{topic} or C{pattern} line: an access (L{READ}, L{WRITE}, both, or
    L{DENY}) on a filter.
    """

    access: int
    filter: str


def parseAcl(text, path="<acl>"):
    """
    Read an ACL file's text.

    @raise AclError: a line is wrong, with C{path:line} and the reason.
    """
    anonymous, users, patterns = [], {}, []
    rules = anonymous
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keyword, _, rest = line.partition(" ")
        rest = rest.strip()
        try:
            if keyword == "user":
                if not rest or " " in rest:
                    raise ValueError("expected: user <name>")
                rules = users.setdefault(rest, [])
            elif keyword == "topic":
                rules.append(_rule(rest, pattern=False))
            elif keyword == "pattern":
                patterns.append(_rule(rest, pattern=True))
            else:
                raise ValueError(f"unknown keyword {keyword!r}: expected user, topic or pattern")
        except ValueError as error:
            raise AclError(f"{path}:{number}: {error}") from error
    return Acl(anonymous, users, patterns)


def loadAcl(path):
    """
    Read an ACL file.

    @raise AclError: it cannot be read, or a line is wrong.
    """
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    except OSError as error:
        raise AclError(f"cannot read the ACL file {path}: {error.strerror}") from error
    except UnicodeDecodeError:
        raise AclError(f"the ACL file {path} is not UTF-8 text") from None
    return parseAcl(text, path)


def _rule(text, pattern):
    words = text.split()
    if len(words) == 1:
        access, topicFilter = READ | WRITE, words[0]
    elif len(words) == 2 and words[0] in _ACCESS:
        access, topicFilter = _ACCESS[words[0]], words[1]
    else:
        keyword = "pattern" if pattern else "topic"
        raise ValueError(f"expected: {keyword} [read|write|readwrite|deny] <filter>")
    try:
        checkFilter(topicFilter)
    except TopicError as error:
        raise ValueError(f"bad filter {topicFilter!r}: {error}") from error
    for level in topicFilter.split(SEPARATOR):
        for substitute in (USER_SUBSTITUTE, CLIENT_SUBSTITUTE):
            if substitute in level and level != substitute:
                raise ValueError(f"{substitute} must be a whole level of the filter, not {level!r}")
            if substitute in level and not pattern:
                raise ValueError(f"{substitute} only means something in a pattern line")
    return Rule(access, topicFilter)


def _substituted(topicFilter, user, clientId):
    return SEPARATOR.join(
        user if level == USER_SUBSTITUTE else clientId if level == CLIENT_SUBSTITUTE else level
        for level in topicFilter.split(SEPARATOR)
    )


def _usable(identity):
    return identity is not None and identity != "" and _UNSAFE_IN_LEVEL.isdisjoint(identity)


def _owns(user, clientId):
    """
    Whether a client may be granted by C{%c} patterns with C{clientId}: an
    anonymous client proved nothing, so its client id is all there is; a
    logged-in user only for its own client ids.
    """
    return user is None or clientId == user or clientId.startswith(user + "-")


class Acl:
    """
    The rules of an ACL file.
    """

    def __init__(self, anonymous, users, patterns):
        """
        @param anonymous: the L{Rule}s of anonymous clients.
        @param users: user name -> its L{Rule}s.
        @param patterns: the pattern L{Rule}s, for everyone.
        """
        self.anonymous = anonymous
        self.users = users
        self.patterns = patterns

    def permissionsFor(self, user, clientId):
        """
        What a client may do.

        @param user: its user name, or C{None} for an anonymous client.
        @param clientId: its client id, or C{None} when it gave none.
        @return: its L{Permissions}.
        """
        own = self.anonymous if user is None else self.users.get(user, [])
        usesClientId = any(CLIENT_SUBSTITUTE in rule.filter for rule in self.patterns)
        if usesClientId and not _usable(clientId):
            return Permissions(_Stage(own), _REFUSE_ALL)
        expanded = [
            Rule(rule.access, _substituted(rule.filter, user, clientId))
            for rule in self.patterns
            # A pattern about the user's name says nothing of anonymous ones.
            if (user is not None or USER_SUBSTITUTE not in rule.filter)
            and (CLIENT_SUBSTITUTE not in rule.filter or _owns(user, clientId))
        ]
        return Permissions(_Stage(own), _Stage(expanded))


class _Stage:
    """
    One step of the decision: rules that refuse, then rules that grant; no
    opinion when none matches.
    """

    def __init__(self, rules):
        self.rules = rules
        self._denials = SubscriptionTree()
        self._grants = SubscriptionTree()
        for index, rule in enumerate(rules):
            tree = self._denials if rule.access == DENY else self._grants
            tree.add(rule.filter, index, rule.access)

    def decide(self, topic, access):
        """
        C{True} or C{False} for C{access} on C{topic}, or C{None} if no rule
        of this stage matches.
        """
        if self._denials.match(topic):
            return False
        for accesses in self._grants.match(topic).values():
            if accesses[0] & access:
                return True
        return None

    def decideFilter(self, topicFilter, access):
        """
        Likewise for a filter: C{False} if a denial covers all it matches,
        C{True} if a grant of C{access} can match a topic it matches.
        """
        for rule in self.rules:
            if rule.access == DENY and covers(rule.filter, topicFilter):
                return False
        for rule in self.rules:
            if rule.access & access and overlaps(rule.filter, topicFilter):
                return True
        return None


class _RefuseAll:
    """
    The pattern stage of a client whose identity cannot be put in them.
    """

    rules = ()

    def decide(self, topic, access):
        return False

    def decideFilter(self, topicFilter, access):
        return False


_REFUSE_ALL = _RefuseAll()


class Permissions:
    """
    What one client may read and write, with its decisions on topics
    remembered: each message delivered costs a dictionary lookup once its
    topic has been seen.
    """

    def __init__(self, own, patterns):
        self._stages = (own, patterns)
        # Topic -> decision, for reading and for writing.
        self._readable = {}
        self._writable = {}

    def _decide(self, decided, topic, access):
        decision = False
        for stage in self._stages:
            verdict = stage.decide(topic, access)
            if verdict is not None:
                decision = verdict
                break
        if len(decided) >= CACHED_TOPICS:
            decided.clear()
        decided[topic] = decision
        return decision

    def mayRead(self, topic):
        decision = self._readable.get(topic)
        if decision is None:
            decision = self._decide(self._readable, topic, READ)
        return decision

    def mayWrite(self, topic):
        decision = self._writable.get(topic)
        if decision is None:
            decision = self._decide(self._writable, topic, WRITE)
        return decision

    def mayMatch(self, topicFilter, access):
        """
        Whether a filter (of a subscription, C{access} L{READ}, or of a
        publish to every matching topic, L{WRITE}) can reach any topic
        C{access} is granted on.
        """
        for stage in self._stages:
            verdict = stage.decideFilter(topicFilter, access)
            if verdict is not None:
                return verdict
        return False


def _hidesReserved(literal, index):
    """
    Whether, at level C{index}, a wildcard cannot stand for the level
    C{literal}: a wildcard in the first level does not match C{$} topics.
    """
    return index == 0 and literal.startswith(RESERVED_PREFIX)


def overlaps(first, second):
    """
    Whether two valid filters match at least one topic in common.
    """
    a, b = first.split(SEPARATOR), second.split(SEPARATOR)
    for index in range(max(len(a), len(b)) + 1):
        x = a[index] if index < len(a) else None
        y = b[index] if index < len(b) else None
        if x is None and y is None:
            return True
        if MULTI_LEVEL in (x, y):
            other = y if x == MULTI_LEVEL else x
            return other in (None, MULTI_LEVEL, SINGLE_LEVEL) or not _hidesReserved(other, index)
        if x is None or y is None:
            return False
        if x == SINGLE_LEVEL or y == SINGLE_LEVEL:
            other = y if x == SINGLE_LEVEL else x
            if other != SINGLE_LEVEL and _hidesReserved(other, index):
                return False
            continue
        if x != y:
            return False
    return True


def covers(broad, narrow):
    """
    Whether every topic the valid filter C{narrow} matches is matched by
    the valid filter C{broad}.
    """
    a, b = broad.split(SEPARATOR), narrow.split(SEPARATOR)
    for index in range(len(a)):
        x = a[index]
        if x == MULTI_LEVEL:
            return not (index < len(b) and _hidesReserved(b[index], index))
        if index >= len(b):
            return False
        y = b[index]
        if y == MULTI_LEVEL:
            return False
        if x == SINGLE_LEVEL:
            if _hidesReserved(y, index):
                return False
            continue
        if y == SINGLE_LEVEL or x != y:
            return False
    return len(a) == len(b)
