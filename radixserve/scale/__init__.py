"""Scale-out on Ray Serve: engine replicas, the cache index fed by their KV events, and the routers
(docs/scaling.md). Importing ``radixserve.scale.app``, ``router`` or ``replica`` needs ``ray[serve]``."""
