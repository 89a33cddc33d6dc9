"""The session a sans-IO operation runs in, and the combinators that send its requests.

- :func:`op_send` sends one request: a :class:`~kvredis.redis.requests.ScriptCall` as ``FCALL``
  of the function library (or ``EVALSHA``, its fallback), loading the library or script and
  sending it again when the server lost it (after ``FUNCTION FLUSH``/``SCRIPT FLUSH``, a restart
  or a failover; in a pipeline only the calls that missed are sent again) or a library of
  another protocol version refused it (the registry settles again, for the session's namespace:
  :meth:`~kvredis.redis.functions.FunctionRegistry.op_reload`); transient failures
  (connection lost, timeout, ``BUSY``/``LOADING``/``MASTERDOWN``/``READONLY``/``TRYAGAIN``
  replies) are retried ``retries`` times after a :class:`~kvredis.redis.requests.Sleep` with
  exponential backoff, then raise :class:`~kvredis.errors.BackendUnavailableError` naming the
  server; a refused authentication raises at once; any other error reply becomes its
  :mod:`kvredis.errors` exception (:func:`kvredis.errors.translate`).
- :func:`op_drive` runs an operation, sending each of its requests with :func:`op_send`.

Also the checks a connecting client makes of the server's ``INFO`` (cluster mode, eviction
policy). The index operations themselves are in :mod:`kvredis.redis.ops`.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from kvredis.errors import (
    BackendAuthenticationError,
    BackendUnavailableError,
    KVRedisError,
    UnsafeServerConfigError,
    cluster_mode_error,
    translate,
)
from kvredis.redis.requests import (
    TRANSIENT_REPLIES,
    AuthenticationFailed,
    Command,
    ConnectionLost,
    ErrorReply,
    Failure,
    NotRedis,
    Op,
    Pipeline,
    Request,
    ScriptCall,
    Sleep,
    TlsFailed,
)
from kvredis.redis.scripts import Missing, ScriptRegistry, missing_callee
from kvredis.redis.state import CoreState

T = TypeVar("T")
logger = logging.getLogger(__name__)

#: How many times one call is sent in all when the server keeps answering NOSCRIPT (a flush
#: racing the reload).
NOSCRIPT_ATTEMPTS = 3


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How often a failing request is retried, and the server named when giving up."""

    retries: int
    backoff: float
    #: e.g. ``"redis at 127.0.0.1:6379"`` (password masked)
    server: str

    def delay(self, attempt: int) -> float:
        """Seconds to wait before retry ``attempt + 1``: exponential, at most one second."""
        return float(min(1.0, self.backoff * (2**attempt)))

    def unavailable(self, failure: Failure) -> BackendUnavailableError:
        """The error a request raises when it gives up."""
        if isinstance(failure, AuthenticationFailed):
            return BackendAuthenticationError(_refusal(self.server, failure.message))
        if isinstance(failure, TlsFailed):
            return BackendUnavailableError(
                f"{self.server}: the server did not answer TLS ({failure.message}); use "
                "redis:// if it does not serve TLS"
            )
        if isinstance(failure, NotRedis):
            what = "no Redis/Valkey server answers (wrong port?) at"
        else:
            what = "cannot reach"
        return BackendUnavailableError(f"{what} {self.server}: {failure.message}")


#: Words of a server's reply when a client sent no password (Redis, Valkey: NOAUTH, and the
#: HELLO refusal redis-py reports without its code).
_PASSWORD_MISSING = ("NOAUTH", "Authentication required", "HELLO must be called")


def _refusal(server: str, reply: str) -> str:
    """What an authentication failure means, in words (the server's reply quoted last)."""
    if any(word in reply for word in _PASSWORD_MISSING):
        return f"{server} requires a password and none was given (authentication failed)"
    return (
        f"{server} refused the user name and password (authentication failed: wrong password, "
        f"or the user is disabled): {reply.split(chr(10), 1)[0][:120]}"
    )


