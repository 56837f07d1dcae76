"""adapters/cuda"""
