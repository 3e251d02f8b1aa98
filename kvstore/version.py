"""Versions kvstore speaks, importable without loading the tiers."""

API_VERSION = "kvstore.v1"
# the engine <-> daemon protocol on the local socket (kvstore/localproto.py)
LOCAL_PROTOCOL_VERSION = 5
