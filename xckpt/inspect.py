"""Notebook views of a checkpoint of any format: a bounded text/HTML table and plots.

The table renders from metadata alone (no chunk is read), like zarr's tree view:
at most `max_rows` tensors, then a visible "N more" line. Each row has the
bytes each writer holds and a layout glyph (chunks per dim in text, the boxes in
a small SVG in HTML). Plots need matplotlib (the `notebook` extra), imported
only when one is drawn:

* `plot_layout`: saved boxes coloured by writer; a target layout's boxes
  outlined, shaded and labelled by rank; N-D tensors projected onto two dims;
* `plot_plan`: bytes each rank of a [`LoadPlan`][xckpt.plan.LoadPlan] reads,
  with what it keeps and the even share marked;
* `plot_value_ranges`: a value group's chunks over its key domain, with the
  owners of each part of the domain at another world size.
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from xckpt.errors import XckptError
from xckpt.layout import Box, GridIndex, chunk_sizes
from xckpt.targets import Entries, target_boxes


class Source(Entries, Protocol):
    """What the views read of a checkpoint: any [`xckpt.source.Source`][xckpt.source.Source] fits."""

    @property
    def format(self) -> str: ...

    @property
    def path(self) -> str: ...

    @property
    def world_size(self) -> int: ...

    @property
    def save_id(self) -> str | None: ...

    def object_names(self) -> list[str]: ...


class _RankRow(Protocol):
    @property
    def rank(self) -> int: ...

    @property
    def bytes_to_read(self) -> int: ...

    @property
    def bytes_kept(self) -> int: ...


class LoadPlan(Protocol):
    """What `plot_plan` reads of an [`xckpt.plan.LoadPlan`][xckpt.plan.LoadPlan]."""

    @property
    def target(self) -> str: ...

    @property
    def stored_bytes(self) -> int: ...

    @property
    def ranks(self) -> Sequence[_RankRow]: ...

    def summary(self) -> str: ...

__all__ = ["human_bytes", "plural", "text_table", "html_table", "plot_layout", "plot_plan", "plot_value_ranges", "glyph"]

#: Rows shown before the table says it is truncated.
MAX_ROWS = 200
#: Boxes drawn in one HTML glyph before it says "+N".
GLYPH_BOXES = 64
#: Inner-chunk boundary lines drawn per saved chunk in `plot_layout` (more: none drawn).
GRID_LINES = 64
#: Writers listed per row before the rest are summed.
WRITERS_SHOWN = 4

_PALETTE = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
    "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
)  # fmt: skip


def human_bytes(n: float) -> str:
    """`1536` -> `"1.5 KiB"`: byte counts as tables, plans and the CLI print them."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def plural(count: int, noun: str) -> str:
    """`count` and `noun`, plural unless there is exactly one (`"1 object"`, `"2 objects"`)."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _per_writer(t: Any) -> str:
    by: dict[int, int] = {}
    if hasattr(t, "bytes_by_rank"):  # (a grid's from its columns: no cell built)
        by = dict(t.bytes_by_rank())
    else:
        for c in t.chunks:
            by[c.rank] = by.get(c.rank, 0) + c.nbytes
    parts = [f"r{r} {human_bytes(b)}" for r, b in sorted(by.items())[:WRITERS_SHOWN]]
    if len(by) > WRITERS_SHOWN:
        rest = sum(b for _, b in sorted(by.items())[WRITERS_SHOWN:])
        parts.append(f"+{len(by) - WRITERS_SHOWN} more {human_bytes(rest)}")
    return ", ".join(parts) or "-"


def glyph(t: Any) -> str:
    """Chunks per dim, e.g. `4x1` (a row split in 4); `-` for a tensor without chunks."""
    if not t.chunks:
        return "-"
    if not t.shape:
        return "1"
    index = getattr(t, "chunk_index", None) if getattr(t, "is_grid", False) else None
    if isinstance(index, GridIndex):  # a grid's counts, without building its cells
        return "x".join(map(str, index.counts))
    return "x".join(str(len({c.offset[d] for c in t.chunks})) for d in range(len(t.shape)))


def _svg(t: Any, width: int = 64, height: int = 28) -> str:
    """A small SVG of the boxes, projected on dims 0 (down) and 1 (across)."""
    shape = tuple(t.shape) if len(t.shape) >= 2 else (1, t.shape[0] if t.shape else 1)
    sy, sx = height / max(shape[0], 1), width / max(shape[1], 1)
    rects = []
    for c in t.chunks[:GLYPH_BOXES]:
        off = c.offset if len(c.offset) >= 2 else (0, c.offset[0] if c.offset else 0)
        shp = c.shape if len(c.shape) >= 2 else (1, c.shape[0] if c.shape else 1)
        rects.append(
            f'<rect x="{off[1] * sx:.1f}" y="{off[0] * sy:.1f}" width="{max(shp[1] * sx, 0.5):.1f}" '
            f'height="{max(shp[0] * sy, 0.5):.1f}" fill="{_PALETTE[c.rank % len(_PALETTE)]}" '
            'stroke="black" stroke-width="0.5"/>'
        )
    more = len(t.chunks) - GLYPH_BOXES
    tail = f'<text x="2" y="{height - 2}" font-size="9">+{more}</text>' if more > 0 else ""
    return (
        f'<svg width="{width}" height="{height}" xmlns="http://www.w3.org/2000/svg">'
        f'{"".join(rects)}{tail}</svg>'
    )


def _rows(ck: Source) -> list[tuple[str, Any]]:
    return [(name, ck.info(name)) for name in ck.names()]


def _summary(ck: Source) -> str:
    names = ck.names()
    total = sum(ck.info(n).nbytes for n in names)
    save = f", save {ck.save_id}" if ck.save_id else ""
    return (
        f"{ck.format} checkpoint {ck.path}: {plural(len(names), 'tensor')} ({human_bytes(total)}), "
        f"{plural(len(ck.object_names()), 'object')}, {plural(ck.world_size, 'writer')}{save}"
    )


def _more(n: int) -> str:
    return f"... truncated: {n} more tensors (ck.names() lists all)"


def text_table(ck: Source, max_rows: int = MAX_ROWS) -> str:
    """Plain-text table of tensors, at most `max_rows` rows."""
    rows = _rows(ck)
    lines = [_summary(ck)]
    for name, t in rows[:max_rows]:
        lines.append(
            f"  {name}  {t.dtype}{list(t.shape)}  chunks={len(t.chunks)} ({glyph(t)})  "
            f"bytes={t.nbytes}  writers: {_per_writer(t)}"
        )
    if len(rows) > max_rows:
        lines.append("  " + _more(len(rows) - max_rows))
    return "\n".join(lines)


def html_table(ck: Source, max_rows: int = MAX_ROWS) -> str:
    """Escaped HTML table of tensors, at most `max_rows` rows."""
    rows = _rows(ck)
    e = html.escape
    body = "".join(
        f"<tr><td>{e(n)}</td><td>{e(t.dtype)}</td><td>{e(str(list(t.shape)))}</td>"
        f"<td>{len(t.chunks)} ({e(glyph(t))})</td><td>{_svg(t)}</td><td>{e(human_bytes(t.nbytes))}</td>"
        f"<td>{e(_per_writer(t))}</td></tr>"
        for n, t in rows[:max_rows]
    )
    more = f"<p>{e(_more(len(rows) - max_rows))}</p>" if len(rows) > max_rows else ""
    return (
        f"<div><p><b>{e(_summary(ck))}</b></p><table><thead><tr><th>name</th><th>dtype</th>"
        f"<th>shape</th><th>chunks</th><th>layout</th><th>bytes</th><th>bytes per writer</th>"
        f"</tr></thead><tbody>{body}</tbody></table>{more}</div>"
    )


def _colors(n: int) -> list[Any]:
    import matplotlib

    cmap = matplotlib.colormaps["tab20" if n > 10 else "tab10"]
    return [cmap(i % cmap.N) for i in range(max(n, 1))]


def _xy(box: Box) -> tuple[tuple[int, int], tuple[int, int]]:
    """(row, col) offset and extent of `box` projected on dims 0 and 1 (1-D: one row)."""
    if len(box.shape) >= 2:
        return (box.offset[0], box.offset[1]), (box.shape[0], box.shape[1])
    if len(box.shape) == 1:
        return (0, box.offset[0]), (1, box.shape[0])
    return (0, 0), (1, 1)


def _target_boxes(ck: Source, name: str, target: Any) -> tuple[str, Mapping[int, tuple[Box, ...]]]:
    """("rank" or "device", rank -> boxes of `name`) for a torch or JAX target."""
    if isinstance(target, tuple) and len(target) == 2:
        target = {name: target}
    elif not isinstance(target, dict):
        target = {name: target}
    kind, boxes = target_boxes(ck, target)
    if name not in boxes:
        raise XckptError(f"plot_layout: the target does not lay out tensor {name!r}")
    return ("rank" if kind == "torch" else "device"), boxes[name]


def _ranks_label(who: str, ranks: list[int]) -> str:
    """`rank 3`, `devices 0-3`, `devices 0,2,4,6` (runs collapsed; long lists cut)."""
    if len(ranks) == 1:
        return f"{who} {ranks[0]}"
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    parts = [f"{g[0]}-{g[-1]}" if len(g) > 2 else ",".join(map(str, g)) for g in runs]
    text = ",".join(parts)
    if len(text) > 24:
        text = ",".join(parts[:3]) + f",... ({len(ranks)})"
    return f"{who}s {text}"


def _draw_grids(ax: Any, chunks: Any) -> bool:
    """Dotted lines at the inner (zarr) chunk boundaries of array chunks, the unit a load reads;
    skipped for a chunk whose projection has more than `GRID_LINES` of them."""
    drawn = False
    for c in chunks:
        if c.grid is None:
            continue
        (y, x), (h, w) = _xy(c.box)
        (_, _), (gh, gw) = _xy(Box(c.offset, c.grid))
        ys, xs = range(y + gh, y + h, gh), range(x + gw, x + w, gw)
        if len(ys) + len(xs) > GRID_LINES:
            continue
        for yy in ys:
            ax.plot([x, x + w], [yy, yy], color="white", linestyle=":", linewidth=1.2)
        for xx in xs:
            ax.plot([xx, xx], [y, y + h], color="white", linestyle=":", linewidth=1.2)
        drawn = drawn or bool(len(ys) + len(xs))
    return drawn


def plot_layout(ck: Source, name: str, ax: Any = None, *, target: Any = None) -> Any:
    """Draw a tensor's saved chunk boxes coloured by writer; returns the Axes.

    Dotted white lines mark the inner chunks of xckpt array chunks (and of their
    views through rules): the unit a load reads.

    Args:
        ck: any source.
        name: the tensor.
        ax: matplotlib Axes to draw on (default: a new figure).
        target: a layout to draw over the saved one: `(mesh_shape, placements)`
            (torch ranks) or a JAX sharding; each rank's boxes are outlined, shaded
            and labelled with the rank.

    1-D tensors are drawn as one row; for more than 2 dims the boxes are projected
    onto dims 0 and 1 (the title says so).
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    t = ck.info(name)
    if ax is None:
        _, ax = plt.subplots(figsize=(6.5, 4))
    (_, _), (rows, cols) = _xy(Box.full(t.shape))
    writers = sorted({c.rank for c in t.chunks})
    colors = _colors(max(writers, default=0) + 1)
    for c in t.chunks:
        (y, x), (h, w) = _xy(c.box)
        ax.add_patch(Rectangle((x, y), w, h, facecolor=colors[c.rank], edgecolor="black", alpha=0.75))
    handles = [Patch(facecolor=colors[r], edgecolor="black", label=f"writer {r}") for r in writers[:20]]
    if _draw_grids(ax, t.chunks):
        handles.append(Patch(facecolor="grey", edgecolor="white", linestyle=":", linewidth=1.2,
                             label="inner chunk (one read)"))
    title = f"{name} {t.dtype}{list(t.shape)}: {len(t.chunks)} saved chunks"
    if target is not None:
        who, per_rank = _target_boxes(ck, name, target)
        # one outline per distinct (projected) box, labelled with every rank that holds it:
        # replicated boxes and boxes differing only in collapsed dims share a label
        holders: dict[tuple[tuple[int, int], tuple[int, int]], list[int]] = {}
        for rank, boxes in sorted(per_rank.items()):
            for b in boxes:
                if not b.empty:
                    holders.setdefault(_xy(b), []).append(rank)
        for ((y, x), (h, w)), ranks in holders.items():
            ax.add_patch(
                Rectangle((x, y), w, h, fill=True, facecolor=(0, 0, 0, 0.08), hatch="//",
                          edgecolor="black", linewidth=2.0, linestyle="--")
            )
            ax.text(x + w / 2, y + h / 2, _ranks_label(who, sorted(set(ranks))), ha="center", va="center",
                    fontsize="small", fontweight="bold",
                    bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "none"})
        handles.append(Patch(facecolor=(0, 0, 0, 0.08), hatch="//", edgecolor="black", linestyle="--",
                             label=f"target box (what a {who} reads)"))
        title += f" vs a target of {len(per_rank)} {who}s"
    ax.set_xlim(0, max(cols, 1))
    ax.set_ylim(max(rows, 1), 0)
    if len(t.shape) >= 2:
        ax.set_xlabel("columns (dim 1)")
        ax.set_ylabel("rows (dim 0)")
    else:
        ax.set_xlabel("elements (dim 0)")
        ax.set_yticks([])
    if len(t.shape) > 2:
        title += f"\nprojected on dims 0 and 1 (dims 2..{len(t.shape) - 1} collapsed)"
    ax.set_title(title, fontsize="medium")
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    return ax


