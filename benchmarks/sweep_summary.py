"""The concurrency sweep's summary: each system at each level, the app's ratios over its peers,
where its CPU went and how fast the machine ran, from the rows and CPU use benchmarks.sweep records."""

import os
import statistics
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from app.config import AppConfig
from benchmarks.cpu_profile import CLIENT_ROLE
from benchmarks.report import Row, ideal_tokens, later_hit_share, percentile, wall_s

APP_EXTRA = {"app": {}, "app-fixed": {"load_aware_placement": False}}
"""The app as shipped, and with the fixed placement rule (per request), on the same deployment."""
BURST_S = 0.010
"""A reply whose content chunks all reached the client within this of the first came in one burst."""


@dataclass(frozen=True)
class CpuUse:
    """CPU seconds each process role used while one system ran one level (benchmarks.cpu_profile)."""

    system: str
    concurrency: int
    repeat: int
    replies: int
    seconds_by_role: dict[str, float]

    @property
    def client_ms_per_reply(self) -> float:
        return self.seconds_by_role.get(CLIENT_ROLE, 0.0) * 1e3 / max(self.replies, 1)


@dataclass(frozen=True)
class LevelSummary:
    """One system at one level (failed requests are counted, never timed)."""

    first_p50: float
    later_p50: float
    later_p99: float
    itl_p50: float
    requests_per_s: float
    tokens_per_s: float
    one_burst: float
    later_hits: float
    prefilled_over_ideal: float
    failed: int

    @classmethod
    def of(cls, rows: list[Row], block_size: int) -> "LevelSummary":
        ok = [r for r in rows if not r.error]
        later = [r.ttft_s for r in ok if r.turn > 1]
        wall = sum(wall_s([r for r in ok if r.repeat == repeat]) for repeat in {r.repeat for r in ok})
        bursts = [r for r in ok if r.completion_tokens > 1]
        return cls(statistics.median(r.ttft_s for r in ok if r.turn == 1), statistics.median(later),
                   percentile(later, 99), statistics.median(r.itl_s for r in ok), len(ok) / wall,
                   sum(r.completion_tokens for r in ok) / wall,
                   sum(r.itl_s * (r.completion_tokens - 1) <= BURST_S for r in bursts) / max(len(bursts), 1),
                   later_hit_share(ok, block_size), sum(r.prefilled_tokens for r in ok) / ideal_tokens(ok),
                   len(rows) - len(ok))


TARGETS = {"later_p50": ("ideal", 1.5, "<="), "later_p99": ("ideal", 2.0, "<="), "first_p50": ("ideal", 1.5, "<="),
           "requests_per_s": ("ideal", 0.9, ">="), "tokens_per_s": ("ideal", 0.9, ">=")}
"""Issue 14's targets at 32 and 64 conversations: the app's value over the ideal's."""


def core_handicap(systems) -> list[str]:
    """What the app's rows carry against a one-engine peer's, written beside the results (the peers
    get the same engine settings and prompt tokens; the cores cannot be split the same way)."""
    if not {"ideal", "vllm"} & set(systems):
        return []
    return ["", f"Handicap: the ideal and vLLM's chat API run one engine on all {os.cpu_count()} cores; the app's "
            "and Ray Serve LLM's prefill and decode engines one core each, and the app's serving path shares them."]


def summarize(rows: list[Row], config: AppConfig) -> str:
    levels = sorted({r.concurrency for r in rows})
    systems = list(dict.fromkeys(r.system for r in rows))
    table = {(s, n): LevelSummary.of(group, config.block_size) for s in systems for n in levels
             if (group := [r for r in rows if r.system == s and r.concurrency == n])}
    lines = ["| conversations | system | turn-1 TTFT p50 ms | later TTFT p50 / p99 ms | ITL p50 ms | requests/s "
             "| tokens/s | one-burst replies | later-turn hits | prefilled / ideal | failed |", "|" + "---|" * 11]
    for (system, n), s in table.items():
        lines.append(f"| {n} | {system} | {s.first_p50 * 1e3:.0f} | {s.later_p50 * 1e3:.0f} / "
                     f"{s.later_p99 * 1e3:.0f} | {s.itl_p50 * 1e3:.1f} | {s.requests_per_s:.2f} | "
                     f"{s.tokens_per_s:.0f} | {s.one_burst:.2f} | {s.later_hits:.2f} | "
                     f"{s.prefilled_over_ideal:.2f}x | {s.failed} |")
    lines += core_handicap(systems)
    lines += ["", "Where the app computed prompts (share of turns on decode, first turns / later turns):"]
    for system in (s for s in systems if s in APP_EXTRA):
        shares = []
        for n in levels:
            ok = [r for r in rows if r.system == system and r.concurrency == n and not r.error]
            first, later = [r for r in ok if r.turn == 1], [r for r in ok if r.turn > 1]
            shares.append(f"{n}: {_on_decode_share(first):.2f} / {_on_decode_share(later):.2f}")
        lines.append(f"- {system}: " + "; ".join(shares))
    lines += ["", "Later turns by where the app computed them, p50 ms (TTFT; in the engine: waiting for the step in "
              "flight and the queue / the step to the first token):"]
    lines += [line for system in systems if system in APP_EXTRA for n in levels
              if (line := _later_by_side(system, n, [r for r in rows if r.system == system and r.concurrency == n]))]
    lines += ["", "Ratios, app / peer (issue 14's targets at 32 and 64 conversations):"]
    peers_ran = any(s not in APP_EXTRA for s in systems)
    lines += _ratio_lines(table, levels) if peers_ran else ["- not computed: no peer ran"]
    return "\n".join(lines)


