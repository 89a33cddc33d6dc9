"""The key layout of a namespace in Redis: THE specification both the client and the scripts follow.

Key layout of a namespace ``<ns>`` (all keys start with ``<ns>:``)::

    key              type  content
    <ns>:meta        HASH  layout (LAYOUT_VERSION), bucket_bits, gen (random token of this
                           incarnation), next_id (last entry id allocated), next_run (last
                           run id allocated), expiry (how expiring entries expire: "field"
                           or "key", see below); removals, cleared and removed:<pod id> (the
                           stamps of reads in parts: lua/includes/stamps.lua)
    <ns>:pe          HASH  encoded entry -> 4-byte entry id
    <ns>:pi          HASH  4-byte entry id -> encoded entry (ids are never reused); also the
                           fields next_id, bucket_bits, expiry and next_run, from which a
                           lost meta record heals
    <ns>:pp          HASH  pod id -> the pod's entry ids (id list)
    <ns>:pr          HASH  pod id -> the pod's retired entry ids (id list): a clear under way
                           retired them (out of pe and pp, still defined in pi) and deletes
                           their definitions once no bucket holds them (lua/retire.lua)
    <ns>:wm          HASH  stream -> "epoch:seq:token" (apply_batch watermarks; token: the call
                           that applied it)
    <ns>:sx          STR   the latest deadline (ms, server clock) of any expiring entry;
                           expires then (the gate of the expiring buckets)
    <ns>:wp          HASH  stream -> "epoch:seq:token:part", a batch being applied in parts
    <ns>:r:<bucket>  HASH  8-byte request key -> entry ids (id list), oldest added first, or
                           the 6-byte ref (u32 run id, u16 position) of the run holding it
    <ns>:mx          ZSET  only while ``kvredis migrate`` converts a namespace of layout
                           kvredis-kvblock/1 that holds speculative entries of its sorted-set
                           form: the (8-byte request key + 4-byte entry id -> deadline) pairs
                           still to convert into expiring buckets (:mod:`kvredis.redis.migrate`)
    <ns>:mv          HASH  only while ``kvredis migrate`` converts a cluster namespace of the key
                           layout to the pod layout, in each shard: pod id -> how many evicts
                           and clears of that pod reached the shard meanwhile (the mover copies
                           a pod's pairs only while it has not moved: kvredis.redis.cluster.migrate)
    <ns>:c:<run id>  HASH  a chain run: request keys stored together (RUN_MAX at most),
                           fields k (their keys in chain order) and r (ranges of positions
                           holding the same ids): see lua/includes/runs.lua
    <ns>:e:<bucket>  HASH  8-byte engine key -> request keys (hash list), most recent last,
                           at most MAX_REQUEST_KEYS_PER_ENGINE_KEY
    <ns>:s:<bucket>  HASH  8-byte request key -> its expiring speculative entries: 12-byte
                           items, 4-byte entry id + 8-byte big-endian deadline (ms, server
                           clock), most recent last; deleted by the server itself: each field
                           at its latest deadline (hash field expiry, meta expiry "field") or
                           the whole key at its latest deadline (expiry "key"; writes then
                           drop the bucket's past-due items). lua/includes/expiry.

A run is what one add stored as consecutive new request keys (RUN_MIN of them or more, or
any number following the last key of a run; keys appended to a run of more than RUN_APPEND_MAX
keys join it only when they are at least 1/RUN_APPEND_SHARE of it, else start a run of their
own after it): a walk reads it with one call and compares its keys with the request's as
bytes, instead of one call per key. ``<run id>`` is 4 big-endian bytes allocated from
``next_run`` in ``<ns>:meta`` (copied to ``<ns>:pi``, where a lost meta record heals from).

``<bucket>`` is the bucket of the hash (:func:`bucket_of`: its low ``bucket_bits`` bits) as
``ceil(bucket_bits / 8)`` big-endian bytes; the first client of a namespace fixes
``bucket_bits`` in ``<ns>:meta`` and every later client adopts it. Encodings (entry, id list,
hash) are those of :mod:`kvredis.redis.codec`. The scripts name bucket keys from the hashes the
same way (``lua/includes/layout.lua``). Every script first compares ``gen`` with the client's:
a client of an earlier incarnation gets ``KVREDIS_STALE`` and reloads. While the namespace is
being dropped, ``gen`` is a ``dropping:<token>`` tombstone (``lua/drop.lua``): nothing writes to
it, and the next client to load it finishes the drop first. While ``kvredis migrate`` converts a
namespace of an earlier layout, ``<ns>:meta`` already names this layout and also holds
``migrating`` (the layout it converts from) and ``migrate_total`` (pairs to convert).
"""

