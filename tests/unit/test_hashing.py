from app.hashing import block_hashes, common_prefix_len


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
    from app.tenants import cache_salt

    assert cache_salt("a") == cache_salt("a") != cache_salt("b")
