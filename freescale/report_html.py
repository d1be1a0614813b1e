"""report.json as one self-contained HTML page: inline SVG plots, inline CSS, no scripts, no external files.

Each plot is a ``<figure id="plot-...">`` holding one ``<svg>``: the length histogram, how far composition
moved samples, the per-step lockstep bubble, the worst step's (rank, microbatch) heatmaps, the max/mean CDF,
and the GPU-hours lost. Points carry ``<title>`` tooltips with their values.
"""

from __future__ import annotations

import html

from freescale.planning import steps_text

COLORS = {"balanced": "#1b9e77", "naive": "#d95f02", "zigzag": "#7570b3", "kk": "#e7298a", "lpt": "#66a61e"}
W, H = 640, 300  # plot size in px
PAD_L, PAD_R, PAD_T, PAD_B = 64, 16, 12, 40
STYLE = """body{font-family:system-ui,sans-serif;margin:24px auto;max-width:760px;color:#222}
figure{margin:24px 0}figcaption{font-size:14px;color:#444;margin-top:4px}svg text{font-size:11px;fill:#333}
table{border-collapse:collapse;font-size:14px}td,th{padding:3px 10px;border-bottom:1px solid #ddd;text-align:right}
th:first-child,td:first-child{text-align:left}.note{font-size:13px;color:#555}"""


def render_html(report: dict) -> str:
    """The whole page for an ``analysis.report.build_report`` dict (plus ``dataset``)."""
    cfg = report["config"]
    esc = html.escape
    title = f"FreeScale balancing report: {report.get('dataset', {}).get('path', '')}"
    head = (f"<p>{report['histories']} histories, {report['tokens']} events; {report['steps']} steps of "
            f"{cfg['samples_per_step']} onto {cfg['ranks']} ranks &times; {cfg['microbatches']} microbatches; "
            f"cost model {esc(_cost_text(cfg['cost_model']))}; seed {cfg['seed']}"
            f"{'' if cfg['shuffle'] else ' (file order)'}; the loader's steps, "
            f"{esc(steps_text(cfg['compose'], cfg['compose_window'], report['moved_steps']))}"
            f"{_skips_text(report.get('dataset', {}), cfg)}.</p>")
    body = [f"<h1>{esc(title)}</h1>", head, _summary_table(report), _histogram(report["histogram"]),
            _moved_plot(report["moved_steps"], cfg), _bubble_plot(report["bubble_fraction"]),
            _heatmaps(report["worst_step"]), _cdf_plot(report["cdf"]), _gpu_hours(report)]
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{esc(title)}</title><style>{STYLE}</style></head><body>\n" + "\n".join(body)
            + "\n</body></html>\n")


def _skips_text(dataset: dict, cfg: dict) -> str:
    """Rows the loader skips (per reason) and truncates, for the page's head line."""
    parts = [f"{n} {html.escape(reason)}" for reason, n in (dataset.get("skipped") or {}).items()]
    text = f"; rows skipped: {', '.join(parts)}" if parts else ""
    if dataset.get("rows_truncated"):
        text += (f"; {dataset['rows_truncated']} histories truncated to {cfg.get('max_seq_len')} events "
                 f"({dataset['events_truncated']} events cut)")
    return text


def _cost_text(cost_model: dict | None) -> str:
    if cost_model is None:
        return "L^2"
    return f"{cost_model['quadratic']:.4g} L^2 + {cost_model['linear']:.4g} L + {cost_model['constant']:.4g}"


