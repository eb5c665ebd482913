"""Every benchmark result the repository keeps: `benchmarks/history.csv`, one row per value of one
metric for one system at one level in one run. `benchmarks.sweep`, `benchmarks.multi_turn` and
`benchmarks.agent` append their summary's rows at the end of each run (`--no-history` skips it);
the rows from before the file existed come from docs/measurements.md's run log (their `source`
names the docs commit that recorded them, and `commit` is empty).

    from benchmarks.history import query
    query(benchmark="sweep", system="app/ideal", level=64, metric="later_ttft_p50")

Ratios are rows whose system names both sides ("app/ideal": the app's value over the ideal's).
"""

import argparse
import csv
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

PATH = Path(__file__).with_name("history.csv")
COLUMNS = ("date", "commit", "source", "benchmark", "run", "scenario", "system", "level", "repeats", "metric",
           "value", "unit", "note")
"""`level`: conversations or tasks in flight; `repeats`: the repeats pooled in the value; `value` is
empty where only a range is known (then in `note`)."""


def load(path: Path = PATH) -> list[dict[str, str]]:
    """Every row, as the file has it (strings; empty for unknown)."""
    with open(path, newline="") as file:
        reader = csv.DictReader(file)
        if tuple(reader.fieldnames or ()) != COLUMNS:
            raise ValueError(f"{path}: columns {reader.fieldnames}, expected {list(COLUMNS)}")
        return list(reader)


def load_table(path: Path = PATH):
    """Every row as a pyarrow Table: `value` float64, `level` and `repeats` int64 (null where unknown)."""
    import pyarrow as pa

    rows = load(path)
    numeric = {"value": (float, pa.float64()), "level": (int, pa.int64()), "repeats": (int, pa.int64())}
    columns = {}
    for name in COLUMNS:
        values = [row[name] for row in rows]
        if name in numeric:
            kind, arrow_type = numeric[name]
            columns[name] = pa.array([kind(v) if v != "" else None for v in values], arrow_type)
        else:
            columns[name] = pa.array(values, pa.string())
    return pa.table(columns)


def query(path: Path = PATH, **where) -> list[dict[str, str]]:
    """The rows whose columns equal `where`'s values (compared as text: level=64 and level="64" alike)."""
    unknown = set(where) - set(COLUMNS)
    if unknown:
        raise ValueError(f"no such column: {', '.join(sorted(unknown))}")
    return [row for row in load(path) if all(row[k] == str(v) for k, v in where.items())]


def append(rows: Iterable[Mapping[str, object]], path: Path = PATH) -> int:
    """Append rows (missing columns empty; an unknown column is an error); the header if the file is
    new. Returns the number of rows written."""
    rows = list(rows)
    for row in rows:
        unknown = set(row) - set(COLUMNS)
        if unknown:
            raise ValueError(f"no such column: {', '.join(sorted(unknown))}")
    new = not path.exists() or path.stat().st_size == 0
    with open(path, "a", newline="") as file:
        writer = csv.DictWriter(file, COLUMNS, lineterminator="\n")
        if new:
            writer.writeheader()
        writer.writerows({k: _text(row.get(k, "")) for k in COLUMNS} for row in rows)
    return len(rows)


