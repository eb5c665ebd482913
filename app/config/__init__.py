"""One typed configuration for the whole graph: defaults run the tiny model on this CPU machine.

Sources, later ones winning: the defaults, a YAML file (`config=path.yaml`), then `key=value` Serve
args (`serve run app:graph prefill.replicas=2 retention_ttl_s=60`), or a Serve config's `args`.
Checked once, strictly, when the graph is built; replicas receive the frozen object.

    types.py        strict value types and the section decorator
    engines.py      engine groups, the device, vLLM's engine arguments (passed through or set by the app)
    limits.py       every concurrency cap, queue bound, timeout, TTL and retry count
    placement.py    where a turn's prompt runs; how Serve runs each replica's Python
    autoscaling.py  per-group Serve autoscaling
    app_config.py   AppConfig, the root, and what derives from it
    relations.py    the checks that relate keys of different sections
    loading.py      YAML and Serve args to a checked AppConfig, errors by dotted key
Every key, day one or advanced, and what it trades: docs/configuration.md.
"""

from app.config.app_config import AppConfig
from app.config.autoscaling import Autoscaling, DecodeScaling, PrefillScaling, RouterScaling, ScalingBounds
from app.config.engines import APP_ENGINE_ARGS, TINY_MODEL, Device, EngineGroupConfig, engine_kwargs_problems
from app.config.limits import Limits
from app.config.loading import load_config
from app.config.placement import Placement, ReplicaRuntime
from app.conversations.records import RenderMode
from app.turn.routing import RoutingPolicy

__all__ = ["APP_ENGINE_ARGS", "TINY_MODEL", "AppConfig", "Autoscaling", "DecodeScaling", "Device", "EngineGroupConfig",
           "Limits", "Placement", "PrefillScaling", "RenderMode", "ReplicaRuntime", "RouterScaling", "RoutingPolicy",
           "ScalingBounds", "engine_kwargs_problems", "load_config"]
