"""The SGLang 0.5.23 radix cache model the branch tests drive: it lives in
:mod:`kvredis.testing.radix` (the realistic benchmark replays it too)."""

from kvredis.testing.radix import Node, RadixCache, page_digest

__all__ = ["Node", "RadixCache", "page_digest"]
