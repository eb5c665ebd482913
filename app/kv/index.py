"""What is cached where: retained decode sequences and prefill replicas' recent prompts, by block hash.

Fed by the router after each turn (decode's RetainedBlocks, prefill's computed blocks); read by
the router before each turn. Plain data, no Ray: deployments/kv_index.py wraps it in an actor.

    retained:  hash(b0..bi) ──▶ {sequence keys}     sequences: key ──▶ RetainedBlocks
    prefill:   replica ──▶ LRU{hash(b0..bi): CONFIRMED (KV events) | predicted-at (router history)}
    replicas:  replica ──▶ (ReplicaInfo, last heartbeat); unrenewed ones are dropped with their data

A retained sequence is read at most once (vLLM frees it after the first read), so it has one
owner: whoever `take`s it out of the index. Only the owner pulls it or releases it.
"""

import time
from collections import OrderedDict
from typing import TYPE_CHECKING

from app.kv.hashing import DEFAULT_HASH_ALGO, DEFAULT_HASH_SEED, block_hashes
from app.protocol import PrefixLookup, ReplicaInfo, RetainedBlocks, RetainedMatch, Role

if TYPE_CHECKING:
    from app.config import AppConfig

SequenceKey = tuple[str, str]  # (decode replica id, engine request id)
CONFIRMED = -1.0  # a prefill block reported by the engine's KV events, not only predicted