def _summary_table(report: dict) -> str:
    hours, share = report["gpu_hours_lost"], report["epoch_bubble_fraction"]
    rows = []
    for m, bubbles in report["bubble_fraction"].items():
        ratio = report["max_over_mean"][m]
        mean_b = sum(bubbles) / len(bubbles) if bubbles else 0.0
        rows.append(f"<tr><td>{m}</td><td>{mean_b:.4f}</td><td>{max(bubbles, default=0.0):.4f}</td>"
                    f"<td>{share[m]:.2%}</td><td>{(sum(ratio) / len(ratio) if ratio else 1.0):.4f}</td>"
                    f"<td>{'&ndash;' if hours is None else f'{hours[m]:.4g}'}</td></tr>")
    steps = ("<code>naive</code> plans the plain shuffled order's steps (what a DistributedSampler gives), the "
             "others the loader's composed steps." if report["config"]["compose"] else
             "Every method plans the same steps: the plain shuffled order's (composition off).")
    return ("<table><tr><th>method</th><th>bubble mean</th><th>bubble worst</th><th>share of GPU time</th>"
            "<th>max/mean mean</th><th>GPU-hours lost / epoch</th></tr>" + "".join(rows) + "</table>"
            f'<p class="note">{steps} Share of GPU time: the epoch\'s lockstep idle time over its GPU time, '
            "R &Sigma;<sub>steps</sub> &Sigma;<sub>j</sub> max<sub>r</sub> C[r,j].</p>")


def _figure(plot_id: str, svg: str, caption: str) -> str:
    return f'<figure id="plot-{plot_id}">{svg}<figcaption>{caption}</figcaption></figure>'


def _svg(inner: list[str], width: int = W, height: int = H) -> str:
    return (f'<svg width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}">' + "".join(inner) + "</svg>")


def _scale(lo: float, hi: float, a: float, b: float):
    """Linear map of [lo, hi] onto pixels [a, b] (a constant map when hi == lo)."""
    span = hi - lo
    return (lambda v: a + (v - lo) / span * (b - a)) if span > 0 else (lambda v: (a + b) / 2)


def _axes(xlabel: str, ylabel: str, yticks: list[tuple[float, str]], xticks: list[tuple[float, str]]) -> list[str]:
    """Frame, tick labels (already in pixels) and axis titles."""
    x0, x1, y0, y1 = PAD_L, W - PAD_R, H - PAD_B, PAD_T
    out = [f'<rect x="{x0}" y="{y1}" width="{x1 - x0}" height="{y0 - y1}" fill="none" stroke="#999"/>']
    out += [f'<text x="{x0 - 4}" y="{y + 4:.1f}" text-anchor="end">{t}</text>' for y, t in yticks]
    out += [f'<text x="{x:.1f}" y="{y0 + 14}" text-anchor="middle">{t}</text>' for x, t in xticks]
    out.append(f'<text x="{(x0 + x1) / 2}" y="{H - 6}" text-anchor="middle">{xlabel}</text>')
    out.append(f'<text transform="translate(14 {(y0 + y1) / 2}) rotate(-90)" text-anchor="middle">{ylabel}</text>')
    return out


def _ticks(lo: float, hi: float, to_px, n: int = 5, fmt: str = "{:.3g}") -> list[tuple[float, str]]:
    values = [lo + (hi - lo) * i / (n - 1) for i in range(n)] if hi > lo else [lo]
    return [(to_px(v), fmt.format(v)) for v in values]


def _legend(methods) -> str:
    items = "".join(f'<span style="color:{COLORS.get(m, "#000")}">&#9632; {m}</span> ' for m in methods)
    return f"<div>{items}</div>"


