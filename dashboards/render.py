"""Draws dashboards/kv-loop.json as one PNG from a Prometheus server: each panel's queries through
/api/v1/query_range, laid out on the dashboard's own 24-column grid (gridPos), with its titles, units and
legend tables (the panel's calculations: mean, max, ...). A picture of the dashboard where no Grafana runs.

    python -m dashboards.render --prometheus http://127.0.0.1:9090 --start 2025-01-01T10:00:00 \
        --end 2025-01-01T10:10:00 --out docs/img/dashboard.png

--start/--end: unix seconds or ISO 8601 (local time unless it names a zone). Grafana's variables are
replaced: $__rate_interval by --rate-interval, $__interval by --step, $__range by the window (the
datasource variable names no query: the queries go to --prometheus).
"""

import argparse
import json
import math
import re
import sys
import urllib.parse
import urllib.request
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

DASHBOARD = Path(__file__).with_name("kv-loop.json")
GRID_COLUMNS = 24
_VARIABLE = re.compile(r"\$(?:\{(\w+)(?::\w+)?\}|(\w+))")
_LEGEND = re.compile(r"\{\{\s*(\w+)\s*\}\}")


# ---- pure parts: variables, legends, series, layout -------------------------------------------------
def substitute(expr: str, variables: dict[str, str]) -> str:
    """`expr` with every $name / ${name} replaced; an unknown variable raises (a query would be wrong)."""
    def value(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        if name not in variables:
            raise KeyError(f"no value for ${name} in {expr!r}")
        return variables[name]
    return _VARIABLE.sub(value, expr)


def legend(legend_format: str, labels: dict[str, str]) -> str:
    """Grafana's legend format: {{label}} is the label's value (empty if the series has none)."""
    if not legend_format:
        return "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
    return _LEGEND.sub(lambda m: labels.get(m.group(1), ""), legend_format)


@dataclass
class Series:
    name: str
    times: list[float]
    values: list[float]
    """NaN where the query had no value (the line breaks there, as in Grafana)."""


def series_of(response: dict, legend_format: str, times: list[float]) -> list[Series]:
    """A /api/v1/query_range answer (resultType matrix) as one series per result on the `times` grid."""
    if response.get("status") != "success":
        raise RuntimeError(f"Prometheus: {response.get('errorType')}: {response.get('error')}")
    out = []
    for result in response["data"]["result"]:
        by_time = {round(float(t), 3): float(v) for t, v in result["values"]}
        out.append(Series(legend(legend_format, result["metric"]), times,
                          [by_time.get(round(t, 3), math.nan) for t in times]))
    return sorted(out, key=lambda s: s.name)


@dataclass
class Cell:
    panel: dict
    rows: slice
    columns: slice


def layout(panels: list[dict]) -> tuple[list[Cell], int]:
    """Each panel (rows' nested panels included) on the grid: its grid rows and columns, and the grid's height."""
    flat = [p for panel in panels for p in (panel, *panel.get("panels", []))]
    cells = []
    for panel in sorted(flat, key=lambda p: (p["gridPos"]["y"], p["gridPos"]["x"])):
        g = panel["gridPos"]
        if g["x"] < 0 or g["w"] <= 0 or g["x"] + g["w"] > GRID_COLUMNS:
            raise ValueError(f"panel {panel.get('title')!r} is off the grid: {g}")
        cells.append(Cell(panel, slice(g["y"], g["y"] + g["h"]), slice(g["x"], g["x"] + g["w"])))
    return cells, max((c.rows.stop for c in cells), default=0)


CALCS = {"mean": lambda v: sum(v) / len(v), "max": max, "min": min, "lastNotNull": lambda v: v[-1]}
CALC_NAMES = {"lastNotNull": "last"}


def calc(name: str, values: list[float]) -> float:
    """A Grafana legend calculation (mean, max, min, lastNotNull) over the values that are numbers."""
    real = [v for v in values if not math.isnan(v)]
    return CALCS[name](real) if real else math.nan


_SI = [(1e9, "G"), (1e6, "M"), (1e3, "k")]


def fmt(value: float, unit: str) -> str:
    """A value in a Grafana unit: percentunit, s, Bps, ops, reqps, short."""
    if math.isnan(value):
        return "-"
    if unit == "percentunit":
        return f"{100 * value:.0f}%"
    if unit == "s":
        for scale, name in ((3600, "h"), (60, "min"), (1, "s")):
            if abs(value) >= scale:
                return f"{value / scale:.3g} {name}"
        return f"{1e3 * value:.0f} ms" if abs(value) >= 0.01 else f"{1e3 * value:.2g} ms"
    suffix = {"Bps": "B/s", "ops": "ops/s", "reqps": "req/s"}.get(unit, "")
    for scale, prefix in _SI:
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{suffix}"
    return f"{value:.2g} {suffix}".rstrip()


# ---- Prometheus ----------------------------------------------------------------------------------------
def query_range(prometheus: str, expr: str, start: float, end: float, step: float) -> dict:
    params = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step})
    with urllib.request.urlopen(f"{prometheus.rstrip('/')}/api/v1/query_range?{params}", timeout=30) as answer:
        return json.load(answer)


