"""Plot conventions every chapter shares: the legend never covers the data it explains.

    fig, ax = plotting.figure(8, 3)
    ax.plot(...)
    plotting.legend_outside(ax)          # to the right of the axes, outside the data

Imported lazily by chapters' plotting functions, never at the import of a pattern module.
"""

from __future__ import annotations

#: One colour per meaning, the same in every chapter.
COLORS = {
    "ok": "#27ae60",
    "bad": "#c0392b",
    "warn": "#f39c12",
    "neutral": "#7f8c8d",
    "fix": "#2980b9",
}


def figure(width: float = 8.0, height: float = 3.0, **kwargs):
    """``(fig, ax)`` with the course's size and a constrained layout (room for outside legends)."""
    import matplotlib.pyplot as plt

    kwargs.setdefault("layout", "constrained")
    return plt.subplots(figsize=(width, height), **kwargs)


def legend_outside(ax, where: str = "right", **kwargs):
    """Put ``ax``'s legend outside the plotting area: ``"right"`` of it or ``"below"`` it."""
    if where == "below":
        kwargs.setdefault("loc", "upper center")
        kwargs.setdefault("bbox_to_anchor", (0.5, -0.18))
        kwargs.setdefault("ncols", 3)
    else:
        kwargs.setdefault("loc", "upper left")
        kwargs.setdefault("bbox_to_anchor", (1.01, 1.0))
    kwargs.setdefault("frameon", False)
    kwargs.setdefault("fontsize", "small")
    return ax.legend(**kwargs)
