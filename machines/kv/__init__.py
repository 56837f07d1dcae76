"""The vocabulary both KV-transfer modes share: events and effects of push and pull."""
