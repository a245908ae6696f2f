"""The runtime: :class:`hybrimoe.Llama` on llama.cpp and the engine around it (the only layer that loads llama.cpp).

================== ===============================================================================================
``llama``          :class:`~hybrimoe.runtime.llama.Llama`: constructs and exposes
``params``         llama.cpp parameters llama-cpp-python lacks (``-ot``, ``--cpu-moe``, ``--rpc``), the keyword
                   check, the default-parameter patch of llama-cpp-python (a context manager)
``engine_facts``   what the engine needs to know about a GGUF (expert layout, slot size)
``setup``          :class:`~hybrimoe.runtime.setup.EngineSetup`: the engine's decisions, made once
``calibration``    the cost model measured on a loaded model; the first-use calibration and its store
``calibrate_model`` the full calibration of a model file (``hybrimoe calibrate``)
``disk_calibration`` the disk under a model file, measured with cold reads (``hybrimoe calibrate --disk``)
``readahead``      the read-ahead of the block device under a model file, set and put back by the RAM benchmarks
``generate``       the token loop (``hybrimoe run``), the default tiny model
``batch``          several requests in one batch per step: ``Llama.create_completions``, ``serve --parallel``
``decision_replay`` the engine-log replay through the simulator's rules
``recording``      routing recording into traces (``hybrimoe trace``)
``benchmark``      the measuring machinery of ``hybrimoe bench``
``stats``          ``moe_stats()``'s figures
``errors``         :class:`~hybrimoe.runtime.errors.DeviceLostError`
``rpc``            the RPC stand-in server
================== ===============================================================================================
"""
from hybrimoe._lazy import lazy_submodules

__getattr__ = lazy_submodules(__name__, ("llama", "params", "engine_facts", "setup", "calibration", "calibrate_model",
                                         "disk_calibration", "readahead", "generate", "batch", "decision_replay",
                                         "recording", "benchmark", "stats", "errors", "rpc"))
