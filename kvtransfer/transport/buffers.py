"""Reusable staging buffers: allocating (and first touching) megabytes per part would
cost as much as moving them, so parts go through a few long-lived buffers."""

from __future__ import annotations

import threading

import torch


class BufferPool:
    """Free uint8 buffers by (device, size); keeps at most ``max_free`` of them."""

    def __init__(self, max_free: int) -> None:
        self.max_free = max_free
        self._free: dict[tuple[str, int], list[torch.Tensor]] = {}
        self._num_free = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int, device: torch.device) -> torch.Tensor:
        key = (str(device), nbytes)
        with self._lock:
            free = self._free.get(key)
            if free:
                self._num_free -= 1
                return free.pop()
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def give(self, buffer: torch.Tensor) -> None:
        key = (str(buffer.device), buffer.numel())
        with self._lock:
            if self._num_free < self.max_free:
                self._free.setdefault(key, []).append(buffer)
                self._num_free += 1

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._num_free = 0