def _bar_chart(counts: list[int], labels: list[str], titles: list[str], xlabel: str, ylabel: str) -> str:
    """One bar per count, ``labels[i]`` at its left edge (about 12 shown), ``titles[i]`` its tooltip."""
    top = max(counts, default=0) or 1
    to_y = _scale(0, top, H - PAD_B, PAD_T)
    width = (W - PAD_L - PAD_R) / len(counts)
    bars = [f'<rect x="{PAD_L + i * width + 1:.1f}" y="{to_y(c):.1f}" width="{max(width - 2, 1):.1f}" '
            f'height="{to_y(0) - to_y(c):.1f}" fill="#4a78b0"><title>{titles[i]}: {c}</title></rect>'
            for i, c in enumerate(counts)]
    step = max(1, len(labels) // 12)
    xticks = [(PAD_L + i * width, labels[i]) for i in range(0, len(labels), step)]
    return _svg(bars + _axes(xlabel, ylabel, _ticks(0, top, to_y, fmt="{:.0f}"), xticks))


def _histogram(hist: dict) -> str:
    edges, counts = hist["edges"], hist["counts"]
    svg = _bar_chart(counts, [str(e) for e in edges], [f"[{lo}, {hi})" for lo, hi in zip(edges, edges[1:])],
                     "history length (log2 bins [2^k, 2^(k+1)))", "histories")
    return _figure("histogram", svg, "Length histogram: histories per power-of-two length bin.")


def _moved_plot(moved: dict, cfg: dict) -> str:
    counts = moved["counts"]
    svg = _bar_chart(counts, [str(d) for d in range(len(counts))], [f"moved {d} steps" for d in range(len(counts))],
                     "steps moved from the shuffled order's step", "histories")
    if not cfg["compose"]:
        return _figure("moved", svg, "Steps not composed (<code>--no-compose</code>): every history stays in its "
                                     "shuffled order's step.")
    share = 1.0 - counts[0] / max(sum(counts), 1)
    return _figure("moved", svg, f"How far composition moved histories from their step of the shuffled order, "
                                 f"within windows of {cfg['compose_window']} steps: {share:.1%} moved; "
                                 f"mean {moved['mean']:.3f} steps, max {moved['max']}.")


def _lines(series: dict[str, list[float]], to_x, to_y, steps: bool = False) -> list[str]:
    out = []
    for m, ys in sorted(series.items(), key=lambda item: item[0] == "balanced"):  # ours drawn last, on top
        if steps:  # a CDF: x is the sorted value, y the fraction at or below it
            pts = [(to_x(ys[0]), to_y(0))] + [(to_x(v), to_y((i + 1) / len(ys))) for i, v in enumerate(ys)]
        else:
            pts = [(to_x(i), to_y(v)) for i, v in enumerate(ys)]
        text = " ".join(f"{x:.1f},{y:.1f}" for x, y in pts)
        out.append(f'<polyline fill="none" stroke="{COLORS.get(m, "#000")}" stroke-width="1.5" points="{text}">'
                   f"<title>{m}</title></polyline>")
    return out


def _bubble_plot(bubbles: dict[str, list[float]]) -> str:
    n = max((len(v) for v in bubbles.values()), default=0)
    top = max((max(v, default=0.0) for v in bubbles.values()), default=0.0) or 1.0
    to_x = _scale(0, max(n - 1, 1), PAD_L, W - PAD_R)
    to_y = _scale(0, top, H - PAD_B, PAD_T)
    xticks = [(to_x(i), str(i)) for i in sorted({round((n - 1) * k / 4) for k in range(5)})]  # whole steps
    svg = _svg(_lines(bubbles, to_x, to_y) + _axes("step", "lockstep bubble fraction", _ticks(0, top, to_y), xticks))
    return _figure("bubble", svg, _legend(bubbles) + "Per-step lockstep bubble fraction "
                   "1 &minus; &Sigma;<sub>j</sub> mean<sub>r</sub> C[r,j] / &Sigma;<sub>j</sub> max<sub>r</sub> C[r,j].")


def _cdf_plot(cdf: dict[str, list[float]]) -> str:
    top = max((v[-1] for v in cdf.values() if v), default=1.0)
    hi = top if top > 1.0 else 1.0 + 1e-3
    to_x = _scale(1.0 - 0.02 * (hi - 1.0), hi, PAD_L, W - PAD_R)  # a margin keeps lines at 1 off the frame
    to_y = _scale(0, 1, H - PAD_B, PAD_T)
    svg = _svg(_lines(cdf, to_x, to_y, steps=True) + _axes("max / mean bin cost", "fraction of steps",
                                                            _ticks(0, 1, to_y), _ticks(1.0, hi, to_x)))
    return _figure("cdf", svg, _legend(cdf) + "CDF over steps of max/mean (1 = perfectly even bins).")


def _heat(value: float, top: float) -> str:
    """White (0) to dark blue (top)."""
    t = value / top if top > 0 else 0.0
    r, g, b = (round(a + (z - a) * t) for a, z in ((247, 8), (251, 48), (255, 107)))
    return f"rgb({r},{g},{b})"


def _heatmaps(worst: dict | None) -> str:
    if worst is None:
        return _figure("heatmap", _svg([]), "No steps: the dataset holds no histories.")
    loads = worst["loads"]
    top = max(max(max(row) for row in grid) for grid in loads.values())
    panel_w, panel_h = (W - 3 * PAD_R) / len(loads), H - PAD_T - PAD_B
    out = []
    for k, (method, grid) in enumerate(loads.items()):
        ranks, mbs = len(grid), len(grid[0])
        cw, ch = (panel_w - PAD_L / 2) / mbs, panel_h / ranks
        x0 = PAD_R + k * (panel_w + PAD_R) + PAD_L / 2
        out.append(f'<text x="{x0 + (panel_w - PAD_L / 2) / 2:.1f}" y="{H - 20}" text-anchor="middle">{method}: '
                   f'bubble {worst["bubble_fraction"][method]:.4f} (x: microbatch, y: rank)</text>')
        out += [f'<rect x="{x0 + j * cw:.2f}" y="{PAD_T + r * ch:.2f}" width="{cw:.2f}" height="{ch:.2f}" '
                f'fill="{_heat(v, top)}"><title>{method} rank {r} microbatch {j}: {v:.6g}</title></rect>'
                for r, row in enumerate(grid) for j, v in enumerate(row)]
    caption = (f"Load C[rank, microbatch] of step {worst['index']} ({worst['samples']} samples), the step with "
               f"the largest <code>balanced</code> bubble, under balanced and naive (each its own step at that "
               f"index: naive the shuffled order's); one colour scale (white 0, dark blue {top:.4g}).")
    return _figure("heatmap", _svg(out), caption)


def _gpu_hours(report: dict) -> str:
    hours, cfg = report["gpu_hours_lost"], report["config"]
    if hours is None:
        return ("<section id=\"gpu-hours\"><h2>GPU-hours lost to bubbles</h2><p class=\"note\">No calibration: pass "
                "<code>--seconds-per-cost</code> or <code>--cost-model</code> to project GPU-hours. Lost time in "
                "cost units per epoch: " + ", ".join(f"{m} {v:.4g}" for m, v in report["lost_cost_units"].items())
                + ".</p></section>")
    top = max(hours.values()) or 1.0
    bar_h, width = 22, W - PAD_L - PAD_R - 80
    bars = []
    for i, (m, v) in enumerate(hours.items()):
        y = 8 + i * (bar_h + 6)
        bars.append(f'<text x="{PAD_L - 4}" y="{y + 15}" text-anchor="end">{m}</text>'
                    f'<rect x="{PAD_L}" y="{y}" width="{max(v / top * width, 0.5):.1f}" height="{bar_h}" '
                    f'fill="{COLORS.get(m, "#000")}"><title>{m}: {v:.6g} GPU-hours</title></rect>'
                    f'<text x="{PAD_L + v / top * width + 4:.1f}" y="{y + 15}">{v:.4g} h</text>')
    svg = _svg(bars, height=16 + len(hours) * (bar_h + 6))
    note = (f"Lost GPU-seconds of a step = R &times; (lockstep step time) &minus; &Sigma; bin times = "
            f"s &middot; (R &Sigma;<sub>j</sub> max<sub>r</sub> C[r,j] &minus; &Sigma;<sub>r,j</sub> C[r,j]), "
            f"summed over the epoch's steps and divided by 3600; s = {cfg['seconds_per_cost']:.6g} s per cost unit, "
            f"R = {cfg['ranks']}. Assumes one GPU per rank, a collective after every microbatch (lockstep), a "
            f"bin's time = s &times; its cost (no communication, launch or data-loading time), and that every "
            f"idle GPU-second is lost.")
    return _figure("gpu-hours", svg, "<b>Projected GPU-hours lost to bubbles per epoch.</b> "
                   f'<span class="note">{note}</span>')

