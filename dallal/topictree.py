"""
Hierarchical topics: subscription filters with wildcards, and the two trees
that match them.

A topic is made of C{/}-separated levels.  A subscription filter may use
C{+} for exactly one level (possibly empty: C{a/+} matches C{a/}) and C{#},
as its last level, for every remaining level including none (C{a/#} matches
C{a}, C{a/b} and C{a/b/c}).  As in MQTT, a filter whose first level is a
wildcard does not match a topic whose first level starts with C{$}, which
leaves room for the broker's own C{$SYS/...} topics: C{#} does not match
C{$SYS/load}, but C{$SYS/#} does.

Two trees, keyed by level, answer the two questions a broker asks:

  - L{SubscriptionTree}: which subscribers want a message published on this
    topic?  (filters in the tree, a topic as the question)
  - L{TopicMap}: which existing topics, such as those holding a retained
    message, does this filter match?  (topics in the tree, a filter as the
    question)

Both walk only the branches that can match, so a lookup costs about what its
matches cost, however many entries the tree holds.
"""

from collections.abc import MutableMapping

from dallal.topics import MAX_TOPIC_LENGTH, SEPARATOR, WILDCARDS, TopicError, checkTopicName

SINGLE_LEVEL = "+"
MULTI_LEVEL = "#"
RESERVED_PREFIX = "$"


def checkFilter(topicFilter, maxLength=MAX_TOPIC_LENGTH, maxLevels=None):
    """
    Check a subscription filter.

    @raise TopicError: with a reason a person can act on.
    """
    checkTopicName(topicFilter, maxLength, "filter", maxLevels)
    if not WILDCARDS.intersection(topicFilter):
        return
    levels = topicFilter.split(SEPARATOR)
    for index, level in enumerate(levels):
        if MULTI_LEVEL in level:
            if level != MULTI_LEVEL:
                raise TopicError(f"'#' must be alone in its level, not in {level!r}")
            if index != len(levels) - 1:
                raise TopicError("'#' must be the last level of a filter")
        elif SINGLE_LEVEL in level and level != SINGLE_LEVEL:
            raise TopicError(f"'+' must be alone in its level, not in {level!r}")


class _Node:
    """
    One level of a tree.

    @ivar children: the next levels, by name.
    @ivar entry: what the tree keeps at the name that ends here, or C{None}
        when no name ends here.
    @ivar single: C{children["+"]}, or C{None}; C{multi}, C{children["#"]}:
        a match takes them at every node it visits, an attribute costs less
        than a lookup.
    """

    __slots__ = ("children", "entry", "single", "multi")

    def __init__(self):
        self.children = {}
        self.entry = None
        self.single = None
        self.multi = None


class _LevelTree:
    """
    What both trees share: nodes by level, created on the way down and pruned
    on the way back up so that memory follows what the tree holds, not what
    it once held.

    @ivar nodeCount: the nodes below the root; 0 when the tree is empty.
    """

    def __init__(self):
        self._root = _Node()
        self.nodeCount = 0

    def _nodeFor(self, name):
        """
        The node where C{name} ends, created with its missing ancestors.
        """
        node = self._root
        for depth, level in enumerate(name.split(SEPARATOR)):
            child = node.children.get(level)
            if child is None:
                child = node.children[level] = _Node()
                self.nodeCount += 1
                if level == SINGLE_LEVEL:
                    node.single = child
                elif level == MULTI_LEVEL:
                    node.multi = child
                else:
                    self._named(depth, level, 1)
            node = child
        return node

    def _pathTo(self, name):
        """
        The (parent, level, node) steps from the root to where C{name} ends,
        or C{None} if the tree has no such node.
        """
        path = []
        node = self._root
        for level in name.split(SEPARATOR):
            child = node.children.get(level)
            if child is None:
                return None
            path.append((node, level, child))
            node = child
        return path

    def _prune(self, path):
        """
        Remove the nodes of C{path} left with neither entry nor children,
        deepest first.
        """
        for depth in range(len(path) - 1, -1, -1):
            parent, level, node = path[depth]
            if node.entry is not None or node.children:
                return
            del parent.children[level]
            self.nodeCount -= 1
            if level == SINGLE_LEVEL:
                parent.single = None
            elif level == MULTI_LEVEL:
                parent.multi = None
            else:
                self._named(depth, level, -1)

    def _named(self, depth, level, change):
        """
        Note that C{change} nodes named C{level} (no wildcard) were added to
        (1) or removed from (-1) the tree at C{depth}; a tree that keeps no
        index of its names ignores it.
        """


