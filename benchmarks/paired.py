"""The default against one plain vLLM engine, both running, driven in alternating rounds: the
later-turn TTFT ratio with the machine's drift paired out.

On a shared machine two runs of the same code a few minutes apart differ by more than the gap
this ratio measures. Here both systems stay up and take turns on the same workload (vllm, app,
app, vllm, ...), so each round's ratio compares them under the same machine state, and the
pooled ratio uses every round's later turns.

    python -m benchmarks.paired [--rounds 4] [--preset default|ci] [--serve-proxy]
    python -m benchmarks.paired --url http://HEAD:8000 --vllm-url http://NODE:8001 [--model NAME ...]

With --url both systems run where they are: the app there, and a plain vLLM OpenAI server of the
same model under the same served name (`vllm serve MODEL --served-model-name NAME
--enable-prefix-caching`) on a node like the app's, at --vllm-url; this machine only drives them.
The app runs as deployed (here it is started with prefill's prefix cache off: cache loss).
"""

import argparse
import statistics
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from benchmarks.multi_turn import (
    APP_SYSTEMS,
    PRESETS,
    Preset,
    SystemRun,
    add_serve_proxy_flag,
    drive,
    scenarios,
    warm_up,
)
from benchmarks.target import NO_KEY, Target, add_target_args, resolve_target

SYSTEMS = ("vllm", "on-decode")


@dataclass(frozen=True)
class Round:
    later_ttft_ms: dict[str, list[float]]
    """System -> TTFT of every later turn in this round."""

    def p50(self, system: str) -> float:
        return statistics.median(self.later_ttft_ms[system])

    @property
    def ratio(self) -> float:
        return self.p50("on-decode") / self.p50("vllm")


def later_ttfts_ms(run: SystemRun) -> list[float]:
    return [r.ttft_s * 1e3 for turns in run.turns for _, r in turns[1:]]


def run_rounds(urls: dict[str, str], tokenizer, preset: Preset, model: str, rounds: int,
               api_key: str = NO_KEY) -> list[Round]:
    """`rounds` rounds over both systems (`urls`: system -> URL; `api_key` on every request); odd
    rounds reverse the order."""
    extras = {"vllm": {"model": model}, "on-decode": {**APP_SYSTEMS["on-decode"], "model": model}}
    for system in SYSTEMS:
        warm_up(urls[system], tokenizer, extras[system], api_key)
    results = []
    for index in range(rounds):
        order = SYSTEMS if index % 2 == 0 else SYSTEMS[::-1]
        runs = {s: drive(urls[s], s, tokenizer, preset, extras[s], api_key) for s in order}
        results.append(Round({s: later_ttfts_ms(run) for s, run in runs.items()}))
    return results


def report(results: list[Round]) -> str:
    lines = [f"round {i}: vllm {r.p50('vllm'):.1f} ms, on-decode {r.p50('on-decode'):.1f} ms, {r.ratio:.2f}x"
             for i, r in enumerate(results)]
    pooled = {s: statistics.median(t for r in results for t in r.later_ttft_ms[s]) for s in SYSTEMS}
    lines.append(f"pooled later-turn TTFT p50: vllm {pooled['vllm']:.1f} ms, on-decode {pooled['on-decode']:.1f} ms, "
                 f"{pooled['on-decode'] / pooled['vllm']:.2f}x (target <= 1.3); rounds "
                 f"{min(r.ratio for r in results):.2f}-{max(r.ratio for r in results):.2f}x")
    return "\n".join(lines)


@contextmanager
def systems_up(target: Target, vllm_url: str | None, config, haproxy: bool) -> Iterator[dict[str, str]]:
    """Both systems' URLs: the target's app and the plain vLLM server at `vllm_url`, or both
    started here with `config` (the app on Serve, the plain engine beside it)."""
    if target.url:
        yield {"vllm": vllm_url, "on-decode": target.url}
        return
    from app.ops.launch import replace_app, start_serve
    from benchmarks.peers import plain_vllm

    app_url = start_serve(haproxy=haproxy)
    replace_app(config)
    with plain_vllm(config) as local_vllm_url:
        yield {"vllm": local_vllm_url, "on-decode": app_url}


def main() -> None:
    from app.config import load_config
    from benchmarks.workload import load_tokenizer

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="default")
    add_serve_proxy_flag(parser)
    add_target_args(parser, url_note="needs --vllm-url")
    parser.add_argument("--vllm-url", help="with --url: a plain vLLM OpenAI server of the same model, under the same "
                                           "served name, on a node like the app's (this benchmark cannot start it "
                                           "there)")
    args = parser.parse_args()
    if bool(args.url) != bool(args.vllm_url):
        parser.error("--url and --vllm-url go together: both systems run where they are, or both here")
    preset = PRESETS[args.preset]
    config = load_config({"max_model_len": str(preset.max_model_len), **scenarios(preset)["prefix-off"].app_args})
    target = resolve_target(args, config)
    config = target.app_config(config)
    with systems_up(target, args.vllm_url, config, haproxy=not args.serve_proxy) as urls:
        results = run_rounds(urls, load_tokenizer(config), preset, target.model, args.rounds, target.api_key)
    print(report(results))


if __name__ == "__main__":
    main()
