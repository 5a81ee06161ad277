"""A worker's KV data plane, role-neutral: every worker can send KV and receive it (a
prefill worker sends, a decode worker receives; a decode worker that hands a request to
another sends too), over ``kvtransfer``.

- ``config``: ``KVPlaneConfig``, the rank plugin's settings (``EngineConfig.rank_plugin_config``);
- ``messages``: the typed leader → rank calls and their replies (never pickled);
- ``reports``: what a rank reports on a transfer and how the leader folds every rank's report;
- ``rank``: ``KVRank``, the rank plugin (``PLUGIN``): a sending side (a ``KVSender``) and a
  receiving side (a ``KVReceiver``, hosting rank 0's rendezvous store once asked to);
- ``sending``, ``receiving``: the leader's side of each direction (``KVSendLeader``,
  ``KVReceiveLeader``), driven from the engine-loop thread, never waiting on the network;
- ``plane``: ``KVPlane``, both directions of one worker, and its figures by direction.

Each module's docstring says who owns which blocks when.
"""
