"""Where a turn's prompt is computed: on a prefill replica (decode then reads it over NIXL) or on
the decode replica that streams the reply (no hop, no transfer), whichever is estimated to give
the first token sooner, from both sides' live load and each engine's measured costs.

    on prefill P = busy_P(queued_P + to compute on P) + pulled x pull_P
    on decode D  = busy_D(queued_D + to compute on D)
    busy(tokens) = tokens x compute on an idle engine; on one with requests running, the step in
                   flight (half a step) and at least one whole step (the batch the prompt joins)
    each side then calibrated against measured turns: slope x estimate + offset (`Calibration`)
    decode wins if D + itl_weight x running_D x (to compute on D) x compute_D < P

queued: prompt tokens this router has sent the replica to compute and not yet seen answered, of
the turns that run before this one (for a later turn only later turns': engines take them before
first turns' prompts, app/engine/scheduler.py); running: decode's streams, which stall while it computes
a prompt (the itl_weight term charges for them, after calibration: it is a cost the turn puts on
others, not part of its own wait, and fitted with the wait it was scaled away); compute and pull:
seconds per token, measured by each engine (LoadReport). A decode replica whose KV pool is fuller
than the watermark, or a prompt longer than the cap, stays off decode.
"""

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from app.protocol import Estimate, LoadReport, RoutingDecision


@dataclass(frozen=True)
class PlacementPolicy:
    itl_weight: float
    """How much one running decode stream's stall counts against the new turn's wait."""
    kv_high_watermark: float
    max_decode_prefill_tokens: int
    prior_pull_share: float
    """Before an engine has pulled anything: a pulled token costs this share of a computed one."""


def pull_cost(load: LoadReport, policy: PlacementPolicy) -> float:
    return load.pull_s_per_token or load.compute_s_per_token * policy.prior_pull_share


def estimate(prefill_compute: int, pulled: int, decode_compute: int,
             prefill: LoadReport, decode: LoadReport, prefill_queued: int, decode_queued: int,
             policy: PlacementPolicy, decode_reads: int = 0) -> Estimate:
    """`prefill_compute` / `decode_compute`: prompt tokens each side would compute itself. Decode's
    read of prefill's KV is left out when prefill sends the first token before it; `decode_reads`:
    the prompt tokens decode reads first when the first token is decode's (a reply whose sampling
    reads the reply so far): an agent's tool call paid it on every turn placed on prefill."""
    decode_read = decode_reads * pull_cost(decode, policy) + compute_time(1, decode) if decode_reads else 0.0
    on_prefill = (compute_time(prefill_queued + prefill_compute, prefill) + pulled * pull_cost(prefill, policy)
                  + decode_read)
    on_decode = compute_time(decode_queued + decode_compute, decode)
    stall = policy.itl_weight * decode.num_running_reqs * decode_compute * decode.compute_s_per_token
    return Estimate(round(on_prefill * 1e3, 3), round(on_decode * 1e3, 3), prefill_queued, decode_queued,
                    decode.num_running_reqs, round(decode.kv_cache_usage, 3),
                    round(prefill.compute_s_per_token * 1e6, 3), round(decode.compute_s_per_token * 1e6, 3),
                    round(pull_cost(prefill, policy) * 1e6, 3), decode_stall_ms=round(stall * 1e3, 3),
                    prefill_step_ms=round(_busy_step(prefill) * 1e3, 3),
                    decode_step_ms=round(_busy_step(decode) * 1e3, 3), decode_read_ms=round(decode_read * 1e3, 3))


def compute_time(tokens: int, load: LoadReport) -> float:
    """Seconds to compute `tokens` on the engine. Its measured cost is a prefill's alone; an engine
    with requests running first finishes the step in flight (half a step on average), and the
    prompt's own step carries the rest of the batch: a short later turn behind first turns' chunk
    steps waits for those steps, far longer than its cost alone says."""
    alone, step = tokens * load.compute_s_per_token, _busy_step(load)
    return step / 2 + max(alone, step) if step else alone


def _busy_step(load: LoadReport) -> float:
    return load.step_s if load.num_running_reqs else 0.0


def decode_allowed(decode_compute: int, decode: LoadReport, policy: PlacementPolicy) -> bool:
    """Hard limits, whatever the estimate: the stall a long prompt puts on every stream, and a full pool."""
    return (decode_compute <= policy.max_decode_prefill_tokens
            and decode.kv_cache_usage < policy.kv_high_watermark and decode.compute_s_per_token > 0)


