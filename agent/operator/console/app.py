"""The console's web app: starlette routes behind two ASGI layers, outermost first:

1. `agent.base.webguard.RequestGuard`: the Host allow-list and Origin check of the HTTP API (a
   web page elsewhere cannot drive it, nor a DNS rebinding one);
2. `Access`: GET and HEAD only (anything else 405: the console only reads), then the key, when
   the console has one: `Authorization: Bearer <key>`, or the cookie a visit to `/?key=<key>`
   sets (HttpOnly, SameSite=Strict; then a redirect to the same page without the key, so that
   it leaves the address bar and the history). A missing or wrong key: the 401 page.

Pages (docs/ROLLOUTS.md "The console"): `/` the fleet, `/rollouts`, `/rollouts/<id>`,
`/devices/<id>`, and their JSON under `/api/`. Every page is written by jinja2 with autoescape:
device ids, models and rollout reasons come from the network and from files, never as markup.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from datetime import UTC, datetime
from http.cookies import SimpleCookie
from pathlib import Path
from typing import Any, Final
from urllib.parse import parse_qsl, quote, urlencode

from jinja2 import Environment, PackageLoader, select_autoescape
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from agent.operator.console import pages
from agent.operator.console.feed import LiveFleet
from agent.operator.console.rollouts import ReadOnlyStore
from agent.operator.inventory import inventory_row
from agent.operator.rollout.state import ROLLOUT_ID_RE, RolloutError
from agent.operator.view import _row

COOKIE: Final = "edge_agent_console"
Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
HEADERS: Final = {
    # the page's own scripts and plotly.js only; plotly writes its styles inline
    "content-security-policy": "default-src 'self'; script-src 'self'; style-src 'self' "
    "'unsafe-inline'; img-src 'self' data:; frame-ancestors 'none'; form-action 'self'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-store",
}
STATIC: Final = Path(__file__).parent / "static"


def cookie_token(key: str) -> str:
    """What the cookie holds: derived from the key, so the key itself is not stored there."""
    return hashlib.sha256(b"edge-agent console cookie\0" + key.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Console:
    """What the pages read: the live fleet (None: no broker, rollouts only) and the rollouts
    directory; `plotly_js` is the file the charts are drawn with."""

    fleet: LiveFleet | None
    rollouts_dir: Path
    plotly_js: Path
    started_unix: float


class Access:
    """ASGI middleware: read-only methods, then the key (module docstring)."""

    def __init__(self, app: Any, key: str | None, env: Environment) -> None:
        self._app, self._env = app, env
        self._token = cookie_token(key).encode() if key else None
        self._key = key.encode() if key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        if scope["method"] not in ("GET", "HEAD"):
            page = _error(self._env, 405, "The console only reads: GET and HEAD.")
            page.headers["allow"] = "GET, HEAD"
            await page(scope, receive, send)
            return
        if self._key is None:
            await self._app(scope, receive, send)
            return
        query = parse_qsl(scope.get("query_string", b"").decode("latin-1"))
        given = [v for k, v in query if k == "key"]
        if given:
            if not hmac.compare_digest(given[0].encode(), self._key):
                await _denied(self._env)(scope, receive, send)
                return
            rest = urlencode([(k, v) for k, v in query if k != "key"])
            target = quote(scope["path"]) + (f"?{rest}" if rest else "")
            back = Response(status_code=303, headers={"location": target, **HEADERS})
            back.set_cookie(
                COOKIE, cookie_token(given[0]), httponly=True, samesite="strict", path="/"
            )
            await back(scope, receive, send)
            return
        if not self._allowed(scope):
            await _denied(self._env)(scope, receive, send)
            return
        await self._app(scope, receive, send)

    def _allowed(self, scope: Scope) -> bool:
        assert self._key is not None and self._token is not None
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, given = value.partition(b" ")
                if scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self._key):
                    return True
            elif name == b"cookie":
                jar: SimpleCookie = SimpleCookie()
                try:
                    jar.load(value.decode("latin-1"))
                except Exception:
                    continue
                morsel = jar.get(COOKIE)
                if morsel is not None and hmac.compare_digest(morsel.value.encode(), self._token):
                    return True
        return False


def _environment() -> Environment:
    env = Environment(
        loader=PackageLoader("agent.operator.console", "templates"),
        autoescape=select_autoescape(default=True, default_for_string=True),
    )
    env.filters["clip"] = pages.clip
    env.filters["when"] = lambda t: (
        datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M:%S UTC") if t else "-"
    )
    return env


def _html(env: Environment, template: str, code: int = 200, **values: Any) -> HTMLResponse:
    body = env.get_template(template).render(**values)
    return HTMLResponse(body, status_code=code, headers=HEADERS)


def _error(env: Environment, status: int, message: str) -> HTMLResponse:
    return _html(env, "error.html", status, status=status, message=message)


def _denied(env: Environment) -> HTMLResponse:
    return _error(
        env, 401,
        "This console needs its key: open the address `edge-agent fleet console` printed "
        "(it ends in /?key=...), or send Authorization: Bearer <key>.",
    )  # fmt: skip


def build_app(console: Console, key: str | None) -> Any:
    """The routes and the key layer (the caller adds the Host/Origin guard around it)."""
    env = _environment()
    fleet = console.fleet

    def fleet_note() -> dict[str, Any]:
        status = "no broker (rollouts only)"
        malformed = 0
        if fleet is not None:
            with fleet.lock:
                status, malformed = fleet.status, fleet.view.malformed
        return {"status": status, "malformed": malformed, "started": console.started_unix}

    def snapshot() -> dict[str, Any]:
        """Inventory rows by device id; the lock is held only to copy the (frozen) devices."""
        if fleet is None:
            return {}
        with fleet.lock:
            devices = dict(fleet.view.devices)
        return {d: inventory_row(devices[d]) for d in sorted(devices)}

    def overview(request: Request) -> Response:
        q = request.query_params
        page = int(q["page"]) if q.get("page", "").isdigit() and len(q["page"]) < 7 else 1
        values = pages.overview(
            snapshot(), time.time(), page=page, group=q.get("group"), query=q.get("q", "")
        )
        return _html(env, "overview.html", **values, note=fleet_note(), live=fleet is not None)

    def fleet_json(request: Request) -> Response:
        rows = snapshot()
        return JSONResponse([dataclasses.asdict(r) for r in rows.values()], headers=HEADERS)

    def rollouts(request: Request) -> Response:
        store = ReadOnlyStore(console.rollouts_dir)
        try:
            heads, total = store.heads()
            problem = ""
        except RolloutError as exc:
            heads, total, problem = [], 0, str(exc)
        finally:
            store.close()
        return _html(env, "rollouts.html", heads=heads, total=total, problem=problem,
                     directory=str(console.rollouts_dir), note=fleet_note())  # fmt: skip

    def load(rid: str) -> Any:
        if not ROLLOUT_ID_RE.fullmatch(rid):
            raise HTTPException(404, f"no rollout {rid!r} in {console.rollouts_dir}")
        store = ReadOnlyStore(console.rollouts_dir)
        try:
            if not store.exists(rid):
                raise HTTPException(404, f"no rollout {rid!r} in {console.rollouts_dir}")
            return store.load(rid)
        except RolloutError as exc:
            raise HTTPException(503, f"rollout {rid!r} cannot be read: {exc}") from exc
        finally:
            store.close()

    def rollout(request: Request) -> Response:
        r = load(request.path_params["rid"])
        return _html(env, "rollout.html", **pages.rollout_page(r), note=fleet_note())

    def rollout_json(request: Request) -> Response:
        from agent.operator.rollout.report import report

        r = load(request.path_params["rid"])
        return JSONResponse(report(r).to_json(), headers=HEADERS)

    def device_values(did: str) -> dict[str, Any]:
        if fleet is None:
            raise HTTPException(404, f"no device {did!r}: the console has no broker")
        now = time.time()
        with fleet.lock:
            d = fleet.view.devices.get(did)
            series = fleet.history.series(did)
            refused = did in fleet.history.refused
            if d is None and series is None:
                raise HTTPException(404, f"no device {did!r} under {fleet.prefix}")
            row = inventory_row(d) if d is not None else None
            health = d.health if d is not None else None
            issues = _row(d, now, fleet.view.stale_after_s).issues if d is not None else ()
        values = pages.device_page(did, row, health, issues, series, now)
        return {**values, "refused": refused}

    def device(request: Request) -> Response:
        values = device_values(request.path_params["did"])
        return _html(env, "device.html", **values, note=fleet_note())

    def device_json(request: Request) -> Response:
        did = request.path_params["did"]
        device_values(did)  # 404 as the page
        assert fleet is not None
        with fleet.lock:
            s = fleet.history.series(did)
        doc = {"device": did, "times": list(s.times) if s else [],
               "figures": {k: list(v) for k, v in s.figures.items()} if s else {}}  # fmt: skip
        return JSONResponse(doc, headers=HEADERS)

    def plotly_js(request: Request) -> Response:
        return FileResponse(console.plotly_js, media_type="text/javascript",
                            headers={**HEADERS, "cache-control": "max-age=86400"})  # fmt: skip

    def console_js(request: Request) -> Response:
        return FileResponse(STATIC / "console.js", media_type="text/javascript", headers=HEADERS)

    async def not_found(request: Request, exc: Exception) -> Response:
        if isinstance(exc, HTTPException):
            return _error(env, exc.status_code, str(exc.detail))
        return _error(env, 500, "internal error")

    routes = [
        Route("/", overview),
        Route("/rollouts", rollouts),
        Route("/rollouts/{rid}", rollout),
        Route("/devices/{did}", device),
        Route("/api/fleet", fleet_json),
        Route("/api/rollouts/{rid}", rollout_json),
        Route("/api/devices/{did}", device_json),
        Route("/static/plotly.min.js", plotly_js),
        Route("/static/console.js", console_js),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: not_found})
    return Access(app, key, env)
