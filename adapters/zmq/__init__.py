"""adapters/zmq"""
