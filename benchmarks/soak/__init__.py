"""The chaos soak (``soak``) and its parts: traffic, faults, capacity, outcomes, report, server."""
