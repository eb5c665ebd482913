"""A later turn that arrives while a first turn's long prompt is being computed in chunks starts in
the next step, not after that whole prompt (app/engine/scheduler.py), in a real vLLM engine."""

import time
from concurrent.futures import ThreadPoolExecutor

from app.config import load_config
from app.model.tiny import ensure_tiny_model
from app.ops.client import completion_turn
from app.turn.spec import turn_priority
from benchmarks.peers import plain_vllm
from benchmarks.workload import openai_client

LONG_PROMPT = [(7 * i) % 500 + 100 for i in range(3000)]
SHORT_PROMPT = list(range(300, 340))


def test_a_later_turn_starts_before_a_running_first_turns_remaining_chunks(tmp_path):
    # 48-token steps: the long prompt takes ~63 steps, and the later turn, which fits in one,
    # arrives among them (sent 0.3 s in, it came after the whole prompt once the engine computed
    # 47 steps of 64 tokens in 0.2 s).
    config = load_config({"model_cache_dir": str(tmp_path), "max_model_len": "4096",
                          "prefill.engine_kwargs": "{max_num_batched_tokens: 48}", "engine_max_num_seqs": "8"})
    assert config.later_turns_first and config.later_turns_before_chunks
    ensure_tiny_model(config.model_path())
    with plain_vllm(config) as url:
        client = openai_client(url)
        completion_turn(client, SHORT_PROMPT[:8], 2, model=config.model_name)  # warm-up
        began = time.perf_counter()

        def sent_at(delay_s: float, prompt: list[int], later: bool) -> float:
            time.sleep(delay_s)
            result = completion_turn(client, prompt, 4, model=config.model_name, priority=turn_priority(later))
            return time.perf_counter() - began - result.e2e_s + result.ttft_s

        with ThreadPoolExecutor(2) as pool:
            first_turn = pool.submit(sent_at, 0.0, LONG_PROMPT, False)
            later_turn = pool.submit(sent_at, 0.1, SHORT_PROMPT, True)
            first_token_s, later_token_s = first_turn.result(), later_turn.result()
    assert later_token_s < first_token_s, (later_token_s, first_token_s)
