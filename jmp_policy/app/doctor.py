"""`jmp-policy doctor`'s rendering of a `GradientReport`: a text table and a histogram.

The histogram is drawn on a `matplotlib.figure.Figure`, never through
`pyplot`, so the caller's plotting backend is left alone.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from jmp_policy.core.diagnostics import F16_MAX, HEADROOM, GradientReport, diagnose


def _pct(share: float) -> str:
    if share == 0:
        return "0"
    if share < 1e-4:
        return "<0.01%"
    return f"{100 * share:.1f}%" if share < 0.9995 else "100%"


def _log2(x: float) -> str:
    if not (x > 0 and math.isfinite(x)):
        return "-"
    return f"2^{math.log2(x):.1f}"


def report_text(r: GradientReport) -> str:
    """The report as a table with its recommendation, for a terminal."""
    return "\n".join([*_table(r), "", *_float16_and_bfloat16(r), _recommendation(r),
                      *_matmul_lines(r)])  # fmt: skip


def _table(r: GradientReport) -> list[str]:
    """Each gradient array's shares of lost, subnormal and overflowing values."""
    header = (
        "path",
        "shape",
        "zero",
        "f16 <2^-24",
        "f16 <2^-14",
        "f16 >65504",
        "bf16 <2^-133",
        "bf16 >max",
        "max|g|",
        "min|g|>0",
    )
    rows = [
        (
            s.path,
            "x".join(map(str, s.shape)) or "-",
            _pct(s.zero),
            _pct(s.f16_underflow),
            _pct(s.f16_below_normal),
            _pct(s.f16_overflow),
            _pct(s.bf16_underflow),
            _pct(s.bf16_overflow),
            _log2(s.max_abs),
            _log2(s.min_abs),
        )
        for s in (*r.arrays, r.total)
    ]
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]

    def line(row: tuple[str, ...]) -> str:
        return "  ".join(
            c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))
        )

    rule = "-" * len(line(header))
    return [
        f"Gradient report: {len(r.arrays)} arrays, {r.total.size:,} values. Shares of all "
        "values: below 2^-24 a value is lost in float16 (flushed to zero), below 2^-14 it "
        "is subnormal (fewer bits), above 65504 it overflows.",
        line(header),
        rule,
        *(line(row) for row in rows[:-1]),
        rule,
        line(rows[-1]),
    ]


def _float16_and_bfloat16(r: GradientReport) -> list[str]:
    t = r.total
    nonzero = max(1.0 - t.zero - t.nonfinite, 1e-12)
    return [
        f"float16 without loss scaling: {_pct(t.f16_underflow)} of the values "
        f"({_pct(t.f16_underflow / nonzero)} of the nonzero ones) underflow, "
        f"{_pct(t.f16_overflow)} overflow.",
        f"float16 with a loss scale of 2^{math.log2(r.float16_loss_scale):g} "
        f"(largest power of two keeping max|g| below 65504/{HEADROOM:g}): "
        f"{_pct(r.f16_underflow_scaled)} underflow, {_pct(r.f16_overflow_scaled)} overflow.",
        f"bfloat16: {_pct(t.bf16_underflow)} underflow, {_pct(t.bf16_overflow)} overflow.",
    ]


def _recommendation(r: GradientReport) -> str:
    if r.recommended_loss_scale is not None:
        return (
            f"Recommended: {r.recommended_policy!r} with "
            f"DynamicLossScale(2.0**{math.log2(r.recommended_loss_scale):g}): {r.reason}."
        )
    rec = f"Recommended: {r.recommended_policy!r}, NoOpLossScale(): {r.reason}."
    if r.recommended_policy == "mixed_bfloat16":
        rec += (
            f" Where bfloat16 is not fast (GPUs before Ampere): 'mixed_float16' with "
            f"DynamicLossScale(2.0**{math.log2(r.float16_loss_scale):g})."
        )
    return rec


def _matmul_lines(r: GradientReport) -> list[str]:
    """The matrix products whose sizes Tensor Cores would need padded, if any."""
    if not r.matmuls:
        return []
    bad = r.misaligned_matmuls
    if not bad:
        return ["", f"Matrix products: all {len(r.matmuls)} have M, N, K multiples of 8."]
    out = [
        "",
        f"Matrix products with a size not a multiple of 8 ({len(bad)} of "
        f"{len(r.matmuls)}; Tensor Cores need multiples of 8 for half inputs, "
        "pad the layer width or batch size):",
    ]
    for m in bad:
        sizes = ", ".join(f"{d}={v}" for d, v in m.misaligned.items())
        times = f" (x{m.count})" if m.count > 1 else ""
        out.append(
            f"  {m.name}: {m.lhs_shape} x {m.rhs_shape}, M={m.m} N={m.n} K={m.k}; "
            f"not a multiple of 8: {sizes}{times}"
        )
    return out


def plot_histogram(
    report: GradientReport | Any, path: str | os.PathLike, *, title: str | None = None
) -> None:
    """Writes a PNG histogram of log2 |gradient| over the float16 and bfloat16 ranges.

    Like Figure 3 of Micikevicius et al. (2018): the share of values per
    power of two, with the range float16 represents shaded (subnormal part
    lighter), the part that becomes zero in float16 marked, bfloat16's range
    drawn above, and the histogram shifted by the recommended float16 loss
    scale drawn as an outline.

    Args:
      report: a `GradientReport`, or a gradient pytree (diagnosed first).
      path: where the PNG goes.
      title: an optional title.
    """
    from matplotlib.figure import Figure

    if not isinstance(report, GradientReport):
        report = diagnose(report)
    counts, edges = report.log2_counts, report.log2_edges
    share = 100.0 * counts / max(report.total.size, 1)
    used = np.nonzero(counts)[0]
    lo = min(edges[used[0]] if used.size else -30, -30) - 3
    hi = max(edges[used[-1] + 1] if used.size else 17, 17) + 3
    shift = math.log2(report.float16_loss_scale)

    fig = Figure(figsize=(9, 4.5), dpi=110)
    ax = fig.subplots()
    ax.axvspan(lo, -24, color="tab:red", alpha=0.12, lw=0, label="becomes zero in float16")
    ax.axvspan(-24, -14, color="tab:blue", alpha=0.10, lw=0, label="float16 subnormal")
    ax.axvspan(-14, math.log2(F16_MAX), color="tab:blue", alpha=0.22, lw=0, label="float16 normal")
    ax.bar(edges[:-1], share, width=1.0, align="edge", color="0.25", label="gradients")
    if shift:
        ax.step(
            edges[:-1] + shift,
            share,
            where="post",
            color="tab:orange",
            lw=1.2,
            label=f"gradients x 2^{shift:g} (loss scale)",
        )
    top = max(float(np.max(share)) if share.size else 1.0, 1e-3) * 1.25
    ax.set_ylim(0, top * 1.12)
    ax.hlines(
        top * 1.04,
        max(lo, -133),
        min(hi, 128),
        color="tab:green",
        lw=4,
        label="bfloat16 range (2^-133 .. 2^128)",
    )
    ax.set_xlim(lo, hi)
    ax.set_xlabel("log2 |gradient|")
    ax.set_ylabel("% of all values")
    zero = report.total.zero
    ax.set_title(title or f"Gradient magnitudes ({100 * zero:.1f}% exact zeros, not shown)")
    ax.legend(loc="upper left", fontsize=8, framealpha=0.9)
    fig.tight_layout()
    fig.savefig(path, format="png")
