"""machines/push"""
