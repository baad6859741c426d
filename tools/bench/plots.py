"""PNG plots where a curve says more than a table: prefill tok/s against P per chunk, decode tok/s
against k per workload, aggregate decode against streams. Small files (one figure each, 110 dpi)."""

from __future__ import annotations

from pathlib import Path

DPI = 110


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _measured(points):
    return [p for p in points or [] if "skipped" not in p and "error" not in p]


def _title(r: dict, what: str) -> str:
    run = r["run"]
    return f"{what} — {run['shape']} on {run['device']['name']} ({run['mode']}, {run['date'][:10]})"


def _finish(plt, fig, ax, title: str, path: Path, **legend) -> bool:
    ax.grid(alpha=0.3)
    ax.legend(**legend)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return True


def write_all(r: dict, out: Path) -> list[str]:
    written = []
    for name, fn in (("prefill.png", prefill), ("decode.png", decode), ("concurrency.png", concurrency)):
        if fn(r, out / name):
            written.append(name)
    return written


def prefill(r: dict, path: Path) -> bool:
    pts = _measured(r["sections"].get("prefill", {}).get("points"))
    if not pts:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for c in sorted({p["chunk"] for p in pts}):
        row = sorted((p for p in pts if p["chunk"] == c), key=lambda p: p["P"])
        ax.plot([p["P"] for p in row], [p["prefill_tok_s_peak"] for p in row], "o-", label=f"ninfer chunk {c}")
        ax.plot([p["P"] for p in row], [p["prefill_tok_s_median"] for p in row], ".", color="grey", alpha=0.5)
    peer = _measured(r["sections"].get("peer", {}).get("prefill"))
    if peer:
        ax.plot([p["P"] for p in peer], [p["tok_s_peak"] for p in peer], "kx--", label="transformers (sdpa)")
    ax.set_xscale("log", base=2)
    ticks = sorted({p["P"] for p in pts} | {p["P"] for p in peer})
    ax.set_xticks(ticks, [f"{t // 1024}k" if t >= 1024 else str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("prompt tokens P (computed)")
    ax.set_ylabel("prefill tok/s (peak; dots: median)")
    ax.set_ylim(bottom=0)
    return _finish(plt, fig, ax, _title(r, "prefill"), path, fontsize=8)


def decode(r: dict, path: Path) -> bool:
    secs = r["sections"]
    acc = secs.get("acceptance", {})
    dec = _measured(secs.get("decode", {}).get("points"))
    ctx = acc.get("implied_context") or r.get("plan", {}).get("reference", {}).get("decode_context")
    measured = sorted((p for p in dec if p["context"] == ctx and not p.get("draft_vocab")), key=lambda p: p["draft_tokens"])
    if not measured:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    k0 = acc.get("k0_decode_tok_s")
    entries = [e for e in acc.get("results", []) if e.get("implied_decode_tok_s")]
    for i, w in enumerate(sorted({e["workload"] for e in entries})):
        for t in sorted({e["temperature"] for e in entries}):
            row = sorted((e for e in entries if e["workload"] == w and e["temperature"] == t), key=lambda e: e["k"])
            xs = ([0] if k0 else []) + [e["k"] for e in row]
            ys = ([k0] if k0 else []) + [e["implied_decode_tok_s"] for e in row]
            ax.plot(xs, ys, "o-" if t == 0 else "s--", color=f"C{i}", label=f"{w} T={t:g} (implied)")
    ax.plot([p["draft_tokens"] for p in measured], [p["decode_tok_s_peak"] for p in measured], "k^:",
            label="measured, random weights")
    floor = [p for p in measured if p["draft_tokens"] == 0 and p.get("floor_ms")]
    if floor:
        ax.axhline(1e3 / floor[0]["floor_ms"], color="red", lw=0.8, ls=":", label="memory roofline, k=0")
    ax.set_xlabel("draft tokens k")
    ax.set_ylabel("decode tok/s, batch 1")
    ax.set_xticks(sorted({p["draft_tokens"] for p in measured} | {e["k"] for e in entries}))
    ax.set_ylim(bottom=0)
    return _finish(plt, fig, ax, _title(r, f"decode at context {ctx}"), path, fontsize=7, ncol=2)


def concurrency(r: dict, path: Path) -> bool:
    pts = sorted(_measured(r["sections"].get("concurrency", {}).get("points")), key=lambda p: p["streams"])
    if len(pts) < 2:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    ns = [p["streams"] for p in pts]
    ax.plot(ns, [p["aggregate_tok_s"] for p in pts], "o-", label="aggregate")
    ax.plot(ns, [p["per_stream_tok_s_mean"] for p in pts], "s--", label="per stream")
    one = [p for p in pts if p["streams"] == 1]
    if one:
        ax.plot(ns, [n * one[0]["aggregate_tok_s"] for n in ns], ":", color="grey", label="N x one stream")
    ax.set_xlabel("streams N")
    ax.set_ylabel("decode tok/s")
    ax.set_xticks(ns)
    return _finish(plt, fig, ax, _title(r, "concurrent decode"), path, fontsize=8)
