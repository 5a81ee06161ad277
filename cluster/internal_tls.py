"""Optional mutual TLS of the internal gRPC plane (router ↔ workers).

With ``--internal-tls-cert``, ``--internal-tls-key`` and ``--internal-tls-ca`` on every
router and worker, a worker serves its internal API over TLS and accepts only clients
that present a certificate signed by that CA; the router presents its own certificate and
checks each worker's against the CA (and its name against the worker's registered
address). It is independent of the cluster token: TLS keeps the calls (the token among
them) private and proves the peers' certificates; the token still says "this cluster".
The KV data plane is not carried over gRPC and is not encrypted by this (its channels are
authenticated by the token, ``kvtransfer.wire.auth``).

The option helpers are standard library only; ``grpc`` is imported when credentials are
made.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class InternalTLS:
    """PEM files of one process: its certificate (chain), its key, the cluster's CA."""

    cert_file: Path
    key_file: Path
    ca_file: Path

    def _read(self) -> tuple[bytes, bytes, bytes]:
        try:
            return (self.key_file.read_bytes(), self.cert_file.read_bytes(),
                    self.ca_file.read_bytes())
        except OSError as exc:
            raise ValueError(f"cannot read internal TLS file {exc.filename}: {exc.strerror}"
                             ) from None

    def server_credentials(self) -> Any:
        """A worker's: its certificate; clients must present one the CA signed."""
        import grpc

        key, cert, ca = self._read()
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                           require_client_auth=True)

    def channel_credentials(self) -> Any:
        """The router's, towards workers: its certificate; theirs checked against the CA."""
        import grpc

        key, cert, ca = self._read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                            certificate_chain=cert)


def add_internal_tls_args(parser: argparse.ArgumentParser) -> None:
    """The three options, shared by the router and the workers."""
    parser.add_argument("--internal-tls-cert",
                        help="mutual TLS on the internal gRPC plane: this process's PEM "
                             "certificate (chain); give all three --internal-tls-* options or "
                             "none")
    parser.add_argument("--internal-tls-key", help="... its PEM private key")
    parser.add_argument("--internal-tls-ca",
                        help="... and the PEM CA certificate every router's and worker's "
                             "certificate is signed by")


def internal_tls(args: argparse.Namespace) -> InternalTLS | None:
    """The process's internal TLS files, None without; ``ValueError`` for some but not all
    of the three options, or an unreadable file."""
    given = [args.internal_tls_cert, args.internal_tls_key, args.internal_tls_ca]
    if not any(given):
        return None
    if not all(given):
        raise ValueError("give all of --internal-tls-cert, --internal-tls-key and "
                         "--internal-tls-ca, or none")
    tls = InternalTLS(Path(args.internal_tls_cert), Path(args.internal_tls_key),
                      Path(args.internal_tls_ca))
    tls._read()  # fail at start, naming the file
    return tls
