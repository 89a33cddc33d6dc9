"""Redis Cluster support: where keys live, and what the cluster says about it.

Modules, in dependency order (each imports only the ones before it):

- ``slots``     the hash slot of a key (CRC16, hash tags ``{...}``)
- ``redirect``  MOVED / ASK error replies as typed values
- ``topology``  the slot map (primaries and replicas per slot range) parsed from
  ``CLUSTER SHARDS`` or ``CLUSTER SLOTS``, and keys grouped by owning node
- ``routing``   one parallel wave of commands grouped by node, following MOVED and ASK and
  riding out failovers (a sans-IO operation)
- ``executor``  sync and asyncio executors that send the waves with redis-py
- ``shards``    a namespace's shards and their slots; which shard holds a pod (the pod layout)
  or a key (the key layout before it)
- ``core``      the cluster core (shards, slot map, policies), waves of per-shard operations,
  connecting
- ``placement`` a write cut into one segment per shard of its entries' pods
- ``calls``     node calls: the shards one node holds in one script call, every node in one wave
- ``writes``, ``ops``  the index operations: writes (adds, evicts, batches, watermarks); reads,
  clear and drop
- ``migrate``   converting a namespace of the key layout to the pod layout (``kvredis migrate``)
- ``index``     the index classes
- ``inspect``   the operator's reads and repairs (``kvredis stats``, ``check`` ...) on every shard

Everything but ``executor`` and the modules that drive it (``index``, ``inspect``) is sans-IO: it
imports no I/O library.
"""
