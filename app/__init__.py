"""Multi-turn KV reuse on Ray Serve: `serve run app:graph`. See deployments/graph.py for the data flow.

    app/turn/           a turn: its plan (what to compute where), its engine calls, what it holds and releases
    app/kv/             KV state: block hashes, the index of what is cached where, engines' KV events, horizons
    app/conversations/  the OpenAI wire format, rendering, records and sessions, tenants
    app/engine/         the vLLM adapter and the plugins that run inside engine processes
    app/ops/            tools for operators, tests and benchmarks (preflight, local launch, faults, oracle)
    app/protocol.py     every message that crosses a deployment boundary
    app/config/         the one typed configuration
The graph is loaded on first use, so a vLLM plugin importing `app.engine` loads neither Ray Serve nor the graph.
"""


def __getattr__(name: str):
    if name == "graph":
        from deployments.graph import graph

        return graph
    raise AttributeError(f"module 'app' has no attribute {name!r}")