@dataclass(frozen=True, slots=True)
class Session:
    """What one index client carries through its operations (shared by its threads/tasks)."""

    state: CoreState
    registry: ScriptRegistry
    policy: RetryPolicy


def _load_scripts(
    registry: ScriptRegistry,
    names: Collection[str],
    read: bool = False,
    state: CoreState | None = None,
) -> Op[None]:
    """Load what the calls of ``names`` need (:meth:`ScriptRegistry.op_reload`: each script
    once, or the function library once for every name, settled for ``state``'s namespace)."""
    yield from registry.op_reload(names, read, state)


def _by_evalsha(registry: ScriptRegistry, call: ScriptCall, refusal: ErrorReply) -> Op[Any]:
    """``call`` by EVALSHA after the server refused the function path (``refusal``): when that
    works, the registry keeps to EVALSHA from now on; when it does not either, the refusal is
    raised and the function path stays (a user allowed neither waits for the library)."""
    try:
        for attempt in range(1, NOSCRIPT_ATTEMPTS + 1):
            try:
                reply = yield registry.evalsha_command(call)
                break
            except ErrorReply as failure:
                if missing_callee(failure) is not Missing.SCRIPT or attempt == NOSCRIPT_ATTEMPTS:
                    raise
            loaded = yield registry.script_load_command(call.script, call.read)
            ScriptRegistry.check_loaded(registry, call.script, loaded)
    except ErrorReply:
        raise refusal from None
    registry.fall_back(refusal.message)
    return reply


def _script_call(
    registry: ScriptRegistry, call: ScriptCall, state: CoreState | None = None
) -> Op[Any]:
    for attempt in range(1, NOSCRIPT_ATTEMPTS + 1):
        try:
            return (yield registry.call_command(call))
        except ErrorReply as failure:
            if registry.refused(failure):
                return (yield from _by_evalsha(registry, call, failure))
            if not registry.missing(failure) or attempt == NOSCRIPT_ATTEMPTS:
                raise
        try:
            yield from _load_scripts(registry, (call.script,), call.read, state)
        except ErrorReply as failure:
            if not registry.refused(failure):
                raise
            return (yield from _by_evalsha(registry, call, failure))
    raise AssertionError("unreachable")  # pragma: no cover


def _pipeline(
    registry: ScriptRegistry, items: Sequence[ScriptCall | Command], state: CoreState | None = None
) -> Op[list[Any]]:
    def wire(positions: Sequence[int]) -> Pipeline:
        return Pipeline(
            tuple(
                registry.call_command(item) if isinstance(item, ScriptCall) else item
                for item in (items[i] for i in positions)
            )
        )

    def retry(reply: Any) -> bool:
        return registry.missing(reply) or registry.refused(reply)

    replies = list((yield wire(range(len(items)))))
    for _ in range(NOSCRIPT_ATTEMPTS - 1):
        again = [i for i, reply in enumerate(replies) if retry(reply)]
        if not again:
            break
        if any(registry.refused(replies[i]) for i in again):
            for i in again:  # one by one: each call finds its way (see _script_call)
                item = items[i]
                if isinstance(item, ScriptCall):
                    replies[i] = yield from _script_call(registry, item, state)
            continue
        calls = (items[i] for i in again)
        names = {c.script for c in calls if isinstance(c, ScriptCall)}
        yield from _load_scripts(registry, names, False, state)
        for i, reply in zip(again, (yield wire(again)), strict=True):
            replies[i] = reply
    for reply in replies:
        if isinstance(reply, Failure):
            raise reply
    return replies


