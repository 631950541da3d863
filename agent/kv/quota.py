"""Fair eviction between clients: whose entries may make room for whom. One pure rule for
every bounded store clients share, so that a client within its fair share never loses an
entry because another client made many (`fair_victims`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Holding:
    """One entry of a shared store: whose it is, what it takes (1 for a count, or bytes), and
    whether it may be evicted at all (an entry in use may not)."""

    key: str
    owner: str
    size: int
    evictable: bool = True


def fair_share(capacity: int, holdings: Sequence[Holding], owner: str) -> float:
    """The capacity divided by the number of clients holding something, `owner` included."""
    return capacity / len({h.owner for h in holdings} | {owner})


def fair_victims(
    holdings: Sequence[Holding], owner: str, need: int, capacity: int
) -> list[str] | None:
    """Keys to evict, in order, so that `need` more of `owner`'s fits within `capacity`, or
    None when the entries the rule allows are not enough. `holdings` are in least recently
    used order; an owner's usage counts `need` for the one asking.

    One pure rule serves every bounded store that clients share (the session count, the host tier,
    the disk tier): room for a client is made only from that client's own entries or from clients
    holding more than their fair share (the capacity divided by the number of clients holding
    anything, the one asking included). A client within its fair share never loses an entry because
    another client made many. Among those allowed, the client holding the most gives first (the one
    asking, on a tie), its least recently used entry first; when even that is not enough, the caller
    refuses instead of reaching further.
    """
    if need > capacity:
        return None
    usage: Counter[str] = Counter()
    for h in holdings:
        usage[h.owner] += h.size
    usage[owner] += need
    total = sum(usage.values())
    share = fair_share(capacity, holdings, owner)
    left = [h for h in holdings if h.evictable]
    victims: list[str] = []
    while total > capacity:
        allowed = [h for h in left if h.owner == owner or usage[h.owner] > share]
        if not allowed:
            return None
        most = max(usage[h.owner] for h in allowed)
        largest = [h for h in allowed if usage[h.owner] == most]
        own = [h for h in largest if h.owner == owner]
        pick = (own or largest)[0]  # the largest holder's LRU entry; on a tie, the asker's
        left.remove(pick)
        usage[pick.owner] -= pick.size
        total -= pick.size
        victims.append(pick.key)
    return victims
