"""Router metrics through Ray Serve's metrics API (they appear in the Ray dashboard's Serve view).

Fed by the turn loop after each prefill; read by Prometheus via Ray's metrics endpoint.
"""

import json
from collections import Counter
from pathlib import Path
from typing import Any

from app.conversations.records import RenderDiagnostics
from app.protocol import Action, RoutingDecision

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8": 1}


def kv_bytes_per_token(model_path: Path) -> int:
    """2 (K and V) x layers x KV heads x head dim x bytes per element, from the model's config."""
    cfg = model_config(model_path)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16")
    return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * _DTYPE_BYTES.get(dtype, 2)


def model_config(model_path: Path) -> dict:
    """The model's config.json: from its folder, else (a hub id such as serve.yaml's) from the
    Hugging Face cache, as vLLM and the tokenizer load it. The router runs on whichever node Serve
    picks, often not one where the weights were put."""
    local = model_path / "config.json"
    if local.is_file():
        return json.loads(local.read_text())
    from huggingface_hub import hf_hub_download

    return json.loads(Path(hf_hub_download(str(model_path), "config.json")).read_text())


class TurnMetrics:
    """Counter increments and gauge values are kept here and handed to Ray once per `flush()` (the
    router flushes every heartbeat): with about ten updates a turn, Ray's Metric._record on each one
    is a large share of the router's CPU. Histogram observations go to Ray at once."""

    def __init__(self, kv_bytes_per_token: int) -> None:
        from ray.serve import metrics

        self.kv_bytes_per_token = kv_bytes_per_token
        self._increments: Counter[tuple[Any, tuple]] = Counter()
        self._levels: dict[tuple[Any, tuple], float] = {}
        self.decisions = metrics.Counter(
            "kv_loop_decisions", "Pull/recompute decisions of the turn loop.", tag_keys=("action", "reason"))
        self.prompt_tokens = metrics.Counter(
            "kv_loop_prompt_tokens", "Prompt tokens by where their KV came from.", tag_keys=("source",))
        self.bytes_pulled = metrics.Counter("kv_loop_bytes_pulled", "KV bytes pulled from decode replicas.")
        self.requests = metrics.Counter("kv_loop_requests", "Requests by turn index.", tag_keys=("turn",))
        self.ttft = metrics.Histogram(
            "kv_loop_ttft_s", "Time to first token in the router, by turn index.",
            boundaries=[0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4], tag_keys=("turn",))
        self.later_turns = metrics.Counter(
            "kv_loop_later_turns", "Later turns by routing policy: every reusable full block cached or pulled (hit), "
            "and whether they landed where the previous turn ran.", tag_keys=("policy", "hit", "same_replica"))
        self.horizon = metrics.Gauge(
            "kv_loop_eviction_horizon_s", "Estimated seconds an idle block survives: (pool - pinned) / new-token rate.",
            tag_keys=("prefill_replica",))
        self.render_turns = metrics.Counter(
            "kv_loop_render_turns", "Chat turns by rendering mode and where the prefix broke (none: append-only).",
            tag_keys=("mode", "cause"))
        self.render_shared_tokens = metrics.Counter(
            "kv_loop_render_shared_tokens", "Prompt tokens shared with the previous turn's full sequence.",
            tag_keys=("mode",))

        self.bookkeeping_failures = metrics.Counter(
            "kv_loop_bookkeeping_failures", "Index calls and block releases that failed or timed out (the reply "
            "went on without them).", tag_keys=("call",))
        self.engine_failures = metrics.Counter(
            "kv_loop_engine_failures", "Engine calls that failed, by stage; the turn moved to another engine.",
            tag_keys=("stage",))

    def record_bookkeeping_failure(self, call: str) -> None:
        self._add(self.bookkeeping_failures, 1, {"call": call})

    def record_engine_failure(self, stage: str) -> None:
        self._add(self.engine_failures, 1, {"stage": stage})

    def record_turn(self, decision: RoutingDecision, prompt_tokens: int, cached_tokens: int,
                    pulled_tokens: int) -> None:
        self._add(self.decisions, 1, {"action": decision.action.value, "reason": decision.reason.value})
        by_source = {"pulled": pulled_tokens, "local": cached_tokens - pulled_tokens,
                     "computed": prompt_tokens - cached_tokens}
        for source, n in by_source.items():
            if n > 0:
                self._add(self.prompt_tokens, n, {"source": source})
        if decision.action == Action.PULL and pulled_tokens > 0:
            self._add(self.bytes_pulled, pulled_tokens * self.kv_bytes_per_token)

    def record_ttft(self, turn_index: int, ttft_s: float) -> None:
        tags = {"turn": str(turn_index) if turn_index < 10 else "10+"}
        self.ttft.observe(ttft_s, tags)
        self._add(self.requests, 1, tags)

    def record_later_turn(self, policy: str, hit: bool, same_replica: bool) -> None:
        self._add(self.later_turns, 1, {"policy": policy, "hit": str(hit).lower(),
                                        "same_replica": str(same_replica).lower()})

    def record_horizon(self, replica_id: str, seconds: float) -> None:
        self._levels[(self.horizon, (("prefill_replica", replica_id),))] = seconds  # the latest counts

    def record_rendering(self, rendering: RenderDiagnostics) -> None:
        self._add(self.render_turns, 1, {"mode": rendering.mode.value, "cause": rendering.cause.value})
        if rendering.shared_tokens > 0:
            self._add(self.render_shared_tokens, rendering.shared_tokens, {"mode": rendering.mode.value})

    def _add(self, counter: Any, value: float, tags: dict[str, str] | None = None) -> None:
        self._increments[(counter, tuple((tags or {}).items()))] += value

    def flush(self) -> None:
        increments, levels = self._increments, self._levels
        self._increments, self._levels = Counter(), {}
        for (counter, tags), value in increments.items():
            counter.inc(value, dict(tags))
        for (gauge, tags), value in levels.items():
            gauge.set(value, dict(tags))
