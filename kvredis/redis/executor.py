"""Executors: send the requests of a sans-IO operation to a server with redis-py, nothing else.

:class:`SyncExecutor` (threads) and :class:`AsyncExecutor` (asyncio) own a connection pool. They
drive an operation (:data:`~kvredis.redis.requests.Op`): send each request it yields and resume
it with the reply, or throw into it the :class:`~kvredis.redis.requests.Failure` that stands for
the redis-py exception (:func:`failure`). Retries, script reloads and error translation are the
core's (:mod:`kvredis.redis.ops`): the operations driven here are wrapped in its combinators.

With ``read_from_replicas`` an executor also keeps a pool per replica of its server and sends
the commands marked ``read`` where :class:`~kvredis.redis.replicas.ReadRoute` says (a replica
in turn, the primary when none serves); the route is the same for both executors.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import replace
from types import ModuleType
from typing import Any, Generic, TypeVar

import redis
import redis.asyncio
import redis.asyncio.retry
import redis.retry
from redis.backoff import NoBackoff

from kvredis.redis import requests as rq
from kvredis.redis.address import RedisAddress
from kvredis.redis.config import RedisIndexConfig
from kvredis.redis.replicas import ReadRoute, Replica, ReplicaSet, Send

T = TypeVar("T")

#: What a request may raise that is the server's or the network's doing (anything else, e.g. a
#: DataError for an argument redis-py cannot encode, is a bug and propagates as it is).
_FAILURES = (
    redis.exceptions.InvalidResponse,
    redis.ConnectionError,
    redis.TimeoutError,
    redis.ResponseError,
    OSError,
    asyncio.TimeoutError,
)
#: Error codes redis-py strips from the message of the exception classes it maps them to
#: (newer redis-py versions also keep the code in ``status_code``).
_CODES: dict[type[BaseException], str] = {
    redis.exceptions.NoScriptError: "NOSCRIPT",
    redis.exceptions.ReadOnlyError: "READONLY",
    redis.exceptions.TryAgainError: "TRYAGAIN",
    redis.exceptions.MasterDownError: "MASTERDOWN",
    redis.exceptions.OutOfMemoryError: "OOM",
    redis.exceptions.NoPermissionError: "NOPERM",
    redis.exceptions.ExecAbortError: "EXECABORT",
    redis.exceptions.MovedError: "MOVED",
    redis.exceptions.AskError: "ASK",
    redis.exceptions.ClusterDownError: "CLUSTERDOWN",
    redis.exceptions.ClusterCrossSlotError: "CROSSSLOT",
}


class TlsHandshakeError(redis.ConnectionError):
    """The TLS handshake got no TLS answer: it timed out, or the peer answered in plain text."""


def _not_tls(exc: BaseException) -> bool:
    """Whether a handshake error means the peer does not speak TLS (not: a certificate it
    presented was refused, or it sent a TLS alert)."""
    if isinstance(exc, (socket.timeout, ssl.SSLEOFError, ssl.SSLZeroReturnError)):
        return True
    if isinstance(exc, ssl.SSLCertVerificationError) or not isinstance(exc, ssl.SSLError):
        return False
    return "ALERT" not in str(exc.reason or "").upper()


def _in_handshake(exc: BaseException) -> bool:
    """Whether ``exc`` was raised inside the ssl module's handshake (not by the TCP connect)."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name in ("do_handshake", "wrap_socket"):
            return True
        tb = tb.tb_next
    return False


