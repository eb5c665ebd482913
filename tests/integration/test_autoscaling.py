"""The app under more load than it holds, on its own signals: the real app with a prefill group
that may grow from 1 to 2 replicas and small router bounds.

- Prefill autoscaling on queued prefill tokens. Load (one-token turns with long fresh prompts:
  prefill work only) takes it to 2; idle takes it back to 1. Conversations run all along, and
  every later turn pulls its history from decode with every token equal to one plain vLLM engine's.
- Admission: past the router's queue bound a request gets 503 with Retry-After in the OpenAI error
  shape, and every admitted one streams whole.
Replaces the session's app (own_app: after every test on it)."""

import itertools
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import httpx
import pytest
import ray
from ray import serve

from app.config import Autoscaling, PrefillScaling
from app.kv.hashing import common_prefix_len
from app.ops.client import TurnResult, chat_turn
from app.ops.launch import APP_NAME, replace_app
from tests.integration.conftest import SYSTEM_PROMPT, USER_TURNS, decisions_by_request, reference_ids, run_conversation

pytestmark = [pytest.mark.integration, pytest.mark.own_app]
MAX_TOKENS = 16
CONVERSATION_THREADS = 2
LOAD_THREADS = 2
LOAD_PROMPT = SYSTEM_PROMPT + " " + SYSTEM_PROMPT
"""About 1,400 tokens, computed whole: prefill's prefix cache is off in the session's config."""
SCALING = PrefillScaling(enabled=True, min_replicas=1, max_replicas=2, target_queued_tokens=1000,
                         upscale_delay_s=2.0, downscale_delay_s=10.0, metrics_interval_s=0.5, look_back_period_s=3.0)
"""Short delays and window so the test takes minutes; the defaults are for production."""
BOUNDS = {"router_max_ongoing_requests": 8, "router_max_queued_requests": 4, "tenant_share": 1.0}
"""Above the autoscaling test's 4 streams and the frontend's own calls; the burst below is larger.
tenant_share 1: the burst comes from one key, and this bound is the server's, not a tenant's
(test_tenant_limits.py has the tenant's)."""
BURST_REPLY_TOKENS = 400
SCALE_OUT_TIMEOUT_S = 420
"""A second engine starts on the cores that serve the load: 118 s here in one run; on a loaded
machine the first replica alone took 154 s and the second was not running after 180 s."""


@dataclass
class Sample:
    at_s: float
    running: int
    starting: int
    queued_tokens: float
    """The controller's view: each prefill replica's reported mean over the look-back, summed."""
    load_on: bool
    conversation_turns: int


@dataclass
class Conversation:
    turns: list[TurnResult]
    decisions: list[dict]


