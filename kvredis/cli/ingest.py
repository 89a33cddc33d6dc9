"""``kvredis ingest``: subscribe to engines' KV events and keep an index true to them.

Endpoint options form groups: ``--endpoint`` starts a publisher, and the ``--replay``, ``--pod``,
``--model``, ``--topic-filter``, ``--stream`` and ``--engine`` options after it (before the next
``--endpoint``) describe that publisher. A ``tcp://`` (or ``ipc://``) endpoint is a vLLM or SGLang
ZMQ publisher; an ``http://HOST:PORT`` one is a TensorRT-LLM ``trtllm-serve`` whose
``/kv_cache_events`` is polled (it needs ``--pod`` and ``--model``)::

    kvredis ingest --redis redis://127.0.0.1:6379 \\
        --endpoint tcp://10.0.0.5:5557 --replay tcp://10.0.0.5:5558 --pod pod-a --model m \\
        --endpoint tcp://10.0.0.6:5557 --pod pod-b --model m \\
        --endpoint http://10.0.0.7:8000 --pod pod-c --model m
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any, TypeGuard

import click
from click.core import ParameterSource

from kvredis.cli.options import (
    DEFAULT_REDIS_URL,
    check_namespace_option,
    check_redis_url,
    explicit_log_level,
    handle_errors,
    password_file_option,
    read_password,
    unavailable_message,
)
from kvredis.errors import BackendUnavailableError, ConfigError, KVRedisError
from kvredis.hashing import HASH_ALGOS, ChunkedTokenDatabase, TokenProcessorConfig
from kvredis.index import Closeable, Index
from kvredis.ingest.config import GC_THRESHOLD, EndpointConfig, IngesterConfig, tune_collector
from kvredis.ingest.counters import Counter
from kvredis.ingest.service import EventIngester
from kvredis.redis.layout import MAX_BUCKET_BITS, MIN_BUCKET_BITS
from kvredis.tiers import DEFAULT_TIERS, TierMap

if TYPE_CHECKING:
    from kvredis.redis.index import RedisIndex

__all__ = ["ingest"]

logger = logging.getLogger("kvredis.cli.ingest")  # also when run as __main__

_GROUP_OPTIONS = {
    "--endpoint": "endpoint",
    "--replay": "replay_endpoint",
    "--pod": "pod_id",
    "--model": "model_name",
    "--topic-filter": "topic_filter",
    "--stream": "stream",
    "--engine": "engine",
}
#: Seconds a stop waits for the received batches to be applied (a second Ctrl-C abandons them).
DRAIN_TIMEOUT_S = 30.0
_ZMQ_ENDPOINT = re.compile(r"^(tcp://[^\s/]+:(\d+|\*)|ipc://\S+|inproc://\S+)$")
_HTTP_ENDPOINT = re.compile(r"^https?://[^\s/]+:\d+(/\S*)?$")
_META_KEY = "kvredis.ingest.args"
#: What an ingester with --in-memory says at WARNING and in /readyz.
IN_MEMORY = (
    "the index lives in this process only: nothing is durable (it is lost at exit) and no "
    "router can read it; give --redis URL for a shared index"
)


class _IngestCommand(click.Command):
    """Keeps the raw argument order, which click's per-option value lists lose."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta[_META_KEY] = list(args)
        return super().parse_args(ctx, args)


def _value_options(ctx: click.Context) -> set[str]:
    names: set[str] = set()
    for param in ctx.command.params:
        if (
            isinstance(param, click.Option)
            and not (param.is_flag or param.count)
            and param.name != "help"
        ):
            names.update(param.opts)
            names.update(param.secondary_opts)
    return names


