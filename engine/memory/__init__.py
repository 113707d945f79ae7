"""KV memory: the request-slot table, the token-granular KV pool (SGLang's two-level layout), and the
radix tree that keeps finished requests' K/V for reuse as a prefix cache."""

from engine.memory.kv_pool import TokenKVPool
from engine.memory.radix_cache import NoPrefixCache, RadixCache
from engine.memory.req_to_token import ReqToTokenPool

__all__ = ["NoPrefixCache", "RadixCache", "ReqToTokenPool", "TokenKVPool"]
