#!/usr/bin/env python3
"""ncu_top.py — the instructions of one profiled kernel where its warps stall most.

Reads the CSV of `ncu --import REPORT --page source --csv --print-source sass` (a report with the
SourceCounters section) on stdin and prints the N instructions with the most warp stall samples:
address, samples, their share, the three largest stall reasons, and the SASS text; first the share of each stall reason.

    ncu --import a.ncu-rep --page source --csv --print-source sass | python3 bench/ncu_top.py [N]
"""
import csv
import sys


def main() -> int:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 40
    rows = list(csv.reader(sys.stdin))
    head = next((i for i, r in enumerate(rows) if any("Source" == c or "Address" == c for c in r)), None)
    if head is None:
        print("no source table in the input", file=sys.stderr)
        return 1
    cols = rows[head]
    body = [r for r in rows[head + 1:] if len(r) == len(cols)]
    total_col = next((i for i, c in enumerate(cols) if c.startswith("Warp Stall Sampling (All")), None)
    if total_col is None:
        print("no 'Warp Stall Sampling (All Samples)' column; columns: " + ", ".join(cols), file=sys.stderr)
        return 1
    src = cols.index("Source") if "Source" in cols else 1
    addr = cols.index("Address") if "Address" in cols else 0
    reasons = [i for i, c in enumerate(cols) if c.startswith("stall_") or c.startswith("smsp__pcsamp_warps_issue_stalled")]

    def num(x: str) -> float:
        try:
            return float(x.replace(",", ""))
        except ValueError:
            return 0.0

    total = sum(num(r[total_col]) for r in body) or 1.0

    def addr_of(r: list) -> int:
        try:
            return int(r[addr], 16)
        except ValueError:
            return 0

    base = min((addr_of(r) for r in body), default=0)
    print(f"{len(body)} instructions, {total:.0f} stall samples (addresses from the function's start)")
    sums = sorted(((sum(num(r[i]) for r in body), cols[i]) for i in reasons if "(Not Issued)" not in cols[i]), reverse=True)
    print("by reason: " + ", ".join(f"{c.replace('stall_', '')} {100 * v / total:.1f}%" for v, c in sums if v > 0))
    for r in sorted(body, key=lambda r: -num(r[total_col]))[:n]:
        top = sorted(((num(r[i]), cols[i]) for i in reasons), reverse=True)[:3]
        why = ", ".join(f"{c.replace('smsp__pcsamp_warps_issue_stalled_', '')} {v:.0f}" for v, c in top if v > 0)
        print(f"{addr_of(r) - base:#07x} {num(r[total_col]):6.0f} {100 * num(r[total_col]) / total:5.1f}%  {r[src].strip()[:70]:70}  {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
