"""Load-aware placement: the estimates, their hard limits, and the turn loop's choice from them."""

import asyncio
import time
from dataclasses import replace

from app.protocol import (
    Action,
    LoadReport,
    Membership,
    PrefillResult,
    PrefixLookup,
    Reason,
    ReplyChunk,
    RetainedMatch,
    Role,
    SamplingSettings,
)
from app.turn.placement import Calibration, PlacementPolicy, decode_allowed, estimate
from app.turn.spec import Turn
from tests.factories import handoff, retained
from tests.fakes import DecodeGroup, Remote, run_turn, turn_loop

POLICY = PlacementPolicy(itl_weight=0.05, kv_high_watermark=0.9, max_decode_prefill_tokens=2048,
                         prior_pull_share=0.05)
COST = 20e-6  # 20 us per token computed
IDLE = LoadReport(compute_s_per_token=COST, pull_s_per_token=1e-6)
PROMPT = tuple(range(1, 1025))
REPLY = [ReplyChunk(token_ids=(5,), text=" 5"), ReplyChunk(token_ids=(6,), text=" 6", finish_reason="length")]


def test_an_idle_decode_beats_a_prefill_with_a_queue():
    sides = estimate(1024, 0, 1024, IDLE, IDLE, prefill_queued=4096, decode_queued=0, policy=POLICY)
    assert sides.decode_wins
    assert sides.on_prefill_ms == round((4096 + 1024) * COST * 1e3, 3)


def test_running_streams_count_against_decode():
    busy = LoadReport(num_running_reqs=64, compute_s_per_token=COST)
    sides = estimate(1024, 0, 1024, IDLE, busy, prefill_queued=0, decode_queued=0, policy=POLICY)
    assert not sides.decode_wins
    assert sides.on_decode_ms == round(1024 * COST * 1e3, 3)  # its own wait
    assert sides.decode_stall_ms == round(0.05 * 64 * 1024 * COST * 1e3, 3)  # what its streams pay


def test_calibration_fits_the_wait_and_leaves_the_streams_stall_as_charged():
    """Fitted with the wait, the stall looked like estimation error and the slope scaled it away."""
    busy = LoadReport(num_running_reqs=64, compute_s_per_token=COST)
    calibration = _other_side_seen(Calibration(alpha=0.5), fitted="decode")
    for n in (256, 1024) * 10:
        raw = estimate(n, 0, n, IDLE, busy, 0, 0, POLICY)
        calibration.observe(calibration.corrected(raw), on_decode=True, measured_ms=raw.on_decode_ms)
    raw = estimate(1024, 0, 1024, IDLE, busy, 0, 0, POLICY)
    corrected = calibration.corrected(raw)
    assert abs(corrected.on_decode_ms - raw.on_decode_ms) < 0.01
    assert corrected.decode_stall_ms == raw.decode_stall_ms and not corrected.decode_wins


def test_an_engine_with_requests_running_costs_the_step_in_flight_and_a_whole_step():
    """Opening burst at 64 conversations: prefill in 200 ms chunk steps of first turns, decode in
    30 ms steps of its streams. A later turn's append costs prefill half a step waiting and a whole
    step computing (its 160 tokens alone would take 3 ms): decode wins it despite its streams."""
    prefill = LoadReport(num_running_reqs=8, compute_s_per_token=COST, pull_s_per_token=1e-6, step_s=0.2)
    decode = LoadReport(num_running_reqs=51, compute_s_per_token=COST, step_s=0.03)
    sides = estimate(160, 0, 160, prefill, decode, 0, 0, POLICY)
    assert (sides.on_prefill_ms, sides.on_decode_ms) == (300.0, 45.0) and sides.decode_wins
    assert (sides.prefill_step_ms, sides.decode_step_ms) == (200.0, 30.0)
    idle_prefill = estimate(160, 0, 160, replace(prefill, num_running_reqs=0), decode, 0, 0, POLICY)
    assert idle_prefill.on_prefill_ms == round(160 * COST * 1e3, 3) and not idle_prefill.decode_wins


