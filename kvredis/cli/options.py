"""What every ``kvredis`` command shares: logging, the Redis target, token input, output, errors.

- ``--log-level`` and ``-v`` are accepted before and after the subcommand (the later one wins);
- ``--redis URL`` (``KVREDIS_REDIS_URL``), ``--namespace`` (``KVREDIS_NAMESPACE``), the password
  from ``KVREDIS_REDIS_PASSWORD`` or ``--password-file`` (``KVREDIS_REDIS_PASSWORD_FILE``); a
  password never appears in output or logs;
- token ids from ``--tokens`` (commas and/or spaces), ``--tokens-file FILE`` or a bare ``-``
  (stdin);
- tables for people, ``--json`` for scripts;
- every failure is one line on stderr and a non-zero exit.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import click

from kvredis.errors import (
    BackendAuthenticationError,
    BackendUnavailableError,
    ConfigError,
    KVRedisError,
)

__all__ = [
    "DEFAULT_REDIS_URL",
    "LOG_LEVELS",
    "Prompt",
    "RedisTarget",
    "check_existing_namespace",
    "check_namespace_option",
    "check_redis_url",
    "echo_json",
    "explicit_log_level",
    "handle_errors",
    "hashing_options",
    "json_option",
    "logging_options",
    "parse_tokens",
    "password_file_option",
    "progress_bar",
    "prompt_options",
    "read_tokens",
    "redis_options",
    "table",
    "token_options",
    "unavailable_message",
    "unknown_environment",
    "warn_unknown_environment",
]

F = TypeVar("F", bound=Callable[..., Any])

LOG_LEVELS = ("debug", "info", "warning", "error")
_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_META_LEVEL = "kvredis.cli.log_level"
_META_VERBOSE = "kvredis.cli.verbose"


# -- logging ------------------------------------------------------------------------------------


def _apply_logging(ctx: click.Context) -> None:
    root_ctx = ctx.find_root()
    level_name: str | None = root_ctx.meta.get(_META_LEVEL)
    verbose: int = root_ctx.meta.get(_META_VERBOSE, 0)
    if level_name is not None:
        level = getattr(logging, level_name.upper())
    else:
        level = logging.WARNING - 10 * min(verbose, 2)
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_LOG_FORMAT))
        root.addHandler(handler)
    root.setLevel(level)
    logging.getLogger("kvredis").setLevel(level)


def _set_level(ctx: click.Context, _param: click.Parameter, value: str | None) -> None:
    if value is not None:
        ctx.find_root().meta[_META_LEVEL] = value.lower()
    _apply_logging(ctx)


def _add_verbose(ctx: click.Context, _param: click.Parameter, value: int) -> None:
    if value:
        meta = ctx.find_root().meta
        meta[_META_VERBOSE] = meta.get(_META_VERBOSE, 0) + value
    _apply_logging(ctx)


def explicit_log_level(ctx: click.Context) -> bool:
    """Whether ``--log-level`` or ``-v`` was given on the command line."""
    meta = ctx.find_root().meta
    return meta.get(_META_LEVEL) is not None or bool(meta.get(_META_VERBOSE))


def logging_params() -> list[click.Parameter]:
    """``--log-level`` and ``-v``, as parameters (for commands defined elsewhere)."""
    return [
        click.Option(
            ["--log-level"],
            type=click.Choice(LOG_LEVELS, case_sensitive=False),
            envvar="KVREDIS_LOG_LEVEL",
            callback=_set_level,
            expose_value=False,
            is_eager=True,
            help="Log level (default warning; env KVREDIS_LOG_LEVEL).",
        ),
        click.Option(
            ["-v", "--verbose"],
            count=True,
            callback=_add_verbose,
            expose_value=False,
            is_eager=True,
            help="More logging: -v info, -vv debug (anywhere on the line).",
        ),
    ]


def logging_options(f: F) -> F:
    """Add ``--log-level`` and ``-v`` to a command."""
    cmd_params = getattr(f, "__click_params__", [])
    cmd_params.extend(logging_params())
    f.__click_params__ = cmd_params  # type: ignore[attr-defined]
    return f


# -- the environment ----------------------------------------------------------------------------

#: The environment variables the command line reads.
ENVIRONMENT = (
    "KVREDIS_REDIS_URL",
    "KVREDIS_NAMESPACE",
    "KVREDIS_REDIS_PASSWORD",
    "KVREDIS_REDIS_PASSWORD_FILE",
    "KVREDIS_LOG_LEVEL",
)
#: Prefixes of the variables kvredis's own test suite and benchmarks read.
_TOOL_PREFIXES = ("KVREDIS_TEST_", "KVREDIS_BENCH_", "KVREDIS_ENGINE_", "KVREDIS_MODEL_")


def unknown_environment(environ: Mapping[str, str]) -> list[str]:
    """A line for each ``KVREDIS_*`` variable of ``environ`` that the command line does not
    read (a misspelled ``KVREDIS_REDIS_URL`` would otherwise go unnoticed)."""
    import difflib

    lines = []
    for name in sorted(environ):
        if not name.startswith("KVREDIS_") or name in ENVIRONMENT:
            continue
        if name.startswith(_TOOL_PREFIXES):
            continue
        close = difflib.get_close_matches(name, ENVIRONMENT, n=1, cutoff=0.7)
        hint = f" (did you mean {close[0]}?)" if close else ""
        lines.append(
            f"the environment variable {name} is not one kvredis reads{hint}; it reads "
            f"{', '.join(ENVIRONMENT)}"
        )
    return lines


def warn_unknown_environment() -> None:
    """Log :func:`unknown_environment` of this process at WARNING."""
    import os

    for line in unknown_environment(os.environ):
        logging.getLogger("kvredis.cli").warning("%s", line)


# -- the Redis target ---------------------------------------------------------------------------


class RedisTarget:
    """The server and namespace a command works on (from ``--redis``, ``--namespace``, ...)."""

    def __init__(self, url: str, namespace: str, password: str | None) -> None:
        self.url = url
        self.namespace = namespace
        self.password = password
        #: the namespace may have a name the rules refuse (one an earlier kvredis created):
        #: for the commands that move or delete such a namespace (rename, drop, migrate)
        self.existing = False

    @property
    def shown(self) -> str:
        """The address with any password masked (for messages)."""
        from kvredis.redis.address import mask_password

        return mask_password(self.url)

    def config(self, **overrides: Any) -> Any:
        """The :class:`~kvredis.redis.config.RedisIndexConfig` of this target."""
        from kvredis.redis.config import RedisIndexConfig

        kwargs: dict[str, Any] = {"address": self.url, "namespace": self.namespace}
        if self.password is not None:
            kwargs["password"] = self.password
        kwargs.update(overrides)
        named = kwargs["namespace"]
        if self.existing:
            kwargs["namespace"] = "kvblock"
        try:
            config = RedisIndexConfig(**kwargs)
            if self.existing:
                from kvredis.redis.config import config_for_existing

                config = config_for_existing(config, named)
        except (ConfigError, ValueError) as exc:
            raise click.BadParameter(str(exc), param_hint="--redis") from None
        return config


def check_namespace_option(
    _ctx: click.Context, _param: click.Parameter, value: str | None
) -> str | None:
    """Validate ``--namespace`` (blamed on ``--namespace``, not on ``--redis``)."""
    if value is None:
        return None
    from kvredis.redis.layout import check_namespace_name

    try:
        return check_namespace_name(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def check_existing_namespace(value: str, hint: str = "NAMESPACE") -> str:
    """Validate the name of an existing namespace to move or delete: any name an earlier
    kvredis could create (also one :func:`check_namespace_option` refuses for new use)."""
    from kvredis.redis.layout import check_namespace

    try:
        return check_namespace(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint=hint) from None


def check_redis_url(_ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    if value is None:
        return None
    from kvredis.redis.address import parse_address

    try:
        parse_address(value)
    except ConfigError as exc:
        raise click.BadParameter(str(exc)) from None
    return value


def read_password(password_file: str | None) -> str | None:
    """The password: from ``password_file`` (first line), else ``KVREDIS_REDIS_PASSWORD``."""
    import os

    if password_file:
        try:
            with open(password_file, encoding="utf-8") as fh:
                return fh.readline().rstrip("\r\n") or None
        except OSError as exc:
            raise click.BadParameter(
                f"cannot read {password_file}: {exc.strerror}", param_hint="--password-file"
            ) from None
    return os.environ.get("KVREDIS_REDIS_PASSWORD") or None


#: ``--password-file FILE`` (env ``KVREDIS_REDIS_PASSWORD_FILE``), read by :func:`read_password`.
password_file_option = click.option(
    "--password-file",
    metavar="FILE",
    envvar="KVREDIS_REDIS_PASSWORD_FILE",
    help="Read the Redis password from FILE (else env KVREDIS_REDIS_PASSWORD).",
)


#: The server every command works on unless ``--redis`` (``KVREDIS_REDIS_URL``) names another.
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379"


def redis_options(
    default_namespace: str | None = "kvblock",
    url_required: bool = False,
    namespace_option: bool = True,
) -> Callable[[F], F]:
    """Add ``--redis``, ``--namespace`` and ``--password-file``; pass a ``target``.

    With ``url_required`` the address defaults to :data:`DEFAULT_REDIS_URL` (the rule of every
    command that works on a server); without, a missing ``--redis`` passes ``target=None`` (the
    demo, which runs on an embedded index then). Without ``namespace_option`` there is no
    ``--namespace`` (a command that takes its namespaces as arguments).
    """

    def decorate(f: F) -> F:
        @functools.wraps(f)
        def wrapper(
            *args: Any,
            redis_url: str | None,
            password_file: str | None,
            **kwargs: Any,
        ) -> Any:
            namespace = kwargs.get("namespace") if namespace_option else None
            target = None
            if redis_url is not None:
                target = RedisTarget(
                    redis_url, namespace or "kvblock", read_password(password_file)
                )
            return f(*args, target=target, **kwargs)

        decorated: Any = password_file_option(wrapper)
        if namespace_option:
            decorated = click.option(
                "--namespace",
                envvar="KVREDIS_NAMESPACE",
                default=default_namespace,
                show_default=default_namespace is not None,
                callback=check_namespace_option,
                help="Key namespace (env KVREDIS_NAMESPACE).",
            )(decorated)
        return click.option(  # type: ignore[no-any-return]
            "--redis",
            "redis_url",
            metavar="URL",
            envvar="KVREDIS_REDIS_URL",
            default=None if not url_required else DEFAULT_REDIS_URL,
            show_default=url_required,
            callback=check_redis_url,
            help="Redis/Valkey address (env KVREDIS_REDIS_URL).",
        )(decorated)

    return decorate


# -- token input --------------------------------------------------------------------------------

# Elements are separated by one comma (with any whitespace around it) or by whitespace alone.
_TOKEN_SPLIT = re.compile(r"\s*,\s*|\s+")
_TOKEN_ID = re.compile(r"-?[0-9]+")
_NOT_A_TOKEN = "is not a token id (expected integers separated by commas or spaces)"
#: Token ids are uint32, as the engines send them.
MAX_TOKEN_ID = 2**32 - 1


def parse_tokens(text: str, where: str = "--tokens") -> list[int]:
    """Token ids from text: separated by commas and/or whitespace, or a JSON array of integers.

    Every malformed element is an error saying it ``is not a token id``: an empty element
    (``1,,2`` or a trailing comma), anything but ASCII digits (full-width digits, ``1.0``,
    ``0x10``), a JSON element that is not an integer (``"3"``, ``true``, ``1.5``); so is an id
    outside ``0..2**32-1``.
    """
    stripped = text.strip()
    if stripped.startswith("["):
        try:
            values = json.loads(stripped)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise click.BadParameter(f"not a JSON array: {exc}", param_hint=where) from None
        if not isinstance(values, list):
            raise click.BadParameter("expected a JSON array of token ids", param_hint=where)
        for n, value in enumerate(values):
            if isinstance(value, bool) or not isinstance(value, int):
                raise click.BadParameter(
                    f"element {n} ({json.dumps(value)}) {_NOT_A_TOKEN}", param_hint=where
                )
        parts: list[str] = [str(v) for v in values]
    else:
        parts = _TOKEN_SPLIT.split(stripped) if stripped else []
    tokens = []
    for n, part in enumerate(parts):
        if not part:
            raise click.BadParameter(
                f"element {n} is empty (two commas in a row, or a comma at an end): "
                f"'' {_NOT_A_TOKEN}",
                param_hint=where,
            )
        if not part.isascii() or _TOKEN_ID.fullmatch(part) is None:
            raise click.BadParameter(f"{part!r} {_NOT_A_TOKEN}", param_hint=where)
        value = int(part)
        if value < 0:
            raise click.BadParameter(f"token id {value} is negative", param_hint=where)
        if value > MAX_TOKEN_ID:
            raise click.BadParameter(
                f"token id {value} is out of range (0..{MAX_TOKEN_ID})", param_hint=where
            )
        tokens.append(value)
    if not tokens:
        raise click.BadParameter("no token ids given", param_hint=where)
    return tokens


def read_tokens(tokens: str | None, tokens_file: str | None, stdin: bool = False) -> list[int]:
    """The tokens of ``--tokens``, ``--tokens-file`` or a bare ``-`` (``stdin``).

    ``-`` as the value of either option reads stdin too.
    """
    if sum((tokens is not None, tokens_file is not None, stdin)) != 1:
        raise click.UsageError("give exactly one of --tokens, --tokens-file and -")
    if stdin:
        tokens = "-"
    if tokens is not None and tokens != "-":
        return parse_tokens(tokens)
    path = tokens_file if tokens_file is not None else "-"
    where = "--tokens-file" if tokens_file is not None else "--tokens"
    if path == "-":
        return parse_tokens(sys.stdin.read(), "stdin")
    try:
        with open(path, encoding="utf-8") as fh:
            return parse_tokens(fh.read(), where)
    except OSError as exc:
        raise click.BadParameter(f"cannot read {path}: {exc.strerror}", param_hint=where) from None


def _check_model(_ctx: click.Context, _param: click.Parameter, value: str) -> str:
    if not value.strip():
        raise click.BadParameter("must not be empty")
    return value


def _check_dash(_ctx: click.Context, _param: click.Parameter, value: str | None) -> bool:
    if value is not None and value != "-":
        raise click.BadParameter(
            f"{value!r}: the only argument is '-' (read the token ids from stdin); "
            "use --tokens-file for a file"
        )
    return value is not None


def token_options(f: F) -> F:
    """``--model``, ``--tokens``, ``--tokens-file`` and an optional ``-`` argument (stdin)."""
    f = click.argument("stdin", metavar="[-]", required=False, callback=_check_dash)(f)
    f = click.option(
        "--tokens-file",
        metavar="FILE",
        help="Read the token ids from FILE ('-': stdin); same formats as --tokens.",
    )(f)
    f = click.option(
        "--tokens",
        metavar="IDS",
        help="Token ids: '1,2,3', '1 2 3' or a JSON array; '-' reads stdin.",
    )(f)
    return click.option(
        "--model", required=True, callback=_check_model, help="Model name the keys belong to."
    )(f)


def _merge_seed(ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    if value is not None:
        previous = ctx.meta.get("kvredis.cli.hash_seed")
        if previous is not None and previous != value:
            raise click.BadParameter("--seed is an old name of --hash-seed; give one of them")
        ctx.meta["kvredis.cli.hash_seed"] = value
    return value


def hashing_options(f: F) -> F:
    """``--block-size``, ``--hash-algo``, ``--hash-seed`` (old name ``--seed``, hidden)."""
    from kvredis.hashing import HASH_ALGOS

    f = click.option("--seed", "old_seed", hidden=True, callback=_merge_seed)(f)
    f = click.option(
        "--hash-seed",
        callback=_merge_seed,
        help="Seed of the block-key chain (the engine's PYTHONHASHSEED).",
    )(f)
    f = click.option(
        "--hash-algo", type=click.Choice(HASH_ALGOS), default="xxh3_64", show_default=True
    )(f)
    return click.option(
        "--block-size",
        type=click.IntRange(min=1),
        default=16,
        show_default=True,
        help="Tokens per block.",
    )(f)


def token_processor(block_size: int, hash_algo: str, hash_seed: str | None) -> Any:
    """The ChunkedTokenDatabase of the hashing options."""
    from kvredis.hashing import ChunkedTokenDatabase, TokenProcessorConfig

    try:
        return ChunkedTokenDatabase(
            TokenProcessorConfig(
                block_size_tokens=block_size, hash_seed=hash_seed or "", hash_algo=hash_algo
            )
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None


class Prompt:
    """The token ids and block-key settings of ``keys``, ``lookup`` and ``score``."""

    def __init__(self, model: str, tokens: list[int], block_size: int, processor: Any) -> None:
        self.model = model
        self.tokens = tokens
        self.block_size = block_size
        self.processor = processor

    def block_keys(self, parent: int = 0) -> list[int]:
        """The request keys of the prompt's full blocks, chained from ``parent``."""
        try:
            keys: list[int] = self.processor.tokens_to_kv_block_keys(
                parent, self.tokens, self.model
            )
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None
        return keys


