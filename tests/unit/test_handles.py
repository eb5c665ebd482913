"""Serve's request ids as deployments/handles.py sets them for calls made at once within one request."""

from ray.serve import context as serve_context
from ray.serve._private.default_impl import (
    create_dynamic_handle_options,
    create_init_handle_options,
    get_request_metadata,
)

from deployments.handles import own_request_id


def _call_id() -> str:
    """The internal request id Serve gives a handle call made here."""
    return get_request_metadata(create_init_handle_options(), create_dynamic_handle_options()).internal_request_id


def test_each_choice_s_calls_carry_their_own_id_within_the_request_s():
    token = serve_context._serve_request_context.set(serve_context._RequestContext(_internal_request_id="req"))
    try:
        assert _call_id() == "req"  # Serve's own rule: a call inherits the request's id
        with own_request_id("0"):
            assert _call_id() == "req-0"
        with own_request_id(1):
            assert _call_id() == "req-1"
        with own_request_id(None):  # a request's only choice keeps Serve's id, and its cancellation cascade
            assert _call_id() == "req"
        assert _call_id() == "req"
    finally:
        serve_context._serve_request_context.reset(token)


def test_outside_a_request_every_call_keeps_a_fresh_id():
    token = serve_context._serve_request_context.set(serve_context._RequestContext())
    try:
        with own_request_id("0"):
            first, second = _call_id(), _call_id()
        assert first != second and not first.endswith("-0")
    finally:
        serve_context._serve_request_context.reset(token)
