"""A worker rank's main-thread half, in either KV-transfer mode (push or pull)."""
