"""adapters/nixl"""
