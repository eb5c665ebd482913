"""Every benchmark that sends requests can target a real cluster: the same flags everywhere, the
model from the endpoint's /v1/models, the tokenizer and KV sizes from that model, the key from the
flag or the environment. A small local HTTP server stands in for the endpoint."""

import argparse
import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from app.config import AppConfig
from app.metrics import kv_bytes_per_token
from benchmarks.report import Row
from benchmarks.target import NO_KEY, Target, add_target_args, decisions, resolve_target

ROOT = Path(__file__).parents[2]
SENDS_REQUESTS = ("agent", "eviction_horizon", "faults", "multi_turn", "paired", "prefill_tokens", "reverse_pull",
                  "routing_policies", "sweep")
IN_PROCESS = ("decision_time", "idle_cpu")
"""Runs in this process and sends nothing: the router's own code timed, or a running app's processes read."""
TARGET_FLAGS = ("--url", "--model", "--tokenizer", "--api-key")


@pytest.fixture
def endpoint():
    """An app's endpoint as far as the target needs it: /v1/models and /admin/decisions; yields its
    URL and the (path, Authorization) of every request it got."""
    seen: list[tuple[str, str | None]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append((self.path, self.headers.get("Authorization")))
            bodies = {"/v1/models": {"object": "list", "data": [{"id": "Qwen3-32B"}, {"id": "other"}]},
                      "/admin/decisions?n=5": [{"request_id": "r1"}]}
            body = json.dumps(bodies.get(self.path, {"detail": "not found"})).encode()
            self.send_response(200 if self.path in bodies else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", seen
    server.shutdown()
    server.server_close()


def parsed(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_target_args(parser)
    return parser.parse_args(argv)


@pytest.fixture(autouse=True)
def no_key_in_environment(monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)


def test_without_a_url_the_target_is_the_embedded_default():
    assert resolve_target(parsed(), AppConfig()) == Target(None, "tiny-qwen3", "tiny-qwen3", NO_KEY)


def test_with_a_url_the_model_is_the_endpoints_first_and_names_the_tokenizer(endpoint):
    url, seen = endpoint
    target = resolve_target(parsed("--url", url + "/v1/", "--api-key", "k-1"), AppConfig())
    assert target == Target(url, "Qwen3-32B", "Qwen3-32B", "k-1")
    assert seen == [("/v1/models", "Bearer k-1")]


def test_named_model_and_tokenizer_ask_the_endpoint_nothing(endpoint):
    url, seen = endpoint
    target = resolve_target(parsed("--url", url, "--model", "qwen", "--tokenizer", "Qwen/Qwen3-32B"), AppConfig())
    assert (target.model, target.tokenizer) == ("qwen", "Qwen/Qwen3-32B")
    assert seen == []


def test_the_api_key_comes_from_the_flag_then_the_environment(monkeypatch):
    with_url = ("--url", "http://cluster:8000", "--model", "m")
    assert resolve_target(parsed(*with_url), AppConfig()).api_key == NO_KEY
    monkeypatch.setenv("OPENAI_API_KEY", "from-env")
    assert resolve_target(parsed(*with_url), AppConfig()).api_key == "from-env"
    assert resolve_target(parsed(*with_url, "--api-key", "from-flag"), AppConfig()).api_key == "from-flag"
    assert resolve_target(parsed(), AppConfig()).api_key == NO_KEY, "the app started here ignores the shell's key"


def test_the_key_reaches_every_decision_log_call_and_records_merge_by_request(endpoint):
    url, seen = endpoint
    assert decisions(url, "admin-key", 5, calls=3) == [{"request_id": "r1"}]
    assert seen == [("/admin/decisions?n=5", "Bearer admin-key")] * 3


def test_model_flags_without_a_url_end_the_program():
    with pytest.raises(SystemExit, match="--model and --tokenizer describe the app at --url"):
        resolve_target(parsed("--model", "Qwen3-32B"), AppConfig())


def test_an_endpoint_without_a_model_list_asks_for_model(endpoint):
    url, _ = endpoint
    with pytest.raises(SystemExit, match="--model"):
        resolve_target(parsed("--url", url + "/elsewhere"), AppConfig())


def test_the_app_config_takes_the_targets_model_and_so_its_kv_size(tmp_path):
    """KV bytes per token come from the tokenizer's model (a local folder here, a hub id on a
    cluster), not from the embedded model."""
    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": 64, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
        "hidden_size": 5120, "torch_dtype": "bfloat16"}))
    config = Target("http://x", "Qwen3-32B", str(tmp_path), NO_KEY).app_config(AppConfig(block_size=64))
    assert (config.model_name, config.model_path(), config.block_size) == ("Qwen3-32B", tmp_path, 64)
    assert kv_bytes_per_token(config.model_path()) == 2 * 64 * 8 * 128 * 2


