"""Engines of two ranks each (tensor_parallel_size 2), the GPU layout's code path on this machine:
vLLM's multiprocessing executor under each engine replica, as `device: cuda` runs it on a GPU node
(vLLM's CPU build refuses its Ray executor). A conversation whose later turns prefill pulls from
decode over NIXL, rank to rank, must give the plain single-rank engine's token ids.
Replaces the session's app (own_app: after every test on it)."""

from dataclasses import replace

import psutil
import pytest

from app.ops import faults
from tests.integration.conftest import SYSTEM_PROMPT, USER_TURNS, reference_ids, run_conversation, run_own_app

pytestmark = [pytest.mark.integration, pytest.mark.own_app]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def two_rank_engines(base_url, app_config):
    run_own_app(base_url, replace(app_config, tensor_parallel_size=2))
    return base_url


def test_two_rank_engines_pull_history_and_match_the_oracle(two_rank_engines, client, reference):
    turns = run_conversation(client, f"[tp2] {SYSTEM_PROMPT}", USER_TURNS, MAX_TOKENS, prefill_on_decode=False)
    assert [t.output_ids for t in turns] == reference_ids(reference, turns, MAX_TOKENS)
    # Prefill's prefix cache is off: every later turn's history came back from decode over NIXL.
    assert all(t.cached_tokens >= t.prompt_tokens // 2 for t in turns[1:]), [t.cached_tokens for t in turns]
    for deployment in ("prefill", "decode"):
        (core,) = faults.engine_pids(deployment)
        titles = sorted(" ".join(p.cmdline()) for p in psutil.Process(core).children())
        # vLLM titles each worker process by its rank (VLLM::Worker_TP0, ...).
        ranks = [t.split("Worker_TP")[1].split()[0] for t in titles if "Worker_TP" in t]
        assert ranks == ["0", "1"], titles
