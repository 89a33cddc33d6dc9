"""KV-event payloads byte for byte as vLLM 0.34 and SGLang 0.5.23 publish them: the builders live in
:mod:`kvredis.testing.wire` (shipped for users' suites); ``test_events.py`` pins their bytes
against msgspec's own output."""

from kvredis.testing.wire import (
    Hash,
    Map16,
    all_cleared,
    pack,
    sglang_batch,
    sglang_pages,
    sglang_removed,
    sglang_stored,
    signed,
    vllm_batch,
    vllm_map_batch,
    vllm_offload_placeholder,
    vllm_removed,
    vllm_stored,
)

__all__ = [
    "Hash",
    "Map16",
    "all_cleared",
    "pack",
    "sglang_batch",
    "sglang_pages",
    "sglang_removed",
    "sglang_stored",
    "signed",
    "vllm_batch",
    "vllm_map_batch",
    "vllm_offload_placeholder",
    "vllm_removed",
    "vllm_stored",
]
