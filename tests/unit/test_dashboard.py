"""dashboards/kv-loop.json is a Grafana dashboard whose every PromQL metric is one the code exports.

Exported names are read from source (no Ray, no vLLM import): the app's and Ray Serve's
`metrics.Counter/Gauge/Histogram(...)` calls and vLLM's `self._counter_cls/_gauge_cls/_histogram_cls(name=...)`,
turned into Prometheus names by the rules measured on Ray 2.60's metrics endpoint (ray.init with
_metrics_export_port, one value on each kind of ray.util.metrics metric, then a scrape):
    Counter "x"    -> ray_x_total   (a name already ending in _total is not doubled)
    Gauge "x"      -> ray_x
    Histogram "x"  -> ray_x_bucket, ray_x_sum, ray_x_count
and vLLM's RayPrometheusStatLogger passes "vllm:x" to Ray as "vllm_x" (non [a-zA-Z0-9_] -> "_"), measured the same
way with a RayPrometheusStatLogger built on a VllmConfig (e.g. ray_vllm_kv_cache_usage_perc,
ray_vllm_prompt_tokens_total, ray_vllm_iteration_tokens_total_bucket). The rules hold for Ray's OpenCensus
exporter too (RAY_enable_open_telemetry=0; read from its source), which also exports a deprecated gauge copy of
each counter without _total.
"""

import ast
import importlib.util
import json
import re
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "dashboards" / "kv-loop.json"
APP_METRIC_SOURCES = [*sorted((ROOT / "app").rglob("*.py")), *sorted((ROOT / "deployments").glob("*.py"))]

# ---- Prometheus names of Ray metrics ------------------------------------------------------------
RAY_PREFIX = "ray_"


def exported_names(kind: str, name: str) -> set[str]:
    """What Ray's metrics endpoint shows for a ray.util.metrics metric of this kind and name."""
    base = RAY_PREFIX + re.sub(r"[^a-zA-Z0-9_]", "_", name)
    if kind == "Counter":
        return {base if base.endswith("_total") else base + "_total"}
    if kind == "Gauge":
        return {base}
    if kind == "Histogram":
        return {base + "_bucket", base + "_sum", base + "_count"}
    raise ValueError(kind)


def _string_arg(call: ast.Call, keyword: str) -> str | None:
    """The metric name: the first positional argument or `keyword=`, when it is a string literal."""
    if call.args and isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str):
        return call.args[0].value
    for kw in call.keywords:
        if kw.arg == keyword and isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, str):
            return kw.value.value
    return None


