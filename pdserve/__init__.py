"""pdserve: disaggregated prefill/decode LLM serving.

The command line lives in ``pdserve.cli`` (``pdserve --help``). The offline engine is
``engine.LLM``; the cluster client SDK arrives with the router.
"""

__version__ = "0.1.0"
