"""Decode group: reads prefill's KV over NIXL (or, for a short append, computes the prompt itself
from its prefix cache), streams tokens, and ends with the block metadata of the sequence it keeps
for the next turn. router ──DecodeRequest──▶ generate() ──ReplyChunk…──▶ router.

Kept sequences are a cache, not a reservation: past `limits.retained_pool_share` of the pool (counting
only what the index still holds: later turns take the rest), or while requests wait for blocks
(waiting, with the pool at least `limits.retained_yield_usage` full), the oldest are taken out of
the index and released. With tenants, what trimming for the pool share releases comes first from the
tenants past `limits.tenant_share` of that share, their oldest (tenant_share): one tenant's long
conversations cannot push out the others'; while the pool share has room, any tenant may use it.
"""

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict

from ray import serve
from ray.serve import metrics
from ray.serve.config import RequestRouterConfig

from app.protocol import RetainedBlocks, Role
from deployments.engine_replica import EngineReplica
from deployments.targeted_router import TargetedRequestRouter

logger = logging.getLogger("ray.serve")


@serve.deployment(request_router_config=RequestRouterConfig(request_router_class=TargetedRequestRouter))
class DecodeServer(EngineReplica):
    role = Role.DECODE

    async def __init__(self, config, index, prefill) -> None:
        await super().__init__(config, index)
        self.prefill = prefill.options(_by_reference=False)
        self.kept: OrderedDict[str, RetainedBlocks] = OrderedDict()
        """What this engine holds for next turns, oldest first (by engine request id)."""
        self.released_metric = metrics.Counter(
            "kv_loop_kept_released", "Sequences decode kept for a next turn and released before their TTL: "
            "past its pool share (pool_share), a tenant's share of it (tenant_share) or for requests waiting for "
            "blocks (waiting).", tag_keys=("cause",))
        self._trimmer = asyncio.get_event_loop().create_task(self._trim_forever())

    def on_retained(self, retained: RetainedBlocks) -> None:
        self.kept[retained.handoff.request_id] = retained

    def kept_blocks(self, now: float) -> int:
        for request_id in [r for r, k in self.kept.items() if k.handoff.expiry_time <= now]:
            del self.kept[request_id]  # vLLM freed them at its TTL
        return sum(_blocks(k) for k in self.kept.values())

    async def _trim_forever(self) -> None:
        limits = self.config.limits
        while not self.engine.llm.errored:
            if self._quiet(limits.retained_trim_idle_interval_s):
                # Idle: nothing kept can grow or be wanted until a request comes, which wakes this.
                self.request_arrived.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.request_arrived.wait(), limits.retained_trim_idle_interval_s)
            else:
                await asyncio.sleep(limits.retained_trim_interval_s)
            try:
                await self._trim()
            except Exception:  # noqa: BLE001 - trimming is an optimisation; the TTL still frees blocks
                logger.exception("trimming retained sequences failed")

    def _quiet(self, for_s: float) -> bool:
        """No request in the engine, and none for `for_s`."""
        return not self.engine.in_flight and time.monotonic() - self.engine.quiet_since >= for_s

    async def _trim(self) -> None:
        await self._forget_taken()
        load, limits = self.engine.load, self.config.limits
        budget = int(self.engine.pool_blocks * limits.retained_pool_share)
        over = self.kept_blocks(time.time()) - budget
        if over > 0 and self.config.tenant_quotas:
            over -= await self._trim_tenants(int(budget * limits.tenant_share), over)
        if over > 0:
            await self._release_oldest(over, "pool_share")
        # Requests also wait for the step's token budget, with the pool far from full: releasing then
        # only costs later turns their KV, so waiting requests release only past `retained_yield_usage`.
        elif load.num_waiting_reqs > 0 and load.kv_cache_usage >= limits.retained_yield_usage:
            await self._release_oldest(0, "waiting", at_least_one=True)

    async def _trim_tenants(self, quota: int, blocks: int) -> int:
        """Release up to `blocks` from the tenants past `quota`, furthest past first; the blocks released."""
        held: dict[str, int] = {}
        for retained in self.kept.values():
            held[retained.tenant] = held.get(retained.tenant, 0) + _blocks(retained)
        released = 0
        for tenant, tenant_blocks in sorted(held.items(), key=lambda item: -item[1]):
            if tenant_blocks <= quota or released >= blocks:
                break
            released += await self._release_oldest(min(tenant_blocks - quota, blocks - released), "tenant_share",
                                                   tenant=tenant)
        return released

    async def _forget_taken(self) -> None:
        """Stop counting the kept sequences a later turn took (pulled, or continued here and
        released): nobody tells decode, and counted as held they make the pool share bind on a
        fraction of the KV really held. A sequence kept within the last
        `bookkeeping_timeout_s` may not be recorded yet (its turn's record call is in flight): it stays."""
        recorded_by = time.time() + self.config.retention_ttl_s - self.config.limits.bookkeeping_timeout_s
        keys = [(self.replica_id, r) for r, k in self.kept.items() if k.handoff.expiry_time <= recorded_by]
        if not keys:
            return
        try:
            held = set(await asyncio.wait_for(self.index.held.remote(keys), self.config.limits.bookkeeping_timeout_s))
        except Exception as exc:  # noqa: BLE001 - the index restarts: count them all until it answers
            logger.debug("which kept sequences are held: %s", f"{type(exc).__name__}: {exc}"[:200])
            return
        for key in keys:
            if key not in held:
                self.kept.pop(key[1], None)

    async def _release_oldest(self, blocks: int, cause: str, at_least_one: bool = False,
                              tenant: str | None = None) -> int:
        """Take the oldest kept sequences (of `tenant`, if given) out of the index until they cover
        `blocks` (with `at_least_one`, until one of them was still there) and release what the index
        handed over; the blocks that left the pool. A sequence taken since it was counted (or not yet
        recorded when `_forget_taken` asked) leaves the pool anyway, so it counts against `blocks`.
        One index call a tick: a call per kept sequence was one per reply once the pool share bound."""
        timeout, left = self.config.limits.bookkeeping_timeout_s, 0
        while self.kept and (blocks > 0 or at_least_one):
            oldest, covered = self._oldest(max(blocks, 1), tenant, waits_for_blocks=cause == "waiting")
            if not oldest:
                break
            chosen = {r.handoff.request_id: r for r in oldest}
            blocks, left = blocks - covered, left + covered
            for request_id in chosen:
                del self.kept[request_id]
            keys = [(self.replica_id, request_id) for request_id in chosen]
            for _, request_id in await asyncio.wait_for(self.index.take_all.remote(keys), timeout):
                at_least_one = False
                await asyncio.wait_for(self.prefill.release.remote(chosen[request_id].handoff), timeout)
                self.kept_released += 1
                self.released_metric.inc(1, {"cause": cause})
                logger.info("released retained sequence %s (%s)", request_id, cause)
        return left

    def _oldest(self, blocks: int, tenant: str | None, waits_for_blocks: bool) -> tuple[list[RetainedBlocks], int]:
        """The oldest kept sequences (of `tenant`, if given) whose blocks add up to at least `blocks`,
        and their blocks; those waiting out a tool's run last, unless requests wait for blocks."""
        chosen, covered, now = [], 0, time.time()
        order = self.kept.values() if waits_for_blocks else sorted(self.kept.values(),
                                                                    key=lambda r: r.paused_until > now)
        for retained in order:
            if covered >= blocks:
                break
            if tenant is not None and retained.tenant != tenant:
                continue
            chosen.append(retained)
            covered += _blocks(retained)
        return chosen, covered


def _blocks(retained: RetainedBlocks) -> int:
    """The pool blocks a kept sequence holds (its first KV-cache group's)."""
    return len(retained.handoff.block_ids[0])
