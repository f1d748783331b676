"""bench/serve_gpu.py's runs of one day in one file, and their table:

    python3 bench/serve_summary.py bench/results/2026-11-27-serve

Reads DIR/raw/*/serve.json (one run each, as bench/serve_gpu.py wrote it), writes DIR/serve.json:
{"runs": {RUN: the run's machine}, "rows": every row, with its run's name under "run"}, and
prints a Markdown table: per run and model, each start's first token beside the cold start's
with the same page cache (the ratio), the driver's own restore, and how the restore's time split.
"""

import json
import sys
from pathlib import Path
from typing import Any

SPLIT = ("pos_started_s", "prepare", "criu_restore", "verify_wait", "restore", "all_back_at")


def merged(folder: Path) -> dict[str, Any]:
    runs: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    for f in sorted(folder.glob("raw/*/serve.json")):
        run = f.parent.name
        d = json.loads(f.read_text())
        runs[run] = d["machine"]
        rows += [{"run": run, **r} for r in d["rows"]]
    return {"runs": runs, "rows": rows}


def table(rows: list[dict[str, Any]]) -> list[str]:
    out = ["| run | GPU | model | case | cache | first token s | cold s | cold / it | exact | "
           "driver alone s | split (pos start, prepare, CRIU, checksums' wait, driver, "
           "memory all back) |", "|" + "---|" * 11]
    for r in rows:
        if r["case"] == "cold" or r.get("ttft_s") is None:
            continue
        sp = r.get("split") or {}
        split = ", ".join(f"{sp[k]:.2f}" if isinstance(sp.get(k), (int, float)) else "-"
                          for k in SPLIT)
        ratio = r["cold_ttft_s"] / r["ttft_s"] if r.get("cold_ttft_s") else None
        out.append(f"| {r['run']} | {r['gpu'].replace('NVIDIA ', '')} | {r['model']} | "
                   f"{r['case']} | {r['cache']} | {r['ttft_s']:.2f} | {r['cold_ttft_s']:.2f} | "
                   f"{ratio:.1f}x | {r['exact']} | {r.get('driver_restore_s') or '-'} | "
                   f"{split} |")
    return out


def main() -> None:
    folder = Path(sys.argv[1])
    m = merged(folder)
    (folder / "serve.json").write_text(json.dumps(m, indent=1) + "\n")
    print("\n".join(table(m["rows"])))


if __name__ == "__main__":
    main()
