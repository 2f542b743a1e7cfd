"""A small ASGI app in front of ``create_order`` (chapter 03): ``POST /orders`` with an Idempotency-Key.

Hand-written ASGI (no framework) so every status code is visible in a few lines:

- 400 without an ``Idempotency-Key`` header, or with a body that is not
  ``{"customer": str, "amount_cents": int > 0}``;
- 201 with the stored response (the first time and on every replay);
- 409 with ``Retry-After`` while the first request with the key is running;
- 422 when the key was first used with a different body;
- 502 when the payment provider failed, 500 for anything else.

Drive it in-process with httpx, no server and no port needed::

    app = make_app(pool, create_order, charge)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://orders") as http:
        resp = await http.post("/orders", json=body, headers={"Idempotency-Key": key})
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

import httpx

from course.idempotency import IdempotencyKeyReused, ProviderError, RequestInProgress

MAX_KEY_LENGTH = 255


async def _read_body(receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def _send_json(send, status: int, body: dict, headers: dict | None = None) -> None:
    payload = json.dumps(body).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    raw += [(k.lower().encode(), str(v).encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": payload})


def _valid(body) -> bool:
    return (
        isinstance(body, dict)
        and isinstance(body.get("customer"), str)
        and isinstance(body.get("amount_cents"), int)
        and not isinstance(body.get("amount_cents"), bool)
        and body["amount_cents"] > 0
    )


def make_app(
    pool,
    create_order: Callable[..., Awaitable[dict]],
    charge: Callable[[str, int], Awaitable[str]] | None = None,
    *,
    charge_for_key: Callable[[str], Callable[[str, int], Awaitable[str]]] | None = None,
):
    """The ASGI app. ``charge`` is passed to ``create_order`` as is; or give ``charge_for_key(key)``
    to build a charge that forwards the request's key to the payment provider."""
    if (charge is None) == (charge_for_key is None):
        raise ValueError("give exactly one of charge or charge_for_key")

    async def app(scope, receive, send) -> None:
        if scope["type"] != "http":  # lifespan and websockets: nothing to do
            return
        if scope["path"] != "/orders":
            await _send_json(send, 404, {"error": "not_found"})
            return
        if scope["method"] != "POST":
            await _send_json(send, 405, {"error": "method_not_allowed"}, {"Allow": "POST"})
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        key = headers.get("idempotency-key", "").strip()
        if not key or len(key) > MAX_KEY_LENGTH:
            await _send_json(send, 400, {"error": "idempotency_key_required"})
            return
        try:
            body = json.loads(await _read_body(receive) or b"null")
        except ValueError:
            body = None
        if not _valid(body):
            await _send_json(send, 400, {"error": "body must be {customer: str, amount_cents: int > 0}"})
            return
        body = {"customer": body["customer"], "amount_cents": body["amount_cents"]}
        try:
            result = await create_order(pool, key, body, charge if charge is not None else charge_for_key(key))
        except RequestInProgress:
            await _send_json(send, 409, {"error": "request_in_progress"}, {"Retry-After": "1"})
        except IdempotencyKeyReused:
            await _send_json(send, 422, {"error": "idempotency_key_reused"})
        except (ProviderError, httpx.TransportError) as err:
            await _send_json(send, 502, {"error": "payment_failed", "detail": str(err) or type(err).__name__})
        except Exception as err:  # noqa: BLE001 - an HTTP layer answers 500, never crashes
            await _send_json(send, 500, {"error": "internal", "detail": type(err).__name__})
        else:
            await _send_json(send, 201, result)

    return app


def client(app, *, timeout: float = 5.0) -> httpx.AsyncClient:
    """An httpx client that calls ``app`` in-process (no server, no port)."""
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://orders.local", timeout=timeout)


async def post_order(http: httpx.AsyncClient, key: str | None, body: dict) -> httpx.Response:
    """POST /orders with ``key`` as Idempotency-Key (no header when ``key`` is None)."""
    headers = {"Idempotency-Key": key} if key is not None else {}
    return await http.post("/orders", json=body, headers=headers)


async def post_order_with_retry(http: httpx.AsyncClient, key: str, body: dict, **retry) -> httpx.Response:
    """POST with chapter 01's retry, where a 409 "in progress" is retried (``raise_for_status``)."""
    from course.idempotency import call_with_retry

    async def attempt() -> httpx.Response:
        resp = await post_order(http, key, body)
        resp.raise_for_status()
        return resp

    return await call_with_retry(attempt, **retry)
