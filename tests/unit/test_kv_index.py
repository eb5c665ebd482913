from app.kv.hashing import block_hashes
from app.kv.index import KVIndex
from app.protocol import Role
from tests.factories import BLOCK, replica, retained

NOW = 1000.0


def _index() -> KVIndex:
    index = KVIndex(block_size=BLOCK, prefill_capacity_blocks=8)
    index.register(replica("p0"))
    index.register(replica("p1", prefix_caching=False))
    index.register(replica("d0", role=Role.DECODE))
    return index


def test_lookup_finds_the_longest_retained_prefix():
    index = _index()
    history = list(range(200))
    index.record_retained("t", retained(history[:100], NOW + 60, request_id="short"))
    index.record_retained("t", retained(history, NOW + 60, request_id="long"))
    prompt = history + [999] * 40
    match = index.lookup(block_hashes(prompt, BLOCK, "t"), now=NOW).retained
    assert match.retained.handoff.request_id == "long"
    assert match.matched_blocks == 200 // BLOCK


def test_a_lookup_takes_the_sequence_it_names_only_when_that_is_the_longest_match():
    index = _index()
    history = list(range(200))
    short, long = retained(history[:100], NOW + 60, request_id="short"), retained(history, NOW + 60, request_id="long")
    index.record_retained("t", short)
    index.record_retained("t", long)
    hashes = block_hashes(history + [999] * 40, BLOCK, "t")
    assert not index.lookup(hashes, now=NOW, take=short.key).taken and index.holds(short.key)
    answer = index.lookup(hashes, now=NOW, take=long.key)
    assert answer.taken and answer.retained.retained == long and not index.holds(long.key)
    assert index.lookup(hashes, now=NOW, take=long.key).retained.retained == short, "taken once"


def test_other_salt_and_expired_sequences_do_not_match():
    index = _index()
    index.record_retained("tenant-a", retained(list(range(128)), NOW + 60))
    assert index.lookup(block_hashes(list(range(128)), BLOCK, "tenant-b"), now=NOW).retained is None
    assert index.lookup(block_hashes(list(range(128)), BLOCK, "tenant-a"), now=NOW + 61).retained is None
    assert index.expire(now=NOW + 61) == 1
    assert index.stats()["retained_hashes"] == 0


def test_forget_retained_removes_every_hash():
    index = _index()
    index.record_retained("t", retained(list(range(128)), NOW + 60, request_id="r"))
    index.forget_retained(("d0", "r"))
    assert index.stats() == {"retained_sequences": 0, "retained_hashes": 0, "prefill_blocks": 0, "replicas": 3}


def test_prefill_blocks_are_recorded_only_where_prefix_caching_is_on_and_stay_bounded():
    index = _index()
    hashes = block_hashes(list(range(320)), BLOCK, "t")  # 10 blocks, capacity 8
    index.blocks_stored("p0", hashes[:4])
    index.blocks_stored("p1", hashes[:4])
    cached = index.lookup(hashes[:4], now=NOW).prefill_cached_tokens
    assert cached == {"p0": 4 * BLOCK, "p1": 0}
    index.blocks_stored("p0", hashes)
    assert index.stats()["prefill_blocks"] == 8
    assert index.lookup(hashes, now=NOW).prefill_cached_tokens["p0"] == 0, "LRU dropped the first blocks"


def test_predicted_blocks_count_by_confidence_and_age_out():
    index = _index()
    hashes = block_hashes(list(range(128)), BLOCK, "t")
    index.blocks_stored("p0", hashes[:2])
    index.record_prefill("p0", hashes, now=NOW)
    assert index.lookup(hashes, now=NOW + 1).prefill_cached_tokens["p0"] == int((2 + 2 * 0.8) * BLOCK)
    assert index.lookup(hashes, now=NOW + 301).prefill_cached_tokens["p0"] == 2 * BLOCK, "predictions aged out"


def test_unregister_drops_a_replicas_records():
    index = _index()
    index.record_retained("t", retained(list(range(64)), NOW + 60))
    index.unregister("d0")
    assert index.replica_ids(Role.DECODE) == []
    assert index.stats()["retained_sequences"] == 0


def test_index_follows_a_recorded_engine_event_stream():
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

    from app.kv import events as kv_events
    from app.protocol import KVEvents

    def apply(batch):
        kv_events.apply(index, KVEvents("p0", kv_events.reduce(batch)))

    index = _index()
    hashes = block_hashes(list(range(128)), BLOCK, "t")
    stored = BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=list(range(128)), block_size=BLOCK,
                         lora_id=None, medium="GPU", lora_name=None)
    apply(KVEventBatch(ts=0.0, events=[stored]))
    assert index.lookup(hashes, now=NOW).prefill_cached_tokens["p0"] == 128
    apply(KVEventBatch(ts=1.0, events=[BlockRemoved(block_hashes=hashes[2:], medium="GPU")]))
    assert index.lookup(hashes, now=NOW).prefill_cached_tokens["p0"] == 64, "an LRU eviction shortens the hit"
    apply(KVEventBatch(ts=2.0, events=[AllBlocksCleared()]))
    assert index.lookup(hashes, now=NOW).prefill_cached_tokens["p0"] == 0


def test_a_replica_that_stops_renewing_its_registration_is_forgotten_with_its_sequences():
    index = KVIndex(block_size=BLOCK)
    index.register(replica("p0"), now=NOW)
    index.register(replica("d0", role=Role.DECODE), now=NOW)
    index.record_retained("t", retained(list(range(128)), NOW + 60, request_id="r"))
    index.register(replica("p0"), now=NOW + 4)
    assert index.expire_replicas(ttl_s=5.0, now=NOW + 6) == ["d0"]
    assert index.replica_ids(Role.DECODE) == [] and index.replica_ids(Role.PREFILL) == ["p0"]
    assert index.stats()["retained_sequences"] == 0
    assert index.register(replica("d0", role=Role.DECODE), now=NOW + 7), "a restarted replica registers anew"


def test_a_retained_sequence_has_one_owner():
    index = _index()
    index.record_retained("t", retained(list(range(128)), NOW + 60, request_id="r"))
    assert index.holds(("d0", "r")) and index.holds(("d0", "r")), "asking does not claim"
    assert index.forget_retained(("d0", "r")) is not None
    assert index.forget_retained(("d0", "r")) is None, "the second claimant gets nothing"
    assert not index.holds(("d0", "r"))
