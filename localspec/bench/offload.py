"""The offload path, shown end to end through the commands a user runs.

``localspec plan`` on this machine (the devices llama.cpp sees, all layers offloaded or not),
``localspec up`` serving a local pair with every layer on the device, greedy /infill answers
with speculation against the same requests with it off (``speculative.n_max`` 0), and
``localspec status``'s planned beside allocated memory per device. Prints a table and writes
JSON. On a CPU-only machine with llama.cpp built for Vulkan this runs on Mesa's lavapipe
(``GGML_VK_VISIBLE_DEVICES=0``: llama.cpp skips a CPU-type Vulkan device otherwise).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from localspec.bench import harness
from localspec.bench.anchor import free_port
from localspec.bench.command import bench_parser

# short FIM prompts: the device decodes slowly (lavapipe: a few tokens/s), and each answer is
# asked twice
PROMPTS = (
    ("def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n"),
    ("import os\n\ndef list_files(path):\n    ", "\n"),
    ("class Point:\n    def __init__(self, x, y):\n        self.x = x\n        ", "\n"),
    ("for i in range(10):\n    if i % 2 == 0:\n        ", "\n"),
)


def _cli(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "localspec", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _infill(base: str, prefix: str, suffix: str, n_predict: int, spec: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "input_prefix": prefix,
        "input_suffix": suffix,
        "n_predict": n_predict,
        "top_k": 1,  # greedy: speculation must not change the answer
        "temperature": 0.0,
        "cache_prompt": False,
        # every answer runs to n_predict, so the draft has tokens to offer whatever the
        # model's end token would have cut short
        "ignore_eos": True,
    }
    if spec:
        body["speculative.p_min"] = 0.0  # a draft however unsure its model is: drafts happen
    else:
        body["speculative.n_max"] = 0
    t0 = time.perf_counter()
    r = httpx.post(f"{base}/infill", json=body, timeout=600)
    r.raise_for_status()
    answer = r.json()
    timings = answer.get("timings") or {}
    return {
        "content": answer["content"],
        "tokens": answer.get("tokens_predicted"),
        "draft_n": timings.get("draft_n", 0),
        "draft_n_accepted": timings.get("draft_n_accepted", 0),
        "draft_n_verif_steps": timings.get("draft_n_verif_steps", 0),
        "draft_n_accepted_per_pos": timings.get("draft_n_accepted_per_pos", []),
        "seconds": round(time.perf_counter() - t0, 2),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    plan = _cli("plan", "--json", timeout=120)
    if plan.returncode != 0:
        raise SystemExit(f"localspec plan failed: {plan.stderr}")
    planned = json.loads(plan.stdout)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    up = ["up", "--detach", "--port", str(port), "--ctx-size", str(args.ctx_size)]
    up += ["--target", args.target, "--gpu-layers", str(args.gpu_layers)]
    # the draft model drafts on every step (auto would price it first, from measured times),
    # then the target verifies: no draft thread, whose offers would follow its timing
    if args.draft:
        up += ["--draft", args.draft, "--spec-mode", "draft", "--spec-pipeline", "off"]
    up += ["--gpu-memory-gb", str(args.gpu_memory_gb)] if args.gpu_memory_gb else []
    started = _cli(*up, timeout=args.timeout)
    if started.returncode != 0:
        raise SystemExit(f"localspec up failed: {started.stderr}{started.stdout}")
    try:
        pairs = []
        for prefix, suffix in PROMPTS[: args.prompts]:
            spec = _infill(base, prefix, suffix, args.n_predict, spec=True)
            plain = _infill(base, prefix, suffix, args.n_predict, spec=False)
            pairs.append({"prefix": prefix, "speculative": spec, "target_only": plain})
        status = json.loads(_cli("status", "--port", str(port), "--json", timeout=60).stdout)
        status_text = _cli("status", "--port", str(port), timeout=60).stdout
    finally:
        _cli("down", "--port", str(port), timeout=60)
    llama = (status.get("props") or {}).get("llama_cpp") or {}
    return {
        "plan": {
            k: planned.get(k)
            for k in ("hardware", "backends", "llama_devices", "pair_id", "target_ngl")
        }
        | {"target_layers": planned.get("target_layers"), "memory": planned.get("memory")},
        "served": {"target": args.target, "draft": args.draft, "gpu_layers": args.gpu_layers},
        "backends": llama.get("backends"),
        "memory": llama.get("memory"),
        "answers": pairs,
        "all_equal": all(p["speculative"]["content"] == p["target_only"]["content"] for p in pairs),
        "drafted": sum(p["speculative"]["draft_n"] for p in pairs),
        "accepted": sum(p["speculative"]["draft_n_accepted"] for p in pairs),
        "speculative": (status.get("props") or {}).get("speculative"),
        "metrics": status.get("metrics"),
        "status_text": status_text,
    }


def render(result: dict[str, Any]) -> str:
    plan = result["plan"]
    lines = [
        f"plan: {plan['pair_id']}, GPU layers {plan['target_ngl']}/{plan['target_layers']}, "
        f"backends {', '.join(plan['backends'] or ())}",
        *(f"  device {d}" for d in plan["llama_devices"] or ()),
        *(
            f"  {r['device'][:40]:<40} {r['used'] / 2**30:.2f} of {r['budget'] / 2**30:.2f} GiB"
            for r in plan["memory"] or ()
        ),
        "",
        f"{'device':<12}{'planned MiB':>12}{'allocated MiB':>15}{'ratio':>8}",
    ]
    for r in result["memory"] or ():
        lines.append(
            f"{r['device']:<12}{r['planned']['total'] / 2**20:>12.1f}"
            f"{r['allocated']['total'] / 2**20:>15.1f}{r['ratio'] or 0:>8.3f}"
        )
    lines += ["", f"{'prompt':<32}{'speculative':>14}{'target only':>14}  equal"]
    for p in result["answers"]:
        s, t = p["speculative"], p["target_only"]
        head = p["prefix"].splitlines()[0][:30]
        lines.append(
            f"{head:<32}{s['seconds']:>12.1f} s{t['seconds']:>12.1f} s  "
            f"{s['content'] == t['content']} (drafted {s['draft_n']}, accepted "
            f"{s['draft_n_accepted']})"
        )
    lines.append(f"all equal: {result['all_equal']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = bench_parser(
        "localspec bench offload",
        __doc__,
        "example: GGML_VK_VISIBLE_DEVICES=0 localspec bench offload --target smollm-f16.gguf "
        "--draft smollm-q4_1.gguf --json offload.json",
    )
    ap.add_argument("--target", required=True, help="target GGUF (with FIM tokens)")
    ap.add_argument("--draft", help="draft GGUF")
    ap.add_argument("--gpu-layers", type=int, default=-1, help="default -1: all")
    ap.add_argument("--gpu-memory-gb", type=float, help="cap the device (limits.gpu_memory_gb)")
    ap.add_argument("--ctx-size", type=int, default=1024)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    ap.add_argument("--n-predict", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=900, help="for up to be ready (s)")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)
    result = run(args)
    table = render(result)
    print(table)
    harness.record("offload", argv, table, result, json_path=args.json)
    return 0 if result["all_equal"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
