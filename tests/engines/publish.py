"""Run an engine's real publisher (from its wheel) and publish prompts as that engine would.

``python publish.py ENGINE SANDBOX CONFIG_JSON PLAN_JSON``: ENGINE is ``vllm`` or ``sglang``;
SANDBOX the directory :func:`tests.engines.wheels.sandbox` laid out; CONFIG_JSON the engine's
``--kv-events-config`` value; PLAN_JSON ``{"rank": r, "batches": [[event, ...], ...]}`` with
events ``{"stored": [hash...], "parent": hash|null, "tokens": [...], "block_size": n,
"medium": "GPU"}``, ``{"removed": [hash...], "medium": ...}`` or ``{"cleared": true}``.
Prints the endpoints it bound, then reads commands from stdin: ``warm`` publishes empty batches
every 50 ms (so a subscriber can show it receives before anything that matters is sent: ZMQ
drops what a PUB socket sends before a subscription arrives), ``go`` stops that and publishes
every batch of the plan, ``stop`` (or the end of stdin) shuts the publisher down.
"""

from __future__ import annotations

import json
import sys
import threading
import time


def main() -> None:
    engine, sandbox, config_json, plan_json = sys.argv[1:5]
    sys.path.insert(0, sandbox)
    plan = json.loads(plan_json)
    rank = int(plan.get("rank", 0))
    if engine == "vllm":
        from vllm.config.kv_events import KVEventsConfig
        from vllm.distributed import kv_events as ev

        publisher = ev.EventPublisherFactory.create(
            KVEventsConfig(**json.loads(config_json)), data_parallel_rank=rank
        )

        def stored(e: dict) -> object:
            return ev.BlockStored(
                block_hashes=[bytes.fromhex(h) for h in e["stored"]],
                parent_block_hash=None if e["parent"] is None else bytes.fromhex(e["parent"]),
                token_ids=e["tokens"],
                block_size=e["block_size"],
                lora_id=None,
                medium=e.get("medium", "GPU"),
                lora_name=None,
                group_idx=0,
            )

        def removed(e: dict) -> object:
            hashes = [bytes.fromhex(h) for h in e["removed"]]
            return ev.BlockRemoved(block_hashes=hashes, medium=e.get("medium", "GPU"), group_idx=0)

        def batch(events: list) -> object:
            return ev.KVEventBatch(ts=time.time(), events=events)

        endpoints = (publisher._endpoint, publisher._replay_endpoint)
    else:
        from sglang.srt.disaggregation import kv_events as ev

        publisher = ev.EventPublisherFactory.create(config_json, attn_dp_rank=rank)

        def stored(e: dict) -> object:
            return ev.BlockStored(
                block_hashes=[int(h, 16) - (1 << 64) * (int(h, 16) >> 63) for h in e["stored"]],
                parent_block_hash=None
                if e["parent"] is None
                else int(e["parent"], 16) - (1 << 64) * (int(e["parent"], 16) >> 63),
                token_ids=e["tokens"],
                block_size=e["block_size"],
                lora_id=None,
                medium=e.get("medium", "GPU"),
            )

        def removed(e: dict) -> object:
            hashes = [int(h, 16) - (1 << 64) * (int(h, 16) >> 63) for h in e["removed"]]
            return ev.BlockRemoved(block_hashes=hashes, medium=e.get("medium", "GPU"))

        def batch(events: list) -> object:
            return ev.KVEventBatch(ts=time.time(), events=events)

        endpoints = (publisher._endpoint, publisher._replay_endpoint)
    print(json.dumps({"endpoint": endpoints[0], "replay_endpoint": endpoints[1]}), flush=True)
    warming = threading.Event()

    def warm() -> None:
        while warming.is_set():
            publisher.publish(batch([]))
            time.sleep(0.05)

    warmer = threading.Thread(target=warm, daemon=True)
    command = sys.stdin.readline().strip()
    if command == "warm":
        warming.set()
        warmer.start()
        command = sys.stdin.readline().strip()
        warming.clear()
        warmer.join()
    if command != "go":
        publisher.shutdown()
        return
    for events in plan["batches"]:
        out = []
        for e in events:
            if "stored" in e:
                out.append(stored(e))
            elif "removed" in e:
                out.append(removed(e))
            else:
                out.append(ev.AllBlocksCleared())
        publisher.publish(batch(out))
    sys.stdin.readline()
    publisher.shutdown()


if __name__ == "__main__":
    main()
