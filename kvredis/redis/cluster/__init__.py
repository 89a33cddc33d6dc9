"""Redis Cluster support: where keys live, and what the cluster says about it.

Modules, in dependency order (each imports only the ones before it):

- ``slots``     the hash slot of a key (CRC16, hash tags ``{...}``)
- ``redirect``  MOVED / ASK error replies as typed values
- ``topology``  the slot map (primaries and replicas per slot range) parsed from
  ``CLUSTER SHARDS`` or ``CLUSTER SLOTS``, and keys grouped by owning node
- ``wave``      a per-node parallel wave of commands (sync and asyncio), following MOVED and ASK

Everything but ``wave`` is sans-IO: it imports no I/O library.
"""
