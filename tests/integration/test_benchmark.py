"""The multi-turn benchmark's small preset against the running app: Parquet schema, summary, plot,
and later turns cheaper than turn 1 for this project."""

import pytest

from benchmarks.multi_turn import PRESETS, Scenario, run, run_scenario
from benchmarks.report import summarize, write_results
from benchmarks.workload import load_tokenizer

pytestmark = pytest.mark.integration
SCHEMA = {"scenario": "string", "system": "string", "conversation": "int64", "turn": "int64", "started_s": "double",
          "prompt_tokens": "int64",
          "completion_tokens": "int64", "cached_tokens": "int64", "prefilled_tokens": "int64", "ttft_s": "double",
          "itl_s": "double", "e2e_s": "double", "decision": "string", "pulled_tokens": "int64", "pulled_bytes": "int64",
          "plan_s": "double", "prefill_s": "double", "decode_first_s": "double", "concurrency": "int64",
          "repeat": "int64", "error": "string", "render_s": "double", "engine_wait_s": "double",
          "engine_step_s": "double"}


def test_ci_preset_writes_stable_results_and_later_turns_are_cheaper(base_url, app_config, tmp_path):
    import pyarrow.parquet as pq

    rows = run(base_url, ["disagg", "pull+preserve", "on-decode"], "ci", app_config)
    summary = summarize(rows, app_config)
    write_results(rows, summary, tmp_path)
    table = pq.read_table(tmp_path / "rows.parquet")
    assert {f.name: str(f.type) for f in table.schema} == SCHEMA
    assert (tmp_path / "multi_turn.png").stat().st_size > 10_000
    assert "pull+preserve / disagg (app)" in (tmp_path / "summary.md").read_text()
    assert all(r.render_s > 0 for r in rows), "every turn's rendering time, from the decision log"
    assert all(r.engine_step_s > 0 for r in rows), "every turn's engine step, from the decision log"
    for system, decision in (("pull+preserve", "pull"), ("on-decode", "prefill_on_decode")):
        mine = [r for r in rows if r.system == system]
        first = [r.prefilled_tokens for r in mine if r.turn == 1]
        later = [r.prefilled_tokens for r in mine if r.turn > 1]
        assert max(later) < min(first), (system, first, later)
        assert all(r.decision == decision for r in mine if r.turn > 1), system


def test_serve_llm_peer_serves_the_same_conversations(base_url, app_config):
    """Ray Serve LLM's build_pd_openai_app on the same Serve, same model and engine settings: every
    turn answered in full, and its prefill engine's own counters show every prompt token computed
    (the standard flow under cache loss), which the run checks before returning rows."""
    from tqdm import tqdm

    preset = PRESETS["ci"]
    rows = run_scenario(Scenario("prefix-off", {}, ("serve-llm",)), preset, app_config, load_tokenizer(app_config),
                        base_url, base_url, app_config.model_name, tqdm(disable=True))
    assert len(rows) == preset.in_flight * preset.profile.turns
    assert all(r.completion_tokens == preset.profile.reply_tokens and r.prefilled_tokens == r.prompt_tokens
               for r in rows)
    assert all(b.prompt_tokens > a.prompt_tokens for a, b in zip(rows, rows[1:]) if a.conversation == b.conversation)


def test_notebook_executes_headless_against_the_app(base_url, tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    notebook = Path(__file__).parents[2] / "benchmarks" / "multi_turn.ipynb"
    env = {**os.environ, "KV_LOOP_URL": base_url, "KV_LOOP_PRESET": "ci", "KV_LOOP_SYSTEMS": "pull+preserve",
           "KV_LOOP_OUT": str(tmp_path / "out")}
    subprocess.run([sys.executable, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute", str(notebook),
                    "--output-dir", str(tmp_path), "--ExecutePreprocessor.timeout=600"], env=env, check=True)
    assert (tmp_path / "out" / "rows.parquet").exists() and (tmp_path / "multi_turn.ipynb").exists()


def test_paired_rounds_alternate_the_systems_and_pool_their_later_turns(base_url, app_config):
    from benchmarks.paired import report, run_rounds
    from benchmarks.peers import plain_vllm

    preset = PRESETS["ci"]
    with plain_vllm(app_config) as vllm_url:
        results = run_rounds({"vllm": vllm_url, "on-decode": base_url}, load_tokenizer(app_config), preset,
                             app_config.model_name, rounds=2)
    assert [list(r.later_ttft_ms) for r in results] == [["vllm", "on-decode"], ["on-decode", "vllm"]]
    later_turns = preset.in_flight * (preset.profile.turns - 1)
    assert all(len(ttfts) == later_turns for r in results for ttfts in r.later_ttft_ms.values())
    assert "pooled later-turn TTFT p50" in report(results)