def _endpoint_groups(ctx: click.Context) -> list[dict[str, str]]:
    args: list[str] = ctx.meta.get(_META_KEY, [])
    takes_value = _value_options(ctx)
    groups: list[dict[str, str]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            break
        name, eq, inline = arg.partition("=") if arg.startswith("--") else (arg, "", "")
        if name in _GROUP_OPTIONS:
            if eq:
                value, i = inline, i + 1
            elif i + 1 < len(args):
                value, i = args[i + 1], i + 2
            else:
                raise click.UsageError(f"{name} needs a value")
            field = _GROUP_OPTIONS[name]
            if field == "endpoint":
                groups.append({"endpoint": value})
                continue
            if not groups:
                raise click.UsageError(
                    f"{name} {value} comes before any --endpoint; put it after the --endpoint "
                    "it describes"
                )
            if field in groups[-1]:
                raise click.UsageError(
                    f"{name} is given twice for --endpoint {groups[-1]['endpoint']}"
                )
            groups[-1][field] = value
            continue
        i += 2 if name in takes_value and not eq else 1
    return groups


def _endpoint_configs(groups: Sequence[dict[str, str]]) -> list[EndpointConfig]:
    if not groups:
        raise click.UsageError(
            "give at least one --endpoint tcp://HOST:PORT (vLLM, SGLang) or http://HOST:PORT "
            "(TensorRT-LLM's trtllm-serve) to follow"
        )
    configs = []
    for group in groups:
        endpoint = group["endpoint"]
        if not (_ZMQ_ENDPOINT.match(endpoint) or _HTTP_ENDPOINT.match(endpoint)):
            raise click.BadParameter(
                f"{endpoint!r} is not an engine endpoint (expected tcp://HOST:PORT or ipc://PATH "
                "for vLLM and SGLang, http://HOST:PORT for TensorRT-LLM's trtllm-serve)",
                param_hint="--endpoint",
            )
        replay = group.get("replay_endpoint")
        if replay is not None and not _ZMQ_ENDPOINT.match(replay):
            raise click.BadParameter(
                f"{replay!r} is not a ZMQ endpoint (expected tcp://HOST:PORT, ipc://PATH)",
                param_hint="--replay",
            )
        try:
            configs.append(EndpointConfig(**group))
        except ConfigError as exc:
            hint = "--engine" if str(exc).startswith("engine must be") else "--endpoint"
            raise click.BadParameter(str(exc), param_hint=hint) from None
    seen: set[str] = set()
    for config in configs:
        if config.endpoint in seen:
            raise click.BadParameter(f"{config.endpoint} is given twice", param_hint="--endpoint")
        seen.add(config.endpoint)
    streams = [c.stream_name for c in configs]
    for name in streams:
        if streams.count(name) > 1:
            raise click.BadParameter(
                f"two endpoints share the stream {name!r}; give them distinct --pod or --stream",
                param_hint="--stream",
            )
    for config in configs:
        _check_resolvable(config.endpoint, "--endpoint")
        if config.replay_endpoint:
            _check_resolvable(config.replay_endpoint, "--replay")
    return configs


def _check_resolvable(endpoint: str, option: str) -> None:
    """A tcp:// or http:// endpoint's host must resolve (a typo would otherwise wait silently
    forever)."""
    match = re.match(r"^(?:tcp|https?)://([^/]+):(\d+|\*)(?:/.*)?$", endpoint)
    if match is None:
        return
    host = match.group(1).strip("[]")
    if host == "*":
        return
    try:
        socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError) as exc:
        raise click.BadParameter(
            f"host {host!r} of {endpoint} does not resolve ({exc})", param_hint=option
        ) from None


def _open_index(
    redis_url: str | None, namespace: str, password: str | None, bucket_bits: int | None = None
) -> Index:
    if redis_url is None:
        from kvredis.memory import InMemoryIndex

        logger.warning("--in-memory: %s", IN_MEMORY)
        return InMemoryIndex()
    from kvredis.redis import RedisIndexConfig, new_redis_index

    try:
        config = RedisIndexConfig(address=redis_url, namespace=namespace, password=password)
        if bucket_bits is not None:
            config = dataclasses.replace(config, bucket_bits=bucket_bits)
    except (ConfigError, ValueError) as exc:
        raise click.BadParameter(str(exc), param_hint="--redis") from None
    try:
        index = new_redis_index(config)
        found = index.bucket_bits
        if bucket_bits is not None and found != bucket_bits:
            logger.warning(
                "namespace %r has %s bucket bits, fixed by the client that created it: "
                "--bucket-bits %d only sizes a new namespace",
                namespace,
                found,
                bucket_bits,
            )
        return index
    except BackendUnavailableError as exc:
        raise click.ClickException(unavailable_message(exc)) from None
    except KVRedisError:
        raise
    except Exception as exc:  # e.g. a port that is not Redis: redis-py's protocol error
        raise click.ClickException(
            f"{config.server()} did not answer as Redis or Valkey ({exc})"
        ) from None