class _TlsConnection(redis.SSLConnection):
    """redis-py's TLS connection, telling a peer that does not answer TLS apart (the handshake
    is bounded by ``socket_connect_timeout``, as redis-py does). redis-py 5.1+ wraps the socket
    in ``_wrap_socket_with_ssl``; older releases in ``_connect``, after the TCP connect."""

    def _handshake_failed(self, exc: OSError) -> TlsHandshakeError:
        if isinstance(exc, socket.timeout):
            detail = f"no TLS handshake within {self.socket_connect_timeout:g} s"
        else:
            detail = f"the TLS handshake failed: {exc}"
        return TlsHandshakeError(detail)

    def _wrap_socket_with_ssl(self, sock: Any) -> Any:
        try:
            return super()._wrap_socket_with_ssl(sock)  # type: ignore[no-untyped-call]
        except OSError as exc:
            if not _not_tls(exc):
                raise
            raise self._handshake_failed(exc) from exc

    def _connect(self) -> Any:
        if hasattr(redis.SSLConnection, "_wrap_socket_with_ssl"):
            return super()._connect()  # type: ignore[no-untyped-call]
        try:
            return super()._connect()  # type: ignore[no-untyped-call]
        except OSError as exc:
            if not (_not_tls(exc) and _in_handshake(exc)):
                raise
            raise self._handshake_failed(exc) from exc


def failure(exc: BaseException) -> rq.Failure:
    """The failure value of a redis-py exception (an error reply keeps its code in front)."""
    if isinstance(exc, TlsHandshakeError):
        return rq.TlsFailed(str(exc))
    if isinstance(exc, redis.ConnectionError) and _not_tls_cause(exc):
        return rq.TlsFailed(f"the TLS handshake failed: {exc}")
    if isinstance(exc, redis.AuthenticationError):
        return rq.AuthenticationFailed(str(exc))
    if isinstance(exc, redis.exceptions.InvalidResponse):
        return rq.NotRedis(str(exc))
    if isinstance(exc, redis.ResponseError):
        return rq.ErrorReply(reply_text(exc))
    return rq.ConnectionLost(str(exc))


def _not_tls_cause(exc: BaseException) -> bool:
    """Whether ``exc`` was caused by an SSL error meaning the peer does not speak TLS (the
    asyncio client's handshake)."""
    cause = exc.__cause__
    return isinstance(cause, ssl.SSLError) and _not_tls(cause)


def reply_text(exc: redis.ResponseError) -> str:
    """The error reply as the server sent it, code first, whichever way the installed redis-py
    reports it.

    redis-py cuts the code off the message of the replies it has an exception class for
    (``NOSCRIPT``, ``MOVED``, ``ERR``, ...) and keeps the whole reply as the message of the
    others (``BUSY``, ``KVREDIS_BUDGET``, ...). Since redis-py 8.2 the code of those others is in
    ``status_code`` too, so ``status_code`` alone does not tell whether the message still holds
    it: the message does, when its first word is the code.
    """
    text = str(exc)
    code = getattr(exc, "status_code", None) or _CODES.get(type(exc))
    if not code or text.split(" ", 1)[0] == code:
        return text
    return f"{code} {text}"


def _replies(replies: Sequence[Any]) -> list[Any]:
    return [failure(r) if isinstance(r, BaseException) else r for r in replies]


_NAMED_CLASSES: dict[type, bool] = {}


def _takes_command_name(pool: Any) -> bool:
    """Whether ``pool.get_connection`` needs the command's name (redis-py before 5.3; later
    releases warn when given one): a property of the pool's class (``pool`` is a pool or its
    class), worked out once per class."""
    cls: Any = pool if isinstance(pool, type) else type(pool)
    named = _NAMED_CLASSES.get(cls)
    if named is None:
        try:
            parameter = inspect.signature(cls.get_connection).parameters.get("command_name")
        except (TypeError, ValueError):  # pragma: no cover - a pool without a signature
            named = True
        else:
            named = parameter is not None and parameter.default is inspect.Parameter.empty
        _NAMED_CLASSES[cls] = named
    return named


#: What the pools below pass to the base class's ``get_connection`` when their caller gave
#: nothing: a command name for redis-py before 5.3 (which requires one and ignores it), nothing
#: after (which warns when given one).
_SYNC_NAME = ("PING",) if _takes_command_name(redis.BlockingConnectionPool) else ()
_ASYNC_NAME = ("PING",) if _takes_command_name(redis.asyncio.BlockingConnectionPool) else ()


