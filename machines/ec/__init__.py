"""machines/ec"""
