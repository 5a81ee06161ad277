"""The planner: decides the cluster's prefill/decode split from queue time and the SLO,
and acts on it through live role switches (``SetRole``). Torch-free.

- ``capacity``: each role's capacity from measured step costs, and a split's predicted
  SLO attainment;
- ``policy``: ``Planner``, the I/O-free decision on an injectable clock (the simulator
  runs the same object).

May import ``cluster``; never the workers, the router or the simulator.
"""