def _check_sync(pool: Any, connection: Any) -> None:
    """What redis-py's pool checks before it hands out a connection: connected, and nothing
    left to read on its socket (a reply a failed exchange left, or the server closed it): such a
    connection is reconnected, and one still not ready raises ``ConnectionError``."""
    ensure = getattr(pool, "ensure_connection", None)  # newer redis-py: its own check
    if ensure is not None:
        ensure(connection)
        return
    connection.connect()
    try:
        if connection.can_read():
            raise redis.ConnectionError("Connection has data")
    except (redis.ConnectionError, redis.TimeoutError, OSError):
        connection.disconnect()
        connection.connect()
        if connection.can_read():
            raise redis.ConnectionError("Connection not ready") from None


class _ReusingPool(redis.BlockingConnectionPool):
    """redis-py's blocking pool, handing a released connection straight to the next caller.

    redis-py's own way takes a connection out of a queue and puts it back under locks, records
    each move for its observability hooks and checks the process id: about 12 µs of the
    caller's CPU per call on a small machine, a quarter of a whole ``PING``'s (and as much
    again on asyncio). Here a released connection goes onto a stack (:attr:`idle`) the next
    :meth:`get_connection` pops it from; it is checked as redis-py checks it (connected,
    nothing left to read), and the base class still counts it in use, so the pool never holds
    more than ``max_connections``. A caller that finds the stack empty waits in the base class
    as before, and while one waits every release goes to the base class, which wakes it: a
    connection never idles on the stack while a caller waits for one. A forked child starts
    with an empty stack (the base class resets the pool for it)."""

    def reset(self) -> None:
        base: Any = super()
        base.reset()
        #: connections released and not taken again (in use for the base class), last on top
        self.idle: list[Any] = []
        self._waiting = 0
        self._idle_lock = threading.Lock()

    def get_connection(self, *args: Any, **options: Any) -> Any:
        base: Any = super()
        if self.pid != os.getpid():  # a forked child: the base class resets the pool
            return base.get_connection(*(args or _SYNC_NAME), **options)
        try:
            connection = self.idle.pop()
        except IndexError:
            with self._idle_lock:
                try:
                    connection = self.idle.pop()  # released since
                except IndexError:
                    connection = None
                    self._waiting += 1
            if connection is None:
                try:
                    return base.get_connection(*(args or _SYNC_NAME), **options)
                finally:
                    with self._idle_lock:
                        self._waiting -= 1
        try:
            _check_sync(self, connection)
        except BaseException:
            base.release(connection)
            raise
        return connection

    def release(self, connection: Any) -> None:
        if self.pid == os.getpid():
            with self._idle_lock:
                if not self._waiting:
                    self.idle.append(connection)
                    return
        base: Any = super()
        base.release(connection)


class _AsyncReusingPool(redis.asyncio.BlockingConnectionPool):
    """:class:`_ReusingPool` for asyncio (one event loop: no lock needed between a release and
    a caller that starts waiting, as neither awaits in between)."""

    def __init__(self, *args: Any, **options: Any) -> None:
        super().__init__(*args, **options)
        self.idle: list[Any] = []
        self._waiting = 0

    def reset(self) -> None:
        base: Any = super()
        base.reset()
        self.idle = []

    async def get_connection(self, *args: Any, **options: Any) -> Any:
        base: Any = super()
        try:
            connection = self.idle.pop()
        except IndexError:
            self._waiting += 1
            try:
                return await base.get_connection(*(args or _ASYNC_NAME), **options)
            finally:
                self._waiting -= 1
        try:
            await self.ensure_connection(connection)
        except BaseException:
            await base.release(connection)
            raise
        return connection

    async def release(self, connection: Any) -> None:
        if not self._waiting:
            self.idle.append(connection)
            return
        base: Any = super()
        await base.release(connection)