def prompt_options(f: F) -> F:
    """:func:`token_options` and :func:`hashing_options`, passed as one ``prompt`` (a Prompt)."""

    @functools.wraps(f)
    def wrapper(
        *args: Any,
        model: str,
        tokens: str | None,
        tokens_file: str | None,
        block_size: int,
        hash_algo: str,
        hash_seed: str | None,
        old_seed: str | None,
        stdin: bool,
        **kwargs: Any,
    ) -> Any:
        ids = read_tokens(tokens, tokens_file, stdin)
        processor = token_processor(block_size, hash_algo, hash_seed or old_seed)
        return f(*args, prompt=Prompt(model, ids, block_size, processor), **kwargs)

    return token_options(hashing_options(wrapper))  # type: ignore[return-value]


# -- output -------------------------------------------------------------------------------------


def json_option(f: F) -> F:
    """``--json``: machine-readable output."""
    return click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")(f)


def echo_json(data: Any) -> None:
    """Print ``data`` as indented JSON."""
    click.echo(json.dumps(data, indent=2, sort_keys=False, default=str))


def table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A plain text table: left-aligned text, right-aligned numbers."""
    body = [[str(c) for c in row] for row in rows]
    numeric = [all(_is_number(r[i]) for r in body) and bool(body) for i in range(len(headers))]
    widths = [max([len(h)] + [len(r[i]) for r in body]) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        out = [
            c.rjust(w) if num else c.ljust(w)
            for c, w, num in zip(cells, widths, numeric, strict=True)
        ]
        return "  ".join(out).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(list(headers)), rule, *(line(r) for r in body)])


def _is_number(text: str) -> bool:
    try:
        float(text.replace(",", ""))
    except ValueError:
        return False
    return True


class _Bar:
    """A progress callback ``(done, total)`` drawing a click progress bar on stderr (a TTY)."""

    def __init__(self, label: str, enabled: bool) -> None:
        self.label = label
        self.enabled = enabled
        self._bar: Any = None
        self._shown = 0

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled or total <= 0:
            return
        if self._bar is None:
            self._bar = click.progressbar(
                length=total, label=self.label, file=sys.stderr, show_eta=False
            )
            self._bar.__enter__()
        done = min(done, total)
        self._bar.update(done - self._shown)
        self._shown = done

    def close(self) -> None:
        if self._bar is not None:
            self._bar.__exit__(None, None, None)
            self._bar = None


def progress_bar(label: str, no_progress: bool = False) -> _Bar:
    """A progress callback, drawing only when stderr is a terminal and not ``no_progress``."""
    return _Bar(label, not no_progress and sys.stderr.isatty())


# -- errors -------------------------------------------------------------------------------------


def handle_errors(f: F) -> F:
    """Turn every failure into one line on stderr and exit status 1 (usage errors: 2)."""

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return f(*args, **kwargs)
        except click.ClickException:
            raise
        except BackendUnavailableError as exc:
            raise click.ClickException(unavailable_message(exc)) from None
        except KVRedisError as exc:
            raise click.ClickException(f"{type(exc).__name__}: {exc}") from None
        except Exception as exc:
            failure = _failure_error(exc, kwargs.get("target"))
            if failure is not None:  # a request's failure that no session translated
                raise click.ClickException(failure) from None
            if isinstance(exc, OSError) and not isinstance(exc, ConnectionError) and exc.filename:
                raise click.ClickException(  # a local file, not the server
                    f"cannot access {exc.filename}: {exc.strerror or exc}"
                ) from None
            if _is_redis_error(exc) or isinstance(exc, OSError):
                target = kwargs.get("target")
                where = f" at {target.shown}" if isinstance(target, RedisTarget) else ""
                raise click.ClickException(
                    f"unexpected reply from the server{where} (is it Redis or Valkey?): {exc}"
                ) from None
            raise

    return wrapper  # type: ignore[return-value]


#: How the command line takes a password (said when the server asks for one).
PASSWORD_HINT = (
    "give the password with KVREDIS_REDIS_PASSWORD, --password-file FILE (env "
    "KVREDIS_REDIS_PASSWORD_FILE) or in the address: --redis redis://USER:PASSWORD@HOST:PORT "
    "(USER may be empty)"
)


def unavailable_message(exc: BackendUnavailableError) -> str:
    """The one line for a server that cannot be used; a refused password says how to give one."""
    if isinstance(exc, BackendAuthenticationError):
        return f"{exc}; {PASSWORD_HINT}"
    return str(exc)


def _failure_error(exc: BaseException, target: object) -> str | None:
    """The one line for a :class:`kvredis.redis.requests.Failure` (None for anything else)."""
    requests = sys.modules.get("kvredis.redis.requests")
    if requests is None or not isinstance(exc, requests.Failure):
        return None
    from kvredis.errors import translate
    from kvredis.redis.session import RetryPolicy

    server = f"redis at {target.shown}" if isinstance(target, RedisTarget) else "the server"
    if isinstance(exc, requests.ErrorReply):
        error: KVRedisError = translate(exc.message)
        return f"{type(error).__name__}: {error}"
    unavailable = RetryPolicy(0, 0.0, server).unavailable(exc)
    return unavailable_message(unavailable)


def _is_redis_error(exc: BaseException) -> bool:
    redis = sys.modules.get("redis")
    return redis is not None and isinstance(exc, redis.RedisError)
