"""The Redis protocol of a batchery queue: key layout, Lua scripts, batch-formation policy."""
