"""What the multi-turn benchmark records and makes of it: one Row per request; the Markdown summary
(per system and scenario, the stage split of later turns, the ratios against the targets); the
Parquet file and the PNG plots. Used by `benchmarks/multi_turn.py` and its notebook.
"""

import os
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from app.config import AppConfig
from app.metrics import kv_bytes_per_token, model_config


@dataclass(frozen=True)
class Row:
    scenario: str
    system: str
    conversation: int
    turn: int
    started_s: float
    """When the turn was sent, seconds after the system's run began."""
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    prefilled_tokens: int
    ttft_s: float
    itl_s: float
    e2e_s: float
    decision: str
    pulled_tokens: int
    pulled_bytes: int
    plan_s: float
    """This app's stages, from its decision log (0 for peers): locate KV and choose a replica,"""
    prefill_s: float
    """compute the prompt (prefill: pull or recompute; or decode itself, for a short append, up to
    its first chunk), and get decode's first token, all inside the router"""
    decode_first_s: float
    """(0 when prefill sent the first token); the rest of ttft_s is outside: HTTP proxy,
    rendering, streaming hops."""
    concurrency: int = 0
    """Conversations in flight (the concurrency sweep; 0 elsewhere)."""
    repeat: int = 0
    """Which of the sweep's interleaved repeats of this level the row ran in (0 elsewhere)."""
    error: str = ""
    """Why the request failed (HTTP status or exception type); its timings are then 0."""
    render_s: float = 0.0
    """The app's router from receiving the request to planning it: rendering and hashing the
    prompt, waits for the render thread included (0 for peers)."""
    engine_wait_s: float = 0.0
    """In the engine that computed the prompt, before its first step: the rest of the step in
    flight and the scheduler's queue (`engine_ms` admit + queued in the decision log; 0 for peers)."""
    engine_step_s: float = 0.0
    """That engine's step(s) from scheduling the prompt to its first token (0 for peers)."""


def _by_label(rows: list[Row]) -> dict[tuple[str, str], list[Row]]:
    """Rows per (scenario, system), in the order the systems ran."""
    groups: dict[tuple[str, str], list[Row]] = {}
    for row in rows:
        groups.setdefault((row.scenario, row.system), []).append(row)
    return groups


def _turn_ttft(rows: list[Row], turn: int) -> str:
    values = [r.ttft_s * 1e3 for r in rows if r.turn == turn]
    return f"{statistics.median(values):.0f}/{percentile(values, 95):.0f}"