def panel_series(panel: dict, prometheus: str, start: float, end: float, step: float,
                 variables: dict[str, str]) -> list[Series]:
    times = [start + i * step for i in range(int((end - start) // step) + 1)]
    return [s for target in panel.get("targets", [])
            for s in series_of(query_range(prometheus, substitute(target["expr"], variables), start, end, step),
                               target.get("legendFormat", ""), times)]


# ---- drawing -------------------------------------------------------------------------------------------
def draw(board: dict, data: dict[int, list[Series]], out: Path, subtitle: str = "",
         marks: list[tuple[float, str]] = (), row_inches: float = 0.42) -> None:
    """The dashboard's panels on its grid; `data`: each query panel's series by panel id; `marks`: (unix time,
    label) drawn as a dashed line on every panel, like Grafana's annotations."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    cells, height = layout(board["panels"])
    width_in, top_in = 20.0, 0.5
    fig = plt.figure(figsize=(width_in, height * row_inches + top_in))
    fig_h = height * row_inches + top_in
    fig.text(0.01, 1 - 0.3 / fig_h, board["title"], fontsize=15, fontweight="bold", va="center")
    fig.text(0.07, 1 - 0.3 / fig_h, subtitle, fontsize=10, va="center")

    def rect(cell: Cell, left: float, right: float, top: float, bottom: float) -> list[float]:
        """The cell in figure fractions, less margins in inches (room for ticks, title and legend)."""
        x0 = cell.columns.start / GRID_COLUMNS * width_in + left
        x1 = cell.columns.stop / GRID_COLUMNS * width_in - right
        y_top = fig_h - top_in - cell.rows.start * row_inches - top
        y_bottom = fig_h - top_in - cell.rows.stop * row_inches + bottom
        return [x0 / width_in, y_bottom / fig_h, (x1 - x0) / width_in, (y_top - y_bottom) / fig_h]

    for cell in cells:
        panel = cell.panel
        if panel["type"] == "row":
            fig.text(*rect(cell, 0.1, 0, 0, 0)[:2], panel["title"], fontsize=13, fontweight="bold")
            continue
        ax = fig.add_axes(rect(cell, 0.75, 0.2, 0.3, 1.3))  # bottom: ticks and the legend table
        defaults = panel.get("fieldConfig", {}).get("defaults", {})
        unit = defaults.get("unit", "short")
        series = data.get(panel["id"], [])
        ax.set_title(panel["title"], loc="left", fontsize=10.5, fontweight="bold")
        ax.grid(alpha=0.3)
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _, u=unit: fmt(v, u)))
        ax.xaxis.set_major_locator(locator := mdates.AutoDateLocator(minticks=5, maxticks=12))
        ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator, show_offset=False))
        ax.tick_params(labelsize=8)
        if not series:
            ax.text(0.5, 0.5, "No data", ha="center", va="center", transform=ax.transAxes, color="grey")
            continue
        times = [datetime.fromtimestamp(t) for t in series[0].times]
        calcs = panel.get("options", {}).get("legend", {}).get("calcs", [])
        labels = ["   ".join([s.name, *(f"{CALC_NAMES.get(c, c)} {fmt(calc(c, s.values), unit)}" for c in calcs)])
                  for s in series]
        if defaults.get("custom", {}).get("stacking", {}).get("mode") == "normal":
            ax.stackplot(times, [[0.0 if math.isnan(v) else v for v in s.values] for s in series],
                         labels=labels, alpha=0.55)
        else:
            for s, label in zip(series, labels):
                ax.plot(times, s.values, label=label, linewidth=1.3)
        ax.set_ylim(bottom=0)
        ax.set_xlim(times[0], times[-1])
        top = ax.get_ylim()[1]
        if unit == "s":  # ticks at round numbers of the unit shown (min, h), not of seconds
            scale = next((k for k in (3600, 60, 1) if top >= 2 * k), 1e-3)
            ax.set_yticks(MaxNLocator(5).tick_values(0, top / scale) * scale)
            ax.set_ylim(0, top)
        for when, label in marks:
            ax.axvline(datetime.fromtimestamp(when), color="grey", linestyle="--", linewidth=0.8)
            ax.text(datetime.fromtimestamp(when), top, f" {label}", fontsize=7, color="grey", va="top")
        ax.legend(loc="upper left", bbox_to_anchor=(0, -0.1), fontsize=7.5, frameon=False,
                  ncol=1 if len(series) <= 5 else 2, handlelength=1.2, borderaxespad=0)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    plt.close(fig)


def render(prometheus: str, start: float, end: float, out: Path, step: float = 5, rate_interval: str = "1m",
           dashboard: Path = DASHBOARD, subtitle: str = "", marks: list[tuple[float, str]] = ()) -> dict[str, int]:
    """Draws the dashboard into `out`; returns the number of series of each query panel, by title."""
    board = json.loads(dashboard.read_text())
    start, end = math.floor(start), math.ceil(end)  # whole seconds: the answer's timestamps match the grid
    variables = {"__rate_interval": rate_interval, "__interval": f"{step:g}s", "__range": f"{end - start}s"}
    queried = [c.panel for c in layout(board["panels"])[0] if c.panel["type"] != "row"]
    data = {p["id"]: panel_series(p, prometheus, start, end, step, variables) for p in queried}
    draw(board, data, out, subtitle, marks)
    return {p["title"]: len(data[p["id"]]) for p in queried}


def timestamp(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return datetime.fromisoformat(text).timestamp()


def mark(text: str) -> tuple[float, str]:
    """TIME=LABEL: a moment (unix s or ISO) and its label."""
    when, _, label = text.partition("=")
    return timestamp(when), label


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prometheus", default="http://127.0.0.1:9090")
    parser.add_argument("--start", type=timestamp, required=True)
    parser.add_argument("--end", type=timestamp, required=True)
    parser.add_argument("--step", type=float, default=5, help="seconds between points")
    parser.add_argument("--rate-interval", default="1m",
                        help="replaces $__rate_interval (Ray exports every 10 s: shorter windows zigzag)")
    parser.add_argument("--dashboard", type=Path, default=DASHBOARD)
    parser.add_argument("--subtitle", default="", help="a line beside the dashboard's title")
    parser.add_argument("--mark", type=mark, nargs="+", default=[], metavar="TIME=LABEL",
                        help="a dashed line on every panel at TIME (unix s or ISO), labelled")
    parser.add_argument("--out", type=Path, default=Path("docs/img/dashboard.png"))
    args = parser.parse_args()
    counts = render(args.prometheus, args.start, args.end, args.out, args.step, args.rate_interval, args.dashboard,
                    args.subtitle, args.mark)
    for title, n in counts.items():
        print(f"{n:3d} series  {title}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
