"""Benchmark: the server's own overhead per /infill request (wall time minus engine time).

Starts the daemon in-process on a loopback port, replays an editor walking through a real
source file (the Python standard library's) with the requests llama-vscode sends (256-line
prefix window, 64-line suffix, the cursor line, a 16-chunk ring buffer), and reports, per
configuration, p50/p95 of

* ``overhead``: client wall time minus the engine's time (``Server-Timing: engine``), i.e.
  HTTP + JSON + queue + prompt assembly, as the client sees it;
* ``app``: the same measured inside the process (from the first ASGI byte to the body).

Configurations run in one process, interleaved request by request, so machine noise hits
both alike: the full llama-server answer (llama-vscode) and ``response_fields`` (llama.vim).

    localspec bench overhead --model MODEL.gguf [--requests 100] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import uvicorn

from localspec.bench import corpus, harness
from localspec.bench.stats import percentile
from localspec.engine.types import EngineSettings, ModelSettings, SpecSettings
from localspec.server.app import create_app
from localspec.server.options import ServerSettings
from localspec.server.run import bind_sockets, uvicorn_config

CONFIGS: dict[str, dict[str, Any]] = {
    "llama-vscode (full answer)": {},
    "llama.vim (response_fields)": {
        "response_fields": ["content", "timings/prompt_n", "timings/predicted_n", "tokens_cached"]
    },
}


def editor_requests(source: Path, n: int, n_predict: int) -> list[dict[str, Any]]:
    """Someone retyping the file from line 300 on: one request per keystroke (after the
    line's indentation), the prefix/suffix windows moving at each new line."""
    lines = source.read_text().splitlines(keepends=True)
    extra = corpus.ring_chunks()
    out: list[dict[str, Any]] = []
    row = 300
    while len(out) < n and row < len(lines) - 1:
        line = lines[row].rstrip("\n")
        indent = len(line) - len(line.lstrip())
        for col in range(indent + 1, len(line) + 1):
            if len(out) == n:
                break
            out.append({
                "id_slot": 0,
                "input_prefix": "".join(lines[max(0, row - 256) : row]),
                "input_suffix": "\n" + "".join(lines[row + 1 : row + 65]),
                "input_extra": extra,
                "prompt": line[:col],
                "n_predict": n_predict,
                "n_cmpl": 1,
                "top_k": 40,
                "top_p": 0.99,
                "stream": False,
                "samplers": ["top_k", "top_p", "infill"],
                "cache_prompt": True,
                "t_max_prompt_ms": 500,
                "t_max_predict_ms": 250,
            })  # fmt: skip
        row += 1
    return out


class RawClient:
    """A minimal keep-alive HTTP/1.1 client on one TCP_NODELAY socket.

    The cheapest client there is, so the figure is the server's overhead rather than the
    client library's (http.client parses headers with the email package: ~1 ms a response;
    editors use undici or curl, whose parsers are C).
    """

    def __init__(self, host: str, port: int) -> None:
        self.sock = socket.create_connection((host, port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    def request(
        self, method: str, path: str, body: bytes = b""
    ) -> tuple[int, dict[str, str], bytes]:
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        self.sock.sendall(head + body)
        while b"\r\n\r\n" not in self.buf:
            self.buf += self._recv()
        raw_head, _, self.buf = self.buf.partition(b"\r\n\r\n")
        lines = raw_head.decode("latin-1").split("\r\n")
        headers = {k.lower(): v for k, _, v in (line.partition(": ") for line in lines[1:])}
        n = int(headers.get("content-length", "0"))
        while len(self.buf) < n:
            self.buf += self._recv()
        data, self.buf = self.buf[:n], self.buf[n:]
        return int(lines[0].split()[1]), headers, data

    def _recv(self) -> bytes:
        chunk = self.sock.recv(1 << 16)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        return chunk

    def close(self) -> None:
        self.sock.close()


def server_timing(header: str) -> dict[str, float]:
    parts = (p.strip().split(";dur=") for p in header.split(","))
    return {name: float(value) for name, value in parts}


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = ModelSettings(path=args.model, n_ctx=args.ctx, n_batch=1024, n_ubatch=1024,
                          n_threads=args.threads, n_threads_batch=args.threads)  # fmt: skip
    draft = None
    if args.draft:
        draft = ModelSettings(path=args.draft, n_ctx=args.ctx, n_batch=1024, n_ubatch=1024,
                              n_threads=args.threads, n_threads_batch=args.threads)  # fmt: skip
    engine_settings = EngineSettings(target=model, draft=draft, spec=SpecSettings())
    app = create_app(ServerSettings(port=0, metrics=True), engine_settings)
    sockets = bind_sockets("127.0.0.1", 0)
    port = sockets[0].getsockname()[1]
    server = uvicorn.Server(uvicorn_config(app))  # configured as `serve` runs the daemon
    thread = threading.Thread(target=server.run, kwargs={"sockets": sockets}, daemon=True)
    thread.start()
    parts = (
        "wall",
        "engine",
        "overhead",
        "app",
        "parse",
        "queue",
        "prep",
        "post",
        "wake",
        "render",
        "other",
    )
    samples: dict[str, dict[str, list[float]]] = {
        name: {k: [] for k in parts} for name in [*CONFIGS, "GET /health (HTTP floor)"]
    }
    try:
        print("loading the model ...", file=sys.stderr)
        while thread.is_alive() and app.state.service.worker.state == "loading":
            time.sleep(0.1)
        if app.state.service.worker.state != "ready":
            raise SystemExit(f"the server did not start: {app.state.service.worker.error}")
        client = RawClient("127.0.0.1", port)

        def post(raw: bytes) -> tuple[float, dict[str, float]]:
            t0 = time.perf_counter()
            status, headers, _ = client.request("POST", "/infill", raw)
            wall = (time.perf_counter() - t0) * 1e3
            if status != 200:
                raise SystemExit(f"/infill answered {status}")
            return wall, server_timing(headers["server-timing"])

        requests = editor_requests(Path(args.source), args.requests, args.n_predict)
        post(json.dumps({**requests[0], "n_predict": 0}).encode())  # warm-up
        for i, body in enumerate(requests):
            for name, over in CONFIGS.items():
                raw = json.dumps({**body, **over}).encode()  # encoded before the clock
                wall, timing = post(raw)
                s = samples[name]
                s["wall"].append(wall)
                s["overhead"].append(wall - timing["engine"])
                named = sum(timing[k] for k in ("parse", "queue", "prep", "post", "wake", "render"))
                timing["other"] = timing["app"] - named
                for key in (*parts[3:], "engine"):
                    s[key].append(timing[key])
            t0 = time.perf_counter()
            client.request("GET", "/health")
            floor = (time.perf_counter() - t0) * 1e3
            for key in ("wall", "overhead"):
                samples["GET /health (HTTP floor)"][key].append(floor)
            if (i + 1) % 10 == 0:
                print(f"  {i + 1}/{len(requests)} requests", file=sys.stderr)
        client.close()
    finally:
        server.should_exit = True
        thread.join(60)
    summary = {
        name: {
            "n": len(s["wall"]),
            **{f"{k}_p50_ms": percentile(v, 50) for k, v in s.items() if v},
            **{f"{k}_p95_ms": percentile(v, 95) for k, v in s.items() if v},
        }
        for name, s in samples.items()
    }
    return {"model": args.model, "source": args.source, "requests": args.requests,
            "n_predict": args.n_predict, "configs": summary}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="target GGUF with FIM tokens")
    parser.add_argument("--draft", help="draft GGUF (optional)")
    parser.add_argument("--source", default=str(corpus.stdlib_path("argparse.py")))
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--n-predict", type=int, default=4)
    parser.add_argument("--ctx", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    result = run(args)
    cols = ("wall", "engine", "overhead", "app", "parse", "queue", "prep", "post", "wake",
            "render", "other")  # fmt: skip
    lines = [f"{'p50 ms':30} {'n':>4} " + " ".join(f"{c:>8}" for c in cols) + f" {'ovh p95':>8}"]
    for name, s in result["configs"].items():
        cells = " ".join(
            f"{s[f'{c}_p50_ms']:>8.2f}" if f"{c}_p50_ms" in s else f"{'':>8}" for c in cols
        )
        lines.append(f"{name:30} {s['n']:>4} {cells} {s['overhead_p95_ms']:>8.2f}")
    full, lean = (result["configs"][n]["overhead_p50_ms"] for n in CONFIGS)
    lines.append(f"overhead ratio, full answer / response_fields: {full / lean:.2f}")
    table_text = "\n".join(lines)
    print(table_text)
    harness.record("overhead", argv, table_text, result, json_path=args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