def percentile(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else values[0]


def ideal_prefill(prompt_tokens: list[int], completion_tokens: list[int]) -> list[int]:
    """The project's one definition of the ideal: tokens each turn of a conversation must prefill.
    Turn 1's prompt, then only each later turn's new tokens (its history, replies included, is
    already computed somewhere)."""
    return [prompt_tokens[0]] + [max(b - a - reply, 0) for a, b, reply in
                                 zip(prompt_tokens, prompt_tokens[1:], completion_tokens)]


def later_turn_hit(cached_tokens: int, previous_prompt_tokens: int, block_size: int) -> bool:
    """The project's one definition of a later-turn hit: the turn found at least the previous
    turn's whole prompt (in full blocks) already computed."""
    return cached_tokens >= previous_prompt_tokens // block_size * block_size > 0


def wall_s(rows: list[Row]) -> float:
    """From the first request sent to the last reply's end, in one drive of one system."""
    return max(r.started_s + r.e2e_s for r in rows) - min(r.started_s for r in rows)


def conversations_of(rows: list[Row]) -> list[list[Row]]:
    """Each conversation's rows in turn order."""
    by_conversation: dict[tuple[int, int], list[Row]] = {}
    for r in rows:
        by_conversation.setdefault((r.repeat, r.conversation), []).append(r)
    return [sorted(turns, key=lambda r: r.turn) for turns in by_conversation.values()]


def ideal_tokens(rows: list[Row]) -> int:
    return sum(sum(ideal_prefill([r.prompt_tokens for r in turns], [r.completion_tokens for r in turns]))
               for turns in conversations_of(rows))


def later_hit_share(rows: list[Row], block_size: int) -> float:
    pairs = [(a, b) for turns in conversations_of(rows) for a, b in zip(turns, turns[1:])]
    return sum(later_turn_hit(b.cached_tokens, a.prompt_tokens, block_size) for a, b in pairs) / max(len(pairs), 1)


@dataclass(frozen=True)
class SystemSummary:
    first_p50: float
    later_p50: float
    later_p95: float
    itl_p50: float
    prefilled_over_ideal: float
    later_hits: float
    pulled_share: float
    throughput: float

    @classmethod
    def of(cls, rows: list[Row], block_size: int) -> "SystemSummary":
        later = [r for r in rows if r.turn > 1]
        wall = wall_s(rows)
        return cls(statistics.median(r.ttft_s for r in rows if r.turn == 1), statistics.median(r.ttft_s for r in later),
                   percentile([r.ttft_s for r in later], 95), statistics.median(r.itl_s for r in rows),
                   sum(r.prefilled_tokens for r in rows) / ideal_tokens(rows),
                   later_hit_share(rows, block_size),
                   sum(r.pulled_tokens for r in later) / max(sum(r.cached_tokens for r in later), 1),
                   sum(r.completion_tokens for r in rows) / wall)


def summarize(rows: list[Row], config: AppConfig) -> str:
    groups = _by_label(rows)
    by_label = {label: SystemSummary.of(group, config.block_size) for label, group in groups.items()}
    dtype = config.engine_kwargs_of("prefill").get("dtype", "auto")
    lines = [f"model {config.model_name} ({dtype}, {_parameters(config)}), block size "
             f"{config.block_size}, KV {kv_bytes_per_token(config.model_path())} bytes/token, machine "
             f"{os.cpu_count()} CPU cores, {_memory_gib():.0f} GiB", "",
             "| scenario | system | turn-1 TTFT p50 ms | later TTFT p50 ms | later TTFT p95 ms | ITL p50 ms "
             "| prefilled / ideal | later-turn hits | pulled share of cached | output tok/s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for (scenario, system), s in by_label.items():
        lines.append(f"| {scenario} | {system} | {s.first_p50 * 1e3:.0f} | {s.later_p50 * 1e3:.0f} | "
                     f"{s.later_p95 * 1e3:.0f} | {s.itl_p50 * 1e3:.1f} | {s.prefilled_over_ideal:.2f}x | "
                     f"{s.later_hits:.2f} | {s.pulled_share:.2f} | {s.throughput:.0f} |")
    turns = sorted({r.turn for r in rows})
    lines += ["", "TTFT p50/p95 ms by turn:"] + [
        f"- {scenario}/{system}: " + " ".join(_turn_ttft(group, t) for t in turns)
        for (scenario, system), group in groups.items()]
    return "\n".join(lines + ["", "Later-turn TTFT p50 by stage, ms (plan / prefill / decode first token, 0 "
                               "when prefill sent it / outside the router: proxy, rendering, streaming):"]
                     + breakdown_lines(groups) + [""] + ratio_lines(by_label))


def breakdown_lines(groups: dict[tuple[str, str], list[Row]]) -> list[str]:
    lines = []
    for label, group in groups.items():
        later = [r for r in group if r.turn > 1 and r.prefill_s > 0]
        if later:
            stages = [statistics.median(v) * 1e3 for v in zip(*[
                (r.plan_s, r.prefill_s, r.decode_first_s, r.ttft_s - r.plan_s - r.prefill_s - r.decode_first_s)
                for r in later])]
            lines.append(f"- {'/'.join(label)}: " + " / ".join(f"{v:.0f}" for v in stages))
    return lines


PROJECT_SYSTEMS = ("pull+preserve", "on-decode")
"""This project with reverse pull and append-only sessions: every turn through prefill, and the
default (short appends on decode)."""


def ratio_lines(by_label: dict[tuple[str, str], SystemSummary]) -> list[str]:
    """This project against every other system of its scenario and the single-engine ideal."""
    ideal = next((s for (_, system), s in by_label.items() if system == "vllm"), None)
    # Systems here run one after another; near its target the vLLM ratio is measured paired.
    targets = {"vllm": " (target <= 1.3; sequential, see benchmarks.paired)", "serve-llm": " (target <= 0.4)",
               "disagg": " (target <= 0.4)"}
    lines = []
    for (scenario, system), mine in by_label.items():
        if system not in PROJECT_SYSTEMS:
            continue
        peers = {p: s for (sc, p), s in by_label.items() if sc == scenario and p != system}
        if ideal is not None:
            peers.setdefault("vllm", ideal)
        for name, peer in peers.items():
            lines.append(f"- later-turn TTFT p50, {system} / {name} ({scenario}): "
                         f"{mine.later_p50 / peer.later_p50:.2f}x{targets.get(name, '')}")
        lines.append(f"- tokens prefilled, {system} / ideal ({scenario}): {mine.prefilled_over_ideal:.2f}x "
                     f"(target <= 1.1)")
    return lines


def _parameters(config: AppConfig) -> str:
    hf = model_config(config.model_path())
    return f"{hf.get('num_hidden_layers')} layers, hidden {hf.get('hidden_size')}"


def _memory_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def write_results(rows: list[Row], summary: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pyarrow as pa
    import pyarrow.parquet as pq

    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist([asdict(r) for r in rows]), out / "rows.parquet")
    (out / "summary.md").write_text(summary + "\n")
    groups = _by_label(rows)
    labels = list(groups)
    turns = sorted({r.turn for r in rows})
    # A colour per system, a line style per scenario: up to 20 systems stay apart.
    colors = {system: plt.cm.tab20(i % 20) for i, system in enumerate(dict.fromkeys(s for _, s in labels))}
    styles = {scenario: ("-", "--", ":", "-.")[i % 4] for i, scenario in enumerate(dict.fromkeys(s for s, _ in labels))}
    figure, (ttft_axis, tokens_axis) = plt.subplots(1, 2, figsize=(15, 5.5))
    for (scenario, system), mine in groups.items():
        line = {"color": colors[system], "linestyle": styles[scenario], "marker": "o", "markersize": 3,
                "label": f"{scenario}/{system}"}
        ttft_axis.plot(turns, [statistics.median(r.ttft_s for r in mine if r.turn == t) * 1e3 for t in turns], **line)
        per_turn = [sum(r.prefilled_tokens for r in mine if r.turn == t) for t in turns]
        tokens_axis.plot(turns, [sum(per_turn[:i + 1]) for i in range(len(turns))], **line)
    _reference_lines(tokens_axis, groups[labels[0]], turns)
    ttft_axis.set(xlabel="turn", ylabel="TTFT p50 (ms)", title="Time to first token by turn", yscale="log")
    tokens_axis.set(xlabel="turn", ylabel="tokens prefilled (cumulative)", title="Prefill work")
    ttft_axis.grid(alpha=0.3)
    tokens_axis.grid(alpha=0.3)
    tokens_axis.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    figure.tight_layout()
    figure.savefig(out / "multi_turn.png", dpi=100)


def _reference_lines(axis, rows: list[Row], turns: list[int]) -> None:
    """Cumulative ideal (only new tokens after turn 1) and no reuse (every prompt in full)."""
    ideal = [ideal_tokens([r for r in rows if r.turn <= t]) for t in turns]
    no_reuse = [sum(r.prompt_tokens for r in rows if r.turn <= t) for t in turns]
    axis.plot(turns, ideal, "k--", label="ideal")
    axis.plot(turns, no_reuse, "k:", label="no reuse")
