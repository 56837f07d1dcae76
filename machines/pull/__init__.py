"""machines/pull"""
