"""Asking a worker to switch role over the internal API (``SetRole``), for operators
(``pdserve set-role``) and the planner.

A thin gRPC adapter, asynchronous (``grpc.aio``), torch-free. The call carries the
cluster token when there is one and uses the internal plane's mutual TLS when given.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from cluster.auth import token_call_interceptors
from cluster.internal.v1 import worker_pb2 as pb
from cluster.internal.v1 import worker_pb2_grpc as pb_grpc
from cluster.internal_tls import InternalTLS
from cluster.token import ClusterToken

SET_ROLE_TIMEOUT_S = 10.0
# trailing metadata of a failed SetRole whose switch was made (what failed came after it:
# moving its decoding requests); its value is the role the worker serves now
SWITCHED_TO_KEY = "pdserve-switched-to"


@dataclass(frozen=True)
class RoleSwitch:
    """A worker's answer: it serves ``role`` now, ``previous_role`` before; it can serve
    ``roles``."""

    role: str
    previous_role: str
    roles: tuple[str, ...]


class RoleSwitchError(Exception):
    """The worker refused the switch (``refused``: it said why) or could not be asked; or
    it switched (``switched_to``: the role it serves now) but what was asked with the
    switch failed (its decoding requests could not move)."""

    def __init__(self, message: str, *, refused: bool, switched_to: str | None = None) -> None:
        super().__init__(message)
        self.refused = refused
        self.switched_to = switched_to


async def set_role(address: str, role: str, *, token: ClusterToken | None = None,
                   tls: InternalTLS | None = None, timeout_s: float = SET_ROLE_TIMEOUT_S,
                   move_decoding: bool = False) -> RoleSwitch:
    """Switch the worker at ``address`` (``host:port``) to ``role``; ``RoleSwitchError``
    when it refuses (the message is the worker's), does not answer within ``timeout_s``, or
    switched but could not move its decoding requests (``switched_to`` set).
    ``move_decoding``: switching to prefill, its decoding requests move with their KV to
    other decode workers (``cluster.moves``) instead of finishing there."""
    interceptors = token_call_interceptors(token)
    channel = (grpc.aio.insecure_channel(address, interceptors=interceptors) if tls is None
               else grpc.aio.secure_channel(address, tls.channel_credentials(),
                                            interceptors=interceptors))
    async with channel:
        try:  # either service answers SetRole the same: the decode one is asked
            reply = await pb_grpc.DecodeWorkerStub(channel).SetRole(
                pb.SetRoleRequest(role=role, move_decoding=move_decoding), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            refused = exc.code() == grpc.StatusCode.INVALID_ARGUMENT
            switched = dict(exc.trailing_metadata() or ()).get(SWITCHED_TO_KEY)
            raise RoleSwitchError(f"{exc.code().name}: {exc.details()}" if not refused
                                  else str(exc.details()), refused=refused,
                                  switched_to=str(switched) if switched else None) from None
    return RoleSwitch(reply.role, reply.previous_role, tuple(reply.roles))
