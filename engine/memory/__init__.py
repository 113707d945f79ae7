"""KV memory: the request-slot table and the token-granular KV pool (SGLang's two-level layout)."""

from engine.memory.kv_pool import TokenKVPool
from engine.memory.req_to_token import ReqToTokenPool

__all__ = ["TokenKVPool", "ReqToTokenPool"]
