"""RedisIndexConfig: where and how to reach the server, and which namespace to use.

Accepts the upstream llm-d JSON shape (``address``, ``backendType``, ``enableRDMA``, ...) through
:meth:`RedisIndexConfig.from_dict`, and every field in its snake_case spelling.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, Literal

from kvredis.errors import ConfigError
from kvredis.jsonconfig import check_number, take_fields
from kvredis.redis.address import RedisAddress, mask_password, parse_address
from kvredis.redis.functions import UseFunctions, check_use_functions
from kvredis.redis.layout import (
    DEFAULT_BUCKET_BITS,
    DEFAULT_SHARDS,
    check_bucket_bits,
    check_cluster_namespace,
    check_namespace,
    check_namespace_name,
    check_shards,
)

BACKEND_TYPES = ("redis", "valkey")
#: ``read_from_replicas``: reads on the primary (False), on its replicas (True), or on the
#: primary and its replicas in turn (``"spread"``).
ReadFromReplicas = bool | Literal["spread"]
#: Address of :func:`kvredis.redis.factories.new_valkey_index` without a config.
DEFAULT_VALKEY_ADDRESS = "valkey://127.0.0.1:6379"

#: Fields the clear loop aims to examine per script call (sizes the SCAN pages):
#: ``clear_fields_per_call`` unless configured.
DEFAULT_CLEAR_FIELDS_PER_CALL = 512

#: JSON key -> field name (snake_case names are accepted as well)
_CAMEL = {
    "address": "address",
    "backendType": "backend_type",
    "enableRDMA": "enable_rdma",
    "enableRdma": "enable_rdma",
    "namespace": "namespace",
    "socketTimeout": "socket_timeout",
    "connectTimeout": "connect_timeout",
    "poolSize": "pool_size",
    "poolTimeout": "pool_timeout",
    "retries": "retries",
    "retryBackoff": "retry_backoff",
    "bucketBits": "bucket_bits",
    "clearFieldsPerCall": "clear_fields_per_call",
    "username": "username",
    "password": "password",
    "tlsCaFile": "tls_ca_file",
    "tlsCertFile": "tls_cert_file",
    "tlsKeyFile": "tls_key_file",
    "tlsVerify": "tls_verify",
    "tlsCheckHostname": "tls_check_hostname",
    "clientName": "client_name",
    "strict": "strict",
    "cluster": "cluster",
    "readFromReplicas": "read_from_replicas",
    "clusterShards": "cluster_shards",
    "clusterWaitReplicas": "cluster_wait_replicas",
    "useFunctions": "use_functions",
    "waitForNamespace": "wait_for_namespace",
}


@dataclass(frozen=True, slots=True)
class RedisIndexConfig:
    """Where and how to reach the server, and which namespace to use.

    ``address`` accepts ``redis://``, ``rediss://`` (TLS), ``valkey://``, ``valkeys://``,
    ``unix://`` and a bare ``host:port`` (see :mod:`kvredis.redis.address`). ``enable_rdma`` is
    accepted for upstream compatibility; the Python client does not support RDMA, logs a warning
    and uses TCP. ``username``/``password`` override those in the address. Timeouts are in
    seconds. ``bucket_bits`` only matters for the first client of a new namespace: it fixes the
    number of buckets (``2**bucket_bits``) for everyone:
    :func:`~kvredis.redis.layout.bucket_bits_for` gives the count for an index's size (buckets
    of 32 to 64 request keys; the default 16 suits about 2-4M keys, and stays listpack-encoded
    up to tens of millions, while a smaller index takes less memory with fewer bits).
    ``clear_fields_per_call`` bounds the work of one ``clear`` script call. ``tls_*`` options
    need a TLS address (``rediss://`` or ``valkeys://``). Connecting checks the server's
    ``maxmemory-policy``: an ``allkeys-*`` policy (which deletes index keys) logs a warning, or
    with ``strict`` raises :class:`~kvredis.errors.UnsafeServerConfigError`.

    ``cluster`` selects Redis Cluster mode: ``address`` then names seed nodes. A cluster address
    (``redis+cluster://``, ``valkey+cluster://``, ``rediss+cluster://``, ``valkeys+cluster://``)
    sets it by itself; :func:`kvredis.redis.factories.new_redis_index` then returns the cluster
    index (:mod:`kvredis.redis.cluster.index`). ``cluster_shards`` is the number of shards a
    new cluster namespace is spread over (fixed by its first client, as ``bucket_bits``; see
    :mod:`kvredis.redis.cluster.shards`); a cluster namespace may not contain ``{`` or ``}``.
    No ``namespace`` contains ``:``, a glob character, a space or a control character
    (:func:`~kvredis.redis.layout.check_namespace_name`: one namespace's ACL key pattern
    ``~<ns>:*`` matches no other's keys).
    ``read_from_replicas`` sends lookups and scores to replicas: ``True`` to the replicas
    alone, in turn (on a cluster, the replicas of each slot; on a single server, the online
    replicas of the server (the primary), found with ``INFO replication`` on it: see
    :mod:`kvredis.redis.replicas`); ``"spread"`` to the primary and its replicas in turn, so
    that every replica adds its share of read capacity. Writes, watermarks and
    ``get_request_key`` stay on the primaries. ``cluster_wait_replicas``
    (default 0: off) makes every write wait until that many replicas of each primary it wrote to
    hold it (``WAIT``, sent in the same pipeline, for at most half of ``socket_timeout``); a
    write fewer replicas acknowledged in time raises
    :class:`~kvredis.errors.BackendUnavailableError` (it was applied on the primary, and may be
    lost in a failover; sending it again is safe). ``use_functions`` (JSON ``useFunctions``)
    picks how the index's Lua commands are called: ``"auto"`` (default) calls the ``kvredis``
    Redis Functions library (``FCALL``/``FCALL_RO``, loading it at connect when it is missing or
    older) and falls back to ``EVALSHA``, with one log line, when the server or the ACL user does
    not offer functions; ``True`` requires the library; ``False`` keeps to ``EVALSHA``
    (:mod:`kvredis.redis.functions`, docs/protocol.md). ``wait_for_namespace`` (seconds, JSON
    ``waitForNamespace``; default 0) is for routers that may start before the namespace exists:
    connecting to a namespace that does not exist yet then waits that long for its creator (an
    ingester, ``kvredis restore``) instead of creating it, and raises
    :class:`~kvredis.errors.NamespaceMissingError` if it did not appear; with 0 a client
    creates it, and one whose ACL user may not raises that error at once.
    """

    address: str = "redis://127.0.0.1:6379"
    backend_type: str = "redis"
    enable_rdma: bool = False
    namespace: str = "kvblock"
    socket_timeout: float = 2.0
    connect_timeout: float = 2.0
    pool_size: int = 32
    pool_timeout: float = 5.0
    retries: int = 2
    retry_backoff: float = 0.05
    bucket_bits: int = DEFAULT_BUCKET_BITS
    clear_fields_per_call: int = DEFAULT_CLEAR_FIELDS_PER_CALL
    username: str | None = None
    password: str | None = None
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_verify: bool = True
    tls_check_hostname: bool = True
    client_name: str | None = "kvredis"
    strict: bool = False
    cluster: bool = False
    read_from_replicas: ReadFromReplicas = False
    cluster_shards: int = DEFAULT_SHARDS
    cluster_wait_replicas: int = 0
    use_functions: UseFunctions = "auto"
    wait_for_namespace: float = 0.0

    def __repr__(self) -> str:
        shown = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "address":
                value = mask_password(value)
            elif f.name == "password" and value is not None:
                value = "***"
            shown.append(f"{f.name}={value!r}")
        return f"RedisIndexConfig({', '.join(shown)})"

    def __post_init__(self) -> None:
        address = parse_address(self.address)
        if self.backend_type not in BACKEND_TYPES:
            raise ConfigError(
                f"backend_type must be one of {', '.join(BACKEND_TYPES)}, got {self.backend_type!r}"
            )
        names = ("enable_rdma", "tls_verify", "tls_check_hostname", "strict", "cluster")
        for name in names:
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.read_from_replicas, bool) and self.read_from_replicas != "spread":
            raise ConfigError(
                'read_from_replicas must be true, false or "spread", got '
                f"{self.read_from_replicas!r}"
            )
        if address.cluster and not self.cluster:
            object.__setattr__(self, "cluster", True)  # the address says so
        if self.cluster and address.transport != "tcp":
            raise ConfigError(
                f"cluster is set, but address {address.display!r} is a unix socket; a cluster "
                "is reached over TCP: use redis+cluster://host:port[,host:port...]"
            )
        try:
            check_namespace_name(self.namespace)
            check_bucket_bits(self.bucket_bits)
            check_shards(self.cluster_shards)
            if self.cluster:
                check_cluster_namespace(self.namespace)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        for name in ("socket_timeout", "connect_timeout", "pool_timeout"):
            check_number(name, getattr(self, name))
        check_number("retry_backoff", self.retry_backoff, zero=True)
        check_number("pool_size", self.pool_size, integer=True)
        check_number("retries", self.retries, integer=True, zero=True)
        check_number("cluster_wait_replicas", self.cluster_wait_replicas, integer=True, zero=True)
        check_number("clear_fields_per_call", self.clear_fields_per_call, integer=True)
        check_number("wait_for_namespace", self.wait_for_namespace, zero=True)
        check_use_functions(self.use_functions)
        for name in (
            "username",
            "password",
            "tls_ca_file",
            "tls_cert_file",
            "tls_key_file",
            "client_name",
        ):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ConfigError(f"{name} must be a str or None, got {value!r}")
        tls_set = [
            name
            for name, default in (
                ("tls_ca_file", None),
                ("tls_cert_file", None),
                ("tls_key_file", None),
                ("tls_verify", True),
                ("tls_check_hostname", True),
            )
            if getattr(self, name) != default
        ]
        if tls_set and not self.parsed_address().tls:
            raise ConfigError(
                f"{', '.join(tls_set)} given, but address {mask_password(self.address)!r} is not "
                "TLS; use rediss:// or valkeys:// (or drop the tls options)"
            )

    @classmethod
    def from_dict(cls, mapping: Mapping[str, Any]) -> RedisIndexConfig:
        """Build from the upstream JSON shape (``address``, ``backendType``, ``enableRDMA``, ...).

        Every field is also accepted in its snake_case spelling; unknown keys raise ConfigError.
        """
        kwargs = take_fields("redis config", mapping, _CAMEL)
        return cls(**kwargs)

    def parsed_address(self) -> RedisAddress:
        """The parsed :attr:`address`."""
        return parse_address(self.address)

    def server(self) -> str:
        """``"<backend type> at <address>"`` with any password masked, for messages."""
        return f"{self.backend_type} at {self.parsed_address().display}"


def config_for_existing(config: RedisIndexConfig, namespace: str) -> RedisIndexConfig:
    """``config`` naming ``namespace``, also a name that
    :func:`~kvredis.redis.layout.check_namespace_name` refuses (one an earlier kvredis
    created): for the operator's commands that move such a namespace to an accepted name or
    delete it (``kvredis rename``, ``kvredis drop``), never for the index's clients."""
    try:
        check_namespace(namespace)
        if config.cluster:
            check_cluster_namespace(namespace)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    copy = replace(config)
    object.__setattr__(copy, "namespace", namespace)
    return copy


def check_supported(config: RedisIndexConfig) -> None:
    """Raise :class:`~kvredis.errors.ConfigError` for a config the single-server index cannot
    serve: ``cluster_wait_replicas`` (a cluster option)."""
    if config.cluster_wait_replicas and not config.cluster:
        raise ConfigError(
            "cluster_wait_replicas is for cluster addresses only; leave it at 0 for a single server"
        )
