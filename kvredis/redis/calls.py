"""How a client that is not an index (the operator's inspector, ``drop_namespace``, ``migrate``)
sends its script calls: through the ``kvredis`` function library where the server and the ACL
user offer it, else by ``EVALSHA`` (sans-IO).

:class:`CallChoice` makes the choice an index client makes when it connects
(:meth:`~kvredis.redis.functions.FunctionRegistry.op_choose`), but only before the first
request that calls a script: an operation of plain commands (``kvredis stats``, ``dump``,
``check``) sends nothing more, and a user on the function path needs neither ``EVALSHA`` nor
``SCRIPT LOAD``.
"""

from __future__ import annotations

from typing import TypeVar

from kvredis.redis.functions import FunctionRegistry, UseFunctions
from kvredis.redis.requests import Op, Pipeline, Request, ScriptCall

__all__ = ["CallChoice"]

T = TypeVar("T")


def _calls_script(request: Request) -> bool:
    if isinstance(request, ScriptCall):
        return True
    return isinstance(request, Pipeline) and any(isinstance(i, ScriptCall) for i in request.items)


class CallChoice:
    """A :class:`FunctionRegistry` and whether its choice was made (once per client)."""

    def __init__(self, use: UseFunctions, server: str) -> None:
        self.registry = FunctionRegistry(use=use)
        self.server = server
        self.chosen = False

    def op(self, op: Op[T]) -> Op[T]:
        """``op``, with the choice made before its first script call (run it with
        :func:`~kvredis.redis.session.op_drive` on a session holding :attr:`registry`)."""
        try:
            request = next(op)
            while True:
                if not self.chosen and _calls_script(request):
                    yield from self.registry.op_choose(self.server)
                    self.chosen = True
                try:
                    reply = yield request
                except Exception as exc:
                    request = op.throw(exc)
                else:
                    request = op.send(reply)
        except StopIteration as stop:
            result: T = stop.value
            return result
        finally:
            op.close()
