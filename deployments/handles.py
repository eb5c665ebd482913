"""Ray Serve handles, adapted to the seams a turn is written against (app/turn/seams.py).

Calls and streamed chunks go straight to the replicas over gRPC (Serve's throughput-optimized transport)
rather than through Ray's object store: the payloads are token ids and block metadata, and each hop costs
less that way. Each method returns Serve's own response object, which is awaitable (or, for `generate`,
an async iterator with `cancel`), so a call costs no coroutine of its own.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

from ray.serve import context as serve_context
from ray.serve.handle import DeploymentHandle

from app.kv.index import SequenceKey
from app.protocol import ClientRequest, DecodeRequest, KVHandoff, PrefillRequest, StoredResponse, TurnRecords


def _direct(handle: DeploymentHandle) -> DeploymentHandle:
    return handle.options(_by_reference=False)


class ServeIndex:
    """The KV index deployment (deployments/kv_index.py) as a KVIndexClient."""

    def __init__(self, handle: DeploymentHandle) -> None:
        self._handle = _direct(handle)

    def membership(self):
        return self._handle.membership.remote()

    def lookup(self, hashes: list[bytes], take: SequenceKey | None = None):
        return self._handle.lookup.remote(hashes, take)

    def take(self, key: SequenceKey):
        return self._handle.take.remote(key)

    def record_turn(self, records: TurnRecords):
        return self._handle.record_turn.remote(records)

    def match_conversation(self, chain: list[str], last_assistant: int, session_key: str | None):
        return self._handle.match_conversation.remote(chain, last_assistant, session_key)

    def store_response(self, stored: StoredResponse):
        return self._handle.store_response.remote(stored)

    def load_response(self, tenant: str, response_id: str):
        return self._handle.load_response.remote(tenant, response_id)


class ServeEngineGroup:
    """A prefill or decode deployment as a PrefillGroup / EngineGroup: every call names its replica in
    the request, and deployments/targeted_router.py sends it there."""

    def __init__(self, handle: DeploymentHandle) -> None:
        self._handle = _direct(handle)
        self._streaming = self._handle.options(stream=True)

    def generate(self, request: DecodeRequest):
        return self._streaming.generate.remote(request)

    def release(self, handoff: KVHandoff):
        return self._handle.release.remote(handoff)

    def prefill(self, request: PrefillRequest):
        return self._handle.prefill.remote(request)


class ServeRouterStreams:
    """The router deployment's `generate` as the frontend's relays open it (app/turn/relay.py RouterStreams)."""

    def __init__(self, handle: DeploymentHandle) -> None:
        self._streaming = _direct(handle).options(stream=True)

    def open(self, request: ClientRequest, choice: int | None):
        with own_request_id(choice):
            return self._streaming.generate.remote(request)


@contextmanager
def own_request_id(suffix: int | str | None) -> Iterator[None]:
    """Handle calls made inside carry the serving request's internal id plus `suffix`. Serve's request
    router matches the replica it picked to the pending call by that id, which every call made while
    serving one request inherits; of two calls to one deployment pending at once, the second is then
    never matched and routes until its caller gives up (ray 2.60, request_router.py
    `_add_pending_request_to_indices` keeps only the first). The choices of an `n` > 1 request are
    such calls, to the router and, from there, to the engines. With no suffix, or outside a request
    (Serve then gives each call a fresh id), nothing changes."""
    request = serve_context._get_serve_request_context()
    if suffix is None or not request._internal_request_id:
        yield
        return
    token = serve_context._serve_request_context.set(
        replace(request, _internal_request_id=f"{request._internal_request_id}-{suffix}"))
    try:
        yield
    finally:
        serve_context._serve_request_context.reset(token)
