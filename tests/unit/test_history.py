"""benchmarks/history.csv: the committed history parses with its columns, and a run's summary rows
append to it and read back (on a copy)."""

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import history
from benchmarks.report import Row

ROOT = Path(__file__).parents[2]
WITH_SUMMARY = ("sweep", "multi_turn", "agent")
"""The benchmarks whose runs append to the history."""


def row(system: str, repeat: int, turn: int, started_s: float, ttft_s: float, prompt_tokens: int,
        scenario: str = "c2") -> Row:
    return Row(scenario, system, 0, turn, started_s, prompt_tokens, 32, 0, prompt_tokens, ttft_s, 0.01, 1.0, "", 0, 0,
               0.0, 0.0, 0.0, concurrency=2, repeat=repeat)


def two_repeats(system: str, ttft_s: float) -> list[Row]:
    return [row(system, repeat, turn, started_s, ttft_s, prompt_tokens)
            for repeat in (0, 1) for turn, started_s, prompt_tokens in ((1, 0.0, 1000), (2, 4.0, 1100))]


def test_the_committed_history_has_its_columns_and_parses():
    rows = history.load()
    assert rows, "the history holds the runs recorded before it"
    assert all(tuple(r) == history.COLUMNS for r in rows)
    assert {"sweep", "multi_turn", "agent", "paired", "faults"} <= {r["benchmark"] for r in rows}
    assert all(r["date"][:4].isdigit() and r["benchmark"] and r["system"] and r["metric"] and r["unit"]
               for r in rows)
    assert all(r["value"] or r["note"].startswith("range ") for r in rows), "a value, or the range it stands for"
    table = history.load_table()
    assert table.column_names == list(history.COLUMNS) and table.num_rows == len(rows)
    assert str(table.schema.field("value").type) == "double"


def test_rows_append_to_a_copy_and_read_back(tmp_path):
    copy = tmp_path / "history.csv"
    shutil.copy(history.PATH, copy)
    before = history.load(copy)
    written = history.append([{"date": "2026-12-06T03:30:00Z", "benchmark": "sweep", "run": "sweep-test",
                               "system": "app/ideal", "level": 64, "repeats": 2, "metric": "later_ttft_p50",
                               "value": 1.2345678, "unit": "x"}], copy)
    after = history.load(copy)
    assert written == 1 and after[:-1] == before
    assert after[-1] == {**dict.fromkeys(history.COLUMNS, ""), "date": "2026-12-06T03:30:00Z",
                         "benchmark": "sweep", "run": "sweep-test", "system": "app/ideal", "level": "64",
                         "repeats": "2", "metric": "later_ttft_p50", "value": "1.23457", "unit": "x"}
    assert [r["run"] for r in history.query(copy, benchmark="sweep", level=64, metric="later_ttft_p50")][-1] == \
        "sweep-test"


def test_a_new_file_gets_the_header_and_an_unknown_column_is_refused(tmp_path):
    path = tmp_path / "new.csv"
    history.append([{"benchmark": "sweep", "value": 1.0}], path)
    assert path.read_text().splitlines()[0] == ",".join(history.COLUMNS)
    with pytest.raises(ValueError, match="no such column: ttft"):
        history.append([{"ttft": 1.0}], path)
    with pytest.raises(ValueError, match="no such column"):
        history.query(path, ttft="1")


def test_a_sweeps_summary_is_stamped_and_appended_unless_no_history(tmp_path, monkeypatch):
    rows = history.sweep_rows(two_repeats("app", 0.2) + two_repeats("ideal", 0.1), block_size=32)
    ratios = {r["metric"]: r["value"] for r in rows if r["system"] == "app/ideal"}
    assert ratios["later_ttft_p50"] == pytest.approx(2.0) and ratios["tokens_per_s"] == pytest.approx(1.0)
    assert {(r["system"], r["metric"], r["unit"]) for r in rows} >= {("app", "later_ttft_p50", "ms"),
                                                                      ("ideal", "requests_per_s", "1/s")}
    monkeypatch.setattr(sys, "argv", ["sweep", "--repeats", "2", "--api-key", "k-secret"])
    args = argparse.Namespace(no_history=False, set=[("later_turns_first", "false")], peer_set=[], url=None,
                              out=tmp_path / "sweep-20261206-033000")
    path = tmp_path / "history.csv"
    assert history.record(args, "sweep", rows, path) == len(rows)
    stored = history.load(path)
    assert {(r["benchmark"], r["run"], r["scenario"]) for r in stored} == {
        ("sweep", "sweep-20261206-033000", "later_turns_first=false")}
    assert "k-secret" not in path.read_text(), "the file is committed: no API key in it"
    assert history.record(argparse.Namespace(no_history=True), "sweep", rows, path) == 0
    assert len(history.load(path)) == len(rows)


def test_the_agent_and_multi_turn_summaries_give_the_ratios_their_summaries_give():
    agent = history.agent_rows(two_repeats("app", 0.2) + two_repeats("ideal", 0.1), block_size=32, preset="cpu")
    assert {r["scenario"] for r in agent} == {"preset cpu"}
    assert [r["value"] for r in agent if r["system"] == "app/ideal" and r["metric"] == "later_ttft_p50"] == [
        pytest.approx(2.0)]
    turns = [row(system, 0, turn, started_s, ttft_s if turn > 1 else 0.3, prompt_tokens, "prefix-off")
             for system, ttft_s in (("on-decode", 0.2), ("vllm", 0.1))
             for turn, started_s, prompt_tokens in ((1, 0.0, 1000), (2, 4.0, 1100))]
    ratios = [r for r in history.multi_turn_rows(turns, block_size=32, in_flight=4) if "/" in r["system"]]
    assert [(r["system"], r["level"], r["value"]) for r in ratios] == [("on-decode/vllm", 4, pytest.approx(2.0))]


@pytest.mark.parametrize("module", WITH_SUMMARY)
def test_every_benchmark_with_a_summary_can_leave_the_history_alone(module):
    help_text = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", "--help"], cwd=ROOT, check=True,
                               capture_output=True, text=True, timeout=120).stdout
    assert "--no-history" in help_text
