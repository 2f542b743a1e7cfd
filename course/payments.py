"""A fake payment provider that honours an ``Idempotency-Key`` header (chapter 03).

A real HTTP/1.1 service on 127.0.0.1, run in a daemon thread, that behaves like the
card APIs learners will meet (Stripe's among them):

- ``POST /v1/charges`` with JSON ``{"customer": ..., "amount_cents": ...}`` takes money and
  answers ``{"id": "ch_...", ...}``;
- with an ``Idempotency-Key`` header, a repeat of a finished request is answered from the
  provider's own record (header ``Idempotent-Replayed: true``) and charges nothing; a
  repeat while the first is still running gets 409; the same key with other parameters
  gets 422;
- ``GET /v1/charges`` lists what was charged: the card statement.

Faults, set from the test or notebook: :meth:`PaymentProvider.drop_responses` charges and
then resets the connection before answering (the caller cannot tell whether money moved),
:meth:`PaymentProvider.fail_next` answers 503 without charging.

    with PaymentProvider() as provider:
        client = PaymentsClient(provider.url)
        await client.charge("ada", 1250, idempotency_key="order-1")

Hand-written on asyncio streams (like :class:`course.faults.FlakyService`) so that a
dropped response can be a real TCP reset.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import threading
import time
from dataclasses import dataclass

import httpx

from course.idempotency import ProviderError


@dataclass
class ProviderCharge:
    id: str
    customer: str
    amount_cents: int
    idempotency_key: str | None
    at: float


class PaymentProvider:
    """The fake provider. ``charges`` is its statement; ``requests`` counts what it was sent."""

    def __init__(self, *, latency: float = 0.02) -> None:
        self.latency = latency
        self.charges: list[ProviderCharge] = []
        self.requests = 0
        self.replayed = 0
        self._by_key: dict[str, tuple[dict, int, dict] | None] = {}  # key -> (params, status, body) or None
        self._drop = 0
        self._fail = 0
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server = None
        self.port = 0

    # faults -------------------------------------------------------------------
    def drop_responses(self, n: int = 1) -> None:
        """The next ``n`` charges succeed, but the connection is reset before the answer."""
        self._drop = n

    def fail_next(self, n: int = 1) -> None:
        """The next ``n`` requests get 503 and charge nothing."""
        self._fail = n

    def statement(self) -> list[tuple[str, str, int, str | None]]:
        return [(c.id, c.customer, c.amount_cents, c.idempotency_key) for c in self.charges]

    # lifecycle ----------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> PaymentProvider:
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            self._server = loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
            self.port = self._server.sockets[0].getsockname()[1]
            ready.set()
            loop.run_forever()
            self._server.close()
            tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for t in tasks:
                t.cancel()
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.close()

        self._thread = threading.Thread(target=run, name="PaymentProvider", daemon=True)
        self._thread.start()
        ready.wait(10)
        return self

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    def __enter__(self) -> PaymentProvider:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

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
            charge = ProviderCharge(
                f"ch_{len(self.charges) + 1:05d}", params["customer"], params["amount_cents"], key, time.monotonic()
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

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path = (lines[0].split(" ") + ["", ""])[:2]
                headers = {}
                for line in lines[1:]:
                    if ":" in line:
                        k, v = line.split(":", 1)
                        headers[k.strip().lower()] = v.strip()
                length = int(headers.get("content-length", "0") or 0)
                raw = await reader.readexactly(length) if length else b""
                self.requests += 1
                extra: dict = {}
                drop = False
                if method == "POST" and path == "/v1/charges":
                    try:
                        params = json.loads(raw or b"{}")
                    except ValueError:
                        params = {}
                    status, body, extra, drop = await self._charge(params, headers.get("idempotency-key"))
                elif method == "GET" and path == "/v1/charges":
                    status, body = 200, {"data": [c.__dict__ for c in self.charges]}
                else:
                    status, body = 404, {"error": "not_found"}
                if drop:
                    sock = writer.get_extra_info("socket")
                    if sock is not None:
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    writer.transport.abort()
                    return
                payload = json.dumps(body).encode()
                head_out = f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}\r\n"
                head_out += f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
                head_out += "".join(f"{k}: {v}\r\n" for k, v in extra.items())
                writer.write((head_out + "\r\n").encode() + payload)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError, asyncio.CancelledError):
            pass
        finally:
            if not writer.transport.is_closing():
                writer.close()


_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    409: "Conflict",
    422: "Unprocessable Content",
    503: "Service Unavailable",
}


class PaymentsClient:
    """An async client of the provider: ``await client.charge(customer, cents, idempotency_key=...)``.

    Returns the charge id. A 4xx/5xx answer raises :class:`course.idempotency.ProviderError`
    with its status; a dropped connection raises ``httpx.TransportError`` (outcome unknown).
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
