"""The radix tree: match, insert, lock, evict, integrity, and reads of it (continuations, the
view for people)."""