def test_a_step_is_timed_only_when_requests_ran_through_it():
    from app.engine.load import LoadTracker

    tracker = LoadTracker(kv_bytes_per_token=1024)
    for running, now in ((0, 1.0), (2, 9.0), (2, 9.1), (0, 9.3), (1, 20.0)):
        tracker.observe_step(running, 0, 0.1, now=now)
        if now == 9.1:
            assert abs(tracker.report.step_s - 0.1) < 1e-9
    assert abs(tracker.report.step_s - (0.1 + 0.2 * (0.2 - 0.1))) < 1e-9, "idle gaps are not steps"


def test_a_pull_is_charged_at_the_measured_cost_and_at_a_prior_share_before_any():
    unmeasured = LoadReport(compute_s_per_token=COST)
    measured = estimate(64, 960, 64, IDLE, IDLE, 0, 0, POLICY)
    prior = estimate(64, 960, 64, unmeasured, unmeasured, 0, 0, POLICY)
    assert measured.on_prefill_ms == round((64 * COST + 960 * 1e-6) * 1e3, 3)
    assert prior.on_prefill_ms == round((64 * COST + 960 * COST * 0.05) * 1e3, 3)


def test_a_reply_whose_first_token_is_decode_s_charges_prefill_s_side_decode_s_read():
    """A tool call's grammar keeps the whole reply on decode: placed on prefill, it waits for
    prefill, then for decode's read of the prompt and decode's first step."""
    plain = estimate(128, 0, 128, IDLE, IDLE, 0, 0, POLICY)
    call = estimate(128, 0, 128, IDLE, IDLE, 0, 0, POLICY, decode_reads=2048)
    assert call.decode_read_ms == round((2048 * 1e-6 + COST) * 1e3, 3)
    assert call.on_prefill_ms == round(plain.on_prefill_ms + call.decode_read_ms, 3)
    assert call.on_decode_ms == plain.on_decode_ms


def test_hard_limits_keep_a_prompt_off_decode():
    assert decode_allowed(2048, IDLE, POLICY)
    assert not decode_allowed(2049, IDLE, POLICY)
    assert not decode_allowed(100, LoadReport(kv_cache_usage=0.95, compute_s_per_token=COST), POLICY)
    assert not decode_allowed(100, LoadReport(), POLICY)  # not measured yet


def _other_side_seen(calibration: Calibration, fitted: str) -> Calibration:
    """The fits correct both sides or neither: the side a test does not fit, measured as estimated."""
    raw = estimate(64, 0, 64, IDLE, IDLE, 0, 0, POLICY)
    on_decode = fitted == "prefill"
    calibration.observe(raw, on_decode, raw.on_decode_ms if on_decode else raw.on_prefill_ms)
    return calibration


def test_calibration_learns_an_offset_the_estimates_miss():
    calibration = _other_side_seen(Calibration(alpha=0.5), fitted="prefill")
    raw = estimate(1024, 0, 1024, IDLE, IDLE, 0, 0, POLICY)
    for _ in range(20):
        calibration.observe(calibration.corrected(raw), on_decode=False, measured_ms=raw.on_prefill_ms + 12.0)
    corrected = calibration.corrected(raw)
    assert abs(corrected.on_prefill_ms - raw.on_prefill_ms - 12.0) < 0.01
    assert corrected.prefill_residual_ms == round(corrected.on_prefill_ms - raw.on_prefill_ms, 3)
    assert corrected.on_decode_ms == raw.on_decode_ms


def test_calibration_scales_with_the_size_so_first_turns_errors_do_not_land_on_appends():
    """Under load long first turns came in at half their estimate and short appends 40 ms over
    theirs: an offset alone would make every append's estimate negative."""
    calibration = _other_side_seen(Calibration(alpha=0.1), fitted="prefill")
    first, append = (estimate(n, 0, n, IDLE, IDLE, queued, 0, POLICY) for n, queued in ((1024, 60_000), (128, 0)))
    for _ in range(40):
        for raw in (first, append):
            calibration.observe(calibration.corrected(raw), on_decode=False,
                                measured_ms=0.5 * raw.on_prefill_ms + 40.0)
    for raw in (first, append):
        assert abs(calibration.corrected(raw).on_prefill_ms - (0.5 * raw.on_prefill_ms + 40.0)) < 1.0