def metric_definitions(path: Path, kinds: dict[str, str]) -> set[tuple[str, str]]:
    """(kind, name) of each call `<anything>.<attr>(name, ...)` in `path` whose attr is a key of `kinds`."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in kinds:
            name = _string_arg(node, "name")
            if name is not None:
                found.add((kinds[node.func.attr], name))
    return found


RAY_METRIC_CALLS = {"Counter": "Counter", "Gauge": "Gauge", "Histogram": "Histogram"}
VLLM_METRIC_CALLS = {"_counter_cls": "Counter", "_gauge_cls": "Gauge", "_histogram_cls": "Histogram"}


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)  # locates the package without importing it
    assert spec is not None and spec.submodule_search_locations, f"{name} is not installed"
    return Path(next(iter(spec.submodule_search_locations)))


def _names(definitions: set[tuple[str, str]]) -> set[str]:
    return {exported for kind, name in definitions for exported in exported_names(kind, name)}


@cache
def app_exports() -> frozenset[str]:
    definitions = set().union(*(metric_definitions(p, RAY_METRIC_CALLS) for p in APP_METRIC_SOURCES))
    return frozenset(_names(definitions))


@cache
def serve_exports() -> frozenset[str]:
    serve = _package_dir("ray") / "serve"
    files = sorted(serve.glob("*.py")) + sorted((serve / "_private").rglob("*.py"))
    definitions = set().union(*(metric_definitions(p, RAY_METRIC_CALLS) for p in files))
    return frozenset(n for n in _names(definitions) if n.startswith(RAY_PREFIX + "serve_"))


@cache
def vllm_exports() -> frozenset[str]:
    vllm = _package_dir("vllm")
    files = [*sorted((vllm / "v1" / "metrics").glob("*.py")), vllm / "v1" / "spec_decode" / "metrics.py",
             *sorted((vllm / "distributed" / "kv_transfer").rglob("*.py"))]
    definitions = set().union(*(metric_definitions(p, VLLM_METRIC_CALLS) for p in files if p.exists()))
    return frozenset(n for n in _names(definitions) if n.startswith(RAY_PREFIX + "vllm_"))


def all_exports() -> frozenset[str]:
    return app_exports() | serve_exports() | vllm_exports()


# ---- PromQL: the metric names of an expression --------------------------------------------------
PROMQL_FUNCTIONS = {
    # aggregations
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk",
    "quantile", "limitk", "limit_ratio",
    # functions
    "abs", "absent", "absent_over_time", "ceil", "changes", "clamp", "clamp_max", "clamp_min", "day_of_month",
    "day_of_week", "day_of_year", "days_in_month", "delta", "deriv", "exp", "floor", "histogram_avg",
    "histogram_count", "histogram_fraction", "histogram_quantile", "histogram_stddev", "histogram_stdvar",
    "histogram_sum", "hour", "idelta", "increase", "irate", "label_join", "label_replace", "ln", "log2", "log10",
    "minute", "month", "predict_linear", "rate", "resets", "round", "scalar", "sgn", "sort", "sort_desc",
    "sqrt", "time", "timestamp", "vector", "year", "avg_over_time", "min_over_time", "max_over_time",
    "sum_over_time", "count_over_time", "quantile_over_time", "stddev_over_time", "stdvar_over_time",
    "last_over_time", "present_over_time", "start", "end",  # start()/end(): the @ modifier's
}
PROMQL_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                   "offset", "atan2", "inf", "nan"}
_LABEL_LIST = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_STRIP = [
    re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`'),  # string literals
    re.compile(r"\{[^{}]*\}"),                                       # label matchers
    re.compile(r"\[[^\[\]]*\]"),                                     # range / subquery selectors
    re.compile(r"\$\{?\w+\}?"),                                      # Grafana variables ($__rate_interval)
]
_TOKEN = re.compile(r"(?P<duration>(?:\d+(?:ms|[smhdwy]))+\b)"
                    r"|(?P<number>\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?)"
                    r"|(?P<ident>[a-zA-Z_:][a-zA-Z0-9_:]*)|(?P<other>\S)")


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects: identifiers that are not functions, keywords or labels.
    Raises on a call of a name PromQL does not know (a misspelt function would hide a metric)."""
    text = expr
    for pattern in _STRIP:
        text = pattern.sub(" ", text)
    text = _LABEL_LIST.sub(" ", text)  # after the strings: `by (le, turn)`, `on (ReplicaId)`
    names = set()
    tokens = [(m.lastgroup, m.group()) for m in _TOKEN.finditer(text)]
    for i, (kind, value) in enumerate(tokens):
        if kind != "ident" or value.lower() in PROMQL_KEYWORDS:
            continue
        if i + 1 < len(tokens) and tokens[i + 1][1] == "(":
            if value not in PROMQL_FUNCTIONS:
                raise ValueError(f"{value}( is not a PromQL function, in {expr!r}")
            continue
        names.add(value)
    return names


def test_metric_names_skips_functions_labels_and_variables():
    expr = ('histogram_quantile(0.99, sum by (le, turn) (rate(ray_a_bucket{turn!="1", x=~"a|b"}[$__rate_interval])))'
            ' / on (ReplicaId) group_left (deployment) sum(rate(ray_b_total[5m] offset 1h)) > 1e3'
            ' and ignoring(job) max without (instance) (ray_c) * 2')
    assert metric_names(expr) == {"ray_a_bucket", "ray_b_total", "ray_c"}
    with pytest.raises(ValueError, match="rat\\("):
        metric_names("rat(ray_b_total[5m])")


def test_export_rules_name_a_wrong_metric_as_missing():
    """The check below bites: a counter without _total, a misspelt name, a bare histogram name."""
    exports = all_exports()
    assert "ray_kv_loop_decisions_total" in exports
    for wrong in ("ray_kv_loop_decisions", "ray_kv_loop_decision_total", "ray_kv_loop_ttft_s",
                  "kv_loop_index_size", "ray_vllm:kv_cache_usage_perc"):
        assert wrong not in exports, wrong


