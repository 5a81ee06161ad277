"""``pdserve up --ray``: the cluster placed by Ray, every worker an actor in a placement group
of its own that holds its whole tensor-parallel group.

- ``plan``: what the launcher asks Ray for and what each actor runs, as plain data
  (``RaySpec``, ``ChildSpec``; Ray-free);
- ``actors``: the actors' bodies (a supervised child process, a private Redis);
- ``members``: what the driver knows of each actor and how it follows it;
- ``connect``: connecting to (or starting) Ray, and lookups about the Ray cluster;
- ``launcher``: ``RayLauncher``, the launcher skeleton (``deploy.launcher``) on Ray;
- ``options``: the ``--ray*`` command-line options (standard library only).

Ray itself is imported only when a cluster starts (the ``ray`` extra).
"""
