"""bench/probes"""