from __future__ import annotations

import shlex

from kvredis.errors import InvalidInputError
from kvredis.redis.codec import ID_WIDTH, RUN_ID_WIDTH, escape_glob, text_bytes

#: Layout version stored in ``<ns>:meta``; a client refuses a namespace of another version.
LAYOUT_VERSION = "kvredis-kvblock/2"
#: Every layout version of this family starts so; the number after it orders them.
LAYOUT_FAMILY = "kvredis-kvblock/"
#: Earlier layouts that :func:`kvredis.redis.migrate.migrate_namespace` converts in place.
MIGRATABLE_LAYOUTS = ("kvredis-kvblock/1",)
#: Bucket bits of a new namespace unless configured: 65,536 request buckets (and as many engine
#: buckets), which keeps buckets small (listpack-encoded) up to tens of millions of keys.
DEFAULT_BUCKET_BITS = 16
#: The bucket bits a namespace may have (``lua/includes/layout.lua`` MIN_BUCKET_BITS,
#: MAX_BUCKET_BITS).
MIN_BUCKET_BITS = 1
MAX_BUCKET_BITS = 24
#: The fields of ``<ns>:pi`` that are not entry ids: the copies of ``next_id``, ``bucket_bits``,
#: ``expiry`` and ``next_run`` from which a lost ``<ns>:meta`` heals. Entry ids are 4 bytes, so
#: they never collide.
PI_RECORD_FIELDS = (b"next_id", b"bucket_bits", b"expiry", b"next_run")
#: Width of an item of an expiring bucket: entry id (4 bytes) + deadline (8 bytes, ms):
#: ``lua/includes/expiry.lua`` ITEM_WIDTH.
EXPIRING_ITEM_WIDTH = 12
#: ``expiry`` in ``<ns>:meta``: expiring entries use hash field expiry (HPEXPIREAT per field) ...
EXPIRY_FIELD = "field"
#: ... or expiring bucket keys (PEXPIREAT per bucket key; also what an absent field means).
EXPIRY_KEY = "key"
#: Most request keys of one run (``lua/includes/runs.lua`` RUN_MAX; a run id is
#: :data:`~kvredis.redis.codec.RUN_ID_WIDTH` bytes, a ref :data:`~kvredis.redis.codec.REF_WIDTH`).
RUN_MAX = 1024
#: Fewest consecutive new request keys of one add that become a run (fewer stay inline, unless
#: they follow the last key of a run): ``lua/includes/runs.lua`` RUN_MIN.
RUN_MIN = 8
#: Appending to a run rewrites its key list: a run of more than this many keys is extended only
#: by at least 1/:data:`RUN_APPEND_SHARE` of its length in new keys, fewer start a run of their
#: own after it (``lua/includes/runs.lua`` RUN_APPEND_MAX), so an append costs what its keys
#: cost.
RUN_APPEND_MAX = 256
#: See :data:`RUN_APPEND_MAX` (``lua/includes/runs.lua`` RUN_APPEND_SHARE).
RUN_APPEND_SHARE = 8
#: What reading a run costs on top of its ranges, in the work limits below (RUN_READ_COST).
RUN_READ_COST = 4
#: Most run work (ranges read, plus :data:`RUN_READ_COST` per run) of one write call; a write
#: past it is refused before its first write (``KVREDIS_BUDGET``) and the client splits it:
#: ``lua/includes/writes.lua`` RUN_WORK_LIMIT. One run always fits.
RUN_WORK_LIMIT = 4096
#: Most run work of one walk (lookup, score); past it the walk stops and says where:
#: ``lua/includes/walk.lua`` WALK_WORK_LIMIT. The scripts enforce these limits: the client only
#: reads the outcome (``KVREDIS_BUDGET``, a cut walk), and tests compare them with the Lua.
WALK_WORK_LIMIT = 8192


def expiring_item_deadline(item: bytes) -> int:
    """The deadline (unix ms, server clock) of an item of an expiring bucket."""
    return int.from_bytes(item[ID_WIDTH:EXPIRING_ITEM_WIDTH], "big")


