"""Simulation: what a plan's step takes on a cluster, as the implementation that runs it.

* :mod:`~torch_dcp.sim.simulate`: :func:`simulate` (and :func:`simulate_within`, bounded), the
  entry point: a plan timed by its runtime;
* :mod:`~torch_dcp.sim.runtimes`: one model per :class:`~torch_dcp.planners.base.Runtime`
  (torch_dcp's executor, TransformerEngine's ring, an NCCL all-gather, torch_dcp's all-gather
  runtime), :data:`~torch_dcp.sim.runtimes.RUNTIMES`;
* :mod:`~torch_dcp.sim.timeline`: the per-rank programs on compute streams and links, which the
  runtimes run on;
* :mod:`~torch_dcp.sim.dataflow`: a placement and its routes as if every tile started as soon
  as its inputs arrived (no divisions), what the divisions cost;
* :mod:`~torch_dcp.sim.estimate`: a fast NumPy estimate, division by division, that ranks the
  planner's candidates before any is simulated;
* :mod:`~torch_dcp.sim.floors`: what no run of a plan can beat, which prunes candidates.

Nothing here imports the executor or ``torch.distributed``: the planners call these to choose.
"""

from .simulate import PassResult, SimResult, model_of, ring_step_seconds, simulate, simulate_within

__all__ = ["simulate", "simulate_within", "model_of", "ring_step_seconds", "SimResult", "PassResult"]
