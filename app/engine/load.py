"""What an engine's load and costs are, as its replica reports them in each heartbeat: requests running and
waiting, KV usage, and the measured cost of a prompt token and of a step, from vLLM's own stats loggers."""

import time
from collections import deque
from dataclasses import replace
from typing import Any

from app.protocol import LoadReport

COST_SMOOTHING = 0.2


class LoadTracker:
    """Keeps the engine's LoadReport current: vLLM's scheduler stats every step, its finished
    prefills and its NIXL transfers for the measured costs."""

    def __init__(self, kv_bytes_per_token: int, probe_window: int = 1, ranks: int = 1,
                 nixl_backends: tuple[str, ...] = (), min_measured_tokens: int = 256) -> None:
        self.report = LoadReport(nixl_backends=nixl_backends)
        self.kv_bytes_per_token = kv_bytes_per_token
        self.min_measured_tokens = min_measured_tokens
        """A real prefill re-measures the compute cost only if at least this long (the probe's
        length): a shorter one's time is mostly a step's fixed cost, which counted per token makes
        an engine that computes short appends (decode) look several times dearer than one measured
        on long prompts, and keeps turns off it until its next probe."""
        self.ranks = ranks
        """The engine's workers (tensor x pipeline parallel): vLLM reports each one's transfers."""
        self.probes: deque[float] = deque(maxlen=probe_window)
        """The last probes' costs (s a token); the least of them stands."""
        self.measured_at = 0.0
        """When the compute cost was last measured (time.monotonic())."""
        self.stepped_at = 0.0
        """When the last step's stats came (time.monotonic())."""

    def observe_step(self, running: int, waiting: int, kv_cache_usage: float, now: float | None = None) -> None:
        """Each step's stats; the time since the step before is a step's wall time if requests ran
        through it (else the engine was idle in between)."""
        now = time.monotonic() if now is None else now
        step_s = self.report.step_s
        if self.report.num_running_reqs and self.stepped_at:
            step_s = _smoothed(step_s, now - self.stepped_at)
        self.stepped_at = now
        self.report = replace(self.report, num_running_reqs=running, num_waiting_reqs=waiting,
                              kv_cache_usage=kv_cache_usage, step_s=step_s)

    def observe_prefill(self, seconds: float, computed_tokens: int, others_in_engine: int) -> None:
        """A finished prefill's time (vLLM's `prefill_time`) per token it computed, taken only when it
        ran alone: beside other requests a prefill's time includes theirs, and that cost times the
        queued tokens would count the queue twice, inflating every estimate under load."""
        if computed_tokens >= self.min_measured_tokens and seconds > 0 and others_in_engine == 0:
            cost = _smoothed(self.report.compute_s_per_token, seconds / computed_tokens)
            self.report = replace(self.report, compute_s_per_token=cost)
            self.measured_at = time.monotonic()

    def observe_probe(self, seconds_per_token: float) -> None:
        """A timed prefill the engine ran alone; the least of the recent probes is its cost. An
        idle engine's probe is slowed only by other processes (in a sweep, other systems under
        load), which its turns may never meet; the app's own load reaches the estimate through the
        turns' calibration instead."""
        self.probes.append(seconds_per_token)
        self.report = replace(self.report, compute_s_per_token=min(self.probes))
        self.measured_at = time.monotonic()

    def observe_transfers(self, stats: dict[str, Any]) -> None:
        """NIXL's transfer telemetry of this engine's reads (durations in s, sizes in bytes), one record
        per transfer per rank: the ranks' bytes add up to the tokens moved, and the ranks pull at once,
        so the time is the slowest rank's (their sum would make a pull at TP 8 look 8 times dearer)."""
        moved = sum(stats.get("bytes_transferred") or ())
        if moved and self.kv_bytes_per_token:
            seconds = slowest_rank_seconds(stats.get("transfer_duration") or [], self.ranks)
            cost = _smoothed(self.report.pull_s_per_token, seconds / (moved / self.kv_bytes_per_token))
            self.report = replace(self.report, pull_s_per_token=cost)


def slowest_rank_seconds(durations: list[float], ranks: int) -> float:
    """The time of the slowest rank's transfers. vLLM lists the ranks' records one rank after another
    (KVOutputAggregator extends rank 0's NixlKVConnectorStats with each other rank's), so `durations`
    splits into `ranks` contiguous equal parts when its length divides. Otherwise the ranks finished
    different numbers of transfers in the step and their records cannot be told apart: the total over
    all ranks then stands, which never understates the slowest rank's time (a dear pull makes placement
    recompute: slower, never wrong)."""
    per_rank, uneven = divmod(len(durations), ranks)
    if uneven:
        return sum(durations)
    return max(sum(durations[r * per_rank:(r + 1) * per_rank]) for r in range(ranks))


def _smoothed(previous: float, sample: float) -> float:
    return sample if previous == 0 else previous + COST_SMOOTHING * (sample - previous)


def load_logger_factory(load: LoadTracker):
    """A vLLM stat-logger factory that feeds each step's stats to `load`."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class LoadLogger(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
            if scheduler_stats is None:
                return
            finished = iteration_stats.finished_requests if iteration_stats else ()
            if len(finished) == 1:
                others = scheduler_stats.num_running_reqs + scheduler_stats.num_waiting_reqs
                load.observe_prefill(finished[0].prefill_time,
                                     finished[0].num_prompt_tokens - finished[0].num_cached_tokens, others)
            load.observe_step(scheduler_stats.num_running_reqs, scheduler_stats.num_waiting_reqs,
                              scheduler_stats.kv_cache_usage)
            if scheduler_stats.kv_connector_stats:
                load.observe_transfers(scheduler_stats.kv_connector_stats)

        def log_engine_initialized(self) -> None:
            pass

    return LoadLogger
