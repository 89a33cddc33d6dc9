"""Token processing: turn a prompt's token ids into chained 64-bit KV-block keys.

The prompt is cut into full blocks of ``block_size`` tokens (a partial tail is ignored). Block
``i``'s key is ``H(key[i-1], tokens of block i, extra features of block i)``; the chain starts
from ``parent_key`` when it is non-zero, else from a per-model root derived from ``hash_seed`` and
the model name. Hence the prefix property (the keys of a prompt's first ``k`` blocks do not depend
on what follows) and the chaining property
(``keys(t1 + t2) == keys(t1) + keys(parent=keys(t1)[-1], t2)`` when ``len(t1)`` is a multiple of
the block size).

Token ids are unsigned 32-bit integers. Two algorithms are available, each defined byte by byte
in its module:

``"xxh3_64"`` (default, kvredis's own scheme; :mod:`kvredis.hashing.xxh3`)
    Chained XXH3-64 seeded by the parent key, over the block's little-endian token bytes (plus
    a framed suffix for multimodal blocks): one native call per block.
``"fnv64a_cbor"`` (byte-compatible with Go llm-d's ``kvblock``; :mod:`kvredis.hashing.fnv_cbor`)
    FNV-1a-64 of the canonical CBOR of ``[parent, tokens, extra]``. Runs in pure Python and is
    much slower than ``"xxh3_64"``.

Keys are deterministic across processes, platforms and Python versions. A computed key equal to
``0`` (probability ``2**-64``) cannot be used to continue a chain, since ``parent_key=0`` means
"start from the root".

Modules, in dependency order: :mod:`~kvredis.hashing.config` (the configuration),
:mod:`~kvredis.hashing.tokens` (token-id validation, uint32 arrays and their little-endian
bytes), the two schemes, and :mod:`~kvredis.hashing.database` (the :class:`TokenProcessor`
protocol and :class:`ChunkedTokenDatabase`, which validates a call and runs the configured scheme).
"""

from __future__ import annotations

from kvredis.hashing.config import DEFAULT_BLOCK_SIZE, HASH_ALGOS, TokenProcessorConfig
from kvredis.hashing.database import ChunkedTokenDatabase, TokenProcessor

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "HASH_ALGOS",
    "ChunkedTokenDatabase",
    "TokenProcessor",
    "TokenProcessorConfig",
]
