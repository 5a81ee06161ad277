"""``PromptKV``: what the router knows of one request's prompt in the workers' prefix
caches, for ``Placement``: the prompt's block hashes (each salt's computed once, when first
needed), whether the KV index can be trusted (kv-aware routing, an index that is in sync),
the leading blocks each worker holds by the index, and the prompt's affinity key.
"""

from __future__ import annotations

from engine.kvcache.block_hash import compute_block_hashes
from router.lifecycle.context import RequestContext
from router.recent_kv import RecentKV
from router.routing import affinity_key


class PromptKV:
    """The KV index's view of ``ctx``'s prompt (see the module docstring)."""

    def __init__(self, ctx: RequestContext) -> None:
        self.ctx = ctx
        self._hashes: dict[str, list[bytes]] = {}  # the prompt's block hashes by salt, once used

    def trusted(self) -> bool:
        """Routing is kv-aware and the index can be trusted."""
        index = self.ctx.kv_index
        return self.ctx.config.prefill_routing == "kv-aware" and index is not None \
            and index.trusted()

    def cached_blocks(self, worker_ids: list[str], salt: str = "",
                      recent: RecentKV | None = None) -> dict[str, int]:
        """Leading prompt blocks each worker holds, under ``salt``'s keys (kv-aware with a
        trusted index; else none known), or by what ``recent`` saw land there, which the
        index may not list yet."""
        if not self.trusted():
            return {}
        assert self.ctx.kv_index is not None
        hashes = self.block_hashes(salt)
        found = self.ctx.kv_index.match(hashes, worker_ids)
        if recent is not None:
            found = {w: max(n, recent.held_blocks(w, hashes)) for w, n in found.items()}
        return found

    def block_hashes(self, salt: str = "") -> list[bytes]:
        if salt not in self._hashes:
            ctx = self.ctx
            self._hashes[salt] = compute_block_hashes(ctx.request.prompt_token_ids,
                                                      ctx.block_size, seed=ctx.hash_seed,
                                                      salt=salt)
        return self._hashes[salt]

    def affinity_key(self) -> bytes:
        """The prompt's prefill affinity key (hashing only the blocks it needs, unless
        they are all hashed already)."""
        ctx = self.ctx
        prompt = ctx.request.prompt_token_ids
        hashes = self._hashes[""] if "" in self._hashes else compute_block_hashes(
            prompt[:ctx.config.affinity_blocks * ctx.block_size], ctx.block_size,
            seed=ctx.hash_seed)
        return affinity_key(hashes, prompt, ctx.config.affinity_blocks)