class SubscriptionTree(_LevelTree):
    """
    Subscriptions by filter: which subscribers want a topic.

    Each (filter, subscriber) pair holds one value, such as the options of
    that subscription, and a rank from 0 to C{ranks - 1}: L{best} gives each
    subscriber the value of its highest-ranked filter that matches.  Filters
    must have passed L{checkFilter}.

    A node's entry is one C{dict} of subscriber -> value per rank, so that
    L{best} merges a matching filter's subscribers with C{dict.update},
    whatever their number: a message matching many overlapping filters of
    the same subscribers costs a step per filter, not per pair.

    The tree does not list a subscriber's filters: the broker keeps them with
    the subscriber's session anyway, to remove them when it leaves, and an
    index here would cost memory on every subscription for no new answer.
    It does count the names its filters use at each depth, for L{shape}.
    """

    def __init__(self, ranks=1):
        _LevelTree.__init__(self)
        self._count = 0
        self._ranks = ranks
        # depth -> {level name -> how many nodes at that depth bear it}.
        self._namesAtDepth = []

    def _named(self, depth, level, change):
        names = self._namesAtDepth
        if change > 0:
            while len(names) <= depth:
                names.append({})
            names[depth][level] = names[depth].get(level, 0) + 1
            return
        atDepth = names[depth]
        if atDepth[level] == 1:
            del atDepth[level]
            while names and not names[-1]:
                names.pop()
        else:
            atDepth[level] -= 1

    def shape(self, topic):
        """
        A key that every topic the same filters match shares: the topic's
        levels, each replaced by C{None} where no filter names it at that
        depth.  A match only ever takes a level by its name when some filter
        names it; any other name takes the same wildcard branches.  Topics
        that differ only in such levels, as C{sensors/<id>/temperature}
        does under C{sensors/+/temperature}, share one shape, so a broker
        that remembers the subscribers of a shape matches a new topic of a
        known shape without walking the tree.
        """
        names = self._namesAtDepth
        levels = topic.split(SEPARATOR)
        shape = [
            level if depth < len(names) and level in names[depth] else None
            for depth, level in enumerate(levels)
        ]
        if topic.startswith(RESERVED_PREFIX):
            # Wildcards do not reach a '$' topic's first level, whatever its
            # name: it must not share a shape with an ordinary topic.
            shape[0] = levels[0]
        return tuple(shape)

    def __len__(self):
        """
        The number of (filter, subscriber) pairs.
        """
        return self._count

    def add(self, topicFilter, subscriber, value=None, rank=0):
        """
        Subscribe C{subscriber} to C{topicFilter} with C{value} and C{rank},
        replacing the value and rank of an existing subscription.

        @return: C{True} if the subscription is new, C{False} if it replaced
            one.
        """
        node = self._nodeFor(topicFilter)
        if node.entry is None:
            node.entry = [{} for _ in range(self._ranks)]
        isNew = True
        for values in node.entry:
            if values.pop(subscriber, _ABSENT) is not _ABSENT:
                isNew = False
        node.entry[rank][subscriber] = value
        self._count += isNew
        return isNew

    def remove(self, topicFilter, subscriber):
        """
        Unsubscribe C{subscriber} from C{topicFilter}.

        @return: the value of the subscription.
        @raise KeyError: if there is no such subscription.
        """
        path = self._pathTo(topicFilter)
        node = path[-1][2] if path is not None else None
        for values in node.entry if node is not None and node.entry is not None else ():
            value = values.pop(subscriber, _ABSENT)
            if value is not _ABSENT:
                break
        else:
            raise KeyError((topicFilter, subscriber))
        self._count -= 1
        if not any(node.entry):
            node.entry = None
            self._prune(path)
        return value

    def match(self, topic):
        """
        The subscriptions that want a message published on C{topic}.

        @return: a C{dict} from each subscriber to the list of the values of
            all its filters that match C{topic}, so that the caller sends one
            copy per subscriber even when two of its filters overlap.
        """
        found = {}
        for entry in self._matchingEntries(topic):
            for values in entry:
                _collect(found, values)
        return found

    def best(self, topic):
        """
        The subscriptions that want a message published on C{topic}, one
        per subscriber: of its filters that match, the highest-ranked.

        @return: a C{dict} from each subscriber to that filter's value.
        """
        entries = self._matchingEntries(topic)
        found = {}
        # Lower ranks first: a higher rank's value replaces them.
        for rank in range(self._ranks):
            for entry in entries:
                values = entry[rank]
                if values:
                    found.update(values)
        return found

    def _matchingEntries(self, topic):
        """
        The entries of the filters that match C{topic}.
        """
        found = []
        levels = topic.split(SEPARATOR)
        # Walk the levels breadth first; at each level only the exact child
        # and the '+' child go on, and a '#' child matches everything left.
        nodes = [self._root]
        if topic.startswith(RESERVED_PREFIX):
            # Wildcards in the first level do not reach '$' topics: take
            # that level by its name only.
            child = self._root.children.get(levels[0])
            nodes = [child] if child is not None else []
            levels = levels[1:]
        for level in levels:
            if not nodes:
                return found
            nextNodes = []
            for node in nodes:
                child = node.multi
                if child is not None and child.entry is not None:
                    found.append(child.entry)
                child = node.children.get(level)
                if child is not None:
                    nextNodes.append(child)
                child = node.single
                if child is not None:
                    nextNodes.append(child)
            nodes = nextNodes
        for node in nodes:
            if node.entry is not None:
                found.append(node.entry)
            # 'a/#' also matches 'a' itself.
            child = node.multi
            if child is not None and child.entry is not None:
                found.append(child.entry)
        return found


