"""What each single fault costs users: conversations keep talking to the embedded default while one
part is killed, and every answered turn is checked against one plain vLLM engine.

    python -m benchmarks.faults [--conversations 4] [--window-s 20]
    python -m benchmarks.faults --url http://HEAD:8000 [--model NAME --api-key KEY]   # on a node of that cluster

Prints, per fault: turns answered, turns failed (503s with Retry-After counted apart), other
errors, requests the official client retried (its default: 2 retries), wrong tokens, and the
seconds from the fault to the next answered turn and until the app was whole again. Run with two
router (and so two frontend) replicas, so either can be killed too.

With --url the faults hit the app on the Ray cluster this machine is a node of (run it on the node
of the replicas it hits: engine processes are found among local pids), found under the Serve
application name app.ops.launch.APP_NAME; answered turns are not checked for wrong tokens then (the
plain engine that checks them is started here).
"""

import argparse
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import httpx
import openai
import ray

from app.config import load_config
from app.ops import faults
from app.ops.client import TurnResult, chat_turn
from app.ops.launch import APP_NAME, start_local, stop_local
from app.ops.oracle import start_reference
from benchmarks.target import Target, add_target_args, resolve_target

MAX_TOKENS = 16
SYSTEM = "You are a careful assistant. " + " ".join(f"Fact {i}: the KV index knows which replica holds what."
                                                    for i in range(20))


@dataclass
class FaultRun:
    fault: str
    answered: list[tuple[float, TurnResult]] = field(default_factory=list)
    unavailable: int = 0
    """503s with Retry-After (allowed only while no engine at all can serve)."""
    errors: list[str] = field(default_factory=list)
    wrong_tokens: int | None = None
    """None: not checked (no plain engine to check against)."""
    wrong_turns: list[str] = field(default_factory=list)
    """Request ids of answered turns whose tokens differ from the plain engine's."""
    injected_at: float = 0.0
    whole_after_s: float = 0.0
    requests_sent: int = 0
    """HTTP requests the client sent: more than the turns tried when it retried a dead connection."""

    @property
    def first_served_after_s(self) -> float | None:
        after = [t for t, _ in self.answered if t > self.injected_at]
        return min(after) - self.injected_at if after else None


def converse(client, model: str, tag: str, run: FaultRun, stop: threading.Event) -> None:
    """One conversation, turn after turn, until `stop`; alternating streaming, prefill kept in the path."""
    messages = [{"role": "system", "content": f"{tag}. {SYSTEM}"}]
    k = 0
    while not stop.is_set():
        messages.append({"role": "user", "content": f"Question {k}?"})
        try:
            turn = chat_turn(client, messages, MAX_TOKENS, stream=k % 2 == 0, model=model,
                             prefill_on_decode=k % 3 != 0)
        except openai.APIStatusError as exc:
            retry_after = exc.response.headers.get("retry-after")
            if exc.status_code == 503 and retry_after:
                run.unavailable += 1
            else:
                run.errors.append(f"{exc.status_code}: {str(exc)[:120]}")
            messages.pop()
            time.sleep(0.5)
            continue
        except Exception as exc:  # noqa: BLE001 - a connection cut is a failed turn too
            run.errors.append(f"{type(exc).__name__}: {str(exc)[:120]}")
            messages.pop()
            time.sleep(0.5)
            continue
        run.answered.append((time.monotonic(), turn))
        messages.append({"role": "assistant", "content": turn.text})
        k += 1


def retrying_client(target: Target, run: FaultRun) -> openai.OpenAI:
    """The official client with its default retries (2, on connection errors, 408, 409, 429 and
    5xx), as users run it; every request it sends is counted."""
    def count(_request) -> None:
        run.requests_sent += 1

    return openai.OpenAI(base_url=f"{target.url}/v1", api_key=target.api_key, timeout=600,
                         http_client=httpx.Client(event_hooks={"request": [count]}))


def run_fault(target: Target, fault: str, conversations: int, window_s: float) -> FaultRun:
    run, stop = FaultRun(fault), threading.Event()
    client = retrying_client(target, run)
    threads = [threading.Thread(target=converse, args=(client, target.model, f"{fault}-{i}", run, stop))
               for i in range(conversations)]
    for thread in threads:
        thread.start()
    time.sleep(window_s / 4)
    run.injected_at = time.monotonic()
    hit = faults.inject(fault)
    time.sleep(window_s * 3 / 4)
    stop.set()
    for thread in threads:
        thread.join()
    run.whole_after_s = faults.wait_whole(target.url, gone=(hit,)) + (time.monotonic() - run.injected_at)
    return run


def check(reference, run: FaultRun) -> None:
    turns = [t for _, t in run.answered]
    expected = ray.get(reference.generate.remote([t.prompt_ids for t in turns], MAX_TOKENS))
    run.wrong_tokens = 0
    for turn, tokens in zip(turns, expected):
        wrong = sum(a != b for a, b in zip(turn.output_ids, tokens)) + abs(len(turn.output_ids) - len(tokens))
        if wrong:
            run.wrong_tokens += wrong
            run.wrong_turns.append(turn.request_id)


def report(runs: list[FaultRun]) -> str:
    lines = ["| fault | turns answered | failed (503 + Retry-After) | other errors | requests retried by the client "
             "| wrong tokens | next turn served after | whole again after |", "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        served = f"{r.first_served_after_s:.1f} s" if r.first_served_after_s is not None else "never"
        retried = r.requests_sent - len(r.answered) - r.unavailable - len(r.errors)
        wrong = "not checked" if r.wrong_tokens is None else r.wrong_tokens
        lines.append(f"| {r.fault} | {len(r.answered)} | {r.unavailable} | {len(r.errors)} | {retried} | "
                     f"{wrong} | {served} | {r.whole_after_s:.0f} s |")
    return "\n".join(lines)


@contextmanager
def app_up(target: Target, config) -> Iterator[tuple[Target, object | None]]:
    """The target with its URL, connected to its Ray, and the plain engine that checks answered
    turns: the embedded default and a reference engine started here, or the running cluster's app
    (no reference)."""
    if target.url is None:
        target = replace(target, url=start_local(config))
        try:
            yield target, start_reference(config)
        finally:
            stop_local()
        return
    ray.init(address="auto", log_to_driver=False)
    from ray import serve

    if APP_NAME not in serve.status().applications:
        raise SystemExit(f"no Serve application {APP_NAME!r} on this Ray cluster: the faults find the app's "
                         f"replicas under that name (app.ops.launch.APP_NAME)")
    yield target, None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--window-s", type=float, default=20.0)
    parser.add_argument("--faults", default=",".join((*faults.FAULTS, "kill_router_replica", "kill_frontend_replica")))
    add_target_args(parser, url_note="on the Ray cluster this machine is a node of")
    args = parser.parse_args()
    config = replace(load_config({}), router_replicas=2)
    with app_up(resolve_target(args, config), config) as (target, reference):
        runs = []
        for fault in args.faults.split(","):
            run = run_fault(target, fault, args.conversations, args.window_s)
            if reference is not None:
                check(reference, run)
            runs.append(run)
            print(report([run]).splitlines()[-1], *run.errors[:3], *run.wrong_turns, sep="\n  ", flush=True)
        print(report(runs))


if __name__ == "__main__":
    main()
