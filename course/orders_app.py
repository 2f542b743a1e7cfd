"""The orders service (chapter 03): ``POST /orders`` with an ``Idempotency-Key``, in Starlette.

A Starlette app built with :func:`course.kit.serve.app`, the way the service would ship:

- 400 without an ``Idempotency-Key`` header (or one over 255 characters), or with a body
  that is not ``{"customer": str, "amount_cents": int > 0}``;
- 201 with the stored response, the first time and on every replay;
- 409 with ``Retry-After`` while the first request with the key is running (or its charge
  failed in a way nobody can be sure about, until the reaper has finished it);
- 422 when the key was first used with a different body;
- 402 when the card was declined (certain: nothing was charged, the key is free again);
- 502 when the provider failed and the outcome is unknown (the key stays pending);
- 501 ``not done yet`` when ``create_order`` is still the stub of a graded task.

Serve it on a local port (the app opens its own pool on its own event loop)::

    svc = Service(make_app(create_order, card.charge, database_url=ns.database_url), name="orders").start()
    async with httpx.AsyncClient(base_url=svc.url) as http:
        resp = await post_order(http, "key-1", {"customer": "ada", "amount_cents": 1250})

or call it in-process with a pool of the caller's loop: ``client(make_app(create_order,
charge, pool=pool))`` (no lifespan, no port).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Awaitable, Callable

import httpx

from course.idempotency import ChargeDeclined, IdempotencyKeyReused, ProviderError, RequestInProgress
from course.kit import serve

MAX_KEY_LENGTH = 255


def _valid(body) -> bool:
    return (
        isinstance(body, dict)
        and isinstance(body.get("customer"), str)
        and isinstance(body.get("amount_cents"), int)
        and not isinstance(body.get("amount_cents"), bool)
        and body["amount_cents"] > 0
    )


def make_app(
    create_order: Callable[..., Awaitable[dict]],
    charge: Callable[[str, int], Awaitable[str]] | None = None,
    *,
    pool=None,
    database_url: str | None = None,
    charge_for_key: Callable[[str], Callable[[str, int], Awaitable[str]]] | None = None,
    pool_size: int = 5,
):
    """The Starlette app in front of ``create_order(pool, key, body, charge)``.

    Give ``charge`` (passed to ``create_order`` as is) or ``charge_for_key(key)`` (builds a
    charge that forwards the request's key to the payment provider). Give ``pool`` (an open
    pool on the loop that will run the app: in-process calls) or ``database_url`` (the app
    opens a pool of its own when it starts and closes it when it stops: a served app runs
    on its own event loop, and a pool belongs to the loop that opened it).
    """
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    if (charge is None) == (charge_for_key is None):
        raise ValueError("give exactly one of charge or charge_for_key")
    if (pool is None) == (database_url is None):
        raise ValueError("give exactly one of pool or database_url")
    state = {"pool": pool}

    async def orders(request: Request) -> JSONResponse:
        key = request.headers.get("idempotency-key", "").strip()
        if not key or len(key) > MAX_KEY_LENGTH:
            return JSONResponse({"error": "idempotency_key_required"}, status_code=400)
        try:
            body = json.loads(await request.body() or b"null")
        except ValueError:
            body = None
        if not _valid(body):
            return JSONResponse(
                {"error": "body must be {customer: str, amount_cents: int > 0}"}, status_code=400
            )
        body = {"customer": body["customer"], "amount_cents": body["amount_cents"]}
        pay = charge if charge is not None else charge_for_key(key)
        try:
            result = await create_order(state["pool"], key, body, pay)
        except NotImplementedError:
            raise  # the graded task's stub: the course's handler answers 501 "not done yet"
        except RequestInProgress:
            return JSONResponse(
                {"error": "request_in_progress"}, status_code=409, headers={"Retry-After": "1"}
            )
        except IdempotencyKeyReused:
            return JSONResponse({"error": "idempotency_key_reused"}, status_code=422)
        except ChargeDeclined as err:
            return JSONResponse({"error": "card_declined", "detail": str(err)}, status_code=402)
        except (ProviderError, httpx.TransportError, TimeoutError) as err:
            detail = str(err) or type(err).__name__
            return JSONResponse({"error": "payment_outcome_unknown", "detail": detail}, status_code=502)
        except Exception as err:  # noqa: BLE001 - an HTTP layer answers 500, never crashes
            return JSONResponse({"error": "internal", "detail": type(err).__name__}, status_code=500)
        return JSONResponse(result, status_code=201)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if database_url is None:
            yield
            return
        from psycopg_pool import AsyncConnectionPool

        # a fixed size: the service holds the same connections however long it runs
        own = AsyncConnectionPool(
            database_url, min_size=pool_size, max_size=pool_size, kwargs={"autocommit": True}, open=False
        )
        await own.open(wait=True)
        state["pool"] = own
        try:
            yield
        finally:
            await own.close()

    return serve.app([Route("/orders", orders, methods=["POST"])], lifespan=lifespan)


def client(app, *, timeout: float = 5.0) -> httpx.AsyncClient:
    """An httpx client that calls ``app`` in-process (no server, no port; no lifespan: pass ``pool=``)."""
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://orders.local", timeout=timeout
    )


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