def _identity_hints(configs: Sequence[EndpointConfig]) -> None:
    """Say where each endpoint's pod and model come from. Not a warning: an engine configured
    as docs/engines.md says names them in its topic (kv@POD@MODEL); a batch whose topic names
    none is rejected with a warning, and :func:`_unidentified` says what to do."""
    for config in configs:
        missing = [
            option
            for option, value in (("--pod", config.pod_id), ("--model", config.model_name))
            if not value
        ]
        if missing:
            logger.info(
                "endpoint %s: %s from its kv@POD@MODEL topics (without %s, a batch whose "
                "topic names none is rejected)",
                config.endpoint,
                " and ".join(m.lstrip("-") for m in missing),
                " and ".join(missing),
            )


def _unidentified(ingester: EventIngester) -> str | None:
    """Why nothing was applied, if every batch was refused for want of a pod or model."""
    counts = ingester.counters.snapshot()
    no_pod = counts.get("rejected.no_pod", 0)
    no_model = counts.get("rejected.no_model", 0)
    if counts.get(Counter.BATCHES_APPLIED.value, 0) or not (no_pod or no_model):
        return None
    return (
        f"no batch was applied: {no_pod} refused for want of a pod and {no_model} for want "
        "of a model; vLLM publishes with an empty topic by default, so give --pod and --model "
        "after each --endpoint"
    )


def _readiness(index: Index, ingester: EventIngester) -> Any:
    from kvredis.ingest.metrics import connected_endpoints

    def ready() -> tuple[bool, list[str]]:
        lines = []
        ok = True
        if _is_redis(index):
            try:
                index.client.ping()
                lines.append("redis: ok")
            except Exception as exc:  # any failure means not ready
                ok = False
                lines.append(f"redis: {type(exc).__name__}: {exc}")
        else:
            lines.append(f"index: in memory ({IN_MEMORY})")
        endpoints = [e for e in ingester.endpoints if "://" in e.endpoint]
        connected = connected_endpoints(ingester.counters.snapshot())
        if connected < len(endpoints):
            ok = False
        lines.append(f"endpoints: {min(connected, len(endpoints))}/{len(endpoints)} connected")
        return ok, lines

    return ready


def _is_redis(index: Index) -> TypeGuard[RedisIndex]:
    from kvredis.redis.index import RedisIndex

    return isinstance(index, RedisIndex)


def _tier_map(spec: str | None) -> TierMap:
    """``--tier-map``: a JSON object, or ``@FILE`` holding one."""
    if spec is None:
        return DEFAULT_TIERS
    try:
        if spec.startswith("@"):
            with open(spec[1:], encoding="utf-8") as f:
                spec = f.read()
        data = json.loads(spec)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        return TierMap.from_dict(data)
    except (OSError, ValueError, ConfigError) as exc:
        raise click.BadParameter(str(exc), param_hint="--tier-map") from None


