import pytest

from app.kv.hashing import block_hashes, common_prefix_len


def test_only_full_blocks_are_hashed():
    assert len(block_hashes(list(range(95)), 32, "t")) == 2
    assert len(block_hashes(list(range(96)), 32, "t")) == 3
    assert block_hashes(list(range(31)), 32, "t") == []


def test_hashes_are_chained_on_the_whole_prefix():
    a = block_hashes(list(range(96)), 32, "t")
    b = block_hashes([7] + list(range(1, 96)), 32, "t")
    assert all(x != y for x, y in zip(a, b)), "a change in block 0 must change every later hash"
    c = block_hashes(list(range(64)) + [0] * 32, 32, "t")
    assert a[:2] == c[:2] and a[2] != c[2]


def test_salt_scopes_hashes_per_tenant():
    tokens = list(range(64))
    assert block_hashes(tokens, 32, "tenant-a") != block_hashes(tokens, 32, "tenant-b")
    assert block_hashes(tokens, 32, "tenant-a") == block_hashes(tokens, 32, "tenant-a")


def test_common_prefix_len():
    assert common_prefix_len([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_len([1, 2], [1, 2, 3]) == 2
    assert common_prefix_len([], [1]) == 0


def test_tenants_get_distinct_stable_salts():
    from app.conversations.tenants import cache_salt

    assert cache_salt("a", "secret") == cache_salt("a", "secret") != cache_salt("b", "secret")
    assert cache_salt("a", "secret") != cache_salt("a", "another secret")  # unknowable without the server's


@pytest.mark.parametrize("algo", ["xxhash_cbor", "sha256_cbor"])
def test_parity_with_vllms_own_block_hashes(monkeypatch, tmp_path, algo):
    """Same algorithm, same seed, same salt handling as the engines' prefix cache."""
    from transformers import AutoTokenizer
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    from app.kv.hashing import DEFAULT_HASH_SEED
    from app.model.tiny import corpus_lines, ensure_tiny_model

    monkeypatch.setenv("PYTHONHASHSEED", str(DEFAULT_HASH_SEED))
    hash_fn = get_hash_fn_by_name(algo)
    kv_cache_utils.init_none_hash(hash_fn)
    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model(tmp_path))
    tokens = tokenizer.encode(" ".join(corpus_lines()))
    assert len(tokens) > 500
    for salt in ("tenant-salt", None):
        expected, parent = [], None
        for start in range(0, len(tokens) - 31, 32):
            extra = (("cache_salt", salt),) if start == 0 and salt else None
            parent = kv_cache_utils.hash_block_tokens(hash_fn, parent, tokens[start:start + 32], extra)
            expected.append(bytes(parent))
        assert block_hashes(tokens, 32, salt or "", DEFAULT_HASH_SEED, algo) == expected


def test_per_user_salting_is_opt_in_per_tenant():
    import pytest

    from app.conversations.tenants import KeyRing, Unauthorized, cache_scope

    keys = KeyRing.of({"ka": "a", "kb": "b"}, ())
    assert cache_scope(keys.tenant_of("Bearer ka"), "u1", ("b",)) == "a"
    assert cache_scope("b", "u1", ("b",)) == "b/u1" != cache_scope("b", "u2", ("b",))
    assert cache_scope(KeyRing().tenant_of(None), "u1", ()) == "default"
    with pytest.raises(Unauthorized):
        keys.tenant_of("Bearer nope")