# What a dict holds for no key.
_ABSENT = object()


def _collect(found, subscribers):
    """
    Add the subscribers of one matching filter to C{found}.
    """
    for subscriber, value in subscribers.items():
        values = found.get(subscriber)
        if values is None:
            found[subscriber] = [value]
        else:
            values.append(value)


class TopicMap(_LevelTree, MutableMapping):
    """
    A mapping from topic names to values, such as the topics that hold a
    retained message, that can also list the topics a filter matches.

    Besides the tree it keeps a plain C{dict} of its topics, so looking up,
    counting and iterating over topics cost what they cost in a C{dict}.
    """

    def __init__(self):
        _LevelTree.__init__(self)
        self._nodes = {}

    def __len__(self):
        return len(self._nodes)

    def __iter__(self):
        return iter(self._nodes)

    def __getitem__(self, topic):
        return self._nodes[topic].entry[1]

    def __setitem__(self, topic, value):
        node = self._nodes.get(topic)
        if node is None:
            node = self._nodes[topic] = self._nodeFor(topic)
        node.entry = (topic, value)

    def __delitem__(self, topic):
        node = self._nodes.pop(topic)
        node.entry = None
        self._prune(self._pathTo(topic))

    def match(self, topicFilter, limit=None):
        """
        The topics that a valid C{topicFilter} matches.

        @param limit: stop once more than this many are found (the caller
            refuses that many anyway), rather than walk the whole tree.
        @return: a C{list} of (topic, value) pairs, in no particular order; a
            list rather than a generator so that the caller may change the
            map while it goes through them.
        """
        if not WILDCARDS.intersection(topicFilter):
            node = self._nodes.get(topicFilter)
            return [node.entry] if node is not None else []
        nodes = [self._root]
        for index, level in enumerate(topicFilter.split(SEPARATOR)):
            # Wildcards in the first level do not reach '$' topics.
            skipReserved = index == 0
            if level == MULTI_LEVEL:
                return _entriesUnder(nodes, skipReserved, limit)
            nextNodes = []
            for node in nodes:
                if level == SINGLE_LEVEL:
                    nextNodes.extend(
                        child
                        for name, child in node.children.items()
                        if not (skipReserved and name.startswith(RESERVED_PREFIX))
                    )
                else:
                    child = node.children.get(level)
                    if child is not None:
                        nextNodes.append(child)
            nodes = nextNodes
        found = []
        for node in nodes:
            if node.entry is not None:
                found.append(node.entry)
                if limit is not None and len(found) > limit:
                    break
        return found


def _entriesUnder(nodes, skipReserved, limit=None):
    """
    The entries of C{nodes} and of all their descendants: what a C{#} at
    their level matches.

    @param skipReserved: leave out the children whose name starts with C{$}
        (C{nodes} is the root).
    @param limit: stop once more than this many are found.
    """
    found = []
    stack = []
    for node in nodes:
        if node.entry is not None:
            found.append(node.entry)
        stack.extend(
            child
            for name, child in node.children.items()
            if not (skipReserved and name.startswith(RESERVED_PREFIX))
        )
    while stack:
        node = stack.pop()
        if node.entry is not None:
            found.append(node.entry)
            if limit is not None and len(found) > limit:
                break
        stack.extend(node.children.values())
    return found
