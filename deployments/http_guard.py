"""The frontend's outermost ASGI layer: the API key (401/403), the body-size cap (413), a write
timeout for clients that stop reading, and the OpenAI error shape for any failure that escapes the
handlers (never Starlette's plain-text 500).

HTTP ──▶ HttpGuard: key, size ──▶ FastAPI (body read, validation, handlers, admission) ──▶ ...
The key is checked before anything reads the body or takes an admission place: a request without
a valid key costs the server its headers only. Pure ASGI rather than Starlette's
BaseHTTPMiddleware, which would wrap every streamed chunk.
"""

import asyncio
import json
import logging

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from app.conversations.openai_replies import error_body
from app.conversations.tenants import Forbidden, Unauthorized

logger = logging.getLogger("ray.serve")


def error_response(message: str, status: int, retry_after_s: int | None = None) -> JSONResponse:
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
    return JSONResponse(error_body(message, status), status_code=status, headers=headers)


HEALTH_PATH = "/health"


def serve_docs(app: FastAPI) -> None:
    """Turn on FastAPI's /openapi.json, /docs and /redoc, which the frontend's app is built without."""
    app.openapi_url, app.docs_url, app.redoc_url = "/openapi.json", "/docs", "/redoc"
    app.setup()


def open_paths(app: FastAPI) -> frozenset[str]:
    """Paths answered without a key: health, and the API docs when they are served."""
    docs = (app.openapi_url, app.docs_url, app.redoc_url, app.docs_url and app.swagger_ui_oauth2_redirect_url)
    return frozenset({HEALTH_PATH, *filter(None, docs)})


class BodyTooLarge(Exception):
    pass


class ClientStoppedReading(Exception):
    """A response part waited `write_timeout_s` for the client to take it: the reply ends, and its
    stream's cleanup releases its admission place and engine slots."""


class HttpGuard:
    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = scope["app"].state  # Starlette puts the app in the scope before its middleware
        headers = dict(scope.get("headers") or [])
        if (refused := _refused(state, scope["path"], headers.get(b"authorization"))) is not None:
            return await _send_json(send, refused)
        limit = state.max_request_bytes
        declared = headers.get(b"content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            return await _send_json(send, _too_large(limit))
        received, started = 0, False

        async def counting_receive():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > limit:
                raise BodyTooLarge
            return message

        async def tracking_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send_within(send, message, state.write_timeout_s)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except BodyTooLarge:
            if not started:
                await _send_json(send, _too_large(limit))
        except ClientStoppedReading:
            logger.warning("%s: the client took nothing for %.0f s: reply ended", scope["path"], state.write_timeout_s)
        except Exception as exc:  # noqa: BLE001 - the last line: answer in the API's error shape
            logger.exception("request failed")
            if not started:
                await _send_json(send, (500, error_body(f"internal error: {type(exc).__name__}", 500)))


async def send_within(send, message, timeout_s: float) -> None:
    """`send(message)`, or ClientStoppedReading after `timeout_s`. A timer on the loop rather than
    asyncio.wait_for, which would start a task for every streamed chunk."""
    task, expired = asyncio.current_task(), False

    def expire() -> None:
        nonlocal expired
        expired = True
        task.cancel()

    timer = asyncio.get_running_loop().call_later(timeout_s, expire)
    try:
        await send(message)
    except asyncio.CancelledError:
        if not expired:
            raise
        if hasattr(task, "uncancel"):  # Python 3.11+: this cancellation is handled here
            task.uncancel()
        raise ClientStoppedReading from None
    finally:
        timer.cancel()


def _refused(state, path: str, authorization: bytes | None) -> tuple[int, dict] | None:
    """401 or 403 unless the key may reach `path` (app/conversations/tenants.py KeyRing.authenticate)."""
    try:
        state.keys.authenticate(path, authorization.decode("latin-1") if authorization else None, state.open_paths)
    except (Unauthorized, Forbidden) as exc:
        status = 401 if isinstance(exc, Unauthorized) else 403
        return status, error_body(str(exc), status)
    return None


def _too_large(limit: int) -> tuple[int, dict]:
    return 413, error_body(f"request body exceeds this server's limit of {limit} bytes", 413)


async def _send_json(send, answer: tuple[int, dict]) -> None:
    status, body = answer
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})

