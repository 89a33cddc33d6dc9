"""An SGLang 0.5.23 radix cache, modeled for its KV events (page size ``page``).

What the model copies from ``sglang/srt/mem_cache/radix_cache.py`` and ``events.py``:

* an insert walks the tree over page-aligned matches; a match ending inside a node splits it
  there (the split publishes nothing: the two halves keep the page hashes they had); the rest
  of the key, cut to whole pages, becomes one new node, and only that node is published;
* a node publishes one ``BlockStored`` per page, ``parent_block_hash`` the last page of the node
  it hangs from (``None`` under the root), coalesced while the pages chain; page hashes chain
  over the token content (the same prefix has the same hashes on every pod);
* eviction takes leaves (a parent only once its children are gone) and publishes one
  ``BlockRemoved`` per node, with every page hash of the node; consecutive removals coalesce.

:meth:`RadixCache.held` is what the pod holds: every token sequence from the root to a node.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tests.ingest.wire import sglang_removed, sglang_stored


def page_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """A page's engine hash: chained over the content, 64 bits (SGLang hashes pages with
    SHA-256 over the parent's hash and the page's tokens)."""
    data = (parent or 0).to_bytes(8, "big") + b"".join(t.to_bytes(4, "big") for t in tokens)
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big")


@dataclass(eq=False)
class Node:
    tokens: tuple[int, ...]
    hashes: list[int]
    parent: Node | None
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)

    def path(self) -> tuple[int, ...]:
        out: tuple[int, ...] = ()
        node: Node | None = self
        while node is not None:
            out = node.tokens + out
            node = node.parent
        return out


class RadixCache:
    """One pod's radix tree; :attr:`queue` collects the events its operations publish."""

    def __init__(self, page: int) -> None:
        self.page = page
        self.root = Node((), [], None)
        self.queue: list[dict[str, Any]] = []

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
        head = Node(node.tokens[:at], node.hashes[:pages], node.parent)
        node.parent.children[self._child_key(node.tokens)] = head
        node.tokens, node.hashes, node.parent = node.tokens[at:], node.hashes[pages:], head
        head.children[self._child_key(node.tokens)] = node
        return head

    def insert(self, tokens: Sequence[int]) -> None:
        """Cache ``tokens`` (cut to whole pages), publishing the new node if there is one."""
        key = tuple(tokens[: len(tokens) // self.page * self.page])
        node = self.root
        while key and self._child_key(key) in node.children:
            child = node.children[self._child_key(key)]
            n = self._match(child.tokens, key)
            if n < len(child.tokens):
                child = self._split(child, n)
            node, key = child, key[n:]
        if not key:
            return
        parent = node.hashes[-1] if node.hashes else None
        hashes, prev = [], parent
        for start in range(0, len(key), self.page):
            prev = page_hash(prev, key[start : start + self.page])
            hashes.append(prev)
        new = Node(key, hashes, node)
        node.children[self._child_key(key)] = new
        for i, h in enumerate(hashes):
            page = key[i * self.page : (i + 1) * self.page]
            self._enqueue(sglang_stored([h], parent, page, len(page)))
            parent = h

    def leaves(self) -> list[Node]:
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
        self._enqueue(sglang_removed(leaf.hashes))

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