def _ratio_lines(table: dict[tuple[str, int], LevelSummary], levels: list[int]) -> list[str]:
    lines = []
    for n in levels:
        mine = table.get(("app", n))
        if mine is None:
            continue
        ratios = [f"{name} {getattr(mine, name) / getattr(table[(peer, n)], name):.2f}x (target {op} {limit})"
                  for name, (peer, limit, op) in TARGETS.items() if (peer, n) in table]
        if ("serve-llm", n) in table:
            ratios.append(f"later_p50 / serve-llm {mine.later_p50 / table[('serve-llm', n)].later_p50:.2f}x "
                          "(target <= 0.3)")
        lines.append(f"- {n} conversations: " + "; ".join(ratios))
    return lines


def cpu_lines(cpu: list[CpuUse]) -> str:
    """CPU milliseconds per reply by process role, at each system's highest level (repeats pooled)."""
    top = max(c.concurrency for c in cpu)
    lines = [f"CPU ms per reply by process role at {top} conversations (2 cores: CPU is what binds):", ""]
    for system in dict.fromkeys(c.system for c in cpu):
        runs = [c for c in cpu if c.concurrency == top and c.system == system]
        replies, seconds = sum(c.replies for c in runs), Counter()
        for c in runs:
            seconds.update(c.seconds_by_role)
        per_reply = {role: s * 1e3 / max(replies, 1) for role, s in seconds.most_common()}
        parts = ", ".join(f"{role} {ms:.1f}" for role, ms in per_reply.items())
        lines.append(f"- {system}: {sum(per_reply.values()):.1f} in all: {parts}")
    return "\n".join(lines)


def machine_lines(rows: list[Row], cpu: list[CpuUse], config: AppConfig) -> str:
    """Per level and repeat: how fast the machine ran for each system (the client's CPU per reply)
    and the app's ratios over the ideal in that repeat alone."""
    lines = ["Each repeat alone: the benchmark client's CPU ms per reply (a system's client does the same work "
             "per reply in every run: higher, a slower machine) and, where both ran, the app over the ideal "
             "(later p50 / p99, turn-1 p50, tokens/s):", ""]
    for level in sorted({c.concurrency for c in cpu}):
        for repeat in sorted({c.repeat for c in cpu}):
            runs = [c for c in cpu if c.concurrency == level and c.repeat == repeat]
            line = f"- {level} conversations, repeat {repeat}: client " + ", ".join(
                f"{c.system} {c.client_ms_per_reply:.1f}" for c in runs)
            group = {s: [r for r in rows if r.system == s and r.concurrency == level and r.repeat == repeat]
                     for s in ("app", "ideal")}
            if all(group.values()):
                app, ideal = (LevelSummary.of(group[s], config.block_size) for s in ("app", "ideal"))
                line += (f"; app / ideal {app.later_p50 / ideal.later_p50:.2f} / {app.later_p99 / ideal.later_p99:.2f}"
                         f", {app.first_p50 / ideal.first_p50:.2f}, {app.tokens_per_s / ideal.tokens_per_s:.2f}x")
            lines.append(line)
    return "\n".join(lines)


def _later_by_side(system: str, level: int, rows: list[Row]) -> str:
    by_side: dict[str, list[Row]] = {}
    for row in rows:
        if row.turn > 1 and not row.error:
            by_side.setdefault(row.decision, []).append(row)
    parts = [f"{side} {len(group)}: {statistics.median(r.ttft_s for r in group) * 1e3:.0f} "
             f"({statistics.median(r.engine_wait_s for r in group) * 1e3:.0f} / "
             f"{statistics.median(r.engine_step_s for r in group) * 1e3:.0f})"
             for side, group in sorted(by_side.items())]
    return f"- {system} at {level}: " + "; ".join(parts) if parts else ""


def _on_decode_share(rows: list[Row]) -> float:
    return sum(r.decision == "prefill_on_decode" for r in rows) / max(len(rows), 1)


def plot(rows: list[Row], block_size: int, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = sorted({r.concurrency for r in rows})
    figure, (ttft_axis, first_axis, rate_axis) = plt.subplots(1, 3, figsize=(16, 5))
    for system in dict.fromkeys(r.system for r in rows):
        points = [(n, LevelSummary.of(group, block_size)) for n in levels
                  if (group := [r for r in rows if r.system == system and r.concurrency == n])]
        xs = [n for n, _ in points]
        line = ttft_axis.plot(xs, [s.later_p50 * 1e3 for _, s in points], "o-", label=f"{system} p50")[0]
        ttft_axis.plot(xs, [s.later_p99 * 1e3 for _, s in points], "x--", color=line.get_color(),
                       label=f"{system} p99")
        first_axis.plot(xs, [s.first_p50 * 1e3 for _, s in points], "o-", color=line.get_color(), label=system)
        rate_axis.plot(xs, [s.tokens_per_s for _, s in points], "o-", color=line.get_color(), label=system)
    for axis, title, unit in ((ttft_axis, "Later-turn TTFT", "ms"), (first_axis, "Turn-1 TTFT p50", "ms"),
                              (rate_axis, "Throughput", "output tokens/s")):
        axis.set(xscale="log", xlabel="concurrent conversations", ylabel=unit, title=title, xticks=levels,
                 xticklabels=[str(n) for n in levels])
        axis.grid(alpha=0.3)
    ttft_axis.set_yscale("log")
    first_axis.set_yscale("log")
    ttft_axis.legend(fontsize=7)
    rate_axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(out / "sweep.png", dpi=100)
