"""Token processing: turn a prompt's token ids into chained 64-bit KV-block keys.

The prompt is cut into full blocks of ``block_size`` tokens (a partial tail is ignored). Block
``i``'s key is ``H(key[i-1], tokens of block i, extra features of block i)``; the chain starts
from ``parent_key`` when it is non-zero, else from a per-model root derived from ``hash_seed`` and
the model name. Hence the prefix property (the keys of a prompt's first ``k`` blocks do not depend
on what follows) and the chaining property
(``keys(t1 + t2) == keys(t1) + keys(parent=keys(t1)[-1], t2)`` when ``len(t1)`` is a multiple of
the block size).

Token ids are unsigned 32-bit integers. Two algorithms are available.

``"xxh3_64"`` (default, kvredis's own scheme; all integers little-endian)
    ``u32(x)`` is 4 bytes little-endian, ``pad4(b)`` is ``b`` followed by 0-3 zero bytes up to a
    multiple of 4, ``utf8(s)`` the UTF-8 bytes of ``s``, ``XXH3(msg, seed)`` the 64-bit XXH3 digest.

    * Root of a model: ``XXH3(R, seed=0)`` with
      ``R = pad4(b"KVRXXH3\\x01" + u32(block_size) + u32(len(S)) + S + u32(len(N)) + N) + b"RR"``
      where ``S = utf8(hash_seed)``, ``N = utf8(model_name)`` and ``len`` counts bytes.
      ``len(R) % 4 == 2``.
    * Text block: ``XXH3(T, seed=parent)`` where ``T`` is the block's ``block_size`` token ids as
      ``u32`` each (``4 * block_size`` bytes, the raw little-endian token array, no framing).
      ``len(T) % 4 == 0``.
    * Multimodal block with identifiers ``id_1 .. id_k`` (``k >= 1``):
      ``XXH3(T + pad4(E) + u32(k) + u32(block_size) + b"M", seed=parent)`` with
      ``E = u32(len(utf8(id_1))) + utf8(id_1) + ... + u32(len(utf8(id_k))) + utf8(id_k)``.
      Its length is ``1 (mod 4)``.

    The three message kinds have different lengths modulo 4, and each one decodes uniquely (fixed
    token part whose size follows from the length or from the trailer, explicit counts and
    lengths), so distinct (parent, tokens, block size, identifiers) give distinct
    ``(seed, message)`` pairs, and distinct (hash seed, model, block size) give distinct root
    messages. Block features with an empty identifier list hash like a text block.

``"fnv64a_cbor"`` (byte-compatible with the Go llm-d ``kvblock`` package)
    ``H(parent, tokens, extra) = FNV-1a-64(canonical CBOR of [parent, tokens, extra])``: parent
    an unsigned integer, tokens an array of unsigned integers (``null`` for the root), extra
    ``null`` for text blocks, the model name (a text string) for the root, or an array of
    single-key maps ``{"Hash": identifier}`` for a multimodal block. The root of a model is
    ``H(FNV-1a-64(utf8(hash_seed)), null, model_name)``. Integers use the shortest CBOR head.
    Block features with an empty identifier list encode as ``null`` (like Go's zero-value
    ``BlockExtraFeatures``). This algorithm runs in pure Python and is much slower than
    ``"xxh3_64"``.

Keys are deterministic across processes, platforms and Python versions. A computed key equal to
``0`` (probability ``2**-64``) cannot be used to continue a chain, since ``parent_key=0`` means
"start from the root".
"""

from __future__ import annotations

import operator
import struct
import sys
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from xxhash import xxh3_64_intdigest

from kvredis.errors import ConfigError, InvalidInputError
from kvredis.features import BlockExtraFeatures
from kvredis.jsonconfig import take_fields

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "HASH_ALGOS",
    "ChunkedTokenDatabase",
    "TokenProcessor",
    "TokenProcessorConfig",
]

DEFAULT_BLOCK_SIZE = 16
HASH_ALGOS = ("xxh3_64", "fnv64a_cbor")

_MAX_U64 = (1 << 64) - 1
_MAX_TOKEN = (1 << 32) - 1

# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------

