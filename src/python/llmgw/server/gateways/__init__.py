"""The control plane's own gateway: its worker processes on `http_listen` (or one on the loop,
fed in memory), what they are told, and the figures of every gateway instance.
"""