def op_send(session: Session, request: Request) -> Op[Any]:
    """Send one request: scripts by FCALL or EVALSHA with a reload of what the server lacks,
    retries, error translation.

    A pipeline's reply is the list of its replies; a failed command in it fails the whole
    request (every request is idempotent, so it may be sent again). An error reply is raised as
    its :mod:`kvredis.errors` exception (:func:`typed_error`), which carries the reply as it
    came (:func:`~kvredis.redis.requests.error_reply`).
    """
    policy, registry = session.policy, session.registry
    attempt = 0
    while True:
        try:
            if isinstance(request, ScriptCall):
                return (yield from _script_call(registry, request, session.state))
            if isinstance(request, Pipeline):
                return (yield from _pipeline(registry, request.items, session.state))
            return (yield request)
        except (AuthenticationFailed, NotRedis, TlsFailed) as failure:
            raise policy.unavailable(failure) from failure
        except (ConnectionLost, ErrorReply) as failure:
            if isinstance(failure, ErrorReply) and failure.code not in TRANSIENT_REPLIES:
                raise typed_error(failure) from failure
            if attempt >= policy.retries:
                raise policy.unavailable(failure) from failure
        yield Sleep(policy.delay(attempt))
        attempt += 1


def typed_error(reply: ErrorReply) -> KVRedisError:
    """The :mod:`kvredis.errors` exception of an error reply (:func:`kvredis.errors.translate`),
    with the reply as its cause: what an operation decides from it, it reads from the reply
    (:func:`~kvredis.redis.requests.error_reply`), not from the exception's message."""
    exc = translate(reply.message)
    exc.__cause__ = reply
    return exc


def op_drive(session: Session, op: Op[T]) -> Op[T]:
    """Run ``op``, sending each of its requests with :func:`op_send`; the error a request
    raises is thrown into ``op`` (which may handle it, e.g. split a call the server refused as
    over budget) and propagates when it does not."""
    try:
        request = next(op)
        while True:
            try:
                reply = yield from op_send(session, request)
            except KVRedisError as exc:
                request = op.throw(exc)
            else:
                request = op.send(reply)
    except StopIteration as stop:
        result: T = stop.value
        return result
    finally:
        op.close()




def _info_field(info: Any, name: str) -> Any:
    """A field of an ``INFO`` reply (parsed into a mapping, or its text); bytes as str."""
    value: Any = None
    if isinstance(info, Mapping):
        value = info.get(name)
    elif isinstance(info, (bytes, str)):
        text = info.decode("utf-8", "replace") if isinstance(info, bytes) else info
        for line in text.splitlines():
            if line.startswith(f"{name}:"):
                value = line.split(":", 1)[1].strip()
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def check_not_cluster(info: Any, server: str) -> None:
    """Raise :class:`~kvredis.errors.ClusterModeError` when ``info`` (the reply of ``INFO
    cluster``) says the server runs in cluster mode: a single-server client would only get
    MOVED replies from it."""
    if str(_info_field(info, "cluster_enabled")) == "1":
        raise cluster_mode_error(server, "it reports cluster_enabled:1")


#: maxmemory-policy values under which the server may delete the index's keys (they have no TTL,
#: so the volatile-* policies never pick them).
UNSAFE_POLICY_PREFIX = "allkeys-"


def check_eviction_policy(info: Any, server: str, strict: bool) -> str | None:
    """Warn (raise with ``strict``) when the server may evict index keys on its own.

    ``info`` is the reply of ``INFO memory`` (parsed into a mapping, or its text). Under an
    ``allkeys-*`` policy Redis deletes bucket and dictionary keys when it reaches ``maxmemory``,
    and lookups then return stale entries or miss. Returns the policy found.
    """
    policy = _info_field(info, "maxmemory_policy")
    if not isinstance(policy, str):
        return None
    if policy.startswith(UNSAFE_POLICY_PREFIX):
        message = (
            f"{server} has maxmemory-policy {policy}: when it reaches maxmemory it deletes index "
            "keys, and lookups then return stale or wrong entries; set maxmemory-policy to "
            "noeviction (or a volatile-* policy), e.g. CONFIG SET maxmemory-policy noeviction"
        )
        if strict:
            raise UnsafeServerConfigError(message)
        logger.warning("%s", message)
    return policy


