"""Ports this app binds (engine side channels, Serve's ingress in local runs), picked
where no other process's bind(0) can take them first."""

import random
import socket

EPHEMERAL_PORTS = "/proc/sys/net/ipv4/ip_local_port_range"


def free_port(host: str) -> int:
    """A free port outside the OS's ephemeral range. A port from bind(0) is free only until the
    engine binds it, seconds later, and any process's bind(0) may take it first: a decode worker
    that takes prefill's side-channel port leaves vLLM waiting for its handshake listener forever."""
    low, high = _ephemeral_range()  # and above Ray's worker ports (10002-19999 by default)
    candidates = range(20_000, low) if low > 21_000 else range(high + 1, 65_536)
    for port in random.sample(candidates, min(len(candidates), 500)):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port outside the ephemeral range on {host}")


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open(EPHEMERAL_PORTS) as ports:
            low, high = map(int, ports.read().split())
            return low, high
    except (OSError, ValueError):
        return 32_768, 60_999  # Linux's default