class KVIndex:
    @classmethod
    def of(cls, config: "AppConfig") -> "KVIndex":
        return cls(config.block_size, config.limits.index_blocks_per_replica, config.prefix_hash_seed,
                   predicted_ttl_s=config.placement.predicted_block_ttl_s, hash_algo=config.prefix_hash_algo)

    def __init__(self, block_size: int, prefill_capacity_blocks: int = 100_000,
                 hash_seed: int = DEFAULT_HASH_SEED, predicted_confidence: float = 0.8,
                 predicted_ttl_s: float = 300.0, hash_algo: str = DEFAULT_HASH_ALGO) -> None:
        self.block_size, self.hash_seed, self.hash_algo = block_size, hash_seed, hash_algo
        self.predicted_confidence, self.predicted_ttl_s = predicted_confidence, predicted_ttl_s
        self.prefill_capacity_blocks = prefill_capacity_blocks
        self.replicas: dict[str, ReplicaInfo] = {}
        self._last_seen: dict[str, float] = {}
        self._sequences: dict[SequenceKey, RetainedBlocks] = {}
        self._sequence_hashes: dict[SequenceKey, list[bytes]] = {}
        self._by_hash: dict[bytes, set[SequenceKey]] = {}
        self._prefill_blocks: dict[str, OrderedDict[bytes, float]] = {}  # hash -> predicted at | CONFIRMED

    def register(self, info: ReplicaInfo, now: float | None = None) -> bool:
        """Register or renew (a heartbeat); True when the replica was not registered before."""
        new = info.replica_id not in self.replicas
        self.replicas[info.replica_id] = info
        self._last_seen[info.replica_id] = time.time() if now is None else now
        if info.role == Role.PREFILL:
            self._prefill_blocks.setdefault(info.replica_id, OrderedDict())
        return new

    def expire_replicas(self, ttl_s: float, now: float | None = None) -> list[str]:
        """Drop replicas whose heartbeat stopped (their engine died or they were stopped)."""
        now = time.time() if now is None else now
        stale = [r for r, seen in self._last_seen.items() if now - seen > ttl_s]
        for replica_id in stale:
            self.unregister(replica_id)
        return stale

    def unregister(self, replica_id: str) -> None:
        self.replicas.pop(replica_id, None)
        self._last_seen.pop(replica_id, None)
        self._prefill_blocks.pop(replica_id, None)
        for key in [k for k in self._sequences if k[0] == replica_id]:
            self.forget_retained(key)

    def replica_ids(self, role: Role) -> list[str]:
        return sorted(r.replica_id for r in self.replicas.values() if r.role == role)

    # ---- decode's retained sequences -------------------------------------------------------
    def retained_hashes(self, salt: str, retained: RetainedBlocks) -> list[bytes]:
        return block_hashes(list(retained.token_ids), self.block_size, salt, self.hash_seed, self.hash_algo)

    def record_retained(self, salt: str, retained: RetainedBlocks, hashes: list[bytes] | None = None) -> None:
        """`hashes`: the sequence's block hashes, if the caller computed them already."""
        key = retained.key
        hashes = self.retained_hashes(salt, retained) if hashes is None else hashes
        self._sequences[key] = retained
        self._sequence_hashes[key] = hashes
        for h in hashes:
            self._by_hash.setdefault(h, set()).add(key)

    def holds(self, key: SequenceKey) -> bool:
        """True while nobody has taken the retained sequence `key`."""
        return key in self._sequences

    def forget_retained(self, key: SequenceKey) -> RetainedBlocks | None:
        retained = self._sequences.pop(key, None)
        for h in self._sequence_hashes.pop(key, []):
            keys = self._by_hash.get(h)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._by_hash[h]
        return retained

    def expire(self, now: float | None = None) -> int:
        now = time.time() if now is None else now
        stale = [k for k, r in self._sequences.items() if r.handoff.expiry_time <= now]
        for key in stale:
            self.forget_retained(key)
        return len(stale)

    def _longest_retained(self, hashes: list[bytes], now: float) -> RetainedMatch | None:
        best: RetainedMatch | None = None
        candidates: set[SequenceKey] = set()
        for depth, h in enumerate(hashes, start=1):
            # Chained hashes: a sequence holding block i's hash holds blocks 0..i-1 too.
            live = {k for k in self._by_hash.get(h, ()) if self._sequences[k].handoff.expiry_time > now}
            if not live:
                break
            candidates = live
            key = max(candidates, key=lambda k: self._sequences[k].handoff.expiry_time)
            best = RetainedMatch(retained=self._sequences[key], matched_blocks=depth)
        return best

    # ---- prefill replicas' recent work -----------------------------------------------------
    def record_prefill(self, replica_id: str, hashes: list[bytes], now: float | None = None) -> None:
        """The router's prediction: the replica just computed these blocks (lower confidence)."""
        self._store(replica_id, hashes, time.time() if now is None else now)

    def blocks_stored(self, replica_id: str, hashes: list[bytes]) -> None:
        """The engine's own word (KV events): these blocks are in its prefix cache now."""
        self._store(replica_id, hashes, CONFIRMED)

    def _store(self, replica_id: str, hashes: list[bytes], stamp: float) -> None:
        info = self.replicas.get(replica_id)
        if info is None or not info.prefix_caching:
            return
        blocks = self._prefill_blocks[replica_id]
        for h in hashes:
            blocks[h] = CONFIRMED if blocks.get(h) == CONFIRMED else stamp
            blocks.move_to_end(h)
        while len(blocks) > self.prefill_capacity_blocks:
            blocks.popitem(last=False)

    def blocks_removed(self, replica_id: str, hashes: list[bytes]) -> None:
        blocks = self._prefill_blocks.get(replica_id)
        for h in hashes if blocks is not None else ():
            blocks.pop(h, None)

    def blocks_cleared(self, replica_id: str) -> None:
        if replica_id in self._prefill_blocks:
            self._prefill_blocks[replica_id].clear()

    def _prefill_cached_tokens(self, hashes: list[bytes], now: float) -> dict[str, int]:
        """Expected leading tokens per prefill replica: confirmed blocks count fully, predicted
        ones by their confidence until they age out."""
        cached = {}
        for replica_id in self.replica_ids(Role.PREFILL):
            blocks, expected = self._prefill_blocks[replica_id], 0.0
            for h in hashes:
                stamp = blocks.get(h)
                if stamp is None or (stamp != CONFIRMED and now - stamp > self.predicted_ttl_s):
                    break
                expected += 1.0 if stamp == CONFIRMED else self.predicted_confidence
            cached[replica_id] = int(expected * self.block_size)
        return cached

    # ---- the question the router asks ------------------------------------------------------
    def lookup(self, hashes: list[bytes], now: float | None = None, take: SequenceKey | None = None) -> PrefixLookup:
        """`take`: a retained sequence the caller claims if it is the longest match (a turn that
        extends it, as its router's near cache says): taken in the same call, so a pull needs one."""
        now = time.time() if now is None else now
        retained = self._longest_retained(hashes, now)
        taken = take is not None and retained is not None and retained.retained.key == take
        if taken:
            self.forget_retained(take)
        return PrefixLookup(prefill_cached_tokens=self._prefill_cached_tokens(hashes, now), retained=retained,
                            taken=taken)

    def stats(self) -> dict[str, int]:
        return {"retained_sequences": len(self._sequences), "retained_hashes": len(self._by_hash),
                "prefill_blocks": sum(len(b) for b in self._prefill_blocks.values()),
                "replicas": len(self.replicas)}
