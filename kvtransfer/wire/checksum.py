"""Payload checksums: XXH3-64 over host memory, a position-weighted 64-bit sum on devices.

XXH3 runs at tens of GB/s on one core, so verifying a payload costs a small fraction of
moving it. CUDA payloads are summed on the device instead (copying them to the host
would cost more than the transfer): ``sum(w_i * (2i + 1))`` over the payload as int64
words, modulo 2**64. Each weight is odd, so flipping bit ``b`` of any word moves the sum
by ``2**b`` times an odd number, never a multiple of 2**64: any single flipped bit is
caught (an even weight missed the top bits of some words: ``i + 2`` weights, as before,
let a flipped sign bit of every other word through), and so are most reorderings.
"""

from __future__ import annotations

import torch
import xxhash

from kvtransfer.wire.protocol import ChecksumAlgo


def algo_for(device: torch.device) -> ChecksumAlgo:
    return ChecksumAlgo.XXH3_64 if device.type == "cpu" else ChecksumAlgo.TORCH_SUM64


def checksum(payload: torch.Tensor, algo: ChecksumAlgo) -> int:
    """Checksum of ``payload`` (a contiguous uint8 tensor) as an unsigned 64-bit int."""
    assert payload.dtype == torch.uint8 and payload.is_contiguous()
    if algo == ChecksumAlgo.XXH3_64:
        return xxhash.xxh3_64_intdigest(payload.cpu().numpy().data)
    return _sum64(payload)


def _sum64(payload: torch.Tensor) -> int:
    tail = payload.numel() % 8
    words = payload[: payload.numel() - tail].view(torch.int64)
    weights = torch.arange(1, 2 * words.numel() + 1, 2, device=payload.device,
                           dtype=torch.int64)  # 1, 3, 5, ...: odd
    total = (words * weights).sum()  # int64 arithmetic wraps modulo 2**64
    if tail:
        rest = payload[payload.numel() - tail :].to(torch.int64)
        total = total + (rest * torch.arange(1, tail + 1, device=payload.device) * 1_000_003).sum()
    return int(total.item()) & ((1 << 64) - 1)
