"""A turn as the router hands it to the turn loop: the prompt's token ids, how to sample the reply, and
what the request asked about placement. Frozen: everything the turn learns while it runs lives in its
TurnRun (app/turn/turn.py)."""

from dataclasses import dataclass

from app.conversations.records import RenderDiagnostics
from app.protocol import SamplingSettings
from app.turn.routing import RoutingPolicy

CONTINUATION_PRIORITY, LATER_TURN_PRIORITY, FIRST_TURN_PRIORITY = 0, 1, 2
"""vLLM request priorities (lower runs first). A continuation, decode's reply to a prompt computed on
prefill, goes ahead of every prompt waiting on decode: its user already has the first token, and
starting it costs decode no step budget (vLLM reads its KV asynchronously); behind the first turns
placed on decode it streamed much slower (docs/design.md#later-turns-first-inside-each-engine)."""


def turn_priority(later: bool) -> int:
    """vLLM's request priority of a conversation's turn (lower runs first): a later turn, whose
    user waits on a short append, goes ahead of first turns waiting in the same engine."""
    return LATER_TURN_PRIORITY if later else FIRST_TURN_PRIORITY


@dataclass(frozen=True)
class Turn:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    cache_salt: str
    sampling: SamplingSettings
    block_hashes: tuple[bytes, ...] = ()
    """The prompt's block hashes under its salt, computed where the prompt was (empty: the turn computes them)."""
    tenant: str = ""
    """Whose quotas the turn counts against (decode's retained KV, the records)."""
    tool_pause_s: float = 0.0
    """The reply may end in tool calls: decode keeps its sequence this long ahead of others."""
    reverse_pull: bool = True
    rendering: RenderDiagnostics | None = None
    routing_policy: RoutingPolicy = RoutingPolicy.KV_AWARE
    affinity_key: str = ""
    """The conversation's identity for session affinity (session id, or its first messages)."""
    turn_index: int = 1
    previous_replica: str = ""
    """Where the conversation's previous turn was prefilled, if known."""
    prefill_on_decode: bool = True
    """May a short append run whole on the decode replica that retains the conversation?"""
    load_aware: bool = True
    """Place the prompt by both sides' load and costs (app/turn/placement.py), not by the fixed rule."""
    received_at: float = 0.0
    """time.perf_counter() when the router received the request (0: unknown)."""

    @property
    def later(self) -> bool:
        return self.turn_index > 1

    @property
    def priority(self) -> int:
        return turn_priority(self.later)

    def prefill_samples_first_token(self, enabled: bool) -> bool:
        """Whether a prefill replica that computes the prompt samples the reply's first token
        (`enabled`: the config's first_token_from_prefill). Not when stop strings, or sampling that
        reads the reply (a grammar, penalties, bad words), must see the whole reply in one engine:
        decode would start them afresh after the first token, which it reads as prompt."""
        return enabled and not self.sampling.stop and not self.sampling.reads_reply
