"""Chained block hashes of token ids, scoped by a tenant's cache salt: the KV index's keys.

    salt ──▶ h0 = xxh3(block0, seed=H(salt)) ──▶ h1 = xxh3(block1, seed=h0) ──▶ ...

A block's hash depends on every token before it, so equal hashes at position i mean equal
prefixes of (i + 1) blocks, and two tenants' identical prompts never share a hash.
"""

from array import array

import xxhash


def salt_seed(salt: str) -> int:
    return xxhash.xxh3_64_intdigest(salt.encode())


def block_hashes(token_ids: list[int], block_size: int, salt: str) -> list[int]:
    """Hashes of the full blocks of `token_ids`; a trailing partial block has none."""
    hashes = []
    parent = salt_seed(salt)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = array("I", token_ids[start:start + block_size]).tobytes()
        parent = xxhash.xxh3_64_intdigest(block, seed=parent)
        hashes.append(parent)
    return hashes


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
