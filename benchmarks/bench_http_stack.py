"""Which HTTP stack the daemon's OpenAI-compatible API runs on: aiohttp, or uvicorn+starlette
(both on the caller's own asyncio loop, on a unix socket), by what they cost on an idle board.

For each stack a fresh server process reports its RSS before it imports anything of the stack
and again once it serves one app; the parent then sends 200 keep-alive requests to a tiny JSON
handler (a hand-written HTTP/1.1 client on a raw unix socket, so no client library is measured)
and reads the server's CPU time (utime + stime from /proc) around them.

    python benchmarks/bench_http_stack.py [--requests 200] [--rounds 3]
        [--write docs/PERFORMANCE.md]

With --write, the table replaces the "HTTP stack" section's numbers between its markers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STACKS = ("aiohttp", "uvicorn+starlette")
BEGIN, END = "<!-- http-stack:begin -->", "<!-- http-stack:end -->"


def _rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def _cpu_s(pid: int) -> float:
    """The process's CPU time so far, in ns resolution (schedstat; /proc/PID/stat counts in
    10 ms ticks, too coarse for 200 requests). Single-threaded servers: the main thread's."""
    schedstat = Path(f"/proc/{pid}/schedstat")
    if schedstat.exists():
        return int(schedstat.read_text().split()[0]) / 1e9
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _serve_aiohttp(path: str) -> None:
    from aiohttp import web

    async def handler(request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"ok": True, "n": body["n"]})

    app = web.Application()
    app.router.add_post("/v1/x", handler)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    await web.UnixSite(runner, path).start()
    print(json.dumps({"ready": True, "rss_kib": _rss_kib()}), flush=True)
    await asyncio.Event().wait()


async def _serve_uvicorn(path: str) -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def handler(request: Request) -> JSONResponse:
        body = await request.json()
        return JSONResponse({"ok": True, "n": body["n"]})

    app = Starlette(routes=[Route("/v1/x", handler, methods=["POST"])])
    config = uvicorn.Config(app, uds=path, log_level="warning", access_log=False, lifespan="off")
    server = uvicorn.Server(config)
    config.load()
    server.lifespan = config.lifespan_class(config)
    await server.startup()  # on this loop; no signal capture (that is serve()'s)
    print(json.dumps({"ready": True, "rss_kib": _rss_kib()}), flush=True)
    await asyncio.Event().wait()


def serve(stack: str, path: str) -> None:
    print(json.dumps({"baseline_rss_kib": _rss_kib()}), flush=True)
    asyncio.run(_serve_aiohttp(path) if stack == "aiohttp" else _serve_uvicorn(path))


def _request(n: int) -> bytes:
    body = json.dumps({"n": n}).encode()
    head = (
        "POST /v1/x HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def _read_response(s: socket.socket, buf: bytearray) -> None:
    while b"\r\n\r\n" not in buf:
        buf += s.recv(65536)
    head, _, rest = bytes(buf).partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(rest) < length:
        rest += s.recv(65536)
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(head.decode())
    buf[:] = rest[length:]


def measure(stack: str, requests: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/s.sock"
        proc = subprocess.Popen(
            [sys.executable, __file__, "--serve", stack, path],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdout is not None
            baseline = json.loads(proc.stdout.readline())["baseline_rss_kib"]
            ready = json.loads(proc.stdout.readline())["rss_kib"]
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(path)
                buf = bytearray()
                for i in range(20):  # warm-up: imports done lazily on the first request
                    s.sendall(_request(i))
                    _read_response(s, buf)
                cpu0, t0 = _cpu_s(proc.pid), time.perf_counter()
                for i in range(requests):
                    s.sendall(_request(i))
                    _read_response(s, buf)
                cpu1, t1 = _cpu_s(proc.pid), time.perf_counter()
            after = int(
                next(
                    line.split()[1]
                    for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines()
                    if line.startswith("VmRSS:")
                )
            )
        finally:
            proc.terminate()
            proc.wait()
    return {
        "rss_delta_mib": (ready - baseline) / 1024,
        "rss_after_mib": (after - baseline) / 1024,
        "cpu_us_per_request": (cpu1 - cpu0) / requests * 1e6,
        "wall_us_per_request": (t1 - t0) / requests * 1e6,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--write", type=Path, help="put the table into this markdown file")
    ap.add_argument("--serve", nargs=2, metavar=("STACK", "PATH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(*args.serve)
        return 0
    rows = []
    for stack in STACKS:
        runs = [measure(stack, args.requests) for _ in range(args.rounds)]
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        rows.append((stack, med))
        print(stack, {k: round(v, 1) for k, v in med.items()}, flush=True)
    import importlib.metadata as md

    versions = ", ".join(
        f"{p} {md.version(p)}" for p in ("aiohttp", "uvicorn", "starlette", "h11", "anyio")
    )
    table = [
        BEGIN,
        f"Measured by `benchmarks/bench_http_stack.py` ({args.requests} keep-alive POSTs of a tiny "
        f"JSON handler over a unix socket, median of {args.rounds} fresh server processes; "
        f"{platform.machine()}, Python {platform.python_version()}; {versions}). RSS is the "
        "server process's growth from a bare interpreter to serving one app (idle), and after "
        "the requests; CPU is the server's CPU time per request (/proc/PID/schedstat).",
        "",
        "| stack | RSS serving, idle (MiB) | RSS after requests (MiB) | server CPU per request "
        "(µs) | wall per request (µs) |",
        "| --- | ---: | ---: | ---: | ---: |",
        *(
            f"| {s} | {m['rss_delta_mib']:.1f} | {m['rss_after_mib']:.1f} | "
            f"{m['cpu_us_per_request']:.0f} | {m['wall_us_per_request']:.0f} |"
            for s, m in rows
        ),
        END,
    ]
    text = "\n".join(table)
    print(text)
    if args.write:
        doc = args.write.read_text()
        if BEGIN in doc and END in doc:
            head, _, rest = doc.partition(BEGIN)
            doc = head + text + rest.partition(END)[2]
        else:
            doc = doc.rstrip("\n") + "\n\n## HTTP stack\n\n" + text + "\n"
        args.write.write_text(doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