@click.command(cls=_IngestCommand, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--endpoint",
    "endpoints",
    multiple=True,
    metavar="URL",
    help="Engine KV-event endpoint: a vLLM/SGLang PUB socket (tcp://HOST:PORT) or a "
    "TensorRT-LLM trtllm-serve (http://HOST:PORT); starts an endpoint group. Repeatable.",
)
@click.option("--replay", multiple=True, metavar="URL", help="The group's replay ROUTER endpoint.")
@click.option(
    "--pod", multiple=True, metavar="ID", help="The group's pod id (else from kv@POD@MODEL topics)."
)
@click.option(
    "--model", multiple=True, metavar="NAME", help="The group's model (else the topic's)."
)
@click.option(
    "--topic-filter", multiple=True, metavar="PREFIX", help="The group's ZMQ subscription prefix."
)
@click.option(
    "--stream",
    multiple=True,
    metavar="NAME",
    help="The group's watermark stream (default: its pod, else its endpoint).",
)
@click.option(
    "--engine",
    "engine",
    multiple=True,
    metavar="vllm|sglang|trtllm",
    help="The group's engine: for what its prefix-cache reset drops, and SGLang's (or "
    "TensorRT-LLM's) pages finer than index blocks get one mapping per block (default: "
    "learned from its events; http:// endpoints are trtllm).",
)
@click.option(
    "--redis",
    "redis_url",
    metavar="URL",
    envvar="KVREDIS_REDIS_URL",
    default=DEFAULT_REDIS_URL,
    show_default=True,
    callback=check_redis_url,
    help="Redis/Valkey index (env KVREDIS_REDIS_URL), as for every command.",
)
@click.option(
    "--in-memory",
    is_flag=True,
    help="Keep the index in this process instead (for trying it out: lost at exit, and no "
    "router can read it).",
)
@click.option(
    "--namespace",
    default="kvblock",
    show_default=True,
    envvar="KVREDIS_NAMESPACE",
    callback=check_namespace_option,
    help="Redis key namespace (env KVREDIS_NAMESPACE).",
)
@password_file_option
@click.option(
    "--block-size",
    type=click.IntRange(min=1),
    default=16,
    show_default=True,
    help="Tokens per request-key block.",
)
@click.option("--hash-algo", type=click.Choice(HASH_ALGOS), default="xxh3_64", show_default=True)
@click.option("--hash-seed", default="", help="Seed of the block-key chain roots.")
@click.option("--workers", type=click.IntRange(min=1), default=4, show_default=True)
@click.option(
    "--gc-threshold",
    type=click.IntRange(min=0),
    default=GC_THRESHOLD,
    show_default=True,
    help="Python's garbage collector runs after this many new objects (its default: 700): "
    "10-25% less CPU (0: Python's defaults).",
)
@click.option(
    "--partial-block-pages",
    type=click.IntRange(min=1),
    default=IngesterConfig().partial_block_pages,
    show_default=True,
    help="Engine pages ending inside an index block remembered per pod (about 220 bytes "
    "each), so that a branch from one gets exact keys.",
)
@click.option(
    "--status-interval",
    type=click.FloatRange(min=0.05),
    default=10.0,
    show_default=True,
    help="Seconds between status lines.",
)
@click.option(
    "--duration",
    type=click.FloatRange(min=0),
    default=None,
    help="Stop after this many seconds (default: run until SIGINT/SIGTERM).",
)
@click.option(
    "--no-watermarks",
    is_flag=True,
    help="Do not fence batches with stored watermarks (only for a single ingester).",
)
@click.option(
    "--bucket-bits",
    type=click.IntRange(MIN_BUCKET_BITS, MAX_BUCKET_BITS),
    default=None,
    help="Bucket bits of a namespace this process creates (2**N request and as many engine "
    "buckets; an existing namespace keeps its own; not used with --in-memory). For an index "
    "of about KEYS distinct request keys, kvredis.redis.bucket_bits_for(KEYS) (buckets of "
    "32-64 keys; default 16, for about 2-4M keys: a smaller index takes less memory with fewer "
    "bits).",
)
@click.option(
    "--no-page-journal",
    is_flag=True,
    help="Keep no journal of the pages inside index blocks beside the index (less Redis "
    "memory; a restarted ingester then misses chains hanging inside blocks it never saw).",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    default=None,
    help="Serve /metrics (Prometheus), /healthz and /readyz on this port.",
)
@click.option(
    "--metrics-address",
    default="0.0.0.0",
    show_default=True,
    help="Address the --metrics-port server listens on.",
)
@click.option(
    "--tier-map",
    default=None,
    metavar="JSON|@FILE",
    help='Medium to device tier, e.g. \'{"mediums": {"CPU_PINNED": "cpu"}, "defaultTier": "gpu"}\' '
    "(extends the defaults; @FILE reads it from a file).",
)
@click.option(
    "--offload-blocks-per-chunk",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="GPU blocks per chunk of vLLM's offloading connector (its blocks_per_chunk): a chunk's "
    "CPU event names only its last block and is credited on all of them.",
)
@click.option(
    "--reset-medium",
    "reset_mediums",
    multiple=True,
    metavar="MEDIUM",
    help="An engine medium whose copies a prefix-cache reset (AllBlocksCleared) removes, for "
    "every engine (default: each engine's own: GPU for vLLM, GPU and CPU_PINNED for SGLang, "
    "both cache levels for TensorRT-LLM). Repeatable.",
)
@click.pass_context
@handle_errors
def ingest(
    ctx: click.Context,
    endpoints: tuple[str, ...],
    replay: tuple[str, ...],
    pod: tuple[str, ...],
    model: tuple[str, ...],
    topic_filter: tuple[str, ...],
    stream: tuple[str, ...],
    engine: tuple[str, ...],
    redis_url: str,
    in_memory: bool,
    namespace: str,
    password_file: str | None,
    block_size: int,
    hash_algo: str,
    hash_seed: str,
    workers: int,
    gc_threshold: int,
    partial_block_pages: int,
    status_interval: float,
    duration: float | None,
    no_watermarks: bool,
    bucket_bits: int | None,
    no_page_journal: bool,
    metrics_port: int | None,
    metrics_address: str,
    tier_map: str | None,
    offload_blocks_per_chunk: int,
    reset_mediums: tuple[str, ...],
) -> None:
    """Follow engines' KV-cache events (vLLM, SGLang, TensorRT-LLM) and apply them to the index.

    Each --endpoint starts a group; the --replay, --pod, --model, --topic-filter, --stream and
    --engine options after it describe that endpoint (tcp:// for vLLM and SGLang, http:// for
    TensorRT-LLM's trtllm-serve). Runs until interrupted, logging a status line every
    --status-interval seconds.

    \b
    Example:
      kvredis ingest --redis redis://10.0.0.7:6379 --metrics-port 9464 \\
        --endpoint tcp://10.0.0.5:5557 --replay tcp://10.0.0.5:5558 --pod pod-a --model m
    """
    configs = _endpoint_configs(_endpoint_groups(ctx))
    given = ctx.get_parameter_source("redis_url") is not ParameterSource.DEFAULT
    if in_memory and given:
        raise click.UsageError("give --redis URL or --in-memory, not both")
    target = None if in_memory else redis_url
    try:
        processor = ChunkedTokenDatabase(
            TokenProcessorConfig(
                block_size_tokens=block_size, hash_seed=hash_seed, hash_algo=hash_algo
            )
        )
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--block-size/--hash-algo") from None
    try:
        config = IngesterConfig(
            workers=workers,
            use_watermarks=not no_watermarks,
            page_journal=not no_page_journal,
            tiers=_tier_map(tier_map),
            offload_blocks_per_chunk=offload_blocks_per_chunk,
            reset_mediums=reset_mediums or None,
            partial_block_pages=partial_block_pages,
        )
    except ConfigError as exc:  # the other options are checked by their types
        raise click.BadParameter(str(exc), param_hint="--reset-medium") from None
    _setup_logging(ctx)
    _identity_hints(configs)
    index = _open_index(target, namespace, read_password(password_file), bucket_bits)
    raw_index = index
    registry = probes = None
    if metrics_port is not None:
        from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector

        from kvredis.metrics import InstrumentedIndex

        registry = CollectorRegistry()
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        index = InstrumentedIndex(index, registry=registry)
    ingester = EventIngester(index, processor, configs, config)
    tune_collector(gc_threshold)
    if registry is not None and metrics_port is not None:
        from kvredis.ingest.metrics import IngestMetrics
        from kvredis.probes import ProbeServer

        IngestMetrics(ingester, registry)
        try:
            probes = ProbeServer(
                metrics_port, metrics_address, registry, _readiness(raw_index, ingester)
            ).start()
        except OSError as exc:
            if isinstance(index, Closeable):
                index.close()
            raise click.BadParameter(
                f"cannot listen on {metrics_address}:{metrics_port}: {exc.strerror}",
                param_hint="--metrics-port",
            ) from None
        logger.info("serving /metrics, /healthz and /readyz on port %d", probes.port)
    stop = threading.Event()
    previous = _install_signal_handlers(_Shutdown(stop, ingester))
    try:
        ingester.start()
        logger.info(
            "ingesting from %s into %s",
            ", ".join(f"{c.endpoint} (pod {c.pod_id or 'from topic'})" for c in configs),
            _shown(target, namespace),
        )
        deadline = None if duration is None else time.monotonic() + duration
        while not stop.is_set():
            wait = status_interval
            if deadline is not None:
                wait = min(wait, max(0.0, deadline - time.monotonic()))
            if stop.wait(wait):
                break
            logger.info("status: %s", ingester.status_line())
            hint = _unidentified(ingester)
            if hint is not None:
                logger.warning("%s", hint)
            if deadline is not None and time.monotonic() >= deadline:
                break
    except KVRedisError as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        drained = ingester.stop(drain=True, timeout=DRAIN_TIMEOUT_S)
        left = {} if drained else _pending(ingester)
        logger.info("stopped: %s", ingester.status_line())
        _restore_signal_handlers(previous)
        if probes is not None:
            probes.close()
        if isinstance(index, Closeable):
            index.close()
    if not drained:
        raise click.ClickException(
            f"shutdown waited {DRAIN_TIMEOUT_S:g} s for the received batches; {_not_applied(left)}"
        )
    hint = _unidentified(ingester)
    if hint is not None:
        raise click.ClickException(hint)


