"""Moved in 0.2: the simulator is :mod:`hybrimoe.sim.simulator`, the engine-log replay
:mod:`hybrimoe.runtime.decision_replay`, the command :mod:`hybrimoe.commands.simulate`. This alias module goes in 0.3
(CHANGELOG.md)."""
from hybrimoe._moved import moved, names_of

_NAMES = {
    "Setup": "hybrimoe.sim.simulator",
    "stage_tokens": "hybrimoe.sim.simulator",
    "total_times": "hybrimoe.sim.simulator",
    "record": "hybrimoe.sim.simulator",
    "cache_hit_rates": "hybrimoe.sim.simulator",
    "format_table": "hybrimoe.sim.simulator",
    "replay_engine_log": "hybrimoe.runtime.decision_replay",
}
__getattr__ = moved(__name__, _NAMES)
__dir__ = names_of(__name__, _NAMES)
