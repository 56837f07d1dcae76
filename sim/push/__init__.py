"""sim/push"""
