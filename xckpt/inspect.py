"""Notebook views of a checkpoint: a bounded text/HTML table and layout plots.

The table renders from the manifest alone (no chunk is read); plots need
matplotlib (the ``notebook`` extra), imported only when a plot is drawn.
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING, Any

from xckpt.errors import XckptError

if TYPE_CHECKING:
    from xckpt.source import Source

__all__ = ["text_table", "html_table", "plot_layout", "plot_value_ranges"]

#: Rows shown before the table says it is truncated.
MAX_ROWS = 200


def _rows(ck: Source) -> list[tuple[str, str, str, int, int, str]]:
    out = []
    for name in ck.names():
        t = ck.info(name)
        ranks = sorted({c.rank for c in t.chunks})
        rk = ",".join(map(str, ranks)) if len(ranks) <= 6 else f"{len(ranks)} ranks"
        out.append((name, t.dtype, str(list(t.shape)), len(t.chunks), t.nbytes, rk))
    return out


def _summary(ck: Source) -> str:
    total = sum(ck.info(n).nbytes for n in ck.names())
    return (
        f"xckpt checkpoint {ck.path}: {len(ck.names())} tensors ({total / 2**20:.1f} MiB), "
        f"{len(ck.object_names())} objects, world size {ck.world_size}, save {ck.save_id}"
    )


def text_table(ck: Source, max_rows: int = MAX_ROWS) -> str:
    """Plain-text table of tensors, at most ``max_rows`` rows."""
    rows = _rows(ck)
    lines = [_summary(ck)]
    for name, dtype, shape, n, nbytes, ranks in rows[:max_rows]:
        lines.append(f"  {name}  {dtype}{shape}  chunks={n}  bytes={nbytes}  ranks={ranks}")
    if len(rows) > max_rows:
        lines.append(f"  ... truncated: {len(rows) - max_rows} more tensors (ck.names() lists all)")
    return "\n".join(lines)


def html_table(ck: Source, max_rows: int = MAX_ROWS) -> str:
    """Escaped HTML table of tensors, at most ``max_rows`` rows."""
    rows = _rows(ck)
    e = html.escape
    body = "".join(
        f"<tr><td>{e(n)}</td><td>{e(d)}</td><td>{e(s)}</td><td>{c}</td><td>{b}</td><td>{e(r)}</td></tr>"
        for n, d, s, c, b, r in rows[:max_rows]
    )
    more = ""
    if len(rows) > max_rows:
        more = f"<p>... truncated: {len(rows) - max_rows} more tensors (ck.names() lists all)</p>"
    return (
        f"<div><p><b>{e(_summary(ck))}</b></p><table><thead><tr><th>name</th><th>dtype</th>"
        f"<th>shape</th><th>chunks</th><th>bytes</th><th>writer ranks</th></tr></thead>"
        f"<tbody>{body}</tbody></table>{more}</div>"
    )


def _colors(n: int) -> list[Any]:
    import matplotlib

    cmap = matplotlib.colormaps["tab20" if n > 10 else "tab10"]
    return [cmap(i % cmap.N) for i in range(max(n, 1))]


def plot_layout(ck: Source, name: str, ax: Any = None) -> Any:
    """Draw a tensor's chunk boxes coloured by writer rank; returns the Axes.

    1-D tensors are drawn as one row; for more than 2 dims the boxes are
    projected onto dims 0 and 1.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    t = ck.info(name)
    if ax is None:
        _, ax = plt.subplots(figsize=(5, 4))
    shape = tuple(t.shape) if len(t.shape) >= 2 else (1, t.shape[0] if t.shape else 1)
    colors = _colors(ck.world_size)
    for c in t.chunks:
        off = c.offset if len(c.offset) >= 2 else (0, c.offset[0] if c.offset else 0)
        shp = c.shape if len(c.shape) >= 2 else (1, c.shape[0] if c.shape else 1)
        ax.add_patch(
            Rectangle((off[1], off[0]), shp[1], shp[0], facecolor=colors[c.rank], edgecolor="black", alpha=0.8)
        )
    ax.set_xlim(0, max(shape[1], 1))
    ax.set_ylim(max(shape[0], 1), 0)
    ax.set_xlabel("dim 1" if len(t.shape) >= 2 else "dim 0")
    ax.set_ylabel("dim 0" if len(t.shape) >= 2 else "")
    proj = " (projected on dims 0, 1)" if len(t.shape) > 2 else ""
    ax.set_title(f"{name} {t.dtype}{list(t.shape)}: {len(t.chunks)} chunks{proj}")
    ranks = sorted({c.rank for c in t.chunks})
    ax.legend(
        handles=[Patch(color=colors[r], label=f"rank {r}") for r in ranks[:20]],
        loc="upper left",
        bbox_to_anchor=(1.01, 1),
        fontsize="small",
    )
    return ax


def plot_value_ranges(ck: Source, name: str, ax: Any = None) -> Any:
    """Draw each chunk's key value range [lo, hi) coloured by writer rank; returns the Axes."""
    import matplotlib.pyplot as plt

    t = ck.info(name)
    ranged = [c for c in t.chunks if c.value_range is not None]
    if t.value_range is None or not ranged:
        raise XckptError(
            f"checkpoint {ck.path!r}: tensor {name!r} has no value-range annotation; "
            "plot_value_ranges applies to tensors of a value group (see info(name).value_range)"
        )
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 2 + 0.2 * len(ranged)))
    colors = _colors(ck.world_size)
    for i, c in enumerate(ranged):
        lo, hi = c.value_range  # type: ignore[misc]
        ax.barh(i, hi - lo, left=lo, color=colors[c.rank], edgecolor="black")
        ax.text(lo, i, f" rank {c.rank}", va="center", fontsize="small")
    ax.set_yticks(range(len(ranged)), [str(c.box) for c in ranged])
    ax.set_xlabel("key value")
    ax.set_title(f"{name}: value ranges of {len(ranged)} chunks (group {t.value_range.group})")
    return ax
