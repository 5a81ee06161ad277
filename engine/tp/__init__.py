"""The tensor-parallel process machinery: process groups built on demand from a
rendezvous store (``distributed``), the executors that run a step on every rank
(``executor``), the rank programs and how they are started (``rank_main``,
``rank_process``), the typed leader → follower messages (``messages``) and the config's
wire form (``config_codec``), the torch-free sharding rules (``sharding``), and rank
plugins, through which code outside the engine runs beside each rank (``rank_plugin``).
"""
