"""The default against one plain vLLM engine, both running, driven in alternating rounds: the
later-turn TTFT ratio with the machine's drift paired out.

On a shared machine two runs of the same code a few minutes apart differ by more than the gap
this ratio measures. Here both systems stay up and take turns on the same workload (vllm, app,
app, vllm, ...), so each round's ratio compares them under the same machine state, and the
pooled ratio uses every round's later turns.

    python -m benchmarks.paired [--rounds 4] [--preset default|ci] [--serve-proxy]
"""

import argparse
import statistics
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


def run_rounds(urls: dict[str, str], tokenizer, preset: Preset, model: str, rounds: int) -> list[Round]:
    """`rounds` rounds over both systems (`urls`: system -> URL); odd rounds reverse the order."""
    extras = {"vllm": {"model": model}, "on-decode": {**APP_SYSTEMS["on-decode"], "model": model}}
    for system in SYSTEMS:
        warm_up(urls[system], tokenizer, extras[system])
    results = []
    for index in range(rounds):
        order = SYSTEMS if index % 2 == 0 else SYSTEMS[::-1]
        results.append(Round({s: later_ttfts_ms(drive(urls[s], s, tokenizer, preset, extras[s])) for s in order}))
    return results


def report(results: list[Round]) -> str:
    lines = [f"round {i}: vllm {r.p50('vllm'):.1f} ms, on-decode {r.p50('on-decode'):.1f} ms, {r.ratio:.2f}x"
             for i, r in enumerate(results)]
    pooled = {s: statistics.median(t for r in results for t in r.later_ttft_ms[s]) for s in SYSTEMS}
    lines.append(f"pooled later-turn TTFT p50: vllm {pooled['vllm']:.1f} ms, on-decode {pooled['on-decode']:.1f} ms, "
                 f"{pooled['on-decode'] / pooled['vllm']:.2f}x (target <= 1.3); rounds "
                 f"{min(r.ratio for r in results):.2f}-{max(r.ratio for r in results):.2f}x")
    return "\n".join(lines)


def main() -> None:
    from app.config import load_config
    from app.launch import replace_app, start_serve
    from benchmarks.peers import plain_vllm
    from benchmarks.workload import load_tokenizer

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="default")
    add_serve_proxy_flag(parser)
    args = parser.parse_args()
    preset = PRESETS[args.preset]
    config = load_config({"max_model_len": str(preset.max_model_len), **scenarios(preset)["prefix-off"].app_args})
    app_url = start_serve(haproxy=not args.serve_proxy)
    replace_app(config)
    with plain_vllm(config) as vllm_url:
        results = run_rounds({"vllm": vllm_url, "on-decode": app_url}, load_tokenizer(config), preset,
                             config.model_name, args.rounds)
    print(report(results))


if __name__ == "__main__":
    main()
