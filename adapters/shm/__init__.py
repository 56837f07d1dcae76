"""adapters/shm"""
