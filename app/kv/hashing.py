"""Chained block hashes of token ids, scoped by a tenant's cache salt: the KV index's keys, computed
exactly as vLLM computes its prefix-cache block hashes (`prefix_caching_hash_algo`: xxhash_cbor,
or sha256_cbor once tenants share the engines; NONE_HASH from the shared PYTHONHASHSEED the engine
adapter sets), so the router's keys and the engines' own cache events name the same blocks.

    seed ──▶ NONE ──▶ h0 = H(NONE, block0, (("cache_salt", salt),)) ──▶ h1 = H(h0, block1, None) ──▶ ...
    H(x) = xxh3_128(cbor(x, canonical)) or sha256(cbor(x, canonical))

A block's hash depends on every token before it, so equal hashes at position i mean equal
prefixes of (i + 1) blocks, and two tenants' identical prompts never share a hash.
"""

import hashlib
from functools import lru_cache

import cbor2
import xxhash

DEFAULT_HASH_ALGO = "xxhash_cbor"
DIGESTS = {"xxhash_cbor": xxhash.xxh3_128_digest, "sha256_cbor": lambda data: hashlib.sha256(data).digest()}
"""vLLM's hash functions of the same names (vllm/utils/hashing.py), which a unit test keeps equal."""
DEFAULT_HASH_SEED = 1729
"""PYTHONHASHSEED for every engine: vLLM derives its root hash from it (must be an integer)."""


def _digest(value, algo: str) -> bytes:
    return DIGESTS[algo](cbor2.dumps(value, canonical=True))


@lru_cache(maxsize=8)
def none_hash(seed: int, algo: str) -> bytes:
    return _digest(str(seed), algo)


def block_hashes(token_ids: list[int], block_size: int, salt: str, seed: int = DEFAULT_HASH_SEED,
                 algo: str = DEFAULT_HASH_ALGO) -> list[bytes]:
    """Hashes of the full blocks of `token_ids`; a trailing partial block has none."""
    hashes = []
    parent = none_hash(seed, algo)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        extra = (("cache_salt", salt),) if start == 0 and salt else None
        parent = _digest((parent, tuple(token_ids[start:start + block_size]), extra), algo)
        hashes.append(parent)
    return hashes


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
