"""Settings of the KV data plane (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass, field

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class TransferConfig:
    """Timeouts, channel bound and buffer size; the same on senders and receivers.

    - ``timeout_s``: any single wait on a peer (a part, an acknowledgement, a channel
      handshake) longer than this is an error; a receiver's transfer that is not
      complete this long after ``expect()`` fails (unless ``expect`` gives its own).
    - ``max_channels``: open channels per sender or receiver; least recently used idle
      ones are closed to make room.
    - ``part_bytes``: payload per part; KV moves in buffers this large (>= 1 MiB runs
      near the link's bandwidth), fewer only where a message is smaller. Memory: a
      receiver keeps 3 such buffers posted per open channel, a sender 3 per busy lane.
    - ``bind_host``: the address every group of this process binds to.
    - ``idle_timeout_s``: a channel unused this long closes itself; a sender forgets a
      route nothing went over this long (its connection to the receiver's store).
    - ``park_timeout_s``: how long a receiver holds a part of a transfer it was not told
      about yet before ignoring it (default ``timeout_s / 3``, so the sender's wait on
      that part ends well within its own timeout).
    - ``auth_keys``: with keys (derived from the cluster token; the first is this side's
      own, a second one is accepted while the token rotates), channels open only between
      ends that prove one of them and every part carries a MAC (``kvtransfer.wire.auth``);
      without, channels are unauthenticated.
    """

    timeout_s: float = 30.0
    max_channels: int = 8
    part_bytes: int = 4 << 20
    bind_host: str = LOOPBACK
    idle_timeout_s: float = 600.0
    park_timeout_s: float | None = None
    remember_finished: int = 100_000
    auth_keys: tuple[bytes, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if self.timeout_s <= 0 or self.idle_timeout_s <= 0:
            raise ValueError("timeouts must be positive")
        if self.max_channels < 1:
            raise ValueError(f"max_channels must be >= 1, got {self.max_channels}")
        if self.part_bytes < 4096:
            raise ValueError(f"part_bytes must be >= 4096, got {self.part_bytes}")

    @property
    def park_s(self) -> float:
        return self.park_timeout_s if self.park_timeout_s is not None else self.timeout_s / 3
