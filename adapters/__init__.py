"""The edges: NIXL, ZMQ, CUDA/torch copies, the /dev/shm region, threads, in-memory fabric."""