def _text(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def git_commit(root: Path = PATH.parent) -> str:
    """The checked-out commit, with "-dirty" when tracked files have changes; "" outside git."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                                check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return commit + ("-dirty" if dirty else "")


def add_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-history", action="store_true",
                        help=f"do not append this run's summary rows to {PATH.relative_to(PATH.parents[1])}")


def record(args: argparse.Namespace, benchmark: str, rows: list[dict[str, object]], path: Path = PATH) -> int:
    """Stamp a finished run's summary rows (date, commit, where its output went, what it was run with)
    and append them, unless the run was started with --no-history."""
    if getattr(args, "no_history", False) or not rows:
        return 0
    settings = [f"{k}={v}" for k, v in getattr(args, "set", [])]
    settings += [f"peers {k}={v}" for k, v in getattr(args, "peer_set", [])]
    if getattr(args, "url", None):
        settings.append(f"url {args.url}")
    if getattr(args, "serve_proxy", False):
        settings.append("Serve's Python proxy")
    out = getattr(args, "out", None)
    stamp = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": git_commit(),
             "source": str(out) if out else "", "benchmark": benchmark, "run": out.name if out else "",
             "note": _command_line(sys.argv[1:])}
    written = append(({**stamp, **row, "scenario": "; ".join(filter(None, (row.get("scenario"), *settings)))
                       or "default"} for row in rows), path)
    print(f"{written} rows appended to {path}", file=sys.stderr)
    return written


def _command_line(argv: list[str]) -> str:
    """The run's arguments, the API key's value left out (the file is committed)."""
    shown, hide = [], False
    for arg in argv:
        shown.append("***" if hide else "--api-key=***" if arg.startswith("--api-key=") else arg)
        hide = arg == "--api-key"
    return " ".join(shown)


def _row(system: str, level: object, repeats: object, metric: str, value: float, unit: str,
         scenario: str = "") -> dict[str, object]:
    return {"scenario": scenario, "system": system, "level": level, "repeats": repeats, "metric": metric,
            "value": value, "unit": unit}


LEVEL_METRICS = (("first_p50", "first_ttft_p50", 1e3, "ms"), ("later_p50", "later_ttft_p50", 1e3, "ms"),
                 ("later_p99", "later_ttft_p99", 1e3, "ms"), ("itl_p50", "itl_p50", 1e3, "ms"),
                 ("requests_per_s", "requests_per_s", 1, "1/s"), ("tokens_per_s", "tokens_per_s", 1, "tokens/s"),
                 ("one_burst", "one_burst", 1, "share"), ("later_hits", "later_hits", 1, "share"),
                 ("prefilled_over_ideal", "prefilled_over_ideal", 1, "x"), ("failed", "failed", 1, "count"))
"""benchmarks.sweep_summary.LevelSummary's fields: (attribute, metric, scale, unit)."""


def _levels(rows: list, block_size: int) -> dict[tuple[str, int], tuple[object, int]]:
    """(system, level) -> (LevelSummary, repeats), as benchmarks.sweep summarises them."""
    from benchmarks.sweep_summary import LevelSummary

    groups: dict[tuple[str, int], list] = {}
    for row in rows:
        groups.setdefault((row.system, row.concurrency), []).append(row)
    return {key: (LevelSummary.of(group, block_size), len({r.repeat for r in group}))
            for key, group in groups.items() if any(not r.error for r in group)}


def _level_rows(table: dict, scenario: str = "") -> list[dict[str, object]]:
    return [_row(system, level, repeats, metric, getattr(s, name) * scale, unit, scenario)
            for (system, level), (s, repeats) in table.items() for name, metric, scale, unit in LEVEL_METRICS]


def _ratio(table: dict, level: int, peer: str, name: str, metric: str, scenario: str = "") -> list[dict]:
    mine, theirs = table.get(("app", level)), table.get((peer, level))
    if mine is None or theirs is None or not getattr(theirs[0], name):
        return []
    return [_row(f"app/{peer}", level, mine[1], metric, getattr(mine[0], name) / getattr(theirs[0], name), "x",
                 scenario)]


def sweep_rows(rows: list, block_size: int) -> list[dict[str, object]]:
    """benchmarks.sweep's summary: each system at each level, and the app over each peer on issue
    14's targets and over Ray Serve LLM's later-turn p50."""
    from benchmarks.sweep_summary import TARGETS

    table = _levels(rows, block_size)
    metrics = {name: metric for name, metric, _, _ in LEVEL_METRICS}
    ratios = [r for level in sorted({n for _, n in table}) for name, (peer, _, _) in TARGETS.items()
              for r in _ratio(table, level, peer, name, metrics[name])]
    ratios += [r for level in sorted({n for _, n in table})
               for r in _ratio(table, level, "serve-llm", "later_p50", "later_ttft_p50")]
    return _level_rows(table) + ratios


def agent_rows(rows: list, block_size: int, preset: str) -> list[dict[str, object]]:
    """benchmarks.agent's summary: each system at each task count (the sweep's fields, turns and the
    history each later turn reused), and the app over each peer on issue 36's targets."""
    from benchmarks.agent import TARGETS, history_reused
    from benchmarks.report import percentile

    scenario = f"preset {preset}"
    table = _levels(rows, block_size)
    out = _level_rows(table, scenario)
    for system, level in table:
        group = [r for r in rows if r.system == system and r.concurrency == level]
        reused = history_reused(group)
        repeats = table[system, level][1]
        out.append(_row(system, level, repeats, "turns", sum(not r.error for r in group), "count", scenario))
        if reused:
            out.append(_row(system, level, repeats, "history_reused_p50", statistics.median(reused), "share",
                            scenario))
            out.append(_row(system, level, repeats, "history_reused_p5", percentile(reused, 5), "share", scenario))
            if system == "app":
                out.append(_row(system, level, repeats, "turns_reusing_95pct",
                                sum(s >= 0.95 for s in reused) / len(reused), "share", scenario))
    metrics = {name: metric for name, metric, _, _ in LEVEL_METRICS}
    out += [r for level in sorted({n for _, n in table}) for name, peer, _ in TARGETS if peer is not None
            for r in _ratio(table, level, peer, name, metrics[name], scenario)]
    return out


def multi_turn_rows(rows: list, block_size: int, in_flight: int) -> list[dict[str, object]]:
    """benchmarks.multi_turn's summary: each system in each scenario (`in_flight` conversations at
    once), and this project's systems' later-turn TTFT p50 over every other system of their scenario
    (and over `vllm`, from whichever scenario ran it), as its summary gives them."""
    from benchmarks.report import PROJECT_SYSTEMS, SystemSummary

    groups: dict[tuple[str, str], list] = {}
    for row in rows:
        groups.setdefault((row.scenario, row.system), []).append(row)
    table = {key: SystemSummary.of(group, block_size) for key, group in groups.items()}
    fields = (("first_p50", "first_ttft_p50", 1e3, "ms"), ("later_p50", "later_ttft_p50", 1e3, "ms"),
              ("later_p95", "later_ttft_p95", 1e3, "ms"), ("itl_p50", "itl_p50", 1e3, "ms"),
              ("prefilled_over_ideal", "prefilled_over_ideal", 1, "x"), ("later_hits", "later_hits", 1, "share"),
              ("pulled_share", "pulled_share", 1, "share"), ("throughput", "tokens_per_s", 1, "tokens/s"))
    out = [_row(system, in_flight, 1, metric, getattr(s, name) * scale, unit, scenario)
           for (scenario, system), s in table.items() for name, metric, scale, unit in fields]
    vllm = next((s for (_, system), s in table.items() if system == "vllm"), None)
    for (scenario, system), mine in table.items():
        if system not in PROJECT_SYSTEMS:
            continue
        peers = {p: s for (sc, p), s in table.items() if sc == scenario and p != system}
        if vllm is not None:
            peers.setdefault("vllm", vllm)
        out += [_row(f"{system}/{peer}", in_flight, 1, "later_ttft_p50", mine.later_p50 / s.later_p50, "x", scenario)
                for peer, s in peers.items() if s.later_p50]
    return out
