"""Wire messages of the KV data plane: small, fixed-layout, typed; never pickled.

On a channel (a two-rank group, rank 0 = sender, rank 1 = receiver), part ``s`` of the
channel's stream travels as one message with tag ``s``::

    sender -> receiver   [ PartHeader (HEADER_BYTES) | payload (header.payload_nbytes) ]
    receiver -> sender   Ack (ACK_WORDS int64 words), for the last part of a message only

The receiver keeps a few receives posted ahead (``RecvRing``), each as large as its
``max_part_bytes`` (sent in ``OpenReply``): a part lands without a rendezvous round trip.
With CUDA tensors (nccl) the header goes alone on the gloo group and the payload follows
on the nccl group. Tags are used once per channel; after ``MAX_SEQ`` parts the channel
is replaced. A *message* is one ``send()`` call's layers for one route, cut into parts of
at most ``max_part_bytes``. A transfer may end with a *trailer* (``Kind.TRAILER``): one
header-only part from sender rank 0 to receiver rank 0 whose header carries a ``Trailer``
(the first token and cached-token count), covered by the header checksum.

Channel opening goes through the receiver's rendezvous store (``ReceiverInfo``,
``OpenRequest``, ``OpenReply``): length-prefixed fields, see ``_Codec``.
Torch-free.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import astuple, dataclass, fields, replace
from typing import ClassVar

import xxhash

from engine.kvcache.layout import KVLayout, decode_layout, encode_layout

MAGIC = 0x7064_6B76_0003  # "pdkv", protocol version 3 (authenticated channels)
MAX_SEQ = (1 << 31) - 3  # tags fit a non-negative int32 below engine's ABORT_TAG
HEADER_BYTES = 256  # room for the header words; keeps the payload 256-byte aligned
# uint8: bytes (an int8 cache's slots or an fp8 cache's values; the layout says which)
DTYPE_CODES = {"float32": 1, "float16": 2, "bfloat16": 3, "uint8": 4}


class Kind(enum.IntEnum):
    DATA = 1
    CLOSE = 2  # the sender closes an idle channel on purpose; acknowledged, then cut
    TRAILER = 3  # a transfer's last message: no payload, the header carries a ``Trailer``


class Flag(enum.IntFlag):
    NONE = 0
    LAST_PART = 1  # last part of its message: the receiver acknowledges it
    CANCELLED = 2  # the sender aborted the transfer: no payload follows, KV unusable


class ChecksumAlgo(enum.IntEnum):
    XXH3_64 = 1  # host memory (gloo / CPU tensors)
    TORCH_SUM64 = 2  # device memory (nccl / CUDA tensors), see kvtransfer.wire.checksum


class Status(enum.IntEnum):
    """What the receiver did with a message (``Ack.status``)."""

    OK = 0
    DONE_BEFORE = 1  # the transfer had already completed: the parts were ignored
    CHECKSUM_MISMATCH = 2
    NOT_EXPECTED = 3  # unknown, aborted, failed or timed-out transfer: parts ignored
    BAD_PART = 4  # heads, rows or layout this receiver cannot take


def _u64_to_i64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _words_checksum(words: list[int]) -> int:
    return xxhash.xxh3_64_intdigest(struct.pack(f"<{len(words)}q", *words)) >> 1


@dataclass(frozen=True)
class Trailer:
    """What the prefill side knows only after computing the whole KV: the request's first
    token (sampled from the last layer's logits) and how many prompt tokens its prefix
    cache served. Sent after every layer, from sender rank 0 to receiver rank 0."""

    first_token_id: int
    num_cached_tokens: int


@dataclass(frozen=True)
class PartHeader:
    """Fixed header of one payload part. Rows are the message's ``(layer, K|V, block)``
    triples in that order (layer-major); this part carries rows ``[row_start, row_end)``
    of heads ``[head_start, head_end)`` (global head ids)."""

    magic: int
    kind: int
    seq: int
    transfer_id: int
    layout_digest: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_code: int
    block_size: int
    num_tokens: int
    layer_start: int
    layer_end: int
    head_start: int
    head_end: int
    row_start: int
    row_end: int
    payload_nbytes: int
    checksum_algo: int
    checksum: int  # unsigned 64-bit value stored two's-complement
    sender_rank: int
    sender_tp_size: int
    flags: int
    first_token_id: int = 0  # ``Kind.TRAILER`` only (the ``Trailer``); 0 on other parts
    num_cached_tokens: int = 0
    mac0: int = 0  # on an authenticated channel, the part's MAC (``kvtransfer.wire.auth``)
    mac1: int = 0

    WORDS: ClassVar[int] = 28  # the fields above + a checksum over them

    @classmethod
    def closing(cls, seq: int) -> PartHeader:
        """The header announcing a deliberate close (no payload follows)."""
        return cls(MAGIC, Kind.CLOSE, seq, *([0] * 20))

    @classmethod
    def data(cls, *, layout: KVLayout, seq: int, transfer_id: int, num_tokens: int,
             layers: tuple[int, int], heads: tuple[int, int], rows: tuple[int, int],
             payload_nbytes: int, checksum_algo: int, checksum: int, sender_rank: int,
             sender_tp_size: int, flags: int) -> PartHeader:
        """A ``Kind.DATA`` part: rows ``rows`` of global heads ``heads`` of layers
        ``layers``; ``checksum`` is the payload's unsigned 64-bit digest."""
        return cls(magic=MAGIC, kind=Kind.DATA, seq=seq, transfer_id=transfer_id,
                   **_layout_fields(layout), num_tokens=num_tokens,
                   layer_start=layers[0], layer_end=layers[1], head_start=heads[0],
                   head_end=heads[1], row_start=rows[0], row_end=rows[1],
                   payload_nbytes=payload_nbytes, checksum_algo=checksum_algo,
                   checksum=_u64_to_i64(checksum), sender_rank=sender_rank,
                   sender_tp_size=sender_tp_size, flags=flags)

    @classmethod
    def trailer_part(cls, *, layout: KVLayout, seq: int, transfer_id: int, num_tokens: int,
                     trailer: Trailer, sender_rank: int, sender_tp_size: int, flags: int
                     ) -> PartHeader:
        """A ``Kind.TRAILER`` part: no payload; the header carries ``trailer``."""
        return cls(magic=MAGIC, kind=Kind.TRAILER, seq=seq, transfer_id=transfer_id,
                   **_layout_fields(layout), num_tokens=num_tokens, layer_start=0,
                   layer_end=0, head_start=0, head_end=0, row_start=0, row_end=0,
                   payload_nbytes=0, checksum_algo=0, checksum=0, sender_rank=sender_rank,
                   sender_tp_size=sender_tp_size, flags=flags,
                   first_token_id=trailer.first_token_id,
                   num_cached_tokens=trailer.num_cached_tokens)

    @property
    def is_last(self) -> bool:
        return bool(self.flags & Flag.LAST_PART)

    @property
    def mac(self) -> tuple[int, int]:
        return self.mac0, self.mac1

    def mac_words(self) -> list[int]:
        """The words a MAC covers: every field, the MAC's own as zero."""
        return [int(v) for v in astuple(replace(self, mac0=0, mac1=0))]

    def with_mac(self, mac: tuple[int, int]) -> PartHeader:
        return replace(self, mac0=mac[0], mac1=mac[1])

    @property
    def trailer(self) -> Trailer:
        return Trailer(self.first_token_id, self.num_cached_tokens)

    def encode(self) -> list[int]:
        words = [int(v) for v in astuple(self)]
        return [*words, _words_checksum(words)]

    @classmethod
    def decode(cls, words: list[int]) -> PartHeader:
        """Raises ``ValueError`` on a wrong size, magic or header checksum."""
        if len(words) != cls.WORDS:
            raise ValueError(f"part header has {len(words)} words, expected {cls.WORDS}")
        body, check = words[:-1], words[-1]
        if body[0] != MAGIC:
            raise ValueError(f"bad magic {body[0]:#x} (protocol version mismatch?)")
        if _words_checksum(body) != check:
            raise ValueError("part header checksum mismatch")
        return cls(*body)

    def check_layout(self, layout: KVLayout) -> str | None:
        """``None`` when this header matches ``layout``, else the first differing field."""
        expected = (layout.digest(), layout.num_layers, layout.num_kv_heads, layout.head_dim,
                    DTYPE_CODES[layout.wire_dtype], layout.block_size)
        got = (self.layout_digest, self.num_layers, self.num_kv_heads, self.head_dim,
               self.dtype_code, self.block_size)
        names = ("fingerprint", "num_layers", "num_kv_heads", "head_dim", "dtype", "block_size")
        for name, want, have in zip(names, expected, got, strict=True):
            if want != have:
                return f"{name}: {want} != {have}"
        return None


def _layout_fields(layout: KVLayout) -> dict[str, int]:
    """The header fields that name the KV layout (checked by ``PartHeader.check_layout``)."""
    return dict(layout_digest=layout.digest(), num_layers=layout.num_layers,
                num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim,
                dtype_code=DTYPE_CODES[layout.wire_dtype], block_size=layout.block_size)


assert len(fields(PartHeader)) + 1 == PartHeader.WORDS and 8 * PartHeader.WORDS <= HEADER_BYTES


@dataclass(frozen=True)
class Ack:
    """Receiver -> sender after the last part of a message."""

    transfer_id: int
    seq: int
    status: Status
    mac: tuple[int, int] = (0, 0)  # on an authenticated channel (``kvtransfer.wire.auth``)

    WORDS: ClassVar[int] = 6

    def mac_words(self) -> list[int]:
        """The words a MAC covers."""
        return [self.transfer_id, self.seq, int(self.status)]

    def with_mac(self, mac: tuple[int, int]) -> Ack:
        return replace(self, mac=mac)

    def encode(self) -> list[int]:
        words = [*self.mac_words(), *self.mac]
        return [*words, _words_checksum(words)]

    @classmethod
    def decode(cls, words: list[int]) -> Ack:
        if len(words) != cls.WORDS or _words_checksum(words[:-1]) != words[-1]:
            raise ValueError("malformed acknowledgement")
        try:
            status = Status(words[2])
        except ValueError:
            raise ValueError(f"acknowledgement with unknown status {words[2]}") from None
        return cls(words[0], words[1], status, (words[3], words[4]))


# ---------------------------------------------------------------- rendezvous messages


class _Codec:
    """Length-prefixed fields: ``q`` int64, ``s`` UTF-8 string, ``L`` KVLayout."""

    @staticmethod
    def pack(spec: str, values: tuple[object, ...]) -> bytes:
        out = [struct.pack("<q", MAGIC)]
        for code, value in zip(spec, values, strict=True):
            if code == "q":
                out.append(struct.pack("<q", int(value)))  # type: ignore[call-overload]
            elif code == "s":
                raw = str(value).encode("utf-8")
                out.append(struct.pack("<I", len(raw)) + raw)
            else:
                assert isinstance(value, KVLayout)
                out.append(encode_layout(value))
        return b"".join(out)

    @staticmethod
    def unpack(spec: str, data: bytes) -> list[object]:
        try:
            if struct.unpack_from("<q", data, 0)[0] != MAGIC:
                raise ValueError("bad magic (protocol version mismatch?)")
            values: list[object] = []
            offset = 8
            for code in spec:
                if code == "q":
                    values.append(struct.unpack_from("<q", data, offset)[0])
                    offset += 8
                elif code == "s":
                    (length,) = struct.unpack_from("<I", data, offset)
                    values.append(data[offset + 4 : offset + 4 + length].decode("utf-8"))
                    offset += 4 + length
                else:
                    layout, offset = decode_layout(data, offset)
                    values.append(layout)
        except (struct.error, UnicodeDecodeError) as exc:
            raise ValueError(f"malformed control message: {exc}") from exc
        if offset != len(data):
            raise ValueError(f"malformed control message: {len(data) - offset} trailing bytes")
        return values


@dataclass(frozen=True)
class ReceiverInfo:
    """What a decode worker's receivers advertise in its rendezvous store."""

    layout: KVLayout
    tp_size: int

    def encode(self) -> bytes:
        return _Codec.pack("Lq", (self.layout, self.tp_size))

    @classmethod
    def decode(cls, data: bytes) -> ReceiverInfo:
        layout, tp_size = _Codec.unpack("Lq", data)
        return cls(layout, tp_size)  # type: ignore[arg-type]


@dataclass(frozen=True)
class OpenRequest:
    """Sender -> one receiver rank's accept queue: "join group ``channel_id`` with me"."""

    channel_id: int
    sender_name: str
    sender_rank: int
    sender_tp_size: int
    receiver_rank: int
    backend: str  # "gloo" or "nccl": the data group's backend, from the sender's device
    layout: KVLayout
    nonce: str = ""  # the sender's fresh nonce (hex) when it authenticates, else ""

    SPEC: ClassVar[str] = "qsqqqsLs"

    def encode(self) -> bytes:
        return _Codec.pack(self.SPEC, astuple(self)[:6] + (self.layout, self.nonce))

    @classmethod
    def decode(cls, data: bytes) -> OpenRequest:
        return cls(*_Codec.unpack(cls.SPEC, data))  # type: ignore[arg-type]


class OpenStatus(enum.IntEnum):
    ACCEPTED = 0
    LAYOUT_MISMATCH = 1
    BUSY = 2  # every channel of the receiver is in use; retry later
    UNAUTHENTICATED = 3  # the receiver requires the cluster token and the sender sent none


@dataclass(frozen=True)
class OpenReply:
    """Receiver -> sender (store key ``reply/<channel_id>``). ``max_part_bytes``: the
    largest payload one part may carry on this channel. On an authenticating receiver,
    ``nonce`` is its fresh nonce and ``proofs`` its proofs, comma-separated (hex; see
    ``kvtransfer.wire.auth``); both "" otherwise."""

    status: OpenStatus
    receiver_tp_size: int
    max_part_bytes: int
    reason: str
    nonce: str = ""
    proofs: str = ""

    SPEC: ClassVar[str] = "qqqsss"

    def encode(self) -> bytes:
        return _Codec.pack(self.SPEC, (int(self.status), self.receiver_tp_size,
                                       self.max_part_bytes, self.reason, self.nonce,
                                       self.proofs))

    @classmethod
    def decode(cls, data: bytes) -> OpenReply:
        status, tp_size, max_part, reason, nonce, proofs = _Codec.unpack(cls.SPEC, data)
        try:
            known = OpenStatus(int(status))  # type: ignore[call-overload]
        except ValueError:
            raise ValueError(f"open reply with unknown status {status}") from None
        return cls(known, tp_size, max_part, reason, nonce, proofs)  # type: ignore[arg-type]
