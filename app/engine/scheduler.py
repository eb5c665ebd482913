"""vLLM's scheduler with later turns first within a step, not only in the waiting queue.

vLLM's priority policy orders the waiting queue, but every step schedules the running requests
before any waiting one: a first turn whose prompt is being computed in chunks takes the step's
token budget step after step, and a later turn that arrives behind it waits until that whole
prompt is done. Here, in a step where a request of higher priority waits to start, the running
chunks of lower-priority prompts sit the step out, and the waiting prompt takes their place; they
go on in the next step. Only for a prompt this engine computes: one that reads its KV from another
engine only starts a transfer in its first step, so a pause for each such read costs the running
first turns a step each and brings later turns' first tokens later, not sooner
(docs/measurements.md). A waiting request that still could not start (no free blocks) gets no
second pause, so chunks are never held back for long.

Installed in every engine (the benchmark's peers' too) when `AppConfig.later_turns_before_chunks`.
"""

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus


class LaterTurnsBeforeChunks:
    """Mixed into vLLM's Scheduler (CPU engines, where vLLM turns async scheduling off) or its
    AsyncScheduler (GPU engines)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.made_room_for: str | None = None
        """The waiting request the last pause was for: if it still waits, no second pause for it."""

    def schedule(self, *args, **kwargs):
        paused = self.chunks_to_pause()
        if not paused:
            return super().schedule(*args, **kwargs)
        self.running = [r for r in self.running if r not in paused]
        # The paused requests keep their places in the model runner: admit no more than fit beside them.
        self.max_num_running_reqs -= len(paused)
        self.max_num_active_reqs -= len(paused)
        try:
            return super().schedule(*args, **kwargs)
        finally:
            self.max_num_running_reqs += len(paused)
            self.max_num_active_reqs += len(paused)
            self.running = paused + self.running

    def chunks_to_pause(self) -> list[Request]:
        if self.policy != SchedulingPolicy.PRIORITY or not self.waiting:
            return []
        # A reply that reads its KV (a continuation, first in the queue) takes no step budget to start:
        # the first request that computes its prompt here decides.
        first = next((r for r in self.waiting if not _reads_kv(r)), None)
        if first is None or first.status != RequestStatus.WAITING or first.request_id == self.made_room_for:
            return []
        paused = [r for r in self.running if r.is_prefill_chunk and r.priority > first.priority]
        if paused:
            self.made_room_for = first.request_id
        return paused


def _reads_kv(request: Request) -> bool:
    return (request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            or bool((request.kv_transfer_params or {}).get("remote_block_ids")))


class LaterTurnsFirstScheduler(LaterTurnsBeforeChunks, Scheduler):
    pass


class LaterTurnsFirstAsyncScheduler(LaterTurnsBeforeChunks, AsyncScheduler):
    pass