def _pool(config: RedisIndexConfig, address: RedisAddress, lib: ModuleType, retry: Any) -> Any:
    """A blocking connection pool of ``lib`` (``redis`` or ``redis.asyncio``) for ``config``
    that hands released connections straight back (:class:`_ReusingPool`)."""
    kwargs: dict[str, Any] = {
        "db": address.db,
        "username": config.username if config.username is not None else address.username,
        "password": config.password if config.password is not None else address.password,
        "socket_timeout": config.socket_timeout,
        "socket_connect_timeout": config.connect_timeout,
        "client_name": config.client_name,
        # the ops decode RESP2 replies: not left to the library's default protocol
        "protocol": 2,
    }
    if address.transport == "unix":
        kwargs["path"] = address.path
        connection_class = lib.UnixDomainSocketConnection
    else:
        kwargs["host"] = address.host
        kwargs["port"] = address.port
        if address.tls:
            connection_class = _TlsConnection if lib is redis else lib.SSLConnection
        else:
            connection_class = lib.Connection
    if address.tls:
        kwargs.update(
            ssl_ca_certs=config.tls_ca_file,
            ssl_certfile=config.tls_cert_file,
            ssl_keyfile=config.tls_key_file,
            ssl_cert_reqs="required" if config.tls_verify else "none",
            ssl_check_hostname=config.tls_check_hostname and config.tls_verify,
        )
    pool_class = _ReusingPool if lib is redis else _AsyncReusingPool
    return pool_class(
        connection_class=connection_class,
        max_connections=config.pool_size,
        timeout=config.pool_timeout,
        retry=retry(NoBackoff(), 0),
        **kwargs,
    )


