"""Pull costs from vLLM's per-rank NIXL records: bytes add up over ranks, time is the slowest rank's."""

from app.engine.load import LoadTracker, slowest_rank_seconds

KV_BYTES_PER_TOKEN = 1024
TOKENS = 8000


def _cost(ranks: int, durations: list[float], moved: list[int]) -> float:
    tracker = LoadTracker(KV_BYTES_PER_TOKEN, ranks=ranks)
    tracker.observe_transfers({"transfer_duration": durations, "bytes_transferred": moved})
    return tracker.report.pull_s_per_token


def test_eight_ranks_each_moving_an_eighth_cost_what_one_rank_moving_all_costs():
    one_rank = _cost(1, [0.010], [TOKENS * KV_BYTES_PER_TOKEN])
    eight_ranks = _cost(8, [0.010] * 8, [TOKENS * KV_BYTES_PER_TOKEN // 8] * 8)
    assert abs(one_rank - 0.010 / TOKENS) < 1e-15 and abs(eight_ranks - one_rank) < 1e-15


def test_the_slowest_rank_sets_the_time():
    durations = [0.010] * 8
    durations[5] = 0.030
    assert abs(_cost(8, durations, [TOKENS * KV_BYTES_PER_TOKEN // 8] * 8) - 0.030 / TOKENS) < 1e-15


def test_each_rank_s_transfers_in_a_step_add_up_rank_by_rank():
    """Two transfers per rank, listed rank 0's then rank 1's: rank 1 took 5 + 25 ms."""
    assert abs(slowest_rank_seconds([0.010, 0.010, 0.005, 0.025], ranks=2) - 0.030) < 1e-15


def test_records_that_do_not_split_by_rank_count_in_full():
    """Three records over two ranks: which rank made which cannot be told, so the total stands."""
    assert abs(slowest_rank_seconds([0.010, 0.020, 0.005], ranks=2) - 0.035) < 1e-15
    assert abs(_cost(2, [0.010, 0.020, 0.005], [1000 * KV_BYTES_PER_TOKEN] * 3) - 0.035 / 3000) < 1e-15


def test_a_step_without_transfers_keeps_the_last_cost():
    tracker = LoadTracker(KV_BYTES_PER_TOKEN, ranks=4)
    tracker.observe_transfers({"transfer_duration": [0.004] * 4, "bytes_transferred": [250 * KV_BYTES_PER_TOKEN] * 4})
    tracker.observe_transfers({"transfer_duration": [], "bytes_transferred": []})
    assert abs(tracker.report.pull_s_per_token - 0.004 / 1000) < 1e-15