def bucket_of(value: int, bits: int) -> int:
    """The bucket of a 64-bit hash: its low ``bits`` bits.

    Uniform for the hashes engines and kvredis produce, and still spread for small sequential
    numbers. The bucket key name carries it as ``ceil(bits / 8)`` big-endian bytes, which the
    Lua scripts cut from the 8-byte hash without arithmetic.
    """
    return value & ((1 << bits) - 1)


#: A pod's page journal is the LIST ``<ns>:pj:<pod>`` (kept by the ingesters beside the index:
#: ``kvredis.ingest.journal``); it is a key of the namespace (:meth:`Layout.owns`), dropped with it.
JOURNAL_KEY_INFIX = b":pj:"


def meta_key(namespace: str) -> bytes:
    """The key of a namespace's meta record."""
    return text_bytes(namespace) + b":meta"


class Layout:
    """Key names of one incarnation of a namespace (fixed bucket bits and generation)."""

    __slots__ = (
        "bucket_bits",
        "cprefix",
        "eprefix",
        "gen",
        "jprefix",
        "mask",
        "meta",
        "mv",
        "mx",
        "namespace",
        "pe",
        "pi",
        "pp",
        "pr",
        "rprefix",
        "sprefix",
        "suffix_bytes",
        "sx",
        "wm",
        "wp",
    )

    def __init__(self, namespace: str, bucket_bits: int, gen: bytes) -> None:
        self.namespace = namespace
        self.bucket_bits = bucket_bits
        self.gen = gen
        self.mask = (1 << bucket_bits) - 1
        self.suffix_bytes = (bucket_bits + 7) // 8
        ns = text_bytes(namespace)
        self.meta = meta_key(namespace)
        self.pe = ns + b":pe"
        self.pi = ns + b":pi"
        self.pp = ns + b":pp"
        self.pr = ns + b":pr"
        self.wm = ns + b":wm"
        self.wp = ns + b":wp"
        self.sx = ns + b":sx"
        self.mx = ns + b":mx"
        self.mv = ns + b":mv"
        self.rprefix = ns + b":r:"
        self.eprefix = ns + b":e:"
        self.sprefix = ns + b":s:"
        self.cprefix = ns + b":c:"
        self.jprefix = ns + JOURNAL_KEY_INFIX

    def request_bucket(self, value: int) -> bytes:
        """The request bucket key holding request key ``value``."""
        return self.rprefix + (value & self.mask).to_bytes(self.suffix_bytes, "big")

    def engine_bucket(self, value: int) -> bytes:
        """The engine bucket key holding engine key ``value``."""
        return self.eprefix + (value & self.mask).to_bytes(self.suffix_bytes, "big")

    def expiring_bucket(self, value: int) -> bytes:
        """The expiring bucket key holding the expiring entries of request key ``value``."""
        return self.sprefix + (value & self.mask).to_bytes(self.suffix_bytes, "big")

    def expiring_pattern(self) -> bytes:
        """SCAN MATCH pattern of the expiring buckets (and nothing else)."""
        return escape_glob(self.sprefix) + b"?" * self.suffix_bytes

    def request_pattern(self) -> bytes:
        """SCAN MATCH pattern of the request buckets (and nothing else)."""
        return escape_glob(self.rprefix) + b"?" * self.suffix_bytes

    def engine_pattern(self) -> bytes:
        """SCAN MATCH pattern of the engine buckets (and nothing else)."""
        return escape_glob(self.eprefix) + b"?" * self.suffix_bytes

    def run_pattern(self) -> bytes:
        """SCAN MATCH pattern of the runs (and nothing else)."""
        return escape_glob(self.cprefix) + b"?" * RUN_ID_WIDTH

    def run_key(self, run_id: bytes) -> bytes:
        """The key of the run ``run_id`` (4 bytes)."""
        return self.cprefix + run_id

    def namespace_pattern(self) -> bytes:
        """SCAN MATCH pattern of every key of the namespace."""
        return escape_glob(text_bytes(self.namespace) + b":") + b"*"

    def owns(self, key: bytes) -> bool:
        """Whether ``key`` is a key of this namespace, whatever its bucket bits.

        ``SCAN MATCH <ns>:*`` also returns the keys of every namespace whose name extends
        ``<ns>:`` (``kv`` and ``kv:prod``); this tells them apart. Bucket keys are
        ``<ns>:r:``, ``<ns>:e:`` or ``<ns>:s:`` and 1 to 3 suffix bytes, runs ``<ns>:c:`` and 4
        bytes, which no other accepted namespace can produce (:func:`check_namespace`); a
        pod's page journal is ``<ns>:pj:`` and the pod's name.
        """
        if key in self.fixed_keys():
            return True
        if len(key) > len(self.jprefix) and key.startswith(self.jprefix):
            return True
        suffix = len(key) - len(self.rprefix)
        if suffix == RUN_ID_WIDTH and key.startswith(self.cprefix):
            return True
        return 1 <= suffix <= 3 and key.startswith((self.rprefix, self.eprefix, self.sprefix))

    def fixed_keys(self) -> tuple[bytes, ...]:
        """The keys of the namespace that are not buckets, ``<ns>:meta`` last."""
        return (
            *(self.wm, self.wp, self.sx, self.mx, self.mv, self.pr, self.pp, self.pe, self.pi),
            self.meta,
        )


