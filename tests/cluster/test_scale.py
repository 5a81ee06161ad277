"""``cluster.scale``: the planner's latest scale step round-trips through Redis, strictly."""

from __future__ import annotations

import json

import pytest

from cluster.records import RecordFormatError
from cluster.registry import Registry
from cluster.scale import ScaleTarget
from deploy.redis_server import RedisServer

TARGET = ScaleTarget(action="add", role="decode", worker_id="", num_prefill=1, num_decode=3,
                     reason="20 req/s: predicted 0.40 at 1P+2D, 0.97 at 1P+3D", written_at=5.5)


def test_the_latest_target_is_what_the_launcher_reads(redis_server: RedisServer) -> None:
    with Registry(redis_server.url, cluster="c1") as registry:
        assert registry.scale_target() is None  # no planner wrote one yet
        registry.set_scale_target(TARGET.to_json())
        removal = ScaleTarget("remove", "decode", "decode-2", 1, 2, reason="idle",
                              written_at=9.0)
        registry.set_scale_target(removal.to_json())
        raw = registry.scale_target()
        assert raw is not None and ScaleTarget.from_json(raw) == removal
    with Registry(redis_server.url, cluster="c2") as other:  # clusters do not share it
        assert other.scale_target() is None


@pytest.mark.parametrize(("change", "message"), [
    ({"version": 2}, "not version 1"),
    ({"extra": 1}, "unknown \\['extra'\\]"),
    ({"num_decode": "3"}, "num_decode must be int"),
    ({"num_decode": True}, "num_decode must be int"),
    ({"written_at": None}, "written_at must be float"),
    ({"num_decode": 0}, "num_decode >= 1"),
    ({"role": "router"}, "role must be one of"),
    ({"action": "grow"}, "action must be one of"),
    ({"worker_id": "decode-0"}, "a removal names its worker_id, an addition none"),
])
def test_malformed_targets_are_refused(change: dict[str, object], message: str) -> None:
    data = {**json.loads(TARGET.to_json()), **change}
    with pytest.raises(RecordFormatError, match=message):
        ScaleTarget.from_json(json.dumps(data))
    with pytest.raises(RecordFormatError, match="not JSON"):
        ScaleTarget.from_json(b"\xff")
    assert ScaleTarget.from_json(json.dumps({**json.loads(TARGET.to_json()),
                                             "written_at": 5})).written_at == 5
