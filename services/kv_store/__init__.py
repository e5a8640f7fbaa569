"""HiCache: the kv_store service (host and disk KV tiers) and the engine's tier client.

Files, one job each. The store: ``arena.py`` (the shared-memory slots), ``index.py`` (L2
bookkeeping), ``disk.py`` (L3), ``policies.py`` (write policies, L3 admission), ``store.py``
(all of it without the bus), ``actor.py`` (on the bus), ``events.py`` (KV events), ``metrics.py``.
The engine side: ``client.py`` (the tier hooks) with ``leases.py`` (arena and leased slots),
``mirror.py`` (which slot holds which page), ``copier.py`` (CPU and CUDA copies), ``links.py``
(how the client reaches its store) and ``remote.py`` (a store on another host).
See docs/hicache.md.
"""
