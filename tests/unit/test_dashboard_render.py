"""dashboards/render.py without a Prometheus: variables, legends, query answers, the grid, a whole render."""

import json
import math
from pathlib import Path

import pytest

from dashboards import render

DASHBOARD = Path(render.__file__).with_name("kv-loop.json")
VARIABLES = {"__rate_interval": "30s", "__interval": "5s", "__range": "600s"}  # what render() gives


def test_substitute_replaces_both_spellings_and_refuses_unknown_variables():
    expr = 'sum(rate(ray_x_total[$__rate_interval])) / sum(rate(ray_y[${__rate_interval}])) * $__range'
    assert render.substitute(expr, VARIABLES) == "sum(rate(ray_x_total[30s])) / sum(rate(ray_y[30s])) * 600s"
    assert render.substitute("ray_z[${__interval:raw}]", VARIABLES) == "ray_z[5s]"
    with pytest.raises(KeyError, match="instance"):
        render.substitute("ray_z{instance=~\"$instance\"}", VARIABLES)


def test_every_query_of_the_dashboard_is_complete_after_substitution():
    board = json.loads(DASHBOARD.read_text())
    cells, _ = render.layout(board["panels"])
    exprs = [t["expr"] for c in cells for t in c.panel.get("targets", [])]
    assert exprs and all("$" not in render.substitute(e, VARIABLES) for e in exprs)


def test_legend_format():
    labels = {"turn": "3", "source": "pulled"}
    assert render.legend("p50 turn {{turn}}", labels) == "p50 turn 3"
    assert render.legend("{{ source }} / {{missing}}", labels) == "pulled / "
    assert render.legend("", labels) == '{source="pulled", turn="3"}'


def test_series_of_a_matrix_answer_fills_missing_points_with_nan():
    answer = {"status": "success", "data": {"resultType": "matrix", "result": [
        {"metric": {"source": "pulled"}, "values": [[100, "1.5"], [110, "2"]]},
        {"metric": {"source": "computed"}, "values": [[105, "NaN"], [110, "4"]]}]}}
    series = render.series_of(answer, "{{source}}", [100.0, 105.0, 110.0])
    assert [s.name for s in series] == ["computed", "pulled"]
    pulled, computed = series[1].values, series[0].values
    assert pulled[0] == 1.5 and math.isnan(pulled[1]) and pulled[2] == 2.0
    assert math.isnan(computed[0]) and math.isnan(computed[1]) and computed[2] == 4.0  # missing, then "NaN"
    with pytest.raises(RuntimeError, match="bad_data: parse error"):
        render.series_of({"status": "error", "errorType": "bad_data", "error": "parse error"}, "", [])


def test_layout_follows_grid_pos_rows_included():
    panels = [{"type": "row", "title": "R", "gridPos": {"x": 0, "y": 0, "w": 24, "h": 1},
               "panels": [{"type": "timeseries", "title": "nested", "gridPos": {"x": 0, "y": 9, "w": 24, "h": 8}}]},
              {"type": "timeseries", "title": "right", "gridPos": {"x": 12, "y": 1, "w": 12, "h": 8}},
              {"type": "timeseries", "title": "left", "gridPos": {"x": 0, "y": 1, "w": 12, "h": 8}}]
    cells, height = render.layout(panels)
    assert [(c.panel["title"], c.rows, c.columns) for c in cells] == [
        ("R", slice(0, 1), slice(0, 24)), ("left", slice(1, 9), slice(0, 12)),
        ("right", slice(1, 9), slice(12, 24)), ("nested", slice(9, 17), slice(0, 24))]
    assert height == 17
    with pytest.raises(ValueError, match="off the grid"):
        render.layout([{"title": "wide", "gridPos": {"x": 12, "y": 0, "w": 13, "h": 8}}])


def test_calcs_and_units():
    assert render.calc("mean", [1.0, math.nan, 3.0]) == 2.0
    assert render.calc("lastNotNull", [1.0, 3.0, math.nan]) == 3.0
    assert math.isnan(render.calc("max", [math.nan]))
    cases = [(0.25, "percentunit", "25%"), (0.045, "s", "45 ms"), (0.99999, "s", "1000 ms"), (2.5, "s", "2.5 s"),
             (150, "s", "2.5 min"), (2.5e6, "Bps", "2.5 MB/s"), (0.5, "reqps", "0.5 req/s"), (math.nan, "short", "-")]
    assert [render.fmt(value, unit) for value, unit, _ in cases] == [text for _, _, text in cases]


def test_render_queries_every_target_and_draws_a_png(monkeypatch, tmp_path):
    pytest.importorskip("matplotlib")
    asked = []

    def fake_query_range(prometheus, expr, start, end, step):
        asked.append(expr)
        values = [[start + i * step, str(i % 7)] for i in range(int((end - start) // step) + 1)]
        result = [] if "ray_kv_loop_bytes_pulled_total" in expr else [{"metric": {"turn": "2"}, "values": values}]
        return {"status": "success", "data": {"resultType": "matrix", "result": result}}

    monkeypatch.setattr(render, "query_range", fake_query_range)
    out = tmp_path / "board.png"
    counts = render.render("http://prom", 1_700_000_000, 1_700_000_600, out, step=5)
    board = json.loads(DASHBOARD.read_text())
    targets = [t for p in board["panels"] for t in p.get("targets", [])]
    assert len(asked) == len(targets) and not any("$" in e for e in asked)
    assert counts["KV bytes pulled"] == 0 and counts["Later-turn TTFT by turn (p50 / p99)"] == 2
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