_CONFIG_KEYS: dict[str, str] = {
    "blockSizeTokens": "block_size_tokens",
    "blockSize": "block_size",
    "hashSeed": "hash_seed",
    "hashAlgo": "hash_algo",
}


def _resolve_block_size(block_size_tokens: int, block_size: int) -> int:
    """``block_size_tokens`` unless it is 0; then the deprecated ``block_size``; both 0 -> 16."""
    if block_size_tokens == 0 and block_size == 0:
        return DEFAULT_BLOCK_SIZE
    value = block_size if block_size_tokens == 0 else block_size_tokens
    if value <= 0:
        raise ConfigError(f"blockSizeTokens must be greater than 0, got {value}")
    return value


@dataclass(frozen=True, slots=True)
class TokenProcessorConfig:
    """How prompts are cut into blocks and hashed.

    ``block_size`` is the deprecated spelling of ``block_size_tokens``: it is used only when
    ``block_size_tokens`` is 0 (pass ``block_size_tokens=0`` to use it), and both 0 means 16.
    A block size <= 0 that would be used raises :class:`~kvredis.errors.ConfigError` (a
    ``ValueError``). For ``"fnv64a_cbor"`` keys to match the engines', ``hash_seed`` must
    match theirs (vLLM's ``PYTHONHASHSEED``).
    """

    block_size_tokens: int = DEFAULT_BLOCK_SIZE
    hash_seed: str = ""
    block_size: int = 0
    hash_algo: str = "xxh3_64"

    def __post_init__(self) -> None:
        for name in ("block_size_tokens", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{name} must be an int, got {value!r}")
        if not isinstance(self.hash_seed, str):
            raise ConfigError(f"hash_seed must be a str, got {type(self.hash_seed).__name__}")
        try:
            self.hash_seed.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ConfigError(f"hash_seed is not encodable as UTF-8: {exc}") from None
        if self.hash_algo not in HASH_ALGOS:
            raise ConfigError(
                f"unknown hash_algo {self.hash_algo!r}; valid values are "
                + ", ".join(repr(a) for a in HASH_ALGOS)
            )
        _resolve_block_size(self.block_size_tokens, self.block_size)

    @property
    def resolved_block_size(self) -> int:
        """The number of tokens per block actually used."""
        return _resolve_block_size(self.block_size_tokens, self.block_size)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TokenProcessorConfig:
        """Build from the upstream JSON shape (``blockSizeTokens``, ``blockSize``, ``hashSeed``,
        ``hashAlgo``) or the Python field names. Unknown keys raise ``ConfigError``.

        As in the upstream JSON decoding, a missing ``blockSizeTokens`` counts as 0, so
        ``{"blockSize": 8}`` means 8 and ``{}`` means 16.
        """
        kwargs = take_fields("token processor config", data, _CONFIG_KEYS)
        kwargs.setdefault("block_size_tokens", 0)
        return cls(**kwargs)


# --------------------------------------------------------------------------------------------
# The TokenProcessor protocol
# --------------------------------------------------------------------------------------------


@runtime_checkable
class TokenProcessor(Protocol):
    """Anything that turns token ids into chained block keys."""

    def tokens_to_kv_block_keys(
        self,
        parent_key: int,
        tokens: Sequence[int],
        model_name: str,
        extra_features: Sequence[BlockExtraFeatures | None] | None = None,
    ) -> list[int]:
        """Keys of the full blocks of ``tokens``, chained from ``parent_key`` (0: model root)."""
        ...

    def block_size(self) -> int:
        """Tokens per block."""
        ...


# --------------------------------------------------------------------------------------------
# Token ids -> uint32 array
# --------------------------------------------------------------------------------------------

# An array typecode holding exactly 32 bits ("I" on every mainstream platform), or None.
_U32_CODE: str | None = next((c for c in ("I", "L") if array(c).itemsize == 4), None)
_LITTLE_ENDIAN = sys.byteorder == "little"
# Buffer formats of native-order unsigned 32-bit items (numpy uint32 arrays, array("I"), ...).
# (with itemsize 4; "L" can be 8 bytes wide, which the itemsize check rules out).
_NATIVE_U32_FORMATS = frozenset(
    {"I", "L", "=I", "=L"} | ({"<I", "<L"} if _LITTLE_ENDIAN else {">I", ">L"})
)


def _token_error(tokens: Iterable[Any]) -> InvalidInputError:
    """A precise error naming the first token id that is not an int in [0, 2**32)."""
    try:
        iterator = iter(tokens)
    except TypeError:
        return InvalidInputError(f"tokens must be a sequence of ints, got {type(tokens).__name__}")
    for index, token in enumerate(iterator):
        try:
            value = operator.index(token)
        except TypeError:
            return InvalidInputError(
                f"token ids must be ints in [0, 2**32); tokens[{index}] is "
                f"{type(token).__name__} {token!r}"
            )
        if not 0 <= value <= _MAX_TOKEN:
            return InvalidInputError(
                f"token ids must be ints in [0, 2**32); tokens[{index}] = {value}"
            )
    return InvalidInputError("token ids must be ints in [0, 2**32)")


def _token_array(tokens: Sequence[int], code: str | None) -> Sequence[int]:
    """The token ids as a validated sequence of ints in [0, 2**32).

    An ``array`` of 32-bit items when the platform has such a typecode (``code``), else a list.
    An array of that typecode is used as is (read only). Raises InvalidInputError for anything
    that is not a sequence of ints in range.
    """
    if isinstance(tokens, (str, bytes, bytearray)):
        if isinstance(tokens, str):
            raise InvalidInputError("tokens must be a sequence of ints, got str")
        tokens = list(tokens)  # the byte values, not a raw buffer
    if code is None:
        try:
            values = [operator.index(v) for v in tokens]
        except TypeError:
            raise _token_error(tokens) from None
        for value in values:
            if not 0 <= value <= _MAX_TOKEN:
                raise _token_error(values)
        return values
    if isinstance(tokens, array) and tokens.typecode == code:
        return tokens
    out = array(code)
    try:
        if isinstance(tokens, list):
            out.fromlist(tokens)
        else:
            try:
                view = memoryview(tokens)  # type: ignore[arg-type]
            except TypeError:
                out = array(code, tokens)
            else:
                with view:
                    if view.ndim != 1:
                        raise InvalidInputError(
                            f"tokens must be one-dimensional, got {view.ndim} dimensions"
                        )
                    if view.itemsize == 4 and view.format in _NATIVE_U32_FORMATS:
                        out.frombytes(view.cast("B") if view.c_contiguous else view.tobytes())
                    else:
                        out.fromlist(view.tolist())
    except (OverflowError, TypeError, ValueError):
        raise _token_error(tokens) from None
    return out


def _le_bytes(values: Sequence[int]) -> bytes | memoryview:
    """The token ids as little-endian uint32 bytes (zero-copy for a native little-endian array)."""
    if isinstance(values, array) and values.itemsize == 4:
        if _LITTLE_ENDIAN:
            return memoryview(values).cast("B")
        swapped = array(values.typecode, values)
        swapped.byteswap()
        return swapped.tobytes()
    return struct.pack(f"<{len(values)}I", *values)


# --------------------------------------------------------------------------------------------
# xxh3_64 scheme
# --------------------------------------------------------------------------------------------

_XXH3_ROOT_MAGIC = b"KVRXXH3\x01"
_U32 = struct.Struct("<I")
_MM_TRAILER = struct.Struct("<IIc")


def _pad4(buf: bytearray) -> None:
    buf.extend(b"\x00" * (-len(buf) % 4))


def _xxh3_root(block_size: int, hash_seed: bytes, model_name: bytes) -> int:
    msg = bytearray(_XXH3_ROOT_MAGIC)
    msg += _U32.pack(block_size)
    msg += _U32.pack(len(hash_seed))
    msg += hash_seed
    msg += _U32.pack(len(model_name))
    msg += model_name
    _pad4(msg)
    msg += b"RR"
    return xxh3_64_intdigest(bytes(msg), 0)


def _xxh3_mm_suffix(identifiers: Sequence[str], block_size: int) -> bytes:
    """What follows the token bytes in a multimodal block's message: ``pad4(E) + trailer``.

    The token part is a multiple of 4 bytes long, so padding ``E`` alone pads ``T + E``.
    """
    msg = bytearray()
    for identifier in identifiers:
        raw = identifier.encode("utf-8")
        msg += _U32.pack(len(raw))
        msg += raw
    _pad4(msg)
    msg += _MM_TRAILER.pack(len(identifiers), block_size, b"M")
    return bytes(msg)


# --------------------------------------------------------------------------------------------
# fnv64a_cbor scheme (canonical CBOR + FNV-1a 64)
# --------------------------------------------------------------------------------------------

_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3


def _fnv1a64(data: bytes | bytearray, state: int = _FNV_OFFSET) -> int:
    """FNV-1a 64 of ``data``, continuing from ``state``."""
    prime = _FNV_PRIME
    mask = _MAX_U64
    for byte in data:
        state = ((state ^ byte) * prime) & mask
    return state


def _cbor_head(major: int, value: int) -> bytes:
    """Shortest CBOR head for ``major`` (0..7, unshifted) and argument ``value``."""
    mt = major << 5
    if value < 24:
        return bytes((mt | value,))
    if value <= 0xFF:
        return bytes((mt | 24, value))
    if value <= 0xFFFF:
        return bytes((mt | 25,)) + value.to_bytes(2, "big")
    if value <= 0xFFFFFFFF:
        return bytes((mt | 26,)) + value.to_bytes(4, "big")
    return bytes((mt | 27,)) + value.to_bytes(8, "big")


def _cbor_encode(obj: object, out: bytearray) -> None:
    """Append the canonical CBOR encoding (RFC 7049 section 3.9) of ``obj`` to ``out``.

    Supports what the block payloads hold: None, unsigned ints below 2**64, str, lists/tuples/
    arrays and str-keyed dicts (keys sorted shortest first, then bytewise, as Go's
    fxamacker/cbor canonical mode does).
    """
    if obj is None:
        out.append(0xF6)
    elif isinstance(obj, int) and not isinstance(obj, bool):
        if not 0 <= obj <= _MAX_U64:
            raise InvalidInputError(f"cannot CBOR-encode {obj}: not an unsigned 64-bit integer")
        out += _cbor_head(0, obj)
    elif isinstance(obj, str):
        raw = obj.encode("utf-8")
        out += _cbor_head(3, len(raw))
        out += raw
    elif isinstance(obj, (list, tuple, array)):
        out += _cbor_head(4, len(obj))
        for item in obj:
            _cbor_encode(item, out)
    elif isinstance(obj, dict):
        entries: list[tuple[bytes, object]] = []
        for key, value in obj.items():
            if not isinstance(key, str):
                raise InvalidInputError(
                    f"cannot CBOR-encode a map key of type {type(key).__name__}"
                )
            encoded_key = bytearray()
            _cbor_encode(key, encoded_key)
            entries.append((bytes(encoded_key), value))
        entries.sort(key=lambda e: (len(e[0]), e[0]))
        out += _cbor_head(5, len(entries))
        for key_bytes, value in entries:
            out += key_bytes
            _cbor_encode(value, out)
    else:
        raise InvalidInputError(f"cannot CBOR-encode {type(obj).__name__}")


def _fnv_cbor_hash(parent: int, tokens: Sequence[int] | None, extra: object) -> int:
    """Generic ``FNV-1a-64(canonical CBOR [parent, tokens, extra])``."""
    buf = bytearray(b"\x83")
    _cbor_encode(parent, buf)
    _cbor_encode(None if tokens is None else list(tokens), buf)
    _cbor_encode(extra, buf)
    return _fnv1a64(buf)


_FNV_AFTER_ARRAY3 = _fnv1a64(b"\x83")
_FNV_AFTER_ARRAY3_U64 = _fnv1a64(b"\x83\x1b")


def _fnv_text_block(parent: int, tokens: Iterable[int], array_head: bytes) -> int:
    """``H(parent, tokens, null)``, streaming the CBOR bytes straight into FNV-1a.

    Each step is ``h = (h ^ byte) * prime``; reducing modulo 2**64 once per token (not per byte)
    gives the same result, because XOR with a byte and multiplication modulo 2**64 depend only
    on the low 64 bits of their operands.
    """
    p = _FNV_PRIME
    m = _MAX_U64
    # fmt: off
    if parent > 0xFFFFFFFF:  # the usual case: a 64-bit hash, head 0x1b + 8 bytes
        b = parent.to_bytes(8, "big")
        h = ((((_FNV_AFTER_ARRAY3_U64 ^ b[0]) * p ^ b[1]) * p ^ b[2]) * p ^ b[3]) * p
        h = ((((h ^ b[4]) * p ^ b[5]) * p ^ b[6]) * p ^ b[7]) * p & m
        for byte in array_head:
            h = (h ^ byte) * p & m
    else:
        h = _fnv1a64(_cbor_head(0, parent) + array_head, _FNV_AFTER_ARRAY3)
    for t in tokens:
        if t > 0xFFFF:  # head 0x1a + 4 bytes
            h = (((((h ^ 0x1A) * p ^ (t >> 24)) * p ^ ((t >> 16) & 0xFF)) * p
                  ^ ((t >> 8) & 0xFF)) * p ^ (t & 0xFF)) * p & m
        elif t > 0xFF:  # head 0x19 + 2 bytes
            h = (((h ^ 0x19) * p ^ (t >> 8)) * p ^ (t & 0xFF)) * p & m
        elif t > 23:  # head 0x18 + 1 byte
            h = ((h ^ 0x18) * p ^ t) * p & m
        else:  # the value fits the head byte
            h = (h ^ t) * p & m
    # fmt: on
    return ((h ^ 0xF6) * p) & m


# --------------------------------------------------------------------------------------------
# ChunkedTokenDatabase
# --------------------------------------------------------------------------------------------

_ROOT_CACHE_LIMIT = 4096


def _encode_name(name: object, what: str) -> bytes:
    if not isinstance(name, str):
        raise InvalidInputError(f"{what} must be a str, got {type(name).__name__}")
    try:
        return name.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidInputError(f"{what} is not encodable as UTF-8: {exc}") from None


class ChunkedTokenDatabase:
    """The standard :class:`TokenProcessor`: fixed-size blocks, chained hashes.

    Thread-safe (it holds only immutable configuration and a cache of per-model roots).
    """

    __slots__ = ("_algo", "_block_size", "_block_struct", "_config", "_roots", "_seed_bytes")

    def __init__(self, config: TokenProcessorConfig | Mapping[str, Any] | None = None) -> None:
        if config is None:
            config = TokenProcessorConfig()
        elif isinstance(config, Mapping):
            config = TokenProcessorConfig.from_dict(config)
        elif not isinstance(config, TokenProcessorConfig):
            raise ConfigError(f"config must be a TokenProcessorConfig, got {type(config).__name__}")
        self._config = config
        self._algo = config.hash_algo
        self._block_size = config.resolved_block_size
        self._block_struct = struct.Struct(f"{4 * self._block_size}s")
        self._seed_bytes = config.hash_seed.encode("utf-8")
        self._roots: dict[str, int] = {}

    @property
    def config(self) -> TokenProcessorConfig:
        """The configuration this database was built with."""
        return self._config

    @property
    def hash_algo(self) -> str:
        """``"xxh3_64"`` or ``"fnv64a_cbor"``."""
        return self._algo

    def block_size(self) -> int:
        """Tokens per block."""
        return self._block_size

    def __repr__(self) -> str:
        return f"ChunkedTokenDatabase(block_size={self._block_size}, hash_algo={self._algo!r})"

    def root_key(self, model_name: str) -> int:
        """The chain root used for ``model_name`` when ``parent_key`` is 0."""
        if not isinstance(model_name, str):
            raise InvalidInputError(f"model_name must be a str, got {type(model_name).__name__}")
        root = self._roots.get(model_name)
        if root is None:
            name = _encode_name(model_name, "model_name")
            if self._algo == "xxh3_64":
                root = _xxh3_root(self._block_size, self._seed_bytes, name)
            else:
                root = _fnv_cbor_hash(_fnv1a64(self._seed_bytes), None, model_name)
            if len(self._roots) >= _ROOT_CACHE_LIMIT:
                self._roots.clear()
            self._roots[model_name] = root
        return root

    def tokens_to_kv_block_keys(
        self,
        parent_key: int,
        tokens: Sequence[int],
        model_name: str,
        extra_features: Sequence[BlockExtraFeatures | None] | None = None,
    ) -> list[int]:
        """The keys of the full blocks of ``tokens``, in order.

        ``parent_key`` 0 starts from the model's root; any other value continues that chain.
        ``extra_features``, when given, has one element per full block (``None`` for a text
        block). Raises :class:`~kvredis.errors.InvalidInputError` (a ``ValueError``) for token
        ids outside [0, 2**32), a parent key outside [0, 2**64), a non-str model name or a
        feature list of the wrong length.
        """
        if type(parent_key) is not int and (
            isinstance(parent_key, bool) or not isinstance(parent_key, int)
        ):
            raise InvalidInputError(f"parent_key must be an int, got {type(parent_key).__name__}")
        if not 0 <= parent_key <= _MAX_U64:
            raise InvalidInputError(f"parent_key must be in [0, 2**64), got {parent_key}")
        values = _token_array(tokens, _U32_CODE)
        bs = self._block_size
        n_blocks = len(values) // bs
        identifiers = self._block_identifiers(extra_features, n_blocks, len(values))
        if parent_key:
            if not isinstance(model_name, str):
                raise InvalidInputError(
                    f"model_name must be a str, got {type(model_name).__name__}"
                )
            parent = int(parent_key)
        else:
            parent = self.root_key(model_name)
        if n_blocks == 0:
            return []
        if self._algo == "xxh3_64":
            return self._xxh3_keys(parent, values, n_blocks, identifiers)
        return self._fnv_keys(parent, values, n_blocks, identifiers)

    def _block_identifiers(
        self,
        extra_features: Sequence[BlockExtraFeatures | None] | None,
        n_blocks: int,
        n_tokens: int,
    ) -> list[tuple[str, ...] | None] | None:
        """Per block, the identifier strings (None for text blocks); None when all are text."""
        if extra_features is None:
            return None
        if isinstance(extra_features, (str, bytes)) or not isinstance(extra_features, Sequence):
            raise InvalidInputError(
                "extra_features must be a list with one BlockExtraFeatures or None per full "
                f"block, got {type(extra_features).__name__}"
            )
        if len(extra_features) != n_blocks:
            raise InvalidInputError(
                f"extra_features has {len(extra_features)} elements but the tokens form "
                f"{n_blocks} full blocks (block_size={self._block_size}, tokens={n_tokens})"
            )
        result: list[tuple[str, ...] | None] = [None] * n_blocks
        any_extra = False
        for index, features in enumerate(extra_features):
            if features is None:
                continue
            if not isinstance(features, BlockExtraFeatures):
                raise InvalidInputError(
                    f"extra_features[{index}] must be BlockExtraFeatures or None, "
                    f"got {type(features).__name__}"
                )
            if features.mm_hashes:
                result[index] = tuple([mm.hash for mm in features.mm_hashes])
                any_extra = True
        return result if any_extra else None

    def _xxh3_keys(
        self,
        parent: int,
        values: Sequence[int],
        n_blocks: int,
        identifiers: list[tuple[str, ...] | None] | None,
    ) -> list[int]:
        data = _le_bytes(values)[: n_blocks * 4 * self._block_size]
        blocks = self._block_struct.iter_unpack(data)
        h = xxh3_64_intdigest
        p = parent
        if identifiers is None:
            return [p := h(block, p) for (block,) in blocks]
        bs = self._block_size
        suffixes: dict[tuple[str, ...], bytes] = {}
        for ids in identifiers:
            if ids is not None and ids not in suffixes:
                suffixes[ids] = _xxh3_mm_suffix(ids, bs)
        get = suffixes.get
        return [
            p := h(block if ids is None else block + get(ids, b""), p)
            for (block,), ids in zip(blocks, identifiers, strict=True)
        ]

    def _fnv_keys(
        self,
        parent: int,
        values: Sequence[int],
        n_blocks: int,
        identifiers: list[tuple[str, ...] | None] | None,
    ) -> list[int]:
        bs = self._block_size
        array_head = _cbor_head(4, bs)
        keys: list[int] = []
        p = parent
        for index in range(n_blocks):
            block = values[index * bs : (index + 1) * bs]
            ids = None if identifiers is None else identifiers[index]
            if ids is None:
                p = _fnv_text_block(p, block, array_head)
            else:
                p = _fnv_cbor_hash(p, block, [{"Hash": i} for i in ids])
            keys.append(p)
        return keys
