"""Moved in 0.2: routing replay tables are :mod:`hybrimoe.traces.routing_replay`. This alias module goes in 0.3
(CHANGELOG.md)."""
from hybrimoe._moved import moved, names_of

_NAMES = {
    "replay_table": "hybrimoe.traces.routing_replay:routing_replay_table",
    "check_replay_table": "hybrimoe.traces.routing_replay:check_routing_replay_table",
}
__getattr__ = moved(__name__, _NAMES)
__dir__ = names_of(__name__, _NAMES)