def test_exported_names_cover_the_three_sources():
    assert {"ray_kv_loop_ttft_s_bucket", "ray_kv_loop_ttft_s_sum", "ray_kv_loop_ttft_s_count",
            "ray_kv_loop_index_size", "ray_kv_loop_eviction_horizon_s",
            "ray_kv_loop_bytes_pulled_total"} <= app_exports()
    assert {"ray_serve_num_ongoing_requests_at_replicas", "ray_serve_deployment_queued_queries",
            "ray_serve_deployment_request_counter_total", "ray_serve_num_router_requests_total"} <= serve_exports()
    assert {"ray_vllm_kv_cache_usage_perc", "ray_vllm_num_requests_running", "ray_vllm_num_requests_waiting",
            "ray_vllm_prompt_tokens_total", "ray_vllm_generation_tokens_total",
            "ray_vllm_prompt_tokens_by_source_total", "ray_vllm_iteration_tokens_total_bucket"} <= vllm_exports()


# ---- the dashboard --------------------------------------------------------------------------------
@cache
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels() -> list[dict]:
    """Every panel, rows' nested panels included."""
    out = []
    for panel in dashboard()["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def query_panels() -> list[dict]:
    return [p for p in panels() if p["type"] != "row"]


def test_dashboard_shape():
    board = dashboard()
    assert isinstance(board["title"], str) and board["title"]
    assert re.fullmatch(r"[a-zA-Z0-9_-]{1,40}", board["uid"])
    assert isinstance(board["schemaVersion"], int) and board["schemaVersion"] >= 30
    assert board.get("id") is None  # an id would make an import overwrite another dashboard
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in panels()]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels():
        grid = panel["gridPos"]
        assert all(isinstance(grid[k], int) for k in ("x", "y", "w", "h")), panel["title"]
        assert 0 <= grid["x"] and grid["w"] > 0 and grid["x"] + grid["w"] <= 24 and grid["h"] > 0, panel["title"]
    for panel in query_panels():
        assert panel["title"] and panel["targets"], panel
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
        for target in panel["targets"]:
            assert isinstance(target["expr"], str) and target["expr"].strip(), panel["title"]
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]


def test_panels_do_not_overlap():
    cells = {}
    for panel in panels():
        g = panel["gridPos"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = panel["title"]


def test_the_issue_panels_are_there():
    exprs = " ".join(t["expr"] for p in query_panels() for t in p["targets"])
    used = {name for p in query_panels() for t in p["targets"] for name in metric_names(t["expr"])}
    assert {"ray_kv_loop_ttft_s_bucket", "ray_kv_loop_prompt_tokens_total", "ray_kv_loop_decisions_total",
            "ray_kv_loop_bytes_pulled_total", "ray_kv_loop_eviction_horizon_s", "ray_kv_loop_index_size",
            "ray_serve_num_ongoing_requests_at_replicas", "ray_serve_deployment_queued_queries",
            "ray_vllm_kv_cache_usage_perc", "ray_vllm_num_requests_running", "ray_vllm_num_requests_waiting",
            "ray_vllm_prompt_tokens_total", "ray_vllm_generation_tokens_total"} <= used
    assert "histogram_quantile(0.5," in exprs and "histogram_quantile(0.99," in exprs


@pytest.mark.parametrize("panel", query_panels(), ids=lambda p: p["title"])
def test_every_panel_metric_is_exported(panel):
    exports = all_exports()
    for target in panel["targets"]:
        names = metric_names(target["expr"])
        assert names, f"no metric in {target['expr']!r}"
        missing = sorted(names - exports)
        assert not missing, f"{panel['title']!r} refId {target['refId']}: nobody exports {missing}"


@pytest.mark.skipif(sys.version_info < (3, 11), reason="grafana-foundation-sdk needs Python 3.11")
def test_json_is_what_build_py_writes():
    pytest.importorskip("grafana_foundation_sdk")
    spec = importlib.util.spec_from_file_location("dashboard_build", ROOT / "dashboards" / "build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    assert build.render() == DASHBOARD.read_text(), "run: python dashboards/build.py"