class _Driven(Generic[T]):
    """An operation being driven: resume it with an outcome, get its next request."""

    __slots__ = ("op", "result")

    def __init__(self, op: rq.Op[T]) -> None:
        self.op = op

    def __enter__(self) -> _Driven[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.op.close()

    def resume(self, outcome: Any) -> rq.Request | None:
        """Send ``outcome`` (thrown if a Failure); the next request, or None once it returned."""
        try:
            if isinstance(outcome, rq.Failure):
                return self.op.throw(outcome)
            return self.op.send(outcome)
        except StopIteration as stop:
            self.result: T = stop.value
            return None


def _unsendable(request: object) -> TypeError:
    return TypeError(f"an executor sends commands, pipelines and sleeps, not {request!r}")


def _replica_address(address: RedisAddress, replica: Replica) -> RedisAddress:
    """The address of a replica: the primary's credentials, database and TLS, its host/port."""
    return replace(
        address,
        transport="tcp",
        host=replica.host,
        port=replica.port,
        path="",
        display=f"replica {replica}",
        seeds=((replica.host, replica.port),),
    )


try:  # redis-py's own dependency when installed with hiredis (kvredis asks for it)
    import hiredis as _hiredis
except ImportError:  # pragma: no cover - redis-py packs then
    _hiredis = None  # type: ignore[assignment]

#: hiredis's packer (``None`` without hiredis): one C call from the arguments as the operations
#: give them (bytes, str, int, float), where redis-py encodes each argument in Python first; a
#: ``TypeError`` for any other argument (a memoryview), before anything is sent.
hiredis_pack: Callable[[Any], bytes] | None = None if _hiredis is None else _hiredis.pack_command

#: The script calls: the hot commands, sent through :func:`_send_packed`. redis-py has no reply
#: callback for them, so their reply is the parsed RESP2 reply either way.
_SCRIPT_VERBS = frozenset({"FCALL", "FCALL_RO", "EVALSHA"})


def _packed_script_call(args: tuple[Any, ...]) -> bytes | None:
    """``args`` packed by hiredis when they are a script call it can pack (sent then through
    :func:`_send_packed`), else ``None``: another command, or an argument hiredis does not take
    (a memoryview), which redis-py's ``execute_command`` sends."""
    if hiredis_pack is None or args[0] not in _SCRIPT_VERBS:
        return None
    try:
        return hiredis_pack(args)
    except TypeError:
        return None


def _send_packed(client: redis.Redis, name: Any, packed: bytes, named: bool) -> Any:
    """Send one command packed by hiredis (``hiredis.pack_command``, one C call) on a
    connection of ``client``'s pool and read its reply: what ``client.execute_command`` does for
    a command without a reply callback, without its per-argument Python encoding (a script
    call's 20-30 arguments cost more to encode that way than the round trip itself).

    A connection whose exchange failed is closed, as redis-py does: only an error reply, read
    whole, leaves it usable."""
    pool: Any = client.connection_pool
    conn: Any = pool.get_connection(name) if named else pool.get_connection()
    try:
        conn.send_packed_command([packed])
        return conn.read_response()
    except redis.ResponseError:
        raise
    except BaseException:
        conn.disconnect()
        raise
    finally:
        pool.release(conn)


def send_commands(client: redis.Redis, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
    """Send ``commands`` (commands whose RESP2 reply needs no redis-py callback: ``RPUSH``,
    ``DEL``, ``LRANGE``...) in one write on one connection of ``client``'s pool, packed by
    hiredis, and read their replies in order: a pipeline without redis-py's per-command and
    per-argument Python work (through redis-py's pipeline without hiredis, or for an argument
    hiredis does not take). An error reply raises (the first), once every reply was read."""
    if not commands:
        return []
    packed: list[bytes] | None = None
    if hiredis_pack is not None:
        try:
            packed = [hiredis_pack(command) for command in commands]
        except TypeError:
            packed = None
    if packed is None:
        pipe: Any = client.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        return list(pipe.execute())
    pool: Any = client.connection_pool
    named = _takes_command_name(pool)
    conn: Any = pool.get_connection(commands[0][0]) if named else pool.get_connection()
    replies: list[Any] = []
    error: redis.ResponseError | None = None
    try:
        conn.send_packed_command(packed if len(packed) == 1 else [b"".join(packed)])
        for _ in packed:
            try:
                replies.append(conn.read_response())
            except redis.ResponseError as exc:
                error = error or exc
                replies.append(exc)
    except BaseException:
        conn.disconnect()
        raise
    finally:
        pool.release(conn)
    if error is not None:
        raise error
    return replies


async def _send_packed_async(
    client: redis.asyncio.Redis, name: Any, packed: bytes, named: bool
) -> Any:
    """:func:`_send_packed` on an asyncio connection (a cancelled exchange closes it too)."""
    pool: Any = client.connection_pool
    conn: Any = await (pool.get_connection(name) if named else pool.get_connection())
    try:
        await conn.send_packed_command([packed])
        return await conn.read_response()
    except redis.ResponseError:
        raise
    except BaseException:
        await conn.disconnect()
        raise
    finally:
        await pool.release(conn)


def _queued(pipe: Any, request: rq.Pipeline) -> Any:
    for command in request.items:
        if not isinstance(command, rq.Command):
            raise _unsendable(command)
        pipe.execute_command(*command.args)
    return pipe


class SyncExecutor:
    """Sends requests over a pool of blocking connections; thread-safe."""

    def __init__(self, config: RedisIndexConfig) -> None:
        self._config = config
        self._address = config.parsed_address()
        self.pool = _pool(config, self._address, redis, redis.retry.Retry)
        self.client = redis.Redis(connection_pool=self.pool)
        self._named = _takes_command_name(self.pool)
        self.round_trips = 0
        self._lock = threading.Lock()
        #: The replicas reads go to (``read_from_replicas``), else None.
        self.replicas = (
            ReplicaSet(spread=config.read_from_replicas == "spread")
            if config.read_from_replicas
            else None
        )
        self._replica_clients: dict[Replica, redis.Redis] = {}

    def run(self, op: rq.Op[T]) -> T:
        """Drive ``op`` to its end and return its result."""
        reads = None if self.replicas is None else ReadRoute(self.replicas)
        with _Driven(op) as driven:
            request = driven.resume(None)
            while request is not None:
                if reads is not None and isinstance(request, rq.Command) and request.read:
                    outcome = self._routed(reads.route(request))
                else:
                    outcome = self._outcome(request, self.client)
                request = driven.resume(outcome)
            return driven.result

    def _routed(self, route: Generator[Send, Any, Any]) -> Any:
        outcome = None
        try:
            while True:
                replica, command = route.send(outcome)
                outcome = self._outcome(command, self._client_of(replica))
        except StopIteration as stop:
            return stop.value

    def _client_of(self, replica: Replica | None) -> redis.Redis:
        if replica is None:
            return self.client
        with self._lock:
            client = self._replica_clients.get(replica)
            if client is None:
                address = _replica_address(self._address, replica)
                pool = _pool(self._config, address, redis, redis.retry.Retry)
                client = self._replica_clients[replica] = redis.Redis(connection_pool=pool)
            return client

    def _outcome(self, request: rq.Request, client: redis.Redis) -> Any:
        if not isinstance(request, rq.Sleep):
            with self._lock:
                self.round_trips += 1
        try:
            if isinstance(request, rq.Command):
                args = request.args
                packed = _packed_script_call(args)
                if packed is not None:
                    return _send_packed(client, args[0], packed, self._named)
                execute: Any = client.execute_command
                return execute(*args)
            if isinstance(request, rq.Pipeline):
                pipe = _queued(client.pipeline(transaction=False), request)
                return _replies(pipe.execute(raise_on_error=False))
            if isinstance(request, rq.Sleep):
                return time.sleep(request.seconds)
        except _FAILURES as exc:
            return failure(exc)
        raise _unsendable(request)

    def close(self) -> None:
        """Close the connections."""
        for client in (self.client, *self._replica_clients.values()):
            client.close()
            client.connection_pool.disconnect()


class AsyncExecutor:
    """Sends requests over a pool of asyncio connections (use it from one event loop)."""

    def __init__(self, config: RedisIndexConfig) -> None:
        self._config = config
        self._address = config.parsed_address()
        self.pool = _pool(config, self._address, redis.asyncio, redis.asyncio.retry.Retry)
        self.client = redis.asyncio.Redis(connection_pool=self.pool)
        self._named = _takes_command_name(self.pool)
        self.round_trips = 0
        #: See :attr:`SyncExecutor.replicas`.
        self.replicas = (
            ReplicaSet(spread=config.read_from_replicas == "spread")
            if config.read_from_replicas
            else None
        )
        self._replica_clients: dict[Replica, redis.asyncio.Redis] = {}

    async def run(self, op: rq.Op[T]) -> T:
        """Drive ``op`` to its end and return its result."""
        reads = None if self.replicas is None else ReadRoute(self.replicas)
        with _Driven(op) as driven:
            request = driven.resume(None)
            while request is not None:
                if reads is not None and isinstance(request, rq.Command) and request.read:
                    outcome = await self._routed(reads.route(request))
                else:
                    outcome = await self._outcome(request, self.client)
                request = driven.resume(outcome)
            return driven.result

    async def _routed(self, route: Generator[Send, Any, Any]) -> Any:
        outcome = None
        try:
            while True:
                replica, command = route.send(outcome)
                outcome = await self._outcome(command, self._client_of(replica))
        except StopIteration as stop:
            return stop.value

    def _client_of(self, replica: Replica | None) -> redis.asyncio.Redis:
        if replica is None:
            return self.client
        client = self._replica_clients.get(replica)
        if client is None:
            address = _replica_address(self._address, replica)
            pool = _pool(self._config, address, redis.asyncio, redis.asyncio.retry.Retry)
            client = self._replica_clients[replica] = redis.asyncio.Redis(connection_pool=pool)
        return client

    async def _outcome(self, request: rq.Request, client: redis.asyncio.Redis) -> Any:
        if not isinstance(request, rq.Sleep):
            self.round_trips += 1
        try:
            if isinstance(request, rq.Command):
                args = request.args
                packed = _packed_script_call(args)
                if packed is not None:
                    return await _send_packed_async(client, args[0], packed, self._named)
                execute: Any = client.execute_command
                return await execute(*args)
            if isinstance(request, rq.Pipeline):
                pipe = _queued(client.pipeline(transaction=False), request)
                return _replies(await pipe.execute(raise_on_error=False))
            if isinstance(request, rq.Sleep):
                return await asyncio.sleep(request.seconds)
        except _FAILURES as exc:
            return failure(exc)
        raise _unsendable(request)

    async def close(self) -> None:
        """Close the connections."""
        for client in (self.client, *self._replica_clients.values()):
            await client.aclose()
            await client.connection_pool.disconnect()
