"""Errors of the KV data plane. Every failed transfer raises a ``TransferError``; the
KV it was moving must not be used (the receiver's blocks hold unspecified bytes)."""

from __future__ import annotations


class TransferError(RuntimeError):
    """A transfer failed; ``transfer_id`` is None for errors not tied to one transfer."""

    def __init__(self, message: str, transfer_id: int | None = None) -> None:
        super().__init__(message if transfer_id is None else f"transfer {transfer_id}: {message}")
        self.transfer_id = transfer_id


class TransferTimeout(TransferError):
    """No completion within the deadline (peer stalled, or never sent)."""


class ChannelError(TransferError):
    """The channel broke (peer died, hung past the timeout, or closed it); the channel
    is destroyed and a later transfer opens a new one."""


class PeerUnresponsive(ChannelError):
    """The peer did not answer for a whole timeout, or could not be reached: what is
    queued behind it for the same peer would wait as long."""


class ChannelClosed(ChannelError):
    """The connection was closed (by the peer, or here) rather than timing out: a
    transfer that had not started on it can be retried on a new channel."""


class ChecksumMismatch(TransferError):
    """A payload arrived corrupted; nothing of it was written into the blocks."""


class LayoutMismatch(TransferError):
    """The peers' model fingerprint or KV layout differ; the message names the field."""


class TransferRejected(TransferError):
    """The receiver did not take the transfer (not expected, aborted, or invalid parts)."""