def plot_plan(plan: LoadPlan, ax: Any = None) -> Any:
    """Bytes each rank (or device) of `plan` reads, as bars; what it keeps and the even share marked."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(max(4.0, 0.5 * len(plan.ranks) + 2), 3.5))
    ranks = [r.rank for r in plan.ranks]
    scale, unit = (2**20, "MiB") if plan.stored_bytes >= 2**20 else (2**10, "KiB")
    ax.bar(range(len(ranks)), [r.bytes_to_read / scale for r in plan.ranks], color="#1f77b4", label="bytes read")
    ax.scatter(range(len(ranks)), [r.bytes_kept / scale for r in plan.ranks], color="black", marker="_",
               s=400, zorder=3, label="bytes kept")
    if ranks:
        ax.axhline(plan.stored_bytes / len(ranks) / scale, color="#d62728", linestyle="--",
                   label="even share of the checkpoint")
    who = "device" if plan.target == "jax" else "rank"
    ax.set_xticks(range(len(ranks)), [str(r) for r in ranks])
    ax.set_xlabel(who)
    ax.set_ylabel(unit)
    head, _, tail = plan.summary().partition("; ")
    ax.set_title(f"load plan: {head}\n{tail}", fontsize="small")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))
    return ax


def plot_value_ranges(ck: Source, name: str, ax: Any = None, *, world_size: int | None = None) -> Any:
    """Draw each chunk's key value range [lo, hi) coloured by writer; returns the Axes.

    With `world_size`, the key domain is split as a load at that world size splits
    it (torchrec's ceil split) and each part is shaded and labelled with its new owner.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    t = ck.info(name)
    ranged = [c for c in t.chunks if c.value_range is not None]
    if t.value_range is None or not ranged:
        raise XckptError(
            f"checkpoint {ck.path!r}: tensor {name!r} has no value-range annotation; "
            "plot_value_ranges applies to tensors of a value group (see info(name).value_range)"
        )
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 2 + 0.3 * len(ranged)))
    writers = sorted({c.rank for c in ranged})
    colors = _colors(max(writers) + 1)
    for i, c in enumerate(ranged):
        if c.value_range is None:
            continue
        lo, hi = c.value_range
        ax.barh(i, hi - lo, left=lo, color=colors[c.rank], edgecolor="black", height=0.6)
    ax.set_yticks(range(len(ranged)), [f"rows {c.offset[0]}:{c.offset[0] + c.shape[0]}" for c in ranged])
    handles = [Patch(facecolor=colors[r], edgecolor="black", label=f"saved by rank {r}") for r in writers]
    short = name if len(name) <= 60 else "..." + name[-57:]
    title = f"{short}: key ranges of {len(ranged)} saved chunks"
    domain = t.value_range.domain
    ax.set_ylim(-0.6, len(ranged) - 0.4)
    if world_size is not None:
        if domain is None:
            raise XckptError(f"tensor {name!r}: its annotation records no key domain to split")
        lo0, hi0 = domain
        ax.set_ylim(-0.6, len(ranged) + 0.2)  # a lane above the bars for the new owners' labels
        for r, (start, size) in enumerate(chunk_sizes(hi0 - lo0, world_size)):
            if size == 0:
                continue
            ax.axvspan(lo0 + start, lo0 + start + size, color="grey", alpha=0.22 if r % 2 else 0.08)
            ax.axvline(lo0 + start, color="black", linestyle=":", linewidth=1)
            ax.text(lo0 + start + size / 2, len(ranged) - 0.15, f"new rank {r}", ha="center", va="center",
                    fontsize="small", fontweight="bold")
        title += f"\nshaded: the key domain split among {world_size} ranks (who owns each id after the load)"
    if domain is not None:
        ax.set_xlim(domain[0], domain[1])
    ax.set_xlabel("key value (raw id)")
    ax.set_ylabel("saved chunk")
    ax.set_title(title, fontsize="medium")
    ax.legend(handles=handles, fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))
    return ax
