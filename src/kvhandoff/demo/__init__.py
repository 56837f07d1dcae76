"""The main job: P and D (and producer and consumer) as real processes over NIXL and ZMQ."""
