"""Static PNGs of any figure: the README picture, ``dtlab bench --plot``, reports.

plotly writes images through kaleido 1.x, which drives a headless Chromium offline
and finds Debian's ``/usr/bin/chromium`` by itself (CI installs it); without one,
plotly raises a ``RuntimeError`` that says how to get one.
"""

from __future__ import annotations

import plotly.graph_objects as go


def save_png(
    fig: go.Figure,
    path,
    *,
    width: int | None = None,
    height: int | None = None,
    scale: float = 1.0,
) -> str:
    """Write ``fig`` (a figure or a live ``FigureWidget``) as a PNG at ``path``;
    returns the path."""
    if isinstance(fig, go.FigureWidget):
        fig = go.Figure(fig)
    fig.write_image(str(path), format="png", width=width, height=height, scale=scale)
    return str(path)
