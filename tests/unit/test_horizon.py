from app.kv.horizon import EvictionHorizon


def test_horizon_is_free_pool_over_the_rate_of_new_tokens():
    horizon = EvictionHorizon(window_s=60)
    assert horizon.estimate_s("p0", 327_000, 120_000, now=0.0) is None
    for second in range(60):
        horizon.observe("p0", 6_000, now=float(second))
    assert horizon.rate("p0", now=59.0) == 6_000
    assert round(horizon.estimate_s("p0", 327_000, 120_000, now=59.0), 1) == 34.5  # seed 002's ~35 s
    assert horizon.estimate_s("p0", 327_000, 120_000, now=200.0) is None, "old samples leave the window"
