"""Where a benchmark sends its requests, and what it must know about the model served there.

Every benchmark that sends requests takes the same flags, from here:
    --url URL        a running app's root URL (a cluster's endpoint); default: the embedded default, started here
    --model NAME     with --url: the served model name; default: the first model of the endpoint's GET /v1/models
    --tokenizer ID   with --url: a Hugging Face id or a local path; default: the model name
    --api-key KEY    default: with --url $OPENAI_API_KEY, else "unused"

The tokenizer sizes the prompts, and its model's config.json gives the KV bytes per token: both
are read on this machine (a hub id from the Hugging Face cache, or downloaded into it).
"""

import argparse
import os
from dataclasses import dataclass, replace

import httpx

from app.config import AppConfig

API_KEY_ENV = "OPENAI_API_KEY"
NO_KEY = "unused"
"""The key sent when none is given: an app without api_keys takes any, and the official client
wants one."""
PEERS_ARE_LOCAL = ("the peers (plain vLLM, Ray Serve LLM) are started on this machine by the benchmark and cannot "
                   "be started on a cluster it reaches by URL: with --url only the app is measured")


@dataclass(frozen=True)
class Target:
    url: str | None
    """The app's root URL; None: the benchmark starts the embedded default here (and then has one)."""
    model: str
    """The name every request carries as `model`."""
    tokenizer: str
    """A Hugging Face id or a local path, as the app's `model` setting (so "tiny-qwen3": the embedded model)."""
    api_key: str

    def app_config(self, config: AppConfig) -> AppConfig:
        """`config` with this target's model: what a benchmark reads about the app (its served name,
        tokenizer and config.json, so its KV bytes per token). The endpoint does not tell the rest
        (block size, for one): that stays `config`'s."""
        return replace(config, model=self.tokenizer, served_model_name=self.model)


def add_target_args(parser: argparse.ArgumentParser, url_note: str = "") -> None:
    """The target flags; `url_note` adds what --url means for this benchmark in particular."""
    group = parser.add_argument_group("target")
    group.add_argument("--url", help="a running app's root URL, e.g. a cluster's http://HEAD:8000 (default: start the "
                                     "embedded default on this machine)" + (f"; {url_note}" if url_note else ""))
    group.add_argument("--model", help="with --url: the served model name (default: the first model the endpoint's "
                                       "GET /v1/models lists)")
    group.add_argument("--tokenizer", help="with --url: the model's Hugging Face id or local path, for its tokenizer "
                                           "and config.json (default: the model name)")
    group.add_argument("--api-key", help=f"the key every request carries (default: ${API_KEY_ENV}, else {NO_KEY!r}); "
                                         "where the app sets api_keys, one of its admin_api_keys too, for the "
                                         "benchmarks that read /admin/decisions")


def resolve_target(args: argparse.Namespace, config: AppConfig) -> Target:
    """The flags with their defaults filled in (see `resolve`); a bad flag ends the program with why."""
    try:
        return resolve(args.url, config, args.model, args.tokenizer, args.api_key)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from exc


def resolve(url: str | None, config: AppConfig, model: str | None = None, tokenizer: str | None = None,
            api_key: str | None = None) -> Target:
    """Without a URL, the embedded default that `config` describes (the model flags then have
    nothing to describe); with one, the model the endpoint serves unless `model` names it."""
    if url is None:  # the app started here: a key from the shell is for some other endpoint
        if model or tokenizer:
            raise ValueError("--model and --tokenizer describe the app at --url; without --url the benchmark "
                             f"starts the embedded default ({config.model_name})")
        return Target(None, config.model_name, config.model, api_key or NO_KEY)
    api_key = api_key or os.environ.get(API_KEY_ENV) or NO_KEY
    url = url.rstrip("/").removesuffix("/v1")
    model = model or served_model(url, api_key)
    return Target(url, model, tokenizer or model, api_key)


def served_model(url: str, api_key: str) -> str:
    """The first model the endpoint lists: the name its requests must carry."""
    try:
        response = httpx.get(f"{url}/v1/models", headers=bearer(api_key), timeout=30)
        response.raise_for_status()
        models = response.json()["data"]
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        raise ValueError(f"no model list at {url}/v1/models ({exc}); name the model with --model") from exc
    if not models:
        raise ValueError(f"{url}/v1/models lists no model; name it with --model")
    return models[0]["id"]


def decisions(url: str, api_key: str, n: int, calls: int = 8) -> list[dict]:
    """The routers' last `n` decision records each; where the app sets api_keys, only an admin key
    reads them. Each call answers from one router replica (the less loaded of two picked at random):
    `calls` calls miss one of two replicas with odds 1 in 2**(calls - 1)."""
    merged: dict[str, dict] = {}
    for _ in range(calls):
        response = httpx.get(f"{url}/admin/decisions", params={"n": n}, headers=bearer(api_key), timeout=60)
        response.raise_for_status()
        merged.update((d["request_id"], d) for d in response.json())
    return list(merged.values())


def bearer(api_key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"}
