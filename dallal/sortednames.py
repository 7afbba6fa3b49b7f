"""
A set of names kept in order, so that listing the first few costs what
they are, not how many there are.
"""

from bisect import bisect_left, insort


class SortedNames:
    """
    A set of strings that lists its smallest ones in C{O(limit)}; adding or
    removing one moves the list's pointers (a C{memmove}), never sorts.
    """

    def __init__(self, names=()):
        self._names = sorted(set(names))

    def __len__(self):
        return len(self._names)

    def __contains__(self, name):
        index = bisect_left(self._names, name)
        return index < len(self._names) and self._names[index] == name

    def add(self, name):
        """
        Add C{name}, if it is not there yet.
        """
        if name not in self:
            insort(self._names, name)

    def discard(self, name):
        """
        Remove C{name}, if it is there.
        """
        index = bisect_left(self._names, name)
        if index < len(self._names) and self._names[index] == name:
            del self._names[index]

    def first(self, limit):
        """
        @return: a C{list} of the C{limit} smallest names, in order.
        """
        return self._names[:limit]
