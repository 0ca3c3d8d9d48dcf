"""Prefix-aware replica choice for `qserve serve --replicas`: which replica should run a request.

Pure Python (no Ray), so the policy is testable on its own; cluster.py plugs it into Ray
Serve's request router.

A replica's prefix cache holds the KV blocks of the prompts it has seen. A request whose
prompt starts like an earlier one (the same system prompt, the next turn of a conversation)
reuses those blocks only on the replica that computed them. So the router keys a request by
its leading text, in blocks of BLOCK_CHARS characters:

    "[{"content":"You are a pirate...","role":"system"},{"content":"hi","role":"user"}]"
     |--- block 1 ---|--- block 2 ---|--- block 3 ---|--- ...          (64 characters each)
     key k1 = H(block 1), k2 = H(blocks 1-2), k3 = H(blocks 1-3), ...   (a key names the
                                                        whole prefix, as a KV block's key does)

The text is the request body's messages (chat) or prompt (completions), as canonical JSON:
the rendered prompt is a function of it, and a conversation's next turn extends the previous
turn's text, so its keys extend the previous keys. Only whole blocks are keyed (a KV block is
cached only when full), and at most MAX_BLOCKS, so hashing stays cheap for long prompts.

Each prefix has a home, the replica its first request went to, and stays there (`PrefixTable`).
The homes spread the distinct prefixes evenly over the replicas, so that N replicas' caches
together hold N times what one holds, where round-robin makes every replica cache every prefix:

    round-robin   replica 0 caches  s0 s1 s2 s3 s4 s5 s6 s7   (evicting them in turn)
                  replica 1 caches  s0 s1 s2 s3 s4 s5 s6 s7
    prefix        replica 0 caches  s0 s2 s4 s6               (each fits)
                  replica 1 caches  s1 s3 s5 s7

Choosing (`PrefixPolicy.rank`), with "too busy" meaning more than `max_imbalance` ongoing
requests beyond the least-loaded replica and more than twice its count (a relative bound
too: under heavy load, a few requests' difference is no reason to lose a replica's cache):
  1. the longest key the table knows names the replicas holding that prefix, home first; if it
     covers at least `min_match` of the request's keys, the first of them that is not too busy
     goes first. A request sent past a busy home makes its replica a second holder (the next
     overflow goes there too) but does not move the home: one overflow must not move a system
     prompt's traffic, or both replicas end up caching it;
  2. a request with no such match starts a new prefix: it goes to the replica, not too busy,
     that is home to the fewest prefix blocks (ties: the least loaded), so each replica gets
     about 1/N of the distinct prefixes even when they arrive all at once;
  3. past a too-busy home with no other holder, the least-loaded replica goes first.
The rest follow by load: Serve tries them when the first is at its max_ongoing_requests.
max_imbalance defaults to 8, not fewer: a request sent past its home computes its prefix cold
and evicts another prefix from the replica it lands on. In scripts/bench_routing.py (8 in
flight over 2 replicas) a bound of 4 sent 6% of the requests away from home, and the hit rate
was 70% against 78% with 8, TTFT p50 1.5 s against 0.7 s (one run each, on a shared box).
A replica that dies simply stops matching, and its prefixes find new homes (`forget`).
"""
from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Iterable, Sequence

BLOCK_CHARS = 64  # about 16 tokens of English: one KV block at the default --block-size
MAX_BLOCKS = 64  # keys past 4096 characters add no routing information worth their cost
_KEY_BYTES = 8


