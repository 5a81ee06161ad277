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


@dataclass(frozen=True)
class RoleSwitch:
    """A worker's answer: it serves ``role`` now, ``previous_role`` before; it can serve
    ``roles``."""

    role: str
    previous_role: str
    roles: tuple[str, ...]


class RoleSwitchError(Exception):
    """The worker refused the switch (``refused``: it said why) or could not be asked."""

    def __init__(self, message: str, *, refused: bool) -> None:
        super().__init__(message)
        self.refused = refused


async def set_role(address: str, role: str, *, token: ClusterToken | None = None,
                   tls: InternalTLS | None = None, timeout_s: float = SET_ROLE_TIMEOUT_S,
                   move_decoding: bool = False) -> RoleSwitch:
    """Switch the worker at ``address`` (``host:port``) to ``role``; ``RoleSwitchError``
    when it refuses (the message is the worker's) or does not answer within ``timeout_s``.
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
            raise RoleSwitchError(f"{exc.code().name}: {exc.details()}" if not refused
                                  else str(exc.details()), refused=refused) from None
    return RoleSwitch(reply.role, reply.previous_role, tuple(reply.roles))