def place(prompt_tokens: int, on_prefill: RoutingDecision, on_decode: list[RoutingDecision],
          load: Callable[[str], LoadReport], queued: Mapping[str, int], calibration: "Calibration",
          policy: PlacementPolicy, first_token_on_decode: bool = False) -> RoutingDecision:
    """`on_prefill`, or the `on_decode` candidate of least cost (its wait plus its streams' stall)
    if less than prefill's wait; the chosen decision carries the estimate it won by. Without
    measured costs on both sides, the fixed rule: a candidate decode retaining the conversation wins.
    `first_token_on_decode`: decode samples the reply's first token wherever the prompt is computed."""
    best: RoutingDecision | None = None
    prefill_load = load(on_prefill.prefill_replica_id)
    for candidate in on_decode:
        decode_id = candidate.retained.replica_id if candidate.retained else candidate.decode_replica_id
        decode_load, decode_compute = load(decode_id), prompt_tokens - candidate.tokens_local
        if not (decode_load.compute_s_per_token and prefill_load.compute_s_per_token):
            best = best or (candidate if candidate.retained else None)
            continue
        sides = calibration.corrected(estimate(
            prompt_tokens - on_prefill.tokens_local - on_prefill.pulled_tokens, on_prefill.pulled_tokens,
            decode_compute, prefill_load, decode_load, queued.get(on_prefill.prefill_replica_id, 0),
            queued.get(decode_id, 0), policy, prompt_tokens if first_token_on_decode else 0))
        if decode_allowed(decode_compute, decode_load, policy) and sides.decode_wins and (
                best is None or best.placement is None or sides.decode_cost_ms < best.placement.decode_cost_ms):
            best = replace(candidate, placement=sides)
        elif best is None:
            on_prefill = replace(on_prefill, placement=sides)
    return best or on_prefill


class Calibration:
    """Each side's measured time to its first chunk against its raw estimate, as a line fitted
    online (exponentially weighted least squares): measured ~ slope x raw + offset. The offset is
    what the formula misses whatever the size (the prefill hop and handoff, the router's work);
    the slope, what scales with it (batching with other requests, cores shared with other
    processes). An offset alone, learned from a mix of long first turns and short appends, carries
    the first turns' errors onto the appends: it goes negative enough that every append looks free
    on both sides.

    A side's fit that no turn has refreshed for `ttl_s` is forgotten. A fit learned under one load
    would stand through the next and keep turns off its side, so nothing measures it again: an
    offset from a burst (or from warm-up turns) sends every later turn to the other side, and they
    queue there. The fits correct both sides or neither: what the formula misses on both (Serve's
    hops, an engine's admission and delivery) charged to one side alone would send a lone agent's
    next tool turn to the side no turn had gone to for `ttl_s`."""

    def __init__(self, ttl_s: float = 10.0, alpha: float = 0.05, slope_range: tuple[float, float] = (0.25, 4.0),
                 min_spread_ms: float = 10.0) -> None:
        self.ttl_s, self._fit_args = ttl_s, (alpha, slope_range, min_spread_ms)
        self.fits = {side: _LineFit(*self._fit_args) for side in ("prefill", "decode")}
        self.observed_at: dict[str, float] = {}

    def observe(self, placed: Estimate, on_decode: bool, measured_ms: float) -> None:
        """`placed`: the corrected estimate the turn was placed by; `measured_ms`: plan to the turn's first token."""
        side = "decode" if on_decode else "prefill"
        self.observed_at[side] = time.monotonic()
        raw = placed.on_decode_ms - placed.decode_residual_ms if on_decode else (
            placed.on_prefill_ms - placed.prefill_residual_ms)
        self.fits[side].add(raw, measured_ms)

    def corrected(self, raw: Estimate) -> Estimate:
        self._forget_stale(time.monotonic())
        if len(self.observed_at) < len(self.fits):
            return raw
        on_prefill = round(self.fits["prefill"].predict(raw.on_prefill_ms), 3)
        on_decode = round(self.fits["decode"].predict(raw.on_decode_ms), 3)
        return replace(raw, on_prefill_ms=on_prefill, on_decode_ms=on_decode,
                       prefill_residual_ms=round(on_prefill - raw.on_prefill_ms, 3),
                       decode_residual_ms=round(on_decode - raw.on_decode_ms, 3))

    def _forget_stale(self, now: float) -> None:
        for side, seen in list(self.observed_at.items()):
            if now - seen > self.ttl_s:
                self.fits[side] = _LineFit(*self._fit_args)
                del self.observed_at[side]


class _LineFit:
    """y ~ slope x + offset over exponentially weighted samples; slope 1 until the raw estimates
    have spread enough to tell a slope from noise, and within `slope_range` after."""

    def __init__(self, alpha: float, slope_range: tuple[float, float], min_spread_ms: float) -> None:
        self.alpha, self.slope_range, self.min_spread_ms = alpha, slope_range, min_spread_ms
        self.w = self.x = self.y = self.xx = self.xy = 0.0

    def add(self, x: float, y: float) -> None:
        keep = 1 - self.alpha
        self.w, self.x, self.y = (keep * self.w + self.alpha, keep * self.x + self.alpha * x,
                                  keep * self.y + self.alpha * y)
        self.xx, self.xy = keep * self.xx + self.alpha * x * x, keep * self.xy + self.alpha * x * y

    def predict(self, x: float) -> float:
        if self.w == 0:
            return x
        mean_x, mean_y = self.x / self.w, self.y / self.w
        variance = self.xx / self.w - mean_x * mean_x
        slope = 1.0
        if variance > self.min_spread_ms ** 2:
            low, high = self.slope_range
            slope = min(max((self.xy / self.w - mean_x * mean_y) / variance, low), high)
        return max(mean_y + slope * (x - mean_x), 0.0)