class Run:
    """The test's clock, the replica counts Serve reports each second, and the conversations."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.samples: list[Sample] = []
        self.conversations: list[Conversation] = []
        self.load_on, self.stop = threading.Event(), threading.Event()

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def sample_forever(self) -> None:
        while not self.stop.is_set():
            states = {getattr(k, "value", k): n for k, n in
                      serve.status().applications[APP_NAME].deployments["prefill"].replica_states.items()}
            self.samples.append(Sample(round(self.elapsed(), 1), states.get("RUNNING", 0), states.get("STARTING", 0),
                                       _controller_queued_tokens(), self.load_on.is_set(),
                                       sum(len(c.turns) for c in self.conversations)))
            time.sleep(1.0)

    def wait_for_replicas(self, running: int, timeout_s: float) -> float:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            last = self.samples[-1] if self.samples else None
            if last and last.running == running and last.starting == 0:
                return self.elapsed()
            time.sleep(0.5)
        raise AssertionError(f"prefill never reached {running} replicas: {self.samples[-5:]}")


def _controller_queued_tokens() -> float:
    from ray.serve._private.common import DeploymentID
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    from deployments.autoscaling import QUEUED_PREFILL_TOKENS

    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    metrics = ray.get(controller._get_metrics_for_deployment_for_testing.remote(
        DeploymentID(name="prefill", app_name=APP_NAME)))
    per_replica = [series for series in metrics.get(QUEUED_PREFILL_TOKENS, ()) if series]
    return sum(sum(point.value for point in series) / len(series) for series in per_replica)


def _converse(client, base_url: str, run: Run, thread: int) -> None:
    with httpx.Client(base_url=base_url, timeout=300, headers={"Authorization": "Bearer unused"}) as http:
        for n in itertools.count():
            if run.stop.is_set():
                return
            turns = run_conversation(client, f"[autoscaling {thread}-{n}] {SYSTEM_PROMPT}", USER_TURNS[:3],
                                     MAX_TOKENS, prefill_on_decode=False)
            decisions = decisions_by_request(http)  # now: load turns push these out of the router's ring
            run.conversations.append(Conversation(turns, [decisions[t.request_id] for t in turns]))


def _load(client, run: Run, thread: int) -> None:
    for n in itertools.count():
        run.load_on.wait()
        if run.stop.is_set():
            return
        messages = [{"role": "system", "content": f"[load {thread}-{n}] {LOAD_PROMPT}"},
                    {"role": "user", "content": "Go."}]
        chat_turn(client, messages, 1, stream=False, prefill_on_decode=False)


@pytest.fixture(scope="module")
def autoscaled_prefill(base_url, app_config):
    config = replace(app_config, prefill=replace(app_config.prefill, cpus_per_replica=0.5),
                     decode=replace(app_config.decode, cpus_per_replica=0.5), autoscaling=Autoscaling(prefill=SCALING),
                     limits=replace(app_config.limits, **BOUNDS),
                     engine_max_num_seqs=BOUNDS["router_max_ongoing_requests"])  # the config refuses more
    started = time.monotonic()
    replace_app(config)
    print(f"app with autoscaled prefill started in {time.monotonic() - started:.0f} s")
    return config


def test_prefill_scales_out_under_load_and_back_when_idle_and_conversations_keep_their_reuse(
        autoscaled_prefill, client, base_url, reference, app_config):
    run = Run()
    with ThreadPoolExecutor(1 + CONVERSATION_THREADS + LOAD_THREADS) as pool:
        workers = [pool.submit(run.sample_forever)]
        workers += [pool.submit(_converse, client, base_url, run, i) for i in range(CONVERSATION_THREADS)]
        workers += [pool.submit(_load, client, run, i) for i in range(LOAD_THREADS)]
        try:
            time.sleep(3)
            run.load_on.set()
            load_from = run.elapsed()
            scaled_out = run.wait_for_replicas(2, timeout_s=SCALE_OUT_TIMEOUT_S)
            time.sleep(5)  # turns on both replicas
            run.load_on.clear()
            load_until = run.elapsed()
            scaled_in = run.wait_for_replicas(1, timeout_s=90)
            time.sleep(5)  # conversations after
        finally:
            run.stop.set()
            run.load_on.set()  # wake the load threads so they see stop
        for worker in workers:
            worker.result()
    _print_table(run)
    print(f"load on at {load_from:.0f} s; 2 prefill replicas at {scaled_out:.0f} s; load off at {load_until:.0f} s; "
          f"1 replica at {scaled_in:.0f} s; {len(run.conversations)} conversations")

    block = app_config.block_size
    prefill_replicas = set()
    for conversation in run.conversations:
        for previous, current, decision in zip(conversation.turns, conversation.turns[1:], conversation.decisions[1:]):
            shared = common_prefix_len(current.prompt_ids, previous.prompt_ids + previous.output_ids)
            full_blocks = min(shared, len(current.prompt_ids) - 1) // block * block
            assert decision["action"] == "pull" and full_blocks <= current.cached_tokens <= shared, decision
            assert decision["pulled_tokens"] == current.cached_tokens, "prefill's cache is off: all of it was pulled"
        prefill_replicas |= {d["prefill_replica"] for d in conversation.decisions}
    assert len(prefill_replicas) == 2, "conversations ran on both prefill replicas"
    turns = [t for c in run.conversations for t in c.turns]
    assert [t.output_ids for t in turns] == reference_ids(reference, turns, MAX_TOKENS)


def _print_table(run: Run) -> None:
    """The run as docs/operations.md shows it: every 10 s, and each change of the load or the replicas."""
    print("| t (s) | load | prefill replicas running (starting) | queued prefill tokens (controller) | "
          "conversation turns done |")
    print("|---|---|---|---|---|")
    previous, next_at = None, 0.0
    for s in run.samples:
        changed = previous is not None and (s.running, s.starting, s.load_on) != (
            previous.running, previous.starting, previous.load_on)
        if changed or s.at_s >= next_at:
            print(f"| {s.at_s:.0f} | {'on' if s.load_on else 'off'} | {s.running} ({s.starting}) | "
                  f"{s.queued_tokens:.0f} | {s.conversation_turns} |")
            next_at = s.at_s + 10
        previous = s


def test_requests_past_the_queue_bound_get_503_with_retry_after_and_every_admitted_one_streams_whole(
        autoscaled_prefill, base_url):
    limits = autoscaled_prefill.limits
    holds = limits.router_max_ongoing_requests + limits.router_max_queued_requests
    burst = holds + 8
    # Replies long enough (seconds) that no admitted stream ends before the last request arrives.
    body = {"model": autoscaled_prefill.model_name, "max_tokens": BURST_REPLY_TOKENS, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    together = threading.Barrier(burst)

    def send(i: int) -> tuple[int, dict[str, str], list[str]]:
        messages = [{"role": "system", "content": f"[burst {i}] {SYSTEM_PROMPT}"}, {"role": "user", "content": "Go."}]
        with httpx.Client(base_url=base_url, timeout=300, headers={"Authorization": "Bearer unused"}) as http:
            together.wait()
            with http.stream("POST", "/v1/chat/completions", json={**body, "messages": messages}) as response:
                return response.status_code, dict(response.headers), list(response.iter_lines())

    with ThreadPoolExecutor(burst) as pool:
        answers = list(pool.map(send, range(burst)))
    statuses = [status for status, _, _ in answers]
    print(f"{burst} requests at once: {statuses.count(200)} streamed, {statuses.count(503)} got 503")
    assert statuses.count(200) == holds and statuses.count(503) == burst - holds
    for status, headers, lines in answers:
        if status == 503:
            assert headers["retry-after"] == str(limits.retry_after_s)
            assert json.loads("".join(lines))["error"]["code"] == 503
        else:
            events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
            assert [line for line in lines if line][-1] == "data: [DONE]"
            assert events[-1]["usage"]["completion_tokens"] == BURST_REPLY_TOKENS
