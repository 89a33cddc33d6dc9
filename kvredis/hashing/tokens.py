"""Token ids: validation into a uint32 array, and that array as little-endian bytes.

Token ids are ints in ``[0, 2**32)``. :func:`token_array` checks a caller's sequence (a list, a
tuple, an ``array``, anything with a 1-D buffer such as a numpy array) and returns it as an
``array`` of 32-bit items, without a per-item Python loop where the input allows;
:func:`le_bytes` gives the array's bytes as little-endian uint32 (zero-copy on little-endian
hosts), the token part of the xxh3 scheme's messages.
"""

from __future__ import annotations

import operator
import struct
import sys
from array import array
from collections.abc import Iterable, Sequence
from typing import Any

from kvredis.errors import InvalidInputError

__all__ = ["MAX_TOKEN", "U32_CODE", "le_bytes", "token_array"]

MAX_TOKEN = (1 << 32) - 1

#: An array typecode holding exactly 32 bits ("I" on every mainstream platform), or None.
U32_CODE: str | None = next((c for c in ("I", "L") if array(c).itemsize == 4), None)
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
        if not 0 <= value <= MAX_TOKEN:
            return InvalidInputError(
                f"token ids must be ints in [0, 2**32); tokens[{index}] = {value}"
            )
    return InvalidInputError("token ids must be ints in [0, 2**32)")


def token_array(tokens: Sequence[int], code: str | None) -> Sequence[int]:
    """The token ids as a validated sequence of ints in [0, 2**32).

    An ``array`` of 32-bit items when the platform has such a typecode (``code``, normally
    :data:`U32_CODE`), else a list. An array of that typecode is used as is (read only). Raises
    InvalidInputError for anything that is not a sequence of ints in range.
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
            if not 0 <= value <= MAX_TOKEN:
                raise _token_error(values)
        return values
    if isinstance(tokens, array) and tokens.typecode == code:
        return tokens
    out = array(code)
    try:
        if isinstance(tokens, list):
            out.fromlist(tokens)
        elif isinstance(tokens, tuple):  # (no buffer: as below, without raising to find out)
            out = array(code, tokens)
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


def le_bytes(values: Sequence[int]) -> bytes | memoryview:
    """The token ids as little-endian uint32 bytes (zero-copy for a native little-endian array)."""
    if isinstance(values, array) and values.itemsize == 4:
        if _LITTLE_ENDIAN:
            return memoryview(values).cast("B")
        swapped = array(values.typecode, values)
        swapped.byteswap()
        return swapped.tobytes()
    return struct.pack(f"<{len(values)}I", *values)
