#!/usr/bin/env python3
"""Load benchmark of `kiln serve`: N concurrent streaming clients (1, 8, 32, 64 by default), each
sending requests one after another (prompt of about --prompt-words words, --max-tokens tokens,
end-of-sequence ignored, greedy). Reports per level: requests, time to first token p50/p99 (from
sending the request to the first streamed text), tokens/s over the whole level, and the steady
tokens/s (the server's own token counter, /metrics kiln_batch_tokens_total, over the middle 80 %
of the level), and the decode tokens/s of that window's decode steps alone (tokens over the
steps' wall time, kiln_batch_step_microseconds_total: prefills of joining requests excluded).
Standard library only (http.client, threads).

  python3 bench/serve_load.py --kiln target/release/kiln --model DIR [--batch 64] [--json F]
"""
import argparse
import http.client
import json
import re
import statistics
import subprocess
import sys
import threading
import time

WORDS = ("the quick brown fox jumps over a lazy dog while seven tired owls watch from an old oak "
         "tree and count the stars above a quiet river that runs to the sea").split()


def prompt(i, words):
    return f"Story {i}: " + " ".join(WORDS[(i + k) % len(WORDS)] for k in range(words))


def metrics(addr):
    c = http.client.HTTPConnection(*addr, timeout=30)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+) (\d+)$", text, re.M)}


def metric(addr, name):
    return metrics(addr).get(name, 0)


def one_request(addr, i, args):
    body = json.dumps({"prompt": prompt(i, args.prompt_words), "max_tokens": args.max_tokens, "temperature": 0,
                       "stream": True, "ignore_eos": True})
    c = http.client.HTTPConnection(*addr, timeout=600)
    t0 = time.perf_counter()
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
    first = None
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        if first is None and json.loads(line[6:])["choices"][0].get("text"):
            first = time.perf_counter() - t0
    return first if first is not None else time.perf_counter() - t0


def level(addr, clients, args):
    ttft, errors = [], []
    lock = threading.Lock()
    counter = iter(range(10**9))

    def client():
        for _ in range(args.requests_per_client):
            with lock:
                i = next(counter)
            try:
                t = one_request(addr, clients * 1000 + i, args)
                with lock:
                    ttft.append(t)
            except Exception as e:  # noqa: BLE001 - reported below
                with lock:
                    errors.append(str(e))

    threads = [threading.Thread(target=client) for _ in range(clients)]
    tokens0, t0 = metric(addr, "kiln_batch_tokens_total"), time.perf_counter()
    for t in threads:
        t.start()
    # The steady window: the middle 80 % of an estimate of the level's length, sampled by a
    # watcher that reads the server's token counter.
    samples = []

    def watch():
        while any(t.is_alive() for t in threads):
            m = metrics(addr)
            samples.append((time.perf_counter(), m.get("kiln_batch_tokens_total", 0),
                            m.get("kiln_batch_step_microseconds_total", 0)))
            time.sleep(0.05)

    w = threading.Thread(target=watch)
    w.start()
    for t in threads:
        t.join()
    w.join()
    wall = time.perf_counter() - t0
    tokens = metric(addr, "kiln_batch_tokens_total") - tokens0
    lo, hi = t0 + 0.1 * wall, t0 + 0.9 * wall
    window = [s for s in samples if lo <= s[0] <= hi]
    steady = decode = float("nan")
    if len(window) > 2:
        (ta, na, sa), (tb, nb, sb) = window[0], window[-1]
        steady = (nb - na) / (tb - ta)
        decode = (nb - na) / max((sb - sa) / 1e6, 1e-9)
    after = metrics(addr)
    ttft.sort()
    q = lambda p: ttft[min(len(ttft) - 1, int(p * len(ttft)))] * 1e3 if ttft else float("nan")  # noqa: E731
    return {"clients": clients, "requests": len(ttft), "errors": errors[:3], "error_count": len(errors),
            "ttft_p50_ms": q(0.5), "ttft_p99_ms": q(0.99), "ttft_mean_ms": statistics.mean(ttft) * 1e3 if ttft else None,
            "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall, "steady_tokens_per_s": steady,
            "decode_tokens_per_s": decode, "device_memory_mib": after.get("kiln_device_memory_bytes", 0) / 2**20,
            "rss_mib": after.get("process_resident_memory_bytes", 0) / 2**20}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kiln", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--prompt-words", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--requests-per-client", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=1,
                    help="run the levels this many times (a soak: device memory and RSS after each level)")
    ap.add_argument("--extra", default="", help="more kiln serve arguments")
    ap.add_argument("--json")
    args = ap.parse_args()
    cmd = [args.kiln, "serve", args.model, "--port", "0", "--batch", str(args.batch), "--queue", "1024",
           "--max-length", str(args.max_length)] + args.extra.split()
    server = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        addr = None
        for line in server.stderr:
            sys.stderr.write(line)
            m = re.search(r"listening on http://([\d.]+):(\d+)", line)
            if m:
                addr = (m.group(1), int(m.group(2)))
                break
        if addr is None:
            sys.exit("kiln serve did not start")
        threading.Thread(target=lambda: [None for _ in server.stderr], daemon=True).start()
        level(addr, min(args.batch, 8), argparse.Namespace(**{**vars(args), "requests_per_client": 1}))  # warm-up
        rows = [level(addr, c, args) for _ in range(args.repeat) for c in args.clients]
    finally:
        server.terminate()
        server.wait(timeout=60)
    print(f"kiln serve --batch {args.batch}: prompt ~{args.prompt_words} words, {args.max_tokens} tokens per request, "
          f"{args.requests_per_client} requests per client")
    print("| clients | requests | errors | TTFT p50 ms | TTFT p99 ms | tokens/s (whole level) | tokens/s (steady) "
          "| decode steps' tokens/s | device MiB after | RSS MiB after |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['clients']} | {r['requests']} | {r['error_count']} | {r['ttft_p50_ms']:.1f} | {r['ttft_p99_ms']:.1f} "
              f"| {r['tokens_per_s']:.0f} | {r['steady_tokens_per_s']:.0f} | {r['decode_tokens_per_s']:.0f} "
              f"| {r['device_memory_mib']:.0f} | {r['rss_mib']:.0f} |")
        for e in r["errors"]:
            print("  error:", e)
    if args.json:
        json.dump({"args": vars(args), "levels": rows}, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
