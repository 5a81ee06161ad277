"""Every way to place pdserve's processes: one machine, a Ray cluster, Kubernetes.

- ``spec``: ``ClusterSpec`` (what a cluster is made of), its checks, and the command-line
  options a launcher gives each server;
- ``launcher``: the launcher skeleton (Redis → workers → router; stop in reverse) and
  ``serve``, the loop of ``pdserve up``;
- ``local``: ``LocalLauncher``, every process a child of this one (``pdserve up``);
- ``ray/``: ``RayLauncher``, the processes as Ray actors (``pdserve up --ray``);
- ``children``: child processes that die with their parent, their environment and logs;
- ``redis_server``: the private ``redis-server`` of the embedded default;
- ``docker/``, ``helm/``, ``kuberay/``: container images, the Helm chart, KubeRay manifests.

Torch-free. It runs the servers as processes, through their command lines and option
modules (``router.options``, ``worker.options``); it never imports their internals.
"""
