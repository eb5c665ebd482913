"""The concurrency sweep pools its interleaved repeats of a level without mixing them up (issue 14)."""

import pytest

from app.config import AppConfig
from benchmarks.report import Row, ideal_tokens
from benchmarks.sweep_summary import CpuUse, LevelSummary, machine_lines


def row(system: str, repeat: int, conversation: int, turn: int, started_s: float, ttft_s: float,
        prompt_tokens: int = 1000) -> Row:
    return Row("c2", system, conversation, turn, started_s, prompt_tokens, 32, 0, prompt_tokens, ttft_s, 0.01, 1.0,
               "", 0, 0, 0.0, 0.0, 0.0, concurrency=2, repeat=repeat)


def two_repeats(system: str, ttft_s: float) -> list[Row]:
    """Each repeat: one conversation of two turns, its clock from 0, over 5 s."""
    return [row(system, repeat, 0, turn, started_s, ttft_s, prompt_tokens)
            for repeat in (0, 1) for turn, started_s, prompt_tokens in ((1, 0.0, 1000), (2, 4.0, 1100))]


def test_throughput_counts_each_repeats_own_wall_time():
    summary = LevelSummary.of(two_repeats("app", 0.1), block_size=32)
    assert summary.requests_per_s == pytest.approx(4 / 10.0)  # two 5 s drives, not one 5 s span
    assert summary.tokens_per_s == pytest.approx(4 * 32 / 10.0)


def test_conversations_of_different_repeats_stay_apart():
    # Merged, conversation 0 would have four turns and its ideal would count the repeats' prompts as appends.
    assert ideal_tokens(two_repeats("app", 0.1)) == 2 * (1000 + (1100 - 1000 - 32))


def test_machine_lines_give_each_repeat_its_client_cpu_and_ratios():
    rows = two_repeats("app", 0.2) + two_repeats("ideal", 0.1)
    cpu = [CpuUse(system, 2, repeat, 4, {"client (benchmark)": 0.1 * (1 + repeat)})
           for repeat in (0, 1) for system in ("app", "ideal")]
    lines = machine_lines(rows, cpu, AppConfig()).splitlines()
    assert "- 2 conversations, repeat 1: client app 50.0, ideal 50.0; app / ideal 2.00 / 2.00, 2.00, 1.00x" in lines