def _shown(redis_url: str | None, namespace: str) -> str:
    if redis_url is None:
        return "an in-memory index"
    from kvredis.redis.address import mask_password

    return f"{mask_password(redis_url)} (namespace {namespace})"


def _setup_logging(ctx: click.Context) -> None:
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
    for name in ("kvredis.cli.ingest", "kvredis.ingest"):  # this command, the ingester, transport
        log = logging.getLogger(name)
        if not explicit_log_level(ctx) and log.getEffectiveLevel() > logging.INFO:
            log.setLevel(logging.INFO)


def _pending(ingester: EventIngester, timeout: float = 1.0) -> dict[str, int] | None:
    """Batches received and not yet applied, per stream; ``None`` if that cannot be told
    within ``timeout`` (asked from another thread: a signal handler must never block)."""
    found: list[dict[str, int]] = []
    thread = threading.Thread(
        target=lambda: found.append(ingester.stream_lags()), name="kvredis-pending", daemon=True
    )
    thread.start()
    thread.join(timeout)
    return {name: n for name, n in found[0].items() if n} if found else None


def _not_applied(pending: dict[str, int] | None) -> str:
    """``what was not applied``, in words."""
    if pending is None:
        return "the batches still queued were not applied"
    if not pending:
        return "every received batch was applied or abandoned"
    streams = ", ".join(f"{name}: {n}" for name, n in sorted(pending.items()))
    return (
        f"{sum(pending.values())} received batches were not applied ({streams}); their "
        "events are missing from the index until the engines send them again (a stream with "
        "--replay fetches them when ingest starts)"
    )


