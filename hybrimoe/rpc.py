"""Moved in 0.2: the RPC stand-in is :mod:`hybrimoe.runtime.rpc`. This alias module goes in 0.3 (CHANGELOG.md)."""
from hybrimoe._moved import moved, names_of

_NAMES = {
    "RPCServer": "hybrimoe.runtime.rpc",
    "read_stats": "hybrimoe.runtime.rpc",
    "free_port": "hybrimoe.runtime.rpc",
    "SERVER_BIN": "hybrimoe.runtime.rpc",
    "STATS_ENV": "hybrimoe.runtime.rpc",
    "MEMORY_ENV": "hybrimoe.runtime.rpc",
    "STATS_SCHEMA": "hybrimoe.runtime.rpc",
}
__getattr__ = moved(__name__, _NAMES)
__dir__ = names_of(__name__, _NAMES)
