"""CPU time by process role while a system runs: on a 2-core machine CPU is the resource that
binds, so what each hop of the streaming path costs is read as CPU seconds per reply.

    before = snapshot(); ...drive...; used = spent_since(before)   # {role: CPU seconds}
"""

import os

import psutil

from app.ops.launch import APP_NAME

APP_ROLES = ("frontend", "router", "prefill replica", "decode replica", "kv index")
"""The app's own replicas (each with its engine's processes)."""


def roles_of(app: str) -> tuple[tuple[str, str], ...]:
    """Command-line fragments and their roles, first match wins, for the Serve application `app`."""
    replica = f"ServeReplica:{app}:"
    return ((f"{replica}frontend", "frontend"), (f"{replica}router", "router"),
            (f"{replica}prefill", "prefill replica"), (f"{replica}decode", "decode replica"),
            (f"{replica}KVIndexServer", "kv index"),
            ("ServeReplica:serve-llm", "serve-llm replicas"), ("vllm.entrypoints.openai.api_server", "vllm server"),
            ("haproxy", "haproxy"), ("ProxyActor", "serve proxy"), ("HAProxyManager", "serve proxy"),
            ("ServeController", "serve controller"), ("raylet", "ray system"), ("gcs_server", "ray system"),
            ("dashboard", "ray system"), ("ray::", "ray system"))


ROLES = roles_of(APP_NAME)
CLIENT_ROLE = "client (benchmark)"
"""The benchmark's own process: for one system, the same work per reply in every run, so its CPU
per reply reads how fast the machine ran."""


def role_of(process: psutil.Process, own_pid: int, roles: tuple[tuple[str, str], ...] = ROLES) -> str:
    """A process's role; a vLLM engine core (or its worker) takes its owner's role."""
    if process.pid == own_pid:
        return CLIENT_ROLE
    try:
        command = " ".join(process.cmdline()) or process.name()
    except psutil.Error:
        return "other"
    if "EngineCore" in command or "VLLM" in process.name() or "multiprocessing.spawn" in command:
        owner = process.parent()
        while owner is not None and owner.pid > 1:
            role = role_of(owner, own_pid, roles)
            if role.startswith("engine core"):
                return role
            if role not in ("other", "ray system"):
                return f"engine core ({role})"
            owner = owner.parent()
    return next((role for fragment, role in roles if fragment in command), "other")


def snapshot(roles: tuple[tuple[str, str], ...] = ROLES) -> dict[int, tuple[str, float]]:
    """Every process's role and CPU seconds so far (user + system)."""
    own, seen = os.getpid(), {}
    for process in psutil.process_iter():
        try:
            times = process.cpu_times()
            seen[process.pid] = (role_of(process, own, roles), times.user + times.system)
        except psutil.Error:
            continue
    return seen


def spent_since(before: dict[int, tuple[str, float]], roles: tuple[tuple[str, str], ...] = ROLES) -> dict[str, float]:
    """CPU seconds each role used since `before` (processes started since count from zero)."""
    used: dict[str, float] = {}
    for pid, (role, seconds) in snapshot(roles).items():
        spent = seconds - before.get(pid, (role, 0.0))[1]
        if spent > 0.005:
            used[role] = round(used.get(role, 0.0) + spent, 3)
    return dict(sorted(used.items(), key=lambda kv: -kv[1]))
