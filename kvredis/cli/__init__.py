"""The ``kvredis`` command line (see :mod:`kvredis.cli.app` for the command group).

Kept light: importing ``kvredis.cli.options`` (shared by ``kvredis ingest``) does not load
every command.
"""

from __future__ import annotations

from typing import Any

__all__ = ["cli", "main"]


def main() -> None:
    """Entry point of the ``kvredis`` console script."""
    from kvredis.cli.app import main as run

    run()


def __getattr__(name: str) -> Any:
    if name == "cli":
        from kvredis.cli.app import cli

        return cli
    raise AttributeError(f"module 'kvredis.cli' has no attribute {name!r}")
