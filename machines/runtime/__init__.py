"""machines/runtime"""
