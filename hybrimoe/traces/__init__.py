"""Routing traces: which experts a model routed each token to. A leaf package (it imports :mod:`hybrimoe.model` and
the policy core only); the generator imports the format, never the reverse.

=================  ================================================================================================
``format``         the ``.npz`` format (``hybrimoe.trace`` version 2): :class:`~hybrimoe.traces.format.RoutingTrace`,
                   :func:`~hybrimoe.traces.format.load_trace`, the development trace's path
``stats``          :func:`~hybrimoe.traces.stats.routing_stats`: skew, temporal and cross-layer locality
``synthetic``      :func:`~hybrimoe.traces.synthetic.synthetic_trace`: traces of a model shape whose statistics are
                   knobs
``routing_replay`` the tables that force a model's routing from a trace (``--replay-trace``, ``moe_replay``)
=================  ================================================================================================
"""
from hybrimoe._lazy import lazy_submodules

__getattr__ = lazy_submodules(__name__, ("format", "stats", "synthetic", "routing_replay"))
