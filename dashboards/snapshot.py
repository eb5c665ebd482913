"""docs/img/dashboard.png from a real run: starts a local Ray and Serve with the app, a Prometheus scraping
Ray's metrics endpoint every 5 s, drives multi-turn conversations through the OpenAI API for a few minutes
(one phase per system of benchmarks.multi_turn: the default on-decode flow, a routing policy, no reverse
pulls), renders the dashboard with dashboards/render.py, and stops everything it started.

    python -m dashboards.snapshot [--minutes 5] [--systems on-decode round_robin disagg] [--in-flight 6]

Needs the `prometheus` binary on PATH (Debian: apt-get install prometheus) and the bench extra. The app runs
with two prefill replicas (app args below), so the per-replica panels and the routing policies have something
to tell apart. Prometheus scrapes this Ray's own metrics port (a static target): Ray started without its
dashboard writes no service discovery file, and /tmp/ray/prom_metrics_service_discovery.json may name
another Ray session on a shared machine.
"""

import argparse
import itertools
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

from dashboards.render import render

APP_ARGS = {"max_model_len": "4096", "prefill.replicas": "2", "prefill.cpus_per_replica": "0.5",
            "decode.cpus_per_replica": "0.5"}
PROMETHEUS_YML = """global:
  scrape_interval: 5s
  evaluation_interval: 5s
scrape_configs:
  - job_name: ray
    static_configs:
      - targets: ['127.0.0.1:{port}']
"""


def start_prometheus(workdir: Path, data_dir: Path, metrics_port: int) -> tuple[subprocess.Popen, str]:
    from app.engine.ports import free_port

    (workdir / "prometheus.yml").write_text(PROMETHEUS_YML.format(port=metrics_port))
    port = free_port("127.0.0.1")
    server = subprocess.Popen(
        ["prometheus", f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={data_dir}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=open(workdir / "prometheus.log", "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(60):
        try:
            urllib.request.urlopen(f"{url}/-/ready", timeout=2)
            return server, url
        except OSError:
            if server.poll() is not None:
                break
            time.sleep(0.5)
    server.kill()
    raise RuntimeError(f"prometheus did not start: {(workdir / 'prometheus.log').read_text()[-2000:]}")


def converse_until(url: str, tokenizer, preset, phases: list[tuple[str, float]], model: str,
                   counts: dict[str, int]) -> None:
    """One client's conversations, back to back, each phase's system until that phase's end."""
    from benchmarks.multi_turn import APP_SYSTEMS, SystemRun, converse
    from benchmarks.workload import openai_client

    client = openai_client(url)
    for system, until in phases:
        while time.time() < until:
            index = next(counts["ids"])
            try:
                turns = converse(client, tokenizer, SystemRun(system), index, preset,
                                 {**APP_SYSTEMS[system], "model": model})
                with counts["lock"]:
                    counts["turns"] += len(turns)
            except Exception as error:  # a failed turn ends its conversation; the load goes on
                with counts["lock"]:
                    counts["errors"] += 1
                print(f"{system} conversation {index}: {error!r}", file=sys.stderr)


def snapshot(out: Path, minutes: float, systems: list[str], in_flight: int, turns: int,
             data_dir: Path | None = None) -> None:
    import ray

    from app.config import load_config
    from app.ops.launch import replace_app, start_serve, stop_local
    from benchmarks.multi_turn import APP_SYSTEMS, PRESETS, warm_up
    from benchmarks.workload import load_tokenizer

    if shutil.which("prometheus") is None:
        raise SystemExit("needs the prometheus binary on PATH (Debian: apt-get install prometheus)")
    preset = PRESETS["default"]
    preset = replace(preset, profile=replace(preset.profile, turns=turns), in_flight=in_flight)
    config = load_config(APP_ARGS)
    with tempfile.TemporaryDirectory(prefix="kvloop-prometheus-") as workdir:
        url = start_serve()
        prometheus = None
        try:
            prometheus, prometheus_url = start_prometheus(Path(workdir), data_dir or Path(workdir) / "data",
                                                          ray._private.worker.global_worker.node.metrics_export_port)
            started = time.time()
            replace_app(config)
            tokenizer = load_tokenizer(config)
            warm_up(url, tokenizer, {**APP_SYSTEMS[systems[0]], "model": config.model_name})
            print(f"app up in {time.time() - started:.0f} s; {minutes:g} min of load: {' -> '.join(systems)}, "
                  f"{in_flight} conversations in flight, {turns} turns each", file=sys.stderr)
            begin = time.time()
            phase_s = minutes * 60 / len(systems)
            phases = [(system, begin + (i + 1) * phase_s) for i, system in enumerate(systems)]
            counts = {"ids": itertools.count(), "turns": 0, "errors": 0, "lock": threading.Lock()}
            clients = [threading.Thread(target=converse_until,
                                        args=(url, tokenizer, preset, phases, config.model_name, counts))
                       for _ in range(in_flight)]
            for client in clients:
                client.start()
            for client in clients:
                client.join()
            conversations = next(counts["ids"])
            print(f"load done in {time.time() - begin:.0f} s: {counts['turns']} turns, {conversations} "
                  f"conversations begun, {counts['errors']} failed", file=sys.stderr)
            time.sleep(20)  # Ray reports metrics every 10 s; Prometheus scrapes every 5 s
            profile = preset.profile
            subtitle = (f"a real run: {minutes:g} min of multi-turn chats through the OpenAI API, {in_flight} at once, "
                        f"{turns} turns each ({profile.system_tokens}-token system prompt, {profile.user_tokens}-token "
                        f"questions, {profile.reply_tokens}-token replies); {counts['turns']} turns, "
                        f"{counts['errors']} failed. Embedded model, 1 router, {config.prefill.replicas} prefill + "
                        f"{config.decode.replicas} decode vLLM-CPU engines, {os.cpu_count()} cores.")
            marks = [(begin + i * phase_s, system) for i, system in enumerate(systems)]
            window = (begin - 30, time.time())
            for title, n in render(prometheus_url, *window, out, subtitle=subtitle, marks=marks).items():
                print(f"{n:3d} series  {title}", file=sys.stderr)
            print(f"wrote {out}; window {window[0]:.0f}-{window[1]:.0f}, phases "
                  + " ".join(f"{when:.0f}={name}" for when, name in marks), file=sys.stderr)
        finally:
            if prometheus is not None:
                prometheus.terminate()
                prometheus.wait(timeout=30)
            stop_local()


def main() -> int:
    from benchmarks.multi_turn import APP_SYSTEMS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=5, help="load duration, split evenly among --systems")
    parser.add_argument("--systems", nargs="+", default=["on-decode", "round_robin", "disagg"],
                        choices=sorted(APP_SYSTEMS))
    parser.add_argument("--in-flight", type=int, default=6, help="conversations at once")
    parser.add_argument("--turns", type=int, default=6, help="turns per conversation")
    parser.add_argument("--out", type=Path, default=Path("docs/img/dashboard.png"))
    parser.add_argument("--data-dir", type=Path, help="keep Prometheus's data here (default: a temporary "
                        "directory, deleted); render again with `prometheus --storage.tsdb.path` on it")
    args = parser.parse_args()
    snapshot(args.out, args.minutes, args.systems, args.in_flight, args.turns, args.data_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