#: The parts of key prefixes (``<ns>:<part>:``) that a namespace name may not hold as a part.
PREFIX_PARTS = ("r", "e", "s", "c", "pj")


def check_namespace(namespace: object) -> str:
    """Validate a namespace name: a non-empty str that cannot nest inside another namespace.

    Bucket keys are ``<ns>:r:<bucket>``, ``<ns>:e:<bucket>`` and ``<ns>:s:<bucket>``, runs
    ``<ns>:c:<run id>``, page journals ``<ns>:pj:<pod>``, so a namespace containing ``:r:``,
    ``:e:``, ``:s:``, ``:c:`` or ``:pj:``, or ending in ``:r``, ``:e``, ``:s``, ``:c`` or ``:pj``,
    would share key names with a shorter one; such names are refused. Any other text (including
    ``:``) is fine.
    """
    if not isinstance(namespace, str) or not namespace:
        raise InvalidInputError(f"namespace must be a non-empty str, got {namespace!r}")
    if any(f":{k}:" in namespace or namespace.endswith(f":{k}") for k in PREFIX_PARTS):
        raise InvalidInputError(
            f"namespace {namespace!r} may not contain ':r:', ':e:', ':s:', ':c:' or ':pj:' or "
            "end in ':r', ':e', ':s', ':c' or ':pj' (its keys would collide with those of a "
            "shorter namespace)"
        )
    return namespace


#: What a namespace name may not contain (:func:`check_namespace_name`): ``:``, which joins a
#: namespace's name to its keys' own parts, and the glob characters of key patterns.
NAMESPACE_SEPARATOR = ":"
NAMESPACE_GLOB = "*?[]\\"


def namespace_name_problem(namespace: str) -> str | None:
    """Why ``namespace`` is no namespace name this kvredis creates or opens (``None``: it is).

    Every key of a namespace ``<ns>`` starts with ``<ns>:``, and an ACL user is given its
    namespace as the key pattern ``~<ns>:*`` (``%R~<ns>:*``). For that pattern to match the
    keys of ``<ns>`` and of no other namespace, a name holds no ``:`` (``~a:*`` would match
    the keys of ``a:b``) and no glob character (``~t*:*`` would match those of ``tx``). Space
    and control characters, which split or end an ``ACL SETUSER`` line, are refused too.
    """
    bad = sorted(
        {
            c
            for c in namespace
            if c == NAMESPACE_SEPARATOR or c in NAMESPACE_GLOB or c.isspace() or not c.isprintable()
        }
    )
    if not bad:
        return None
    shown = " ".join(repr(c) for c in bad)
    return (
        f"namespace {namespace!r} contains {shown}: a namespace name may not contain ':', "
        "the glob characters * ? [ ] \\, spaces or control characters (the ACL key pattern "
        "~<ns>:* of one namespace would match the keys of another)"
    )


def suggested_name(namespace: str) -> str:
    """A name the rules accept, for a message about one they refuse (each refused character
    becomes ``-``)."""
    out = "".join(
        "-"
        if c == NAMESPACE_SEPARATOR or c in NAMESPACE_GLOB or c.isspace() or not c.isprintable()
        else c
        for c in namespace
    )
    return out.strip("-") or "kvblock"


