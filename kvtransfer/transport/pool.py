"""A bound on open channels: least recently used idle channels are closed to make room.

Ownership: the pool owns every channel in it. A user borrows one (``checkout`` or
``add``), uses it, and gives it back (``checkin``) or, after an error, ``discard``s it.
Only idle channels (no borrower) are ever closed by the pool. Closing happens outside
the pool's lock (it cuts connections, which wakes other threads).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Hashable

from kvtransfer.errors import ChannelError
from kvtransfer.transport.channel import Channel


class ChannelPool:
    """At most ``max_channels`` open channels (plus none: the bound is hard)."""

    def __init__(self, max_channels: int, idle_timeout_s: float) -> None:
        self.max_channels = max_channels
        self.idle_timeout_s = idle_timeout_s
        self._cond = threading.Condition()
        self._channels: OrderedDict[Hashable, Channel] = OrderedDict()  # LRU first
        self._borrowed: dict[int, int] = {}  # id(channel) -> borrowers
        self._reserved = 0
        self.opened = 0
        self.evicted = 0

    def __len__(self) -> int:
        with self._cond:
            return len(self._channels) + self._reserved

    def checkout(self, key: Hashable) -> Channel | None:
        """Borrow the open channel under ``key``, if any."""
        with self._cond:
            channel = self._channels.get(key)
            if channel is None:
                return None
            if not channel.is_open:
                self._remove(key)
                return None
            self._channels.move_to_end(key)
            self._borrowed[id(channel)] = self._borrowed.get(id(channel), 0) + 1
            return channel

    def reserve(self, timeout_s: float, *, wait: bool = True) -> None:
        """Make room for one more channel (closing LRU idle ones); then ``add`` or
        ``cancel``. Raises ``ChannelError`` when every channel stays borrowed."""
        deadline = time.monotonic() + timeout_s
        victims: list[Channel] = []
        with self._cond:
            while True:
                self._drop_closed()
                if len(self._channels) + self._reserved < self.max_channels:
                    self._reserved += 1
                    break
                victim_key = next((k for k, c in self._channels.items()
                                   if not self._borrowed.get(id(c))), None)
                if victim_key is not None:
                    victims.append(self._remove(victim_key))
                    self.evicted += 1
                    continue
                remaining = deadline - time.monotonic()
                if not wait or remaining <= 0:
                    raise ChannelError(f"all {self.max_channels} channels are in use")
                self._cond.wait(remaining)
        for channel in victims:
            channel.close("closed to make room (least recently used)", graceful=True)

    def cancel(self) -> None:
        with self._cond:
            self._reserved -= 1
            self._cond.notify_all()

    def add(self, key: Hashable, channel: Channel) -> None:
        """Put a new channel (room reserved before) into the pool, borrowed by the caller."""
        with self._cond:
            self._reserved -= 1
            old = self._channels.pop(key, None)
            assert old is None or not old.is_open, "two open channels under one key"
            self._channels[key] = channel
            self._borrowed[id(channel)] = 1
            self.opened += 1

    def checkin(self, channel: Channel) -> None:
        with self._cond:
            self._release(channel)
            channel.last_used = time.monotonic()
            self._cond.notify_all()

    def discard(self, channel: Channel, reason: str) -> None:
        """Give back a broken channel: it is closed and forgotten."""
        channel.close(reason)
        with self._cond:
            self._release(channel)
            self._drop_closed()
            self._cond.notify_all()

    def sweep_idle(self) -> None:
        """Close channels nobody borrowed for ``idle_timeout_s``."""
        now = time.monotonic()
        with self._cond:
            stale = [k for k, c in self._channels.items() if not self._borrowed.get(id(c))
                     and now - c.last_used > self.idle_timeout_s]
            victims = [self._remove(k) for k in stale]
        for channel in victims:
            channel.close("idle timeout", graceful=True)

    def close_all(self, reason: str = "closed") -> None:
        with self._cond:
            victims = [(c, bool(self._borrowed.get(id(c)))) for c in self._channels.values()]
            self._channels.clear()
            self._borrowed.clear()
            self._cond.notify_all()
        for channel, borrowed in victims:
            channel.close(reason, graceful=not borrowed)

    def open_channels(self) -> list[Channel]:
        with self._cond:
            return [c for c in self._channels.values() if c.is_open]

    def _release(self, channel: Channel) -> None:
        count = self._borrowed.get(id(channel), 0) - 1
        if count > 0:
            self._borrowed[id(channel)] = count
        else:
            self._borrowed.pop(id(channel), None)

    def _remove(self, key: Hashable) -> Channel:
        channel = self._channels.pop(key)
        self._borrowed.pop(id(channel), None)
        return channel

    def _drop_closed(self) -> None:
        for key in [k for k, c in self._channels.items() if not c.is_open]:
            self._remove(key)
