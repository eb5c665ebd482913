"""Where each turn's prompt is computed, and how Serve runs every replica's Python."""

from pydantic import Field

from app.config.types import Bool, Count, Delay, Int, Seconds, Share, Weight, section


@section
class Placement:
    """Each turn's prompt runs on a prefill replica or on the decode replica that streams the reply,
    whichever is estimated to give the first token sooner (app/turn/placement.py)."""

    load_aware: Bool = True
    """Off: only a short append to a sequence decode retains runs on decode (the fixed rule)."""
    itl_weight: Weight = 0.05
    """A prompt computed on decode stalls each of its running streams while it runs; one stream's
    stall counts this much against the new turn's wait (0.05: 20 streams stalled for x weigh as much
    as the turn waiting x longer). Higher protects inter-token latency, lower first-token latency."""
    kv_high_watermark: Share = 0.9
    """No prompt is computed on a decode replica whose KV pool is fuller than this (vLLM's usage):
    lower keeps room for the streams decode already runs."""
    prior_pull_share: Weight = 0.05
    """Until an engine has measured a transfer, a pulled token costs this share of a computed one:
    lower pulls sooner on trust, higher recomputes until a pull is measured."""
    probe_tokens: Int = Field(default=256, ge=32)
    """Each engine times a prefill of this many tokens at start: its first measured compute cost.
    Long enough that compute, not a step's fixed cost, sets its time (thousands on a large GPU);
    a longer probe delays the engine's start. A real turn's prefill re-measures the cost only if at
    least this long, for the same reason."""
    cost_refresh_s: Seconds = 10.0
    """An engine whose compute cost is older than this re-times it with one probe once idle for
    cost_refresh_quiet_s: lower follows a changing machine sooner, for more probes."""
    cost_refresh_quiet_s: Delay = 1.0
    """How long an engine must have had no request before it re-times its compute cost."""
    probe_window: Count = 60
    """The least of an engine's last this many probes is its compute cost: a larger window ignores
    probes slowed by other processes longer, and follows a real slowdown later."""
    calibration_ttl_s: Delay = 10.0
    """A side's calibration that no turn has refreshed for this long is forgotten, and turns are
    estimated by the formula alone on both sides until both are measured again: shorter drops a
    fit learned under an old load sooner."""
    predicted_block_ttl_s: Seconds = 300.0
    """How long the KV index counts a prefill block the router predicted but no KV event confirmed:
    longer credits a replica's cache for longer after events stop arriving."""


@section
class ReplicaRuntime:
    """How Serve runs every replica's Python, set on each deployment (Ray's throughput-optimized
    settings, without the cluster-wide flag)."""

    user_code_on_main_loop: Bool = True
    """Run handlers on the replica's own event loop, not a second thread's: no thread hop per request
    and per streamed chunk; handlers then must not block (rendering and hashing run in threads)."""
    handle_router_on_main_loop: Bool = True
    """Run each outgoing handle's request routing on that same loop, not a router thread's."""
    log_to_stderr: Bool = False
    """Also write every replica log line to stderr (the log files and the dashboard have them): CPU per line."""
    access_log: Bool = False
    """Serve's access line per request and replica (the router's decision log covers turns): CPU per request."""
    metrics_export_interval_ms: Count = 1000
    """How often Serve hands each replica's counters, and each handle's it holds, to Ray's metrics
    (Serve's default 100): each export is a task on the replica's event loop; Ray's metrics agent
    exports every few seconds, so a dashboard sees no difference."""

    def env_vars(self) -> dict[str, str]:
        flag = lambda on: "1" if on else "0"  # noqa: E731
        return {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": flag(not self.user_code_on_main_loop),
                "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": flag(not self.handle_router_on_main_loop),
                "RAY_SERVE_LOG_TO_STDERR": flag(self.log_to_stderr),
                "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": str(self.metrics_export_interval_ms)}
