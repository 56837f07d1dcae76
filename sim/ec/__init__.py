"""sim/ec"""
