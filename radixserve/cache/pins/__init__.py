"""Pins: prefixes an application asked the cache to keep (docs/cache.md, "Cache control"), in one
package that owns every pin rule.

- ``types.py``: what crosses the engine process's boundary (``PinSpec``, ``PinRef``, ``PinInfo``,
  ``WarmResult``, ``PrefixEviction``) and a pin as the table keeps it (``Pin``);
- ``table.py``: ``PinTable``, the pins of one tree: TTLs, hits, the budget per tenant;
- ``control.py``: ``PinControl``, the table wired into ``KVCacheManager`` as a listener, and the
  engine's pin calls;
- ``store.py``: pins that outlive the process (the pin file beside the disk tier);
- ``ids.py``: pin ids across engines (a replica's scope in front of the engine's id).

Nothing is imported here, so that importing one module does not import the rest.
"""
