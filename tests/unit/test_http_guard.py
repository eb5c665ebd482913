"""The frontend's outer ASGI layer: oversized bodies get 413 and escaped errors the OpenAI shape."""

from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from deployments.http_guard import HttpGuard


def _client() -> TestClient:
    app = FastAPI()
    app.add_middleware(HttpGuard)
    app.state.max_request_bytes = 100

    @app.post("/echo")
    async def echo(request: Request):
        return {"n": len(await request.body())}

    @app.get("/boom")
    async def boom():
        raise RuntimeError("bug")

    return TestClient(app, raise_server_exceptions=False)


def test_a_body_over_the_limit_gets_413_in_the_error_shape_before_it_is_parsed():
    client = _client()
    assert client.post("/echo", content=b"x" * 100).json() == {"n": 100}
    response = client.post("/echo", content=b"x" * 101)
    assert response.status_code == 413 and response.json()["error"]["code"] == 413
    chunked = client.post("/echo", content=iter([b"x" * 60, b"x" * 60]))  # no Content-Length
    assert chunked.status_code == 413


def test_an_unhandled_error_is_a_json_500_not_plain_text():
    response = _client().get("/boom")
    assert response.status_code == 500
    assert response.json()["error"] == {"message": "internal error: RuntimeError", "type": "server_error", "code": 500}