def check_namespace_name(namespace: object) -> str:
    """Validate the name of a namespace a client creates or opens (:func:`check_namespace`,
    and :func:`namespace_name_problem`).

    A namespace an earlier kvredis created under a name refused now keeps its keys; the error
    names the command that moves them to an accepted name (``kvredis rename``).
    """
    name = check_namespace(namespace)
    problem = namespace_name_problem(name)
    if problem is not None:
        raise InvalidInputError(f"{problem}; {rename_hint(name)}")
    return name


def rename_hint(namespace: str) -> str:
    """What to do with an existing namespace whose name the rules refuse."""
    return (
        "a namespace of this name made by an earlier kvredis keeps its keys until renamed: stop "
        f"its ingesters and run `kvredis rename {shlex.quote(namespace)} "
        f"{shlex.quote(suggested_name(namespace))} --redis URL`, then use the new name"
    )


#: The request keys (and as many engine keys) a bucket holds in an index sized by
#: :func:`bucket_bits_for`: 32 to 64. Fewer, and each bucket key's own overhead (about 60 bytes:
#: its name, its dictionary entry, its listpack's header) outweighs its fields; many more, and
#: a field's lookup scans a longer listpack (past the server's ``hash-max-listpack-entries``,
#: 512 by default, a bucket turns into a hashtable, which costs more per field than a listpack).
KEYS_PER_BUCKET = 64


def bucket_bits_for(keys: int, shards: int = 1) -> int:
    """The bucket bits of a namespace meant to hold about ``keys`` distinct request keys (the
    blocks the fleet holds, counted once however many pods hold them), spread over ``shards``
    (a cluster namespace's shards each have ``2**bits`` buckets of each kind): buckets of 32 to
    64 keys (:data:`KEYS_PER_BUCKET`), within [:data:`MIN_BUCKET_BITS`,
    :data:`MAX_BUCKET_BITS`]. A cluster namespace placed by pod (``kvredis-cluster/2``) stores a
    request key once in each shard whose pods hold it: count it once per such shard there (at
    most once per pod holding it). Measured (``scripts/bench_redis_memory.py --blocks 200000
    --bucket-bits 16,auto,8``, 4 pods): 26.9 bytes per (block, pod) entry at 16 bits (3 keys a
    bucket), 15.3 at 12 (49, what this gives), 39.3 at 8 (781: hashtables); an index of fewer
    than about 4M keys is smaller with fewer bits than the default 16."""
    if isinstance(keys, bool) or not isinstance(keys, int) or keys < 0:
        raise InvalidInputError(f"keys must be an int >= 0, got {keys!r}")
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise InvalidInputError(f"shards must be an int >= 1, got {shards!r}")
    per_shard = -(-keys // shards)  # ceil
    bits = max(0, (per_shard - 1) // KEYS_PER_BUCKET).bit_length()
    return min(MAX_BUCKET_BITS, max(MIN_BUCKET_BITS, bits))


def check_bucket_bits(bits: object) -> int:
    """Validate a bucket bit count."""
    if isinstance(bits, bool) or not isinstance(bits, int):
        raise InvalidInputError(f"bucket bits must be an int, got {bits!r}")
    if not MIN_BUCKET_BITS <= bits <= MAX_BUCKET_BITS:
        raise InvalidInputError(
            f"bucket bits must be in [{MIN_BUCKET_BITS}, {MAX_BUCKET_BITS}], got {bits}"
        )
    return bits


# -- a cluster namespace (kvredis.redis.cluster.shards): its name and shard count, checked here
# (a config checks them) so that the checks need no cluster package ---------------------------

#: Shards of a new cluster namespace unless configured otherwise.
DEFAULT_SHARDS = 6
#: The largest shard count (each shard costs one script call per operation that touches it).
MAX_SHARDS = 256


def check_shards(count: object) -> int:
    """Validate a shard count (1..:data:`MAX_SHARDS`)."""
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_SHARDS:
        raise InvalidInputError(
            f"cluster shards must be an int in [1, {MAX_SHARDS}], got {count!r}"
        )
    return count


def check_cluster_namespace(namespace: str) -> str:
    """A cluster namespace may not hold ``{`` or ``}`` (its keys carry hash tags)."""
    if "{" in namespace or "}" in namespace:
        raise InvalidInputError(
            f"a cluster namespace may not contain '{{' or '}}' (got {namespace!r}): the index "
            "puts its own hash tags in its key names"
        )
    return namespace
