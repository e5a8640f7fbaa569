"""HiCache: the kv_store service (host and disk KV tiers) and the engine's tier client.

Files, one job each: ``arena.py`` (the shared-memory slots), ``index.py`` (L2
bookkeeping), ``disk.py`` (L3), ``policies.py`` (write policies, L3 admission),
``store.py`` (all of it without the bus), ``actor.py`` (on the bus),
``client.py`` + ``links.py`` (the engine side), ``events.py`` (KV events).
See docs/hicache.md.
"""
