"""pdserve: disaggregated prefill/decode LLM serving.

The command line lives in ``pdserve.cli`` (``pdserve --help``). The offline engine is
``engine.LLM``. The client SDK of a running cluster:

    import pdserve

    with pdserve.Client("localhost:50051") as client:
        print(client.complete("Hello", max_tokens=8).text)

``Client``, ``AsyncClient`` and their result and error types are imported on first use
(module ``__getattr__``), so ``import pdserve`` stays cheap: it loads neither gRPC nor
torch.

The package is what a user imports and runs: the SDK (``client``, ``aio_client``, ``results``,
``failover`` — several routers, resumed streams —, the generated public API in
``pdserve.v1``), which needs only grpcio and protobuf, and the command line (``cli``),
whose server commands need the ``pdserve[server]`` extra (``pdserve up`` runs the
launchers of ``deploy``). The SDK modules import nothing else of the tree; the command
line imports the servers lazily.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.aio_client import AsyncClient, AsyncGenerationStream
    from pdserve.client import (
        Client,
        Completion,
        GenerationChunk,
        ModelInfo,
        PdserveError,
        TokenLogprob,
        Usage,
    )

__version__ = "0.1.0"

# public name -> the module that defines it
_LAZY_EXPORTS = {
    "AsyncClient": "pdserve.aio_client",
    "AsyncGenerationStream": "pdserve.aio_client",
    "Client": "pdserve.client",
    "Completion": "pdserve.results",
    "GenerationChunk": "pdserve.results",
    "ModelInfo": "pdserve.results",
    "PdserveError": "pdserve.results",
    "TokenLogprob": "pdserve.results",
    "Usage": "pdserve.results",
}

__all__ = [
    "AsyncClient", "AsyncGenerationStream", "Client", "Completion", "GenerationChunk",
    "ModelInfo", "PdserveError", "TokenLogprob", "Usage", "__version__",
]


def __getattr__(name: str) -> Any:
    module_name = _LAZY_EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY_EXPORTS})
