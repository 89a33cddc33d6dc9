"""An SGLang 0.5.23 radix cache, modeled for the KV events it publishes (page size ``page``).

What the model copies from ``sglang/srt/mem_cache/radix_cache.py``, ``events.py`` and
``utils.py``:

* an insert walks the tree over page-aligned matches; a match ending inside a node splits it
  there (the split publishes nothing: the two halves keep the page hashes they had); the rest
  of the key, cut to whole pages, becomes one new node, and only that node is published;
* a node publishes one ``BlockStored`` per page, ``parent_block_hash`` the last page of the node
  it hangs from (``None`` under the root), coalesced while the pages chain (so a node stored
  right after its parent's node, in the same batch, joins its event);
* a page's hash is the first 64 bits of a SHA-256 over the *whole* 32-byte digest of the page
  before it and the page's tokens (little-endian uint32): the same prefix has the same hashes
  on every pod, and nobody who sees only the 64-bit hashes can compute the next one;
* eviction takes leaves, least recently used first (a parent only once its children are gone),
  and publishes one ``BlockRemoved`` per node, with every page hash of the node; consecutive
  removals coalesce.

:meth:`RadixCache.held` is what the pod holds: every token sequence from the root to a leaf.
:meth:`RadixCache.match` is how much of a prompt it holds (what a router should credit).
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvredis.testing.wire import sglang_removed, sglang_stored

__all__ = ["Node", "RadixCache", "page_digest"]


def page_digest(prior: bytes | None, tokens: Sequence[int]) -> bytes:
    """The 32-byte digest of a page (SGLang's native hash): SHA-256 over the digest of the page
    before it (none for a chain's first page) and the page's tokens as little-endian uint32.
    The page's engine hash is its first 8 bytes, big-endian."""
    sha = hashlib.sha256()
    if prior is not None:
        sha.update(prior)
    sha.update(b"".join(t.to_bytes(4, "little") for t in tokens))
    return sha.digest()


def _event_hash(digest: bytes) -> int:
    return int.from_bytes(digest[:8], "big")


@dataclass(eq=False)
class Node:
    """A radix node: its tokens, the digest and engine hash of each of its pages."""

    tokens: tuple[int, ...]
    digests: list[bytes]
    parent: Node | None
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)
    last_access: int = 0

    @property
    def hashes(self) -> list[int]:
        """The engine hash of each page (unsigned 64-bit)."""
        return [_event_hash(d) for d in self.digests]

    def path(self) -> tuple[int, ...]:
        """The tokens from the root to the end of this node."""
        out: tuple[int, ...] = ()
        node: Node | None = self
        while node is not None:
            out = node.tokens + out
            node = node.parent
        return out


class RadixCache:
    """One pod's radix tree; :attr:`queue` collects the events its operations publish.

    ``capacity`` (tokens; ``None``: unbounded) makes :meth:`insert` evict least recently used
    leaves first to make room, as SGLang's scheduler does before a prefill.
    """

    def __init__(self, page: int, capacity: int | None = None) -> None:
        self.page = page
        self.capacity = capacity
        self.root = Node((), [], None)
        self.queue: list[dict[str, Any]] = []
        self.size = 0
        """Tokens held."""
        self._clock = itertools.count(1)

    def _child_key(self, tokens: Sequence[int]) -> tuple[int, ...]:
        return tuple(tokens[: self.page])

    def _match(self, a: Sequence[int], b: Sequence[int]) -> int:
        n = 0
        for x, y in zip(a, b, strict=False):
            if x != y:
                break
            n += 1
        return n // self.page * self.page

    def _split(self, node: Node, at: int) -> Node:
        assert node.parent is not None
        pages = at // self.page
        head = Node(node.tokens[:at], node.digests[:pages], node.parent, {}, node.last_access)
        node.parent.children[self._child_key(node.tokens)] = head
        node.tokens, node.digests, node.parent = node.tokens[at:], node.digests[pages:], head
        head.children[self._child_key(node.tokens)] = node
        return head

    def _walk(self, key: tuple[int, ...], split: bool) -> tuple[Node, int]:
        """The deepest node whose path ``key`` starts with (splitting a node the match ends in,
        with ``split``), touched now, and the tokens matched."""
        now = next(self._clock)
        node, matched = self.root, 0
        while matched < len(key):
            child = node.children.get(self._child_key(key[matched:]))
            if child is None:
                break
            n = self._match(child.tokens, key[matched:])
            if n == 0:
                break
            if n < len(child.tokens):
                if not split:
                    child.last_access = now
                    return node, matched + n
                child = self._split(child, n)
            child.last_access = now
            node, matched = child, matched + n
        return node, matched

    def match(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of ``tokens`` the cache holds (whole pages), touching them."""
        key = tuple(tokens[: len(tokens) // self.page * self.page])
        return self._walk(key, split=False)[1]

    def insert(self, tokens: Sequence[int]) -> int:
        """Cache ``tokens`` (cut to whole pages), publishing the new node if there is one;
        evicts first to stay within ``capacity``. Returns the tokens it already held."""
        key = tuple(tokens[: len(tokens) // self.page * self.page])
        node, matched = self._walk(key, split=True)
        rest = key[matched:]
        if not rest:
            return matched
        if self.capacity is not None and self.size + len(rest) > self.capacity:
            self.evict_until(self.capacity - len(rest), keep=node)
        prior = node.digests[-1] if node.digests else None
        digests = []
        for start in range(0, len(rest), self.page):
            prior = page_digest(prior, rest[start : start + self.page])
            digests.append(prior)
        new = Node(rest, digests, node, {}, next(self._clock))
        node.children[self._child_key(rest)] = new
        self.size += len(rest)
        parent = _event_hash(node.digests[-1]) if node.digests else None
        for i, digest in enumerate(digests):
            h = _event_hash(digest)
            page = rest[i * self.page : (i + 1) * self.page]
            self._enqueue(sglang_stored([h], parent, page, len(page)))
            parent = h
        return matched

    def leaves(self) -> list[Node]:
        """Every leaf (a node without children)."""
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                out.append(node)
        return out

    def evict(self, leaf: Node) -> None:
        """Evict one leaf (publishing its pages' removal)."""
        assert not leaf.children and leaf.parent is not None
        del leaf.parent.children[self._child_key(leaf.tokens)]
        self.size -= len(leaf.tokens)
        self._enqueue(sglang_removed(leaf.hashes))

    def evict_until(self, size: int, keep: Node | None = None) -> None:
        """Evict least recently used leaves until at most ``size`` tokens are held (never
        ``keep`` or a node on its path, which a running request holds)."""
        locked: set[int] = set()
        node = keep
        while node is not None:
            locked.add(id(node))
            node = node.parent
        order = itertools.count()  # ties broken by discovery, never by comparing nodes
        heap = [
            (leaf.last_access, next(order), leaf)
            for leaf in self.leaves()
            if id(leaf) not in locked
        ]
        heapq.heapify(heap)
        while self.size > size and heap:
            _, _, victim = heapq.heappop(heap)
            parent = victim.parent
            self.evict(victim)
            now_a_leaf = parent is not None and parent is not self.root and not parent.children
            if now_a_leaf and id(parent) not in locked:
                assert parent is not None
                heapq.heappush(heap, (parent.last_access, next(order), parent))

    def held(self) -> list[tuple[int, ...]]:
        """Every root-to-leaf token sequence (every held prefix is a prefix of one)."""
        return [leaf.path() for leaf in self.leaves()]

    def take(self) -> list[dict[str, Any]]:
        """The events published since the last call (one engine batch)."""
        events, self.queue = self.queue, []
        return events

    def _enqueue(self, event: dict[str, Any]) -> None:
        tail = self.queue[-1] if self.queue else None
        if tail is not None and tail["type"] == event["type"] == "BlockRemoved":
            tail["block_hashes"].extend(event["block_hashes"])
            return
        if (
            tail is not None
            and tail["type"] == event["type"] == "BlockStored"
            and tail["block_size"] == event["block_size"]
            and event["parent_block_hash"] == tail["block_hashes"][-1]
        ):
            tail["block_hashes"].extend(event["block_hashes"])
            tail["token_ids"].extend(event["token_ids"])
            return
        self.queue.append(event)
