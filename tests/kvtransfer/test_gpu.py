"""The CUDA path: device checksums and packing, and NCCL channels between two GPUs.
Skipped without CUDA (the NCCL transfer needs two GPUs: one rank per GPU)."""

from __future__ import annotations

import pytest
import torch

from kvtransfer.wire.checksum import algo_for, checksum
from kvtransfer.wire.packing import gather, rows_view, scatter
from kvtransfer.wire.protocol import ChecksumAlgo
from tests.kvtransfer.conftest import AgentsFactory
from tests.kvtransfer.topology import (
    assert_received,
    make_decode,
    make_prefill,
    make_request,
    transfer,
)

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


def test_device_checksum_matches_the_host_and_catches_a_flip() -> None:
    host = torch.randint(0, 256, (1 << 20) + 3, dtype=torch.uint8)
    device = host.cuda()
    assert algo_for(device.device) == ChecksumAlgo.TORCH_SUM64
    assert checksum(device, ChecksumAlgo.TORCH_SUM64) == checksum(host, ChecksumAlgo.TORCH_SUM64)
    device[12345] ^= 0x80
    assert checksum(device, ChecksumAlgo.TORCH_SUM64) != checksum(host, ChecksumAlgo.TORCH_SUM64)


def test_gather_scatter_on_the_device() -> None:
    src = torch.randn(2, 2, 10, 4, 2, 8, device="cuda")
    dst = torch.zeros_like(src)
    src_ids, dst_ids = torch.tensor([7, 2, 5], device="cuda"), torch.tensor([0, 9, 4], device="cuda")
    num_rows = 2 * 2 * 3
    payload = torch.empty(num_rows * 4 * 1 * 8 * 4, dtype=torch.uint8, device="cuda")
    view = rows_view(payload, torch.float32, num_rows, 4, 1, 8)
    gather(src, src_ids, (1, 2), 0, 3, (0, num_rows), view)
    scatter(dst, dst_ids, (1, 2), 0, 3, (0, num_rows), view)
    assert torch.equal(dst[:, :, dst_ids, :, 1:2], src[:, :, src_ids, :, 1:2])
    assert not dst[:, :, :, :, 0].any()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL point-to-point needs two GPUs")
def test_nccl_transfer_between_two_gpus(agents: AgentsFactory) -> None:
    sender, receiver = agents(2)
    prefill = make_prefill([sender], devices=["cuda:0"])
    decode = make_decode([receiver], devices=["cuda:1"])
    for transfer_id in (91, 92):  # the second one reuses the channel
        req = make_request(transfer_id, 77)
        transfer(prefill, decode, req)
        assert_received(decode, req)
    assert sender.call("report")["stats"]["channels_opened"] == 1