def test_every_benchmark_script_is_classified():
    scripts = {p.stem for p in (ROOT / "benchmarks").glob("*.py") if '__name__ == "__main__"' in p.read_text()}
    assert scripts == {*SENDS_REQUESTS, *IN_PROCESS}


@pytest.mark.parametrize("module", SENDS_REQUESTS)
def test_every_benchmark_that_sends_requests_takes_the_target_flags(module):
    help_text = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", "--help"], cwd=ROOT, check=True,
                               capture_output=True, text=True, timeout=120).stdout
    assert all(f"  {flag} " in help_text for flag in TARGET_FLAGS), help_text


def test_the_sweep_with_a_url_refuses_the_peers_and_says_why(monkeypatch, capsys):
    from benchmarks import sweep

    monkeypatch.setattr(sys, "argv", ["sweep", "--url", "http://x", "--systems", "app", "ideal"])
    with pytest.raises(SystemExit):
        sweep.main()
    assert "rows for the peers (ideal, vllm, serve-llm) are absent" in capsys.readouterr().err


def test_the_sweep_summary_of_the_app_alone_computes_no_ratio():
    from benchmarks.sweep_summary import summarize

    rows = [Row("c2", "app", 0, turn, started_s, 1000 + 100 * turn, 32, 0, 1000, 0.1, 0.01, 1.0, "", 0, 0, 0.0, 0.0,
                0.0, concurrency=2) for turn, started_s in ((1, 0.0), (2, 4.0))]
    assert summarize(rows, AppConfig()).endswith("Ratios, app / peer (issue 14's targets at 32 and 64 "
                                                 "conversations):\n- not computed: no peer ran")


def test_a_summary_with_a_one_engine_peer_writes_the_core_handicap_beside_the_results():
    from benchmarks.agent import summarize as agent_summary
    from benchmarks.sweep_summary import summarize

    rows = [Row("c2", system, 0, turn, started_s, 1000 + 100 * turn, 32, 0, 1000, 0.1, 0.01, 1.0, "", 0, 0, 0.0, 0.0,
                0.0, concurrency=2) for system in ("app", "ideal") for turn, started_s in ((1, 0.0), (2, 4.0))]
    handicap = "Handicap: the ideal and vLLM's chat API run one engine on all"
    assert handicap in summarize(rows, AppConfig()) and handicap in agent_summary(rows, 64, "cpu")
    assert handicap not in summarize([r for r in rows if r.system == "app"], AppConfig())


def test_multi_turn_against_a_url_refuses_the_local_peers():
    from benchmarks.multi_turn import run

    with pytest.raises(ValueError, match="cannot be started on a cluster"):
        run(Target("http://x", "Qwen3-32B", "Qwen/Qwen3-32B", NO_KEY), ["vllm", "on-decode"], "ci", AppConfig())


def test_paired_with_a_url_needs_the_plain_engines_url(monkeypatch, capsys):
    from benchmarks import paired

    monkeypatch.setattr(sys, "argv", ["paired", "--url", "http://x"])
    with pytest.raises(SystemExit):
        paired.main()
    assert "--url and --vllm-url go together" in capsys.readouterr().err
