"""Converting a namespace of an earlier layout to this one in place: ``kvredis migrate``.

A namespace of layout ``kvredis-kvblock/1`` (kvredis before chain runs) holds what layout /2
holds, in a form /2 reads as it is, but for the speculative entries with a ttl of the /1 releases
before the expiring buckets: those sit in the request buckets, their deadlines in a sorted set
``<ns>:sx``. The migration (``lua/migrate.lua``) is:

1. ``begin``, one atomic call: a fresh generation fences out every /1 client (its next call
   fails the generation check, and its reload refuses the /2 record), the meta record names
   layout /2 (and an expiry mode, if it had none), and the sorted set, if any, becomes
   ``<ns>:mx``: the pairs still to convert, of which it converts a first page (so a namespace
   with few is converted in this one call). From then on /2 clients read and write the
   namespace.
2. ``page`` calls, each converting a bounded number of pairs atomically (the entry id leaves the
   request key's record and, before its deadline, moves to the expiring bucket; past-due ones
   are dropped) and removing them from ``<ns>:mx``, which is thus the migration's cursor: a
   migration cut short (a crash, a lost connection) goes on where it stopped when run again.
   The last page removes ``migrating`` and ``migrate_total`` from the meta record.

Until its pair is converted, a speculative entry of a /1 namespace reads as an entry without a
ttl (it is returned until then, also past its deadline); everything else reads the same before,
during and after the migration. Records stay one per request key: keys added afterwards are
stored in chain runs. A namespace already in this layout is left alone.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvredis.errors import (
    ConfigError,
    NamespaceLayoutError,
    NamespaceMissingError,
    StaleNamespaceError,
)
from kvredis.redis.calls import CallChoice
from kvredis.redis.config import RedisIndexConfig
from kvredis.redis.executor import AsyncExecutor, SyncExecutor
from kvredis.redis.layout import (
    LAYOUT_VERSION,
    MIGRATABLE_LAYOUTS,
    Layout,
    check_bucket_bits,
    meta_key,
)
from kvredis.redis.ops import op_expiry_mode
from kvredis.redis.requests import Command, Op, ScriptCall
from kvredis.redis.session import RetryPolicy, Session, op_drive
from kvredis.redis.state import CoreState, drop_command, layout_error

#: progress(done, total): speculative pairs converted so far, of ``total`` (both 0 when the
#: namespace has none to convert).
MigrateProgress = Callable[[int, int], None]

#: Pairs one call converts at most: about 3 ms of server time (scripts/bench_migrate.py).
PAIRS_PER_CALL = 250
#: Most pairs one call may be asked to convert (``lua/migrate.lua`` refuses more).
MAX_PAIRS_PER_CALL = 10_000


def _noop(_done: int, _total: int) -> None:
    return None


@dataclass(frozen=True, slots=True)
class MigrationReport:
    """What :func:`migrate_namespace` did.

    ``source`` is the layout converted from (``None`` when the namespace was already in this
    layout, ``migrated`` then False); ``resumed`` says a migration cut short was finished;
    ``pairs`` counts the speculative (request key, entry) pairs of a /1 sorted set: ``moved``
    to expiring buckets, ``dropped`` (past due, or no longer held) by this run.
    """

    namespace: str
    target: str
    source: str | None
    migrated: bool
    resumed: bool
    pairs: int
    moved: int
    dropped: int
    seconds: float


def op_migrate(
    namespace: str,
    expiry_mode: str,
    progress: MigrateProgress = _noop,
    pairs_per_call: int = PAIRS_PER_CALL,
    address: str | None = None,
) -> Op[MigrationReport]:
    """Convert ``namespace`` to :data:`LAYOUT_VERSION` (see the module docstring).

    ``expiry_mode`` is given to a namespace that has none (``"field"`` when the server has hash
    field expiry: :func:`kvredis.redis.ops.op_expiry_mode`). ``address`` is shown in errors.
    """
    if not 1 <= pairs_per_call <= MAX_PAIRS_PER_CALL:
        raise ConfigError(
            f"pairs_per_call must be in [1, {MAX_PAIRS_PER_CALL}], got {pairs_per_call}"
        )
    started = time.monotonic()
    probe = Layout(namespace, 1, b"")
    keys = (probe.meta, probe.pi, probe.sx, probe.mx)
    begin = (
        "begin",
        MIGRATABLE_LAYOUTS[0],
        LAYOUT_VERSION,
        secrets.token_hex(8),
        expiry_mode,
        probe.rprefix,
        pairs_per_call,
    )
    state, gen_raw, left_raw, total_raw, moved_raw, dropped_raw = yield ScriptCall(
        "migrate", keys, begin
    )
    state, gen = _text(state), bytes(gen_raw)
    left, total = int(left_raw), int(total_raw)
    where = f" at {address}" if address else ""
    if state == "missing":
        raise NamespaceMissingError(
            f"namespace {namespace!r} does not exist{where}: nothing to migrate "
            "(check the namespace and --redis)"
        )
    if state == "dropping":
        raise NamespaceLayoutError(
            f"namespace {namespace!r}{where} is being dropped (a drop was cut short): finish "
            f"it with {drop_command(namespace, address)}"
        )
    if state == "other":
        raise layout_error(namespace, gen, address)
    if state == "current":
        progress(0, 0)
        return MigrationReport(
            namespace, LAYOUT_VERSION, None, False, False, 0, 0, 0, time.monotonic() - started
        )
    meta = yield Command(("HMGET", meta_key(namespace), "bucket_bits"))
    try:
        bits = check_bucket_bits(int(meta[0]))
    except (TypeError, ValueError) as exc:
        raise NamespaceLayoutError(
            f"namespace {namespace!r}{where} has no valid bucket bits in its meta record: drop "
            f"it with {drop_command(namespace, address)}"
        ) from exc
    layout = Layout(namespace, bits, gen)
    moved, dropped = int(moved_raw), int(dropped_raw)
    progress(total - left, total)
    while left:
        try:
            n_moved, n_dropped, left_raw = yield ScriptCall(
                "migrate",
                keys,
                ("page", gen, layout.rprefix, bits, pairs_per_call),
            )
        except StaleNamespaceError:
            raise StaleNamespaceError(
                f"namespace {namespace!r}{where} was dropped or recreated while it was being "
                "migrated; nothing is left to convert"
            ) from None
        moved, dropped, left = moved + int(n_moved), dropped + int(n_dropped), int(left_raw)
        progress(total - left, total)
    return MigrationReport(
        namespace,
        LAYOUT_VERSION,
        MIGRATABLE_LAYOUTS[0],
        True,
        state == "resume",
        total,
        moved,
        dropped,
        time.monotonic() - started,
    )


@dataclass(frozen=True, slots=True)
class Survey:
    """What a namespace holds, read without assuming its layout (:func:`op_survey`).

    ``layout`` is its meta record's layout version (``None`` without one), ``dropping`` whether
    a drop was cut short (the generation is a tombstone), ``migrating`` the layout a migration
    under way converts from, ``keys`` how many keys of the namespace exist (meta included; SCAN
    may report a key twice while the server resizes its table).
    """

    namespace: str
    layout: str | None
    dropping: bool
    migrating: str | None
    keys: int

    @property
    def exists(self) -> bool:
        """Whether the namespace has any key."""
        return self.keys > 0


def op_survey(namespace: str, keys_per_call: int = 1000) -> Op[Survey]:
    """Read the meta record and count the namespace's keys (SCAN MATCH ``<ns>:*``, keeping only
    the names :meth:`Layout.owns`, never those of a namespace whose name extends this one)."""
    probe = Layout(namespace, 1, b"")
    meta = yield Command(("TYPE", probe.meta))
    record: list[object] = [None, None, None]
    if _text(meta.get("ok") if isinstance(meta, dict) else meta) == "hash":
        record = list((yield Command(("HMGET", probe.meta, "layout", "gen", "migrating"))))
    count = 0
    cursor: int | None = None
    while cursor != 0:
        reply = yield Command(
            ("SCAN", cursor or 0, "MATCH", probe.namespace_pattern(), "COUNT", keys_per_call)
        )
        cursor = int(reply[0])
        count += sum(1 for k in reply[1] if probe.owns(bytes(k)))
    layout, gen, migrating = (None if v is None else _text(v) for v in record)
    return Survey(
        namespace,
        layout,
        gen is not None and gen.startswith("dropping:"),
        migrating,
        count,
    )


def _text(value: object) -> str:
    return bytes(value).decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _op_migrate_session(
    session: tuple[Session, CallChoice], progress: MigrateProgress, pairs_per_call: int
) -> Op[MigrationReport]:
    run, calls = session
    mode = yield from op_expiry_mode(run)
    state = run.state
    return (
        yield from op_drive(
            run,
            calls.op(op_migrate(state.namespace, mode, progress, pairs_per_call, state.address)),
        )
    )


def _session(config: RedisIndexConfig) -> tuple[Session, CallChoice]:
    if not isinstance(config, RedisIndexConfig):
        raise ConfigError(f"config must be a RedisIndexConfig, got {config!r}")
    if config.cluster:
        raise ConfigError(
            f"{config.server()} is a cluster: convert a cluster namespace with "
            "RedisClusterIndex.migrate (what kvredis migrate does on a cluster address)"
        )
    state = CoreState(config.namespace, config.bucket_bits)
    state.address = config.parsed_address().display
    calls = CallChoice(config.use_functions, config.server())
    policy = RetryPolicy(config.retries, config.retry_backoff, config.server())
    return Session(state, calls.registry, policy), calls


def migrate_namespace(
    config: RedisIndexConfig,
    progress: MigrateProgress | None = None,
    pairs_per_call: int = PAIRS_PER_CALL,
) -> MigrationReport:
    """Convert the namespace of ``config`` from layout ``kvredis-kvblock/1`` to this layout, in
    place and online: clients of this kvredis may read and write it meanwhile; clients of the
    earlier release are fenced out. Run it again after an interruption: it goes on where it
    stopped. A namespace already in this layout is left alone (``report.migrated`` False).

    ``progress(done, total)`` follows the speculative pairs converted. Raises
    NamespaceMissingError when the namespace does not exist, NamespaceLayoutError for a layout
    it cannot convert (the message says what does), ConfigError for a cluster address
    (:meth:`kvredis.redis.cluster.index.RedisClusterIndex.migrate` converts those).
    """
    session = _session(config)
    executor = SyncExecutor(config)
    try:
        return executor.run(_op_migrate_session(session, progress or _noop, pairs_per_call))
    finally:
        executor.close()


async def migrate_namespace_async(
    config: RedisIndexConfig,
    progress: MigrateProgress | None = None,
    pairs_per_call: int = PAIRS_PER_CALL,
) -> MigrationReport:
    """:func:`migrate_namespace` on asyncio (the same operation, sent by the async executor)."""
    session = _session(config)
    executor = AsyncExecutor(config)
    try:
        return await executor.run(_op_migrate_session(session, progress or _noop, pairs_per_call))
    finally:
        await executor.close()
