"""The pages' figures: bars of ratios to a peer, and heat maps of ratios over a grid.

Each is drawn as a PNG with no timestamp or version in it, so that drawing the
same data again writes the same file.
"""

import dataclasses

# The axis of every bar chart of ratios.
RATIO_AXIS = "time / the peer's time in the same run (log scale; left of 1: faster)"


@dataclasses.dataclass(frozen=True)
class Figure:
  """Horizontal bars: `bars` are (label, series, ratio to the peer)."""
  title: str
  axis: str
  bars: list[tuple[str, str, float]]


@dataclasses.dataclass(frozen=True)
class HeatMap:
  """Panels of cells coloured by a ratio on a log scale centred at 1.

  `cells` are (panel, row, column, ratio, text): the ratio is None where there is
  none (the cell is grey), and the text is written on the cell.
  """
  title: str
  axis: str
  row_name: str
  column_name: str
  cells: list[tuple[str, int, int, float | None, str]]

  @property
  def panels(self) -> list[str]:
    return list(dict.fromkeys(panel for panel, *_ in self.cells))


def draw(figure: Figure | HeatMap, path: str) -> None:
  """Writes `figure` as a PNG (no timestamp or version in it: reruns give the same file).

  Each bar runs from 1 (parity with the peer) to the ratio, on a log axis, so that
  twice as fast and twice as slow are bars of one length.
  """
  if isinstance(figure, HeatMap):
    draw_heat_map(figure, path)
    return
  import matplotlib  # Imported here: the pages' Markdown needs no plotting library.
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt
  labels = list(dict.fromkeys(label for label, _, _ in figure.bars))
  series = list(dict.fromkeys(name for _, name, _ in figure.bars))
  colors = dict(zip(series, plt.get_cmap("tab10").colors))
  fig, ax = plt.subplots(figsize=(9, 0.36 * len(labels) + 1.6))
  drawn = set()
  for y, label in enumerate(labels):
    at_label = [(name, value) for l, name, value in figure.bars if l == label]
    height = 0.8 / len(at_label)
    for i, (name, value) in enumerate(at_label):
      ax.barh(y + (i - (len(at_label) - 1) / 2) * height, value - 1.0, left=1.0, height=height,
              color=colors[name], label=None if name in drawn else name)
      drawn.add(name)
  values = [value for _, _, value in figure.bars]
  low, high = min(values + [1.0]) / 1.25, max(values + [1.0]) * 1.25
  ax.set_xscale("log")
  ax.set_xlim(low, high)
  ticks = [t for t in (0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 1, 1.5, 2, 3, 5) if low <= t <= high]
  ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
  ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
  ax.axvline(1.0, color="black", linewidth=0.8)
  ax.set_yticks(range(len(labels)), labels, fontsize=8)
  ax.set_ylim(len(labels) - 0.5, -0.5)
  ax.set_xlabel(figure.axis, fontsize=9)
  columns = min(len(series), 2)
  ax.set_title(figure.title, fontsize=10, pad=12 + 12 * -(-len(series) // columns))
  ax.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=columns,
            frameon=False)
  fig.tight_layout()
  fig.savefig(path, dpi=100, metadata={"Software": None})
  plt.close(fig)


def draw_heat_map(heat_map: HeatMap, path: str) -> None:
  """Writes `heat_map` as a PNG: one panel per variant, rows and columns the values
  seen in any panel, a diverging colour map whose ends are equally far from 1 on a
  log scale, each cell annotated with its ratio."""
  import math
  import matplotlib
  matplotlib.use("Agg")
  from matplotlib import colors
  from matplotlib import pyplot as plt
  import numpy as np
  rows = sorted({row for _, row, _, _, _ in heat_map.cells})
  columns = sorted({column for _, _, column, _, _ in heat_map.cells})
  values = [v for *_, v, _ in heat_map.cells if v is not None]
  reach = max([1.25] + [max(v, 1 / v) for v in values])
  norm = colors.LogNorm(vmin=1 / reach, vmax=reach)
  cmap = plt.get_cmap("RdBu_r").with_extremes(bad="#d9d9d9")  # grey: no ratio
  panels = heat_map.panels
  ncols = min(len(panels), 3)
  nrows = -(-len(panels) // ncols)
  fig, axes = plt.subplots(nrows, ncols, squeeze=False, layout="constrained",
                           figsize=(ncols * (0.62 * len(columns) + 1.2) + 1.2,
                                    nrows * (0.36 * len(rows) + 1.1) + 0.6))
  image = None
  for ax, panel in zip(axes.flat, panels):
    grid = np.full((len(rows), len(columns)), np.nan)
    for name, row, column, value, text in heat_map.cells:
      if name != panel:
        continue
      i, j = rows.index(row), columns.index(column)
      if value is not None:
        grid[i, j] = value
      dark = value is not None and abs(math.log(value)) > 0.6 * math.log(reach)
      ax.text(j, i, text, ha="center", va="center", fontsize=7,
              color="white" if dark else "black")
    image = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, norm=norm, aspect="auto")
    ax.set_xticks(range(len(columns)), [str(c) for c in columns], fontsize=7)
    ax.set_yticks(range(len(rows)), [str(r) for r in rows], fontsize=7)
    ax.set_xlabel(heat_map.column_name, fontsize=8)
    ax.set_ylabel(heat_map.row_name, fontsize=8)
    ax.set_title(panel, fontsize=9)
  for ax in list(axes.flat)[len(panels):]:
    ax.axis("off")
  bar = fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8)
  ticks = [t for t in (0.5, 0.67, 0.8, 0.9, 1, 1.1, 1.25, 1.5, 2) if 1 / reach <= t <= reach]
  bar.set_ticks(ticks, labels=[f"{t:g}" for t in ticks])
  bar.ax.minorticks_off()
  bar.set_label(heat_map.axis, fontsize=8)
  fig.suptitle(heat_map.title, fontsize=10)
  fig.savefig(path, dpi=100, metadata={"Software": None})
  plt.close(fig)


def figure_link(figure: Figure | HeatMap | None, file: str | None) -> list[str]:
  """The Markdown that shows a page's figure, drawn into docs/benchmarks/`file`."""
  if figure is None or file is None:
    return []
  return [f"![{figure.title}](../benchmarks/{file})", ""]