def prefix_keys(text: str, block_chars: int = BLOCK_CHARS,
                max_blocks: int = MAX_BLOCKS) -> list[bytes]:
    """The chained keys of `text`'s whole leading blocks, shortest prefix first."""
    h = hashlib.blake2b(digest_size=_KEY_BYTES)
    keys = []
    for start in range(0, min(len(text) // block_chars, max_blocks) * block_chars,
                       block_chars):
        # blocks are cut on characters, hashed as UTF-8: a multi-byte character is never split
        h.update(text[start:start + block_chars].encode("utf-8", "surrogatepass"))
        keys.append(h.copy().digest())
    return keys


def routing_text(path: str, body: bytes) -> str | None:
    """The text a request is routed by: its chat messages or its prompt, as canonical JSON;
    None when the body is not a generation request (it goes to the least-loaded replica, and
    the replica gives the error)."""
    if not path.endswith(("/chat/completions", "/completions")):
        return None
    try:
        req = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(req, dict):
        return None
    part = req.get("messages") if path.endswith("/chat/completions") else req.get("prompt")
    if isinstance(part, str):
        return part
    if part is None:
        return None
    try:
        text = json.dumps(part, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError):
        return None
    # a list's closing "]" would end every key with the last message: drop it, so a
    # conversation's next turn shares all the previous turn's whole blocks
    return text[:-1] if text.endswith("]") else text


class PrefixTable:
    """Prefix key -> the replicas that ran a request with it, its home (the first) first; an
    LRU bounded to `capacity` keys. `homed[r]` counts the keys whose home is replica r."""

    def __init__(self, capacity: int = 1 << 16):
        assert capacity > 0
        self.capacity = capacity
        self._holders: OrderedDict[bytes, list[str]] = OrderedDict()
        self.homed: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._holders)

    def lookup(self, keys: Sequence[bytes], alive: Iterable[str]) -> tuple[list[str], int]:
        """The replicas among `alive` holding the longest of `keys` that any of them holds,
        home first, and how many blocks match; ([], 0) when none does."""
        alive = set(alive)
        for n in range(len(keys), 0, -1):
            holders = [r for r in self._holders.get(keys[n - 1], ()) if r in alive]
            if holders:
                return holders, n
        return [], 0

    def record(self, keys: Sequence[bytes], replica: str) -> None:
        """`replica` ran a request with every prefix in `keys`: it becomes the home of the new
        ones and one more holder of the others."""
        for key in keys:
            holders = self._holders.get(key)
            if holders is None:
                self._holders[key] = [replica]
                self.homed[replica] = self.homed.get(replica, 0) + 1
                continue
            if replica not in holders:
                holders.append(replica)
            self._holders.move_to_end(key)
        while len(self._holders) > self.capacity:
            _, holders = self._holders.popitem(last=False)
            self.homed[holders[0]] -= 1

    def forget(self, replica: str) -> None:
        """Drop a replica (it is gone; a replacement starts with an empty cache): its keys
        move home to their next holder, or are dropped when it held them alone."""
        for key in [k for k, h in self._holders.items() if replica in h]:
            holders = self._holders[key]
            if holders[0] == replica and len(holders) > 1:
                self.homed[holders[1]] = self.homed.get(holders[1], 0) + 1
            holders.remove(replica)
            if not holders:
                del self._holders[key]
        self.homed.pop(replica, None)


def rank(replicas: Sequence[str], load: dict[str, int], holders: Sequence[str],
         max_imbalance: int, homed: dict[str, int] | None = None) -> list[str]:
    """`replicas` in the order to try them (see the module's docstring).

    Args:
        replicas: the live replicas; among equals the earlier one goes first.
        load: replica -> its ongoing requests.
        holders: the replicas holding the request's prefix, home first; [] for a new one.
        max_imbalance: a replica is too busy to go first with more ongoing requests than
            the least-loaded one's count plus max(max_imbalance, that count): past
            max_imbalance beyond it and past twice it, so that under heavy load a prefix's
            home keeps its traffic while it is under twice the lightest replica's load.
        homed: replica -> prefix blocks homed there, to place a new prefix; None: a request
            without a prefix, which goes to the least loaded.
    """
    by_load = sorted(replicas, key=lambda r: load.get(r, 0))
    if not by_load:
        return []
    least = load.get(by_load[0], 0)
    fits = [r for r in replicas if load.get(r, 0) - least <= max(max_imbalance, least)]
    first = next((r for r in holders if r in fits), None)
    if first is None and not holders and homed is not None:
        first = min(fits, key=lambda r: (homed.get(r, 0), load.get(r, 0)))
    if first is None:
        return by_load
    return [first] + [r for r in by_load if r != first]


class PrefixPolicy:
    """Prefix-aware routing: `rank` a request's replicas by its prefix keys, then tell
    `routed` where it went."""

    def __init__(self, max_imbalance: int = 8, min_match: float = 0.5,
                 capacity: int = 1 << 16):
        assert max_imbalance >= 0 and 0 <= min_match <= 1
        self.max_imbalance = max_imbalance
        self.min_match = min_match
        self.table = PrefixTable(capacity)
        self._turn = 0  # rotates which of equally placed replicas a new prefix goes to

    def rank(self, keys: Sequence[bytes], replicas: Sequence[str],
             load: dict[str, int]) -> list[str]:
        holders, matched = self.table.lookup(keys, replicas)
        if matched < self.min_match * len(keys):  # a short common start (boilerplate)
            holders = []
        if not holders and replicas:
            self._turn += 1
            k = self._turn % len(replicas)
            replicas = list(replicas[k:]) + list(replicas[:k])
        order = rank(replicas, load, holders, self.max_imbalance,
                     self.table.homed if keys else None)
        if keys and not holders and order:
            # the new prefix's home is taken now, not when Serve reports where the request
            # went: the requests of a burst are ranked before any of them is routed, and
            # the ones sharing this prefix must find it
            self.table.record(keys, order[0])
        return order

    def routed(self, keys: Sequence[bytes], replica: str) -> None:
        """The request with `keys` went to `replica` (Serve may have skipped a full one)."""
        if keys:
            self.table.record(keys, replica)

    def forget(self, replica: str) -> None:
        self.table.forget(replica)


class RoundRobin:
    """The baseline the benchmark compares with: each request to the next replica."""

    def __init__(self):
        self._next = 0

    def rank(self, keys: Sequence[bytes], replicas: Sequence[str],
             load: dict[str, int]) -> list[str]:
        if not replicas:
            return []
        start = self._next % len(replicas)
        self._next += 1
        return list(replicas[start:]) + list(replicas[:start])

    def routed(self, keys: Sequence[bytes], replica: str) -> None:
        pass

    def forget(self, replica: str) -> None:
        pass