class _Shutdown:
    """The SIGINT/SIGTERM handler: the first signal stops and drains (saying how long it may
    wait), a second one exits at once (status 128 + signal), saying what was not applied."""

    def __init__(self, stop: threading.Event, ingester: EventIngester) -> None:
        self.stop = stop
        self.ingester = ingester
        self.signals = 0

    def __call__(self, signum: int, _frame: FrameType | None) -> None:
        self.signals += 1
        name = signal.Signals(signum).name
        if self.signals == 1:
            pending = _pending(self.ingester)
            count = "the" if pending is None else f"the {sum(pending.values())}"
            _say(
                f"received {name}: stopping; applying {count} batches received but not applied "
                f"yet (waiting at most {DRAIN_TIMEOUT_S:g} s); press Ctrl-C again to abandon "
                "them and exit now"
            )
            self.stop.set()
            return
        _say(f"received {name} again: exiting now; {_not_applied(_pending(self.ingester))}")
        os._exit(128 + signum)


def _say(line: str) -> None:
    """Write one line to stderr from a signal handler (never through a buffered stream that
    the interrupted code may be writing to)."""
    with contextlib.suppress(OSError):
        os.write(2, f"kvredis ingest: {line}\n".encode("utf-8", "replace"))


def _install_signal_handlers(handler: _Shutdown) -> dict[int, Any]:
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous: dict[int, Any] = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        previous[sig] = signal.signal(sig, handler)
    return previous


def _restore_signal_handlers(previous: dict[int, Any]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


if __name__ == "__main__":
    ingest()
