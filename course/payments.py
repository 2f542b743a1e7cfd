"""A fake payment provider that honours an ``Idempotency-Key`` header (chapter 03).

A real HTTP/1.1 service on 127.0.0.1, run in a daemon thread, that behaves like the
card APIs learners will meet (Stripe's among them):

- ``POST /v1/charges`` with JSON ``{"customer": ..., "amount_cents": ...}`` takes money and
  answers ``{"id": "ch_...", ...}``;
- with an ``Idempotency-Key`` header, a repeat of a finished request is answered from the
  provider's own record (header ``Idempotent-Replayed: true``) and charges nothing; a
  repeat while the first is still running gets 409; the same key with other parameters
  gets 422. Like Stripe, it stores the *result* of the first request, errors included: a
  declined card (402) is replayed to a retry with the same key, not attempted again;
- ``GET /v1/charges`` lists what was charged: the card statement.

Faults, set from the test or notebook: :meth:`PaymentProvider.drop_responses` charges and
then resets the connection before answering (the caller cannot tell whether money moved),
:meth:`PaymentProvider.fail_next` answers 503 without charging, :meth:`PaymentProvider.decline_next`
declines the next cards (402, stored under the key like a success).

    with PaymentProvider() as provider:
        client = PaymentsClient(provider.url)
        await client.charge("ada", 1250, idempotency_key="order-1")

Built on :class:`course.kit.faults.LocalHTTPServer` (like ``FlakyService``), so that a
dropped response is a real TCP reset.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass

import httpx

from course.idempotency import ChargeDeclined, ProviderError
from course.kit.faults import HTTPRequest, LocalHTTPServer, Reply


@dataclass
class ProviderCharge:
    id: str
    customer: str
    amount_cents: int
    idempotency_key: str | None
    at: float


class PaymentProvider(LocalHTTPServer):
    """The fake provider. ``charges`` is its statement; ``requests`` counts what it was sent."""

    name = "payments"

    def __init__(self, *, latency: float = 0.02) -> None:
        super().__init__()
        self.latency = latency
        self.charges: list[ProviderCharge] = []
        self.requests = 0
        self.attempts = 0  # charges tried at the card network (declines included, replays not)
        self.replayed = 0
        self._by_key: dict[str, tuple[dict, int, dict] | None] = {}  # key -> (params, status, body) or None
        self._drop = 0
        self._fail = 0
        self._decline = 0
        self._lock = threading.Lock()

    # faults -------------------------------------------------------------------
    def drop_responses(self, n: int = 1) -> None:
        """The next ``n`` charges succeed, but the connection is reset before the answer."""
        self._drop = n

    def fail_next(self, n: int = 1) -> None:
        """The next ``n`` requests get 503 and charge nothing."""
        self._fail = n

    def decline_next(self, n: int = 1) -> None:
        """The next ``n`` charges are declined by the card network (402 ``card_declined``)."""
        self._decline = n

    def statement(self) -> list[tuple[str, str, int, str | None]]:
        return [(c.id, c.customer, c.amount_cents, c.idempotency_key) for c in self.charges]

    # the API ------------------------------------------------------------------
    async def _charge(self, params: dict, key: str | None) -> tuple[int, dict, dict, bool]:
        """(status, body, extra headers, drop the connection instead of answering)."""
        if not isinstance(params.get("customer"), str) or not isinstance(params.get("amount_cents"), int):
            return 400, {"error": "customer (string) and amount_cents (integer) are required"}, {}, False
        params = {"customer": params["customer"], "amount_cents": params["amount_cents"]}
        with self._lock:
            if self._fail > 0:
                self._fail -= 1
                return 503, {"error": "provider_unavailable"}, {"Retry-After": "1"}, False
            if key is not None:
                if key in self._by_key:
                    seen = self._by_key[key]
                    if seen is None:
                        return 409, {"error": "idempotency_key_in_use"}, {}, False
                    first_params, status, body = seen
                    if first_params != params:
                        return 422, {"error": "idempotency_key_reused"}, {}, False
                    self.replayed += 1
                    return status, body, {"Idempotent-Replayed": "true"}, False
                self._by_key[key] = None  # in flight
        await asyncio.sleep(self.latency)
        with self._lock:
            self.attempts += 1
            if self._decline > 0:
                self._decline -= 1
                body = {"error": "card_declined", "message": "Your card was declined."}
                if key is not None:
                    self._by_key[key] = (params, 402, body)  # the error is the result: replayed, not retried
                return 402, body, {}, False
            charge = ProviderCharge(
                f"ch_{len(self.charges) + 1:05d}",
                params["customer"],
                params["amount_cents"],
                key,
                time.monotonic(),
            )
            self.charges.append(charge)
            body = {
                "id": charge.id,
                "customer": charge.customer,
                "amount_cents": charge.amount_cents,
                "status": "succeeded",
            }
            if key is not None:
                self._by_key[key] = (params, 200, body)
            drop = self._drop > 0
            if drop:
                self._drop -= 1
        return 200, body, {}, drop

    async def respond(self, request: HTTPRequest) -> Reply:
        self.requests += 1
        if request.method == "POST" and request.path == "/v1/charges":
            try:
                params = json.loads(request.body or b"{}")
            except ValueError:
                params = {}
            status, body, extra, drop = await self._charge(params, request.headers.get("idempotency-key"))
            return Reply(action="reset") if drop else Reply(status, body, extra)
        if request.method == "GET" and request.path == "/v1/charges":
            return Reply(200, {"data": [c.__dict__ for c in self.charges]})
        return Reply(404, {"error": "not_found"})


class PaymentsClient:
    """An async client of the provider: ``await client.charge(customer, cents, idempotency_key=...)``.

    Returns the charge id. A 4xx answer other than 409 raises
    :class:`course.idempotency.ChargeDeclined` (certain: nothing was charged); a 409 (the
    first request with this key is still running) or a 5xx raises
    :class:`course.idempotency.ProviderError` (uncertain); a dropped connection raises
    ``httpx.TransportError`` (outcome unknown).
    """

    def __init__(self, base_url: str, *, timeout: float = 2.0) -> None:
        self.base_url = base_url
        self.timeout = timeout

    async def charge(self, customer: str, amount_cents: int, *, idempotency_key: str | None = None) -> str:
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        async with httpx.AsyncClient(base_url=self.base_url, timeout=self.timeout) as http:
            resp = await http.post(
                "/v1/charges", json={"customer": customer, "amount_cents": amount_cents}, headers=headers
            )
        if 400 <= resp.status_code < 500 and resp.status_code != 409:
            raise ChargeDeclined(resp.status_code, f"provider answered {resp.status_code}: {resp.text}")
        if resp.status_code >= 400:
            raise ProviderError(resp.status_code, f"provider answered {resp.status_code}: {resp.text}")
        return resp.json()["id"]

    def charge_with_key(self, key: str):
        """A ``charge(customer, amount_cents)`` that always sends ``key`` (what ``create_order`` takes)."""

        async def charge(customer: str, amount_cents: int) -> str:
            return await self.charge(customer, amount_cents, idempotency_key=key)

        return charge

    async def charge_keyed(self, customer: str, amount_cents: int, key: str) -> str:
        """``charge_with_key`` in the reaper's shape: ``(customer, amount_cents, key)``."""
        return await self.charge(customer, amount_cents, idempotency_key=key)