def test_calibration_keeps_its_slope_in_range_and_its_estimates_non_negative():
    calibration = _other_side_seen(Calibration(alpha=0.5), fitted="decode")
    small, large = (estimate(n, 0, n, IDLE, IDLE, 0, 0, POLICY) for n in (64, 4096))
    for _ in range(20):  # the larger estimate measured faster: a negative slope, clamped to the range's floor
        calibration.observe(calibration.corrected(small), on_decode=True, measured_ms=200.0)
        calibration.observe(calibration.corrected(large), on_decode=True, measured_ms=1.0)
    fitted = calibration.corrected(large).on_decode_ms - calibration.corrected(small).on_decode_ms
    assert abs(fitted - 0.25 * (large.on_decode_ms - small.on_decode_ms)) < 0.01
    assert calibration.corrected(estimate(4096 * 8, 0, 4096 * 8, IDLE, IDLE, 0, 0, POLICY)).on_decode_ms >= 0


def _members(prefill: LoadReport, decode: LoadReport) -> Membership:
    return Membership(("p0",), ("d0",), loads={"p0": prefill, "d0": decode})


PREFILLED = PrefillResult(replica_id="p0", handoff=handoff(len(PROMPT) + 1, 0.0, name="prefill-0"),
                          num_prompt_tokens=len(PROMPT), num_cached_tokens=0,
                          first_chunk=ReplyChunk(token_ids=(4,), text=" 4"))


def _run(loop, prompt=PROMPT):
    return asyncio.run(run_turn(loop, Turn("t", prompt, "salt", SamplingSettings(max_tokens=3, temperature=0.0))))


def test_a_first_turn_goes_to_an_idle_decode_while_prefill_is_queued():
    lookup = PrefixLookup(prefill_cached_tokens={"p0": 0})
    loop = turn_loop(PREFILLED, DecodeGroup(REPLY), lookup, members=_members(IDLE, IDLE))
    loop.journal.queued_tokens["p0"] = 8192
    _, prepared = _run(loop)
    assert prepared.decision.action == Action.PREFILL_ON_DECODE
    assert prepared.decision.reason == Reason.DECODE_SOONER and prepared.decision.decode_replica_id == "d0"
    assert prepared.log_entry["placement"]["prefill_queued_tokens"] == 8192


def test_first_turns_calibrate_first_turns_only_so_a_burst_of_them_leaves_the_appends_estimates_alone():
    lookup = PrefixLookup(prefill_cached_tokens={"p0": 0})
    loop = turn_loop(PREFILLED, DecodeGroup(REPLY), lookup, members=_members(IDLE, IDLE))
    loop.journal.queued_tokens["p0"] = 8192
    _run(loop)
    assert loop.planner.calibrations[False].fits["decode"].w > 0
    assert all(fit.w == 0 for fit in loop.planner.calibrations[True].fits.values())


def test_a_first_turn_stays_on_prefill_when_decode_is_busy_or_costs_are_unknown():
    lookup = PrefixLookup(prefill_cached_tokens={"p0": 0})
    busy = LoadReport(num_running_reqs=64, compute_s_per_token=COST)
    for decode in (busy, LoadReport()):
        loop = turn_loop(PREFILLED, DecodeGroup(REPLY), lookup, members=_members(IDLE, decode))
        _, prepared = _run(loop)
        assert prepared.decision.action == Action.RECOMPUTE


APPENDED = (*PROMPT, *range(2000, 2064))
"""A 64-token append to PROMPT, which decode d0 retains."""
QUIET = LoadReport(compute_s_per_token=COST, pull_s_per_token=1e-7)


