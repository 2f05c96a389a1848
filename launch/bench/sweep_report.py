"""The report of `bench sweep`: results.md (a table, with throughput per device against TP=1) and
PNG plots (throughput against the swept load, one line per TP size; for `serve`, latency against
throughput)."""
from __future__ import annotations

import math
import os

FIGURES = {"latency": ["output_tok_s", "decode_tok_s", "decode_step_ms", "avg_latency_s"],
           "throughput": ["output_tok_s", "requests_per_s"],
           "serve": ["output_tok_s", "requests_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms"]}
X_ORDER = ("batch_size", "request_rate", "num_prompts", "max_concurrency", "input_len", "prefix_len")


def _tp(rec: dict) -> int:
    return int(rec["point"].get("tensor_parallel_size", 1))


def scaling(records: list[dict]) -> dict[int, float]:
    """Throughput per device relative to TP=1 for the same point, by record index."""
    base = {}
    for rec in records:
        if rec["status"] == "ok" and _tp(rec) == 1:
            key = tuple(sorted((k, str(v)) for k, v in rec["point"].items() if k != "tensor_parallel_size"))
            base[key] = rec["figures"]["output_tok_s"]
    out = {}
    for i, rec in enumerate(records):
        key = tuple(sorted((k, str(v)) for k, v in rec["point"].items() if k != "tensor_parallel_size"))
        if rec["status"] == "ok" and key in base and base[key] > 0:
            out[i] = rec["figures"]["output_tok_s"] / _tp(rec) / base[key]
    return out


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:,.2f}" if abs(v) < 1e5 else f"{v:,.0f}"
    return str(v)


def table(records: list[dict], spec: dict) -> str:
    names = list(spec["grid"])
    figs = FIGURES[spec["kind"]]
    scale = scaling(records)
    head = names + ["status"] + figs + ["per GPU vs TP=1", "device", "node"]
    rows = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for i, rec in enumerate(records):
        f = rec.get("figures", {})
        cells = [_cell(rec["point"].get(n)) for n in names] + [rec["status"]]
        cells += [_cell(f[k]) if k in f else "" for k in figs]
        cells += [f"{scale[i]:.2f}" if i in scale else "", f"{rec.get('device_name', '')} x{rec.get('devices', '')}"
                  if rec["status"] == "ok" else rec.get("error", "")[:120], rec.get("node", "")]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _x_name(spec: dict) -> str | None:
    grid = [n for n in spec["grid"] if n != "tensor_parallel_size"]
    for n in X_ORDER:
        if n in grid:
            return n
    return grid[0] if grid else None


def _x_value(v):
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return v
    return str(v)


def plots(records: list[dict], spec: dict, out_dir: str) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ok = [r for r in records if r["status"] == "ok"]
    xname = _x_name(spec)
    written = []
    if not ok or xname is None:
        return written
    # One line per TP size and per value of every other swept parameter.
    others = [n for n in spec["grid"] if n not in (xname, "tensor_parallel_size")]
    series: dict[str, list[dict]] = {}
    for r in ok:
        label = ", ".join([f"TP={_tp(r)}"] + [f"{n}={r['point'].get(n)}" for n in others])
        series.setdefault(label, []).append(r)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    finite = [r["point"][xname] for r in ok if isinstance(r["point"].get(xname), (int, float))
              and math.isfinite(r["point"][xname])]
    inf_at = max(finite) * 2 if finite else 1.0
    for label, recs in sorted(series.items()):
        pts = []
        for r in recs:
            x = _x_value(r["point"].get(xname))
            if isinstance(x, float) and math.isinf(x):
                x = inf_at
            pts.append((x, r["figures"]["output_tok_s"]))
        pts.sort(key=lambda p: (isinstance(p[0], str), p[0]))
        ax.plot([str(p[0]) if isinstance(p[0], str) else p[0] for p in pts], [p[1] for p in pts], marker="o",
                label=label)
    ax.set_xlabel(xname + (" (inf plotted at twice the largest)" if any(
        isinstance(r["point"].get(xname), float) and math.isinf(r["point"][xname]) for r in ok) else ""))
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"{spec['kind']}: {os.path.basename(spec['model'].rstrip('/'))}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    written.append(_save(plt, fig, os.path.join(out_dir, "throughput.png")))
    if spec["kind"] == "serve":
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for ax, what in zip(axes, ("ttft", "itl")):
            for label, recs in sorted(series.items()):
                recs = sorted(recs, key=lambda r: r["figures"]["output_tok_s"])
                xs = [r["figures"]["output_tok_s"] for r in recs]
                for q, style in (("p50", "-o"), ("p99", "--o")):
                    ax.plot(xs, [r["figures"][f"{what}_{q}_ms"] for r in recs], style, label=f"{label} {q}")
            ax.set_xlabel("output tokens/s")
            ax.set_ylabel(f"{what.upper()} (ms)")
            ax.grid(True, alpha=0.3)
            ax.legend()
        written.append(_save(plt, fig, os.path.join(out_dir, "latency.png")))
    return written


def _save(plt, fig, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(records: list[dict], spec: dict, out_dir: str) -> str:
    text = table(records, spec)
    fixed = ", ".join(f"{k}={v}" for k, v in spec["fixed"].items()) or "none"
    pngs = plots(records, spec, out_dir)
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(f"# bench sweep: {spec['kind']} on {spec['model']}\n\nfixed: {fixed}\n\n{text}\n")
        for p in pngs:
            f.write(f"\n![{os.path.basename(p)}]({os.path.basename(p)})\n")
    return text
