"""The frontend's outer ASGI layer: the key first (401/403 before the body is read), oversized bodies
get 413, escaped errors the OpenAI shape, and the API docs only when asked for."""

from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from app.conversations.tenants import KeyRing
from deployments.http_guard import HttpGuard, open_paths, serve_docs

KEY = {"Authorization": "Bearer key-a"}


OPEN_API = KeyRing()


def _client(keys: KeyRing = OPEN_API, docs: bool = False) -> tuple[TestClient, list[int]]:
    """The guarded app and the bodies its echo endpoint read (their sizes)."""
    app, read = FastAPI(docs_url=None, redoc_url=None, openapi_url=None), []
    app.add_middleware(HttpGuard)
    if docs:
        serve_docs(app)
    app.state.max_request_bytes, app.state.keys, app.state.open_paths = 100, keys, open_paths(app)
    app.state.write_timeout_s = 5.0

    @app.post("/echo")
    async def echo(request: Request):
        read.append(len(await request.body()))
        return {"n": read[-1]}

    @app.get("/boom")
    async def boom():
        raise RuntimeError("bug")

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/admin/decisions")
    async def decisions():
        return []

    return TestClient(app, raise_server_exceptions=False), read


def test_a_body_over_the_limit_gets_413_in_the_error_shape_before_it_is_parsed():
    client, _ = _client()
    assert client.post("/echo", content=b"x" * 100).json() == {"n": 100}
    response = client.post("/echo", content=b"x" * 101)
    assert response.status_code == 413 and response.json()["error"]["code"] == 413
    chunked = client.post("/echo", content=iter([b"x" * 60, b"x" * 60]))  # no Content-Length
    assert chunked.status_code == 413


def test_an_unhandled_error_is_a_json_500_not_plain_text():
    response = _client()[0].get("/boom")
    assert response.status_code == 500
    assert response.json()["error"] == {"message": "internal error: RuntimeError", "type": "server_error", "code": 500}


def test_a_wrong_key_gets_401_before_the_body_is_read_or_its_size_counted():
    client, read = _client(KeyRing.of({"key-a": "tenant-a"}, ("root",)))
    for headers in ({}, {"Authorization": "Bearer nope"}):
        response = client.post("/echo", content=b"x" * 1000, headers=headers)
        assert response.status_code == 401 and "API key" in response.json()["error"]["message"]
    assert read == [], "nothing read the body"
    assert client.post("/echo", content=b"x" * 10, headers=KEY).json() == {"n": 10}
    assert client.get("/health").status_code == 200, "health needs no key"
    assert client.get("/admin/decisions", headers=KEY).status_code == 403
    assert client.get("/admin/decisions", headers={"Authorization": "Bearer root"}).status_code == 200


def test_without_keys_the_api_is_open_as_before():
    assert _client()[0].post("/echo", content=b"x").json() == {"n": 1}


def test_the_api_docs_are_off_unless_asked_for_and_then_need_no_key():
    keys = KeyRing.of({"key-a": "tenant-a"}, ())
    closed, _ = _client(keys)
    assert [closed.get(p, headers=KEY).status_code for p in ("/docs", "/redoc", "/openapi.json")] == [404] * 3
    served, _ = _client(keys, docs=True)
    assert [served.get(p).status_code for p in ("/docs", "/redoc", "/openapi.json")] == [200] * 3
    assert "/echo" in served.get("/openapi.json").json()["paths"]


def test_a_client_that_stops_reading_ends_its_stream_and_the_stream_cleans_up(caplog):
    import asyncio

    from fastapi.responses import StreamingResponse

    app, cleaned = FastAPI(docs_url=None, redoc_url=None, openapi_url=None), []
    app.add_middleware(HttpGuard)
    app.state.max_request_bytes, app.state.keys, app.state.open_paths = 100, OPEN_API, open_paths(app)
    app.state.write_timeout_s = 0.2

    @app.get("/stream")
    async def stream():
        async def chunks():
            try:
                for n in range(1000):
                    yield f"data: {n}\n\n"
            finally:
                cleaned.append(True)  # the frontend releases the admission place and engine slots here
        return StreamingResponse(chunks(), media_type="text/event-stream")

    async def client_that_stops_reading() -> list[str]:
        sent, stalled = [], asyncio.Event()

        async def receive():
            await stalled.wait()  # never disconnects: it only stops reading
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message["type"])
            if len([m for m in sent if m == "http.response.body"]) == 3:
                await asyncio.sleep(3600)  # the client's window is full

        scope = {"type": "http", "method": "GET", "path": "/stream", "headers": [], "query_string": b"",
                 "app": app, "root_path": "", "scheme": "http", "server": ("t", 80), "client": ("c", 1)}
        await asyncio.wait_for(app(scope, receive, send), 5)
        return sent

    sent = asyncio.run(client_that_stops_reading())
    assert sent.count("http.response.body") == 3 and cleaned == [True]
    assert "the client took nothing" in caplog.text and "request failed" not in caplog.text