def _append_loop(decode: LoadReport):
    lookup = PrefixLookup(prefill_cached_tokens={"p0": 0},
                          retained=RetainedMatch(retained(list(PROMPT), time.time() + 60, replica_id="d0"),
                                                 len(PROMPT) // 32))
    return turn_loop(PREFILLED, DecodeGroup(REPLY), lookup, members=_members(QUIET, decode))


def _busy_decode_loop():
    loop = _append_loop(LoadReport(num_running_reqs=64, compute_s_per_token=COST, pull_s_per_token=1e-7))
    loop.journal.queued_tokens["d0"] = 20000  # decode is computing other turns' prompts
    return loop


def test_a_short_append_goes_through_prefill_when_decode_is_the_busy_side():
    _, prepared = _run(_busy_decode_loop(), APPENDED)
    assert prepared.decision.action == Action.PULL and prepared.decision.placement is not None
    _, prepared = _run(_append_loop(QUIET), APPENDED)
    assert prepared.decision.action == Action.PREFILL_ON_DECODE and prepared.decision.reason == Reason.SHORT_APPEND


def test_a_pull_queues_on_prefill_only_the_tokens_it_computes():
    """Counting the pulled tokens as queued compute (1,024 here, against 64 computed) made one
    in-flight pull look like a first turn's prefill to every turn placed behind it."""
    loop, queued = _busy_decode_loop(), []
    loop.groups[Role.PREFILL].prefill = Remote(lambda _: queued.append(loop.journal.queued_tokens["p0"]) or PREFILLED)
    _, prepared = _run(loop, APPENDED)
    assert prepared.decision.action == Action.PULL and prepared.decision.pulled_tokens == len(PROMPT)
    assert queued == [len(APPENDED) - len(PROMPT)] and loop.journal.queued_tokens["p0"] == 0


def test_engines_measure_their_costs_from_vllm_s_own_stats():
    from app.engine.load import LoadTracker

    tracker = LoadTracker(kv_bytes_per_token=1024, min_measured_tokens=256)
    tracker.observe_prefill(0.5, 8, 0)  # too short to measure
    tracker.observe_prefill(0.1, 200, 0)  # shorter than the probe: mostly a step's fixed cost
    tracker.observe_prefill(0.02, 1000, 0)
    tracker.observe_prefill(0.5, 1000, 3)  # beside three other requests: its time includes theirs
    tracker.observe_prefill(0.04, 1000, 0)
    assert abs(tracker.report.compute_s_per_token - (20e-6 + 0.2 * 20e-6)) < 1e-12
    tracker.observe_transfers({"transfer_duration": [0.001, 0.001], "bytes_transferred": [1024 * 1000, 1024 * 1000]})
    assert abs(tracker.report.pull_s_per_token - 1e-6) < 1e-12
    tracker.observe_step(3, 1, 0.25)
    assert (tracker.report.num_running_reqs, tracker.report.kv_cache_usage) == (3, 0.25)
    assert tracker.report.compute_s_per_token > 0  # a step keeps the measured costs


def test_an_idle_engine_re_times_a_stale_compute_cost_a_request_during_the_probe_voids_it_and_the_least_stands():
    import time

    from app.engine.adapter import Engine
    from app.engine.load import LoadTracker

    engine = object.__new__(Engine)  # the refresh logic alone: no vLLM engine behind it
    engine.tracker, engine.in_flight, engine.quiet_since = LoadTracker(1024, probe_window=3), 0, time.monotonic() - 5
    engine.tracker.observe_probe(160e-6)  # timed while the other engine started: four times too high
    arrivals: list[int] = []

    async def prefill(num_tokens: int, runs: int) -> float:
        if arrivals:
            engine.in_flight = arrivals.pop()
        return num_tokens * 40e-6

    engine._timed_prefills = prefill
    refresh = lambda: asyncio.run(engine.refresh_compute_cost(256, quiet_s=1.0, max_age_s=10.0))  # noqa: E731
    assert not refresh()  # measured just now
    engine.tracker.measured_at -= 11
    engine.in_flight = 1
    assert not refresh()  # busy: real turns measure it
    engine.in_flight, engine.quiet_since = 0, time.monotonic()
    assert not refresh()  # not quiet for a second yet
    engine.quiet_since -= 2
    arrivals.append(1)
    assert not refresh() and engine.tracker.report.compute_s_per_token == 160e-6  # a request joined the probe
    engine.in_flight = 0
    assert refresh() and engine.tracker.report.compute_s_per_token == 40e-6  # the least probe stands
    for contended in (300e-6, 200e-6):  # timed while other processes loaded the machine
        engine.tracker.observe_probe(contended)
    assert engine.tracker.report.compute_s_per_token == 40e-6
    engine.tracker.observe_probe(90e-6)  # the 40 us probe has left the window of three
    assert engine.tracker.report.compute_s_per_token == 90e-6


def test_a_later_turn_is_estimated_behind_the_later_turns_queued_only_which_engines_run_first():
    """Counted behind first turns' prompts too, appends that arrived during a burst of first turns
    were estimated at 600 ms on decode, measured 100-200 ms, and decode's fit learned -634 ms."""
    loop = _busy_decode_loop()  # 20,000 tokens of first turns queued on decode
    loop.journal.queued_later_tokens["d0"] = 300
    loop.journal.queued_tokens["d0"] += 300
    later = Turn("t", APPENDED, "salt", SamplingSettings(max_tokens=3, temperature=0.0), turn_index=2)
    _, prepared = asyncio.run(run_turn(loop, later))
    assert prepared.log_entry["placement"]["decode_queued_tokens"] == 300


def test_a_fit_no_turn_has_refreshed_for_its_ttl_is_forgotten_and_both_sides_estimated_raw_again():
    from app.protocol import Estimate

    calibration = Calibration(ttl_s=10.0, alpha=0.5)
    raw = Estimate(20.0, 15.0, 0, 0, 0, 0.0, 60.0, 60.0, 3.0)
    calibration.observe(raw, on_decode=True, measured_ms=400.0)  # decode was slow under the last burst
    calibration.observe(raw, on_decode=False, measured_ms=120.0)
    assert not calibration.corrected(raw).decode_wins  # and is kept off decode
    calibration.observed_at["decode"] -= 11.0  # no turn has gone there since
    fresh = calibration.corrected(raw)
    assert fresh.decode_wins and fresh.on_decode_ms == 15.0 and fresh.on_prefill_ms == 20.0
    assert "decode" not in calibration.observed_at
    calibration.observe(fresh, on_decode=True, measured_ms=30.0)  # both seen again: both corrected
    assert calibration.corrected(raw).on_prefill_ms == 120.0 and calibration.corrected(raw).on_decode_ms == 30.0


def test_a_lone_agent_s_turn_after_a_long_tool_pause_stays_on_decode():
    """One task: every tool turn ran on decode, so prefill's fit (+57 ms the formula misses on it)
    went stale; placed by prefill's raw estimate against decode's corrected one (+40 ms the formula
    misses on decode too), one turn in six went to prefill at 72-173 ms against 63-122 on decode."""
    from app.protocol import Estimate

    calibration = Calibration(ttl_s=10.0, alpha=0.5)
    raw = Estimate(30.0, 20.0, 0, 0, 0, 0.0, 60.0, 60.0, 3.0)
    calibration.observe(raw, on_decode=False, measured_ms=87.0)
    calibration.observe(raw, on_decode=True, measured_ms=60.0)
    assert calibration.corrected(raw).decode_wins
    calibration.observed_at["prefill"] -= 11.0  # a tool pause, and turns only on decode before it
    calibration.observe(raw, on_decode=True, measured_ms=60.0)
    assert calibration.corrected(raw).decode_wins


def test_a_burst_placed_between_heartbeats_sees_the_streams_this_router_opened_on_decode():
    from app.turn.membership import LiveEngines

    engines = LiveEngines(suspect_s=10.0)
    heartbeat = LoadReport(num_running_reqs=2, compute_s_per_token=1e-4)
    engines.update(Membership(("p0",), ("d0",), loads={"d0": heartbeat}, settled=True))
    assert engines.load("d0") == heartbeat
    engines.streams["d0"] += 40  # turns placed since that heartbeat
    assert engines.load("d0") == replace(heartbeat, num_running_reqs=40)
    assert engines.load("p0") == LoadReport()
