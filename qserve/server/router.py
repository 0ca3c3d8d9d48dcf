"""Prefix-aware replica choice for `qserve serve --replicas`: which replica should run a request.

Pure Python (no Ray), so the policy is testable on its own; cluster.py plugs it into Ray
Serve's request router.

A replica's prefix cache holds the KV blocks of the prompts it has seen. A request whose
prompt starts like an earlier one (the same system prompt, the next turn of a conversation)
reuses those blocks only on the replica that computed them. So the router keys a request by
its leading text, in blocks of BLOCK_CHARS characters, and remembers which replica last ran
each key:

    "[{"content":"You are a pirate...","role":"system"},{"content":"hi","role":"user"}]"
     |--- block 1 ---|--- block 2 ---|--- block 3 ---|--- ...          (64 characters each)
     key k1 = H(block 1), k2 = H(blocks 1-2), k3 = H(blocks 1-3), ...   (a key names the
                                                        whole prefix, as a KV block's key does)

The text is the request body's messages (chat) or prompt (completions), as canonical JSON:
the rendered prompt is a function of it, and a conversation's next turn extends the previous
turn's text, so its keys extend the previous keys. Only whole blocks are keyed (a KV block is
cached only when full), and at most MAX_BLOCKS, so hashing stays cheap for long prompts.

Choosing (`rank`): the longest key the table knows names the preferred replica; it is tried
first unless it is busier than the least-loaded replica by more than `max_imbalance` ongoing
requests (a popular prefix must not pile every request onto one replica). Without a match, or
past that imbalance, the least-loaded replica goes first. The table is an LRU map bounded to
`capacity` keys; a replica that dies simply stops matching (its keys point nowhere alive).
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
    """Prefix key -> the replica that last ran a request with it; an LRU bounded to
    `capacity` keys."""

    def __init__(self, capacity: int = 1 << 16):
        assert capacity > 0
        self.capacity = capacity
        self._owner: OrderedDict[bytes, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._owner)

    def lookup(self, keys: Sequence[bytes], alive: Iterable[str]) -> tuple[str | None, int]:
        """The replica holding the longest of `keys` among `alive`, and how many blocks
        match; (None, 0) when none does."""
        alive = set(alive)
        for n in range(len(keys), 0, -1):
            owner = self._owner.get(keys[n - 1])
            if owner in alive:
                return owner, n
        return None, 0

    def record(self, keys: Sequence[bytes], replica: str) -> None:
        """`replica` now holds every prefix in `keys` (it ran the request)."""
        for key in keys:
            self._owner[key] = replica
            self._owner.move_to_end(key)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)

    def forget(self, replica: str) -> None:
        """Drop a replica's keys (it is gone; its replacement starts with an empty cache)."""
        for key in [k for k, r in self._owner.items() if r == replica]:
            del self._owner[key]


def rank(replicas: Sequence[str], load: dict[str, int], preferred: str | None,
         max_imbalance: int) -> list[str]:
    """`replicas` in the order to try them: `preferred` first unless it has more than
    `max_imbalance` ongoing requests beyond the least-loaded one; then by load (ties keep
    the given order)."""
    by_load = sorted(replicas, key=lambda r: load.get(r, 0))
    if preferred is None or preferred not in replicas:
        return by_load
    if load.get(preferred, 0) > load.get(by_load[0], 0) + max_imbalance:
        return by_load
    return [preferred] + [r for r in by_load if r != preferred]


class RoundRobin:
    """The baseline the benchmark compares with: each request to the next replica."""

    def __init__(self):
        self._next = 0

    def rank(self, replicas: Sequence[str]) -> list[str]:
        if not replicas:
            return []
        start = self._next % len(replicas)
        self._next += 1
        return list(replicas[start:]) + list(replicas[:start])
