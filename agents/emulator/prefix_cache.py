"""A prefix cache for the emulated engines: whole leading blocks of a prompt are reused.

Like vLLM's automatic prefix caching (and the other engines' KV block reuse or radix
cache), a prompt's tokens are cut into fixed-size blocks and each full
block is keyed by everything before and in it, so a block is found only when
the whole prefix up to it matches. A lookup counts the prompt's tokens as
queried and those in its leading cached blocks as hits, then caches its full
blocks (least recently used blocks are evicted past the capacity). The cached
tokens skip prefill, which is what makes a shared prefix fast.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

PREFIX_BLOCK_TOKENS = 16   # vLLM's default block size
PREFIX_CACHE_BLOCKS = 4096


class PrefixCache:
    """Cumulative counters (`queried_tokens`, `hit_tokens`, `reused_blocks`,
    `missed_blocks`) since the engine started, as the engines count them."""

    def __init__(self, *, block_tokens: int = PREFIX_BLOCK_TOKENS,
                 capacity_blocks: int = PREFIX_CACHE_BLOCKS) -> None:
        if block_tokens < 1 or capacity_blocks < 1:
            raise ValueError("block_tokens and capacity_blocks must be >= 1")
        self.block_tokens = block_tokens
        self._capacity = capacity_blocks
        self._blocks: OrderedDict[bytes, None] = OrderedDict()
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.reused_blocks = 0
        self.missed_blocks = 0

    def lookup(self, tokens: Sequence[str]) -> int:
        """Cached tokens at the start of `tokens` (whole blocks); caches its full blocks."""
        digest = hashlib.blake2b(digest_size=16)
        hits = 0
        matching = True
        full = len(tokens) // self.block_tokens
        for index in range(full):
            block = tokens[index * self.block_tokens:(index + 1) * self.block_tokens]
            digest.update("\x1f".join(block).encode() + b"\x1e")
            key = digest.copy().digest()
            if matching and key in self._blocks:
                hits += 1
                self._blocks.move_to_end(key)
                continue
            matching = False
            self._blocks[key] = None
            if len(self._blocks) > self._capacity:
                self._blocks.popitem(last=False)
        blocks = -(-len(tokens) // self.block_tokens)
        self.queried_tokens += len(tokens)
        self.hit_tokens += hits * self.block_tokens
        self.reused_blocks += hits
        self.missed_blocks += blocks - hits
        return hits * self.block_tokens
