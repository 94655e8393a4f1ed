"""Files neutrain writes and reads back: checksum manifests, format checks, and leftover temporary names.

This package sits at the bottom beside ``errors``: any layer that writes or reads a
checkpoint, an export or a cache may use it, and it imports nothing else of neutrain.
"""
