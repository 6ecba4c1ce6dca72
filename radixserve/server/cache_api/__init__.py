"""The cache routes (/v1/cache/*): warm, pins, evict, and their wire types."""
