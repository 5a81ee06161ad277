"""pdserve's cluster simulator: the router's, the scheduler's and the KV index's real
decision code on a virtual clock, the workers' forward passes replaced by step times
from a measured (or roofline-derived) profile. Torch-free.

- ``sim.profile``: the profile schema, its loader and the step-time model;
- ``sim.roofline``: profiles derived from a model's and a GPU's datasheet figures
  (labelled as derived, never as measured);
- ``sim.events``: the virtual clock and its event queue;
- ``sim.worker``: one worker — the engine's own ``Scheduler`` and ``BlockManager`` —
  stepping on that clock;
- ``sim.router``: one router — ``router.admission``'s budgets, ``router.policy`` and
  ``router.routing``'s choices, ``router.kv_index`` fed by the workers' own KV events;
- ``sim.cluster``: a whole cluster built from a ``SimSpec``, run over a list of requests;
- ``sim.planning``: the planner's policy switching the simulated workers' roles;
- ``sim.metrics``: the serving metrics, as ``vllm bench serve`` computes them
  (``bench.serve`` computes a real cluster's with them too);
- ``sim.runs``: one simulation of a ``loadtest.workloads`` workload, measured with them;
- ``sim.cli``: the ``pdserve simulate`` command — ``bench.serve``'s workloads, arrivals and
  table on a simulated cluster (its parser builders are standard library only).

``pdserve simulate`` is the shipped command; ``python -m bench.simulate`` is the same with
``--validate`` (real clusters against the simulator), and ``python -m bench.profile``
measures a profile.
"""
