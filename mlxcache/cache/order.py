"""The victim order: unpinned entries sorted by `victim_key`, kept as data.

`victim_key` is the eviction policy (docs/architecture.md, "The prompt index"); the rest of
this module finds its minimum fast. The class (extended, rest) and last_used do
not depend on the prompt, so entries are kept sorted by them.
Usefulness does, so it is decided at pick time, and the structure is laid out so that a pick
only looks at the entries useful to the prompt plus one:

- A trimmable entry of at least one block is useful exactly when its first block is the
  prompt's (and the prompt is longer than a block). Such entries are grouped by first block
  and only each group's least recently used member stands in the class list, so the whole
  group the prompt can use costs one step of the scan.
- Every other entry (shorter than a block, or non-trimmable) stands in the class list itself;
  the non-trimmable ones useful to the prompt are its proper prefixes, found by a tree walk.

One logical clock serves born and last_used, so last_used never ties and is the key alone.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Container

from mlxcache.cache.entry import EXTENDED, REST, Entry


def victim_class(e: Entry) -> int:
    """Extended entries go first (a newer, longer entry restores all they can), then the
    rest."""
    return EXTENDED if e.extenders else REST


def victim_key(e: Entry, useful: bool) -> tuple[int, bool, int]:
    """The eviction policy: the unpinned entry with the smallest key goes first.

    By class; within a class, entries of no use to the prompt being served before useful
    ones (`useful`: it can restore some of that prompt); then the least recently used.
    `VictimOrder.pick` returns exactly this minimum without sorting every entry.
    """
    return (victim_class(e), useful, e.last_used)


def _discard(keys: list[int], key: int) -> None:
    del keys[bisect_left(keys, key)]


class VictimOrder:
    """Unpinned entries of an index, ready for a victim pick."""

    def __init__(self) -> None:
        # Per class: the sorted last_used of each ungrouped entry and of each group's head.
        self._lists: tuple[list[int], ...] = ([], [])
        # Per class: the sorted last_used of each group's members.
        self._groups: tuple[dict[bytes, list[int]], ...] = ({}, {})
        self._entry: dict[int, Entry] = {}

    def attach(self, e: Entry, cls: int) -> None:
        """Put `e` in class `cls` at its current last_used (it must not be attached)."""
        key = e.last_used
        e.victim_class = cls
        self._entry[key] = e
        if e.group is None:
            insort(self._lists[cls], key)
            return
        members = self._groups[cls].setdefault(e.group, [])
        insort(members, key)
        if members[0] == key:
            if len(members) > 1:
                _discard(self._lists[cls], members[1])
            insort(self._lists[cls], key)

    def detach(self, e: Entry) -> None:
        """Take `e` out (it must be attached, with the last_used it was attached with)."""
        key, cls = e.last_used, e.victim_class
        del self._entry[key]
        if e.group is None:
            _discard(self._lists[cls], key)
            return
        groups = self._groups[cls]
        members = groups[e.group]
        i = bisect_left(members, key)
        del members[i]
        if i == 0:
            _discard(self._lists[cls], key)
            if members:
                insort(self._lists[cls], members[0])
            else:
                del groups[e.group]

    def pick(self, group: bytes | None, prefixes: Container[Entry]) -> Entry | None:
        """The first entry in victim order, for a prompt whose first-block group is `group`
        (None: no trimmable entry is of use to it) and whose useful non-trimmable entries
        are `prefixes`."""
        for keys in self._lists:
            if not keys:
                continue
            fallback = None
            for key in keys:
                e = self._entry[key]
                if (group is None or e.group != group) and e not in prefixes:
                    return e
                if fallback is None:
                    fallback = e
            return fallback
        return None
