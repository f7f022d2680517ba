"""Which performance pages are written, and each one's Markdown and figure, from
the manifest's files in one directory."""

import re

from experiments.figures import attention
from experiments.figures import charts
from experiments.figures import decoding
from experiments.figures import grid
from experiments.figures import index
from experiments.figures import kernels
from experiments.figures import models
from experiments.figures import platforms
from experiments.figures import setup_page
from experiments.figures.common import Suite, load_suites, with_empty

PAGES = ("index", "platforms", "setup", "attention", "kernels", "models", "decoding", "grid")
# Written whatever suites are present.
ALWAYS = ("index", "platforms", "setup")


def pages_of(manifest: dict, suites: dict[str, Suite]) -> list[str]:
  """The pages to write, in `PAGES` order: `ALWAYS` and those a present suite feeds."""
  fed = {page for name in suites for page in manifest["suites"][name]["pages"]}
  return [p for p in PAGES if p in ALWAYS or p in fed]


def figures(suites: dict[str, Suite]) -> dict[str, charts.Figure | charts.HeatMap]:
  """The figure of each page that has one, from the same records as its tables.

  Args:
    suites: every suite the manifest names, an absent one empty (`with_empty`).
  """
  drawn = {"attention": attention.attention_figure(suites),
           "kernels": kernels.kernels_figure(suites),
           "models": models.models_figure(suites),
           "grid": grid.grid_figure(suites)}
  return {page: figure for page, figure in drawn.items() if figure is not None}


def render_pages(directory: str) -> dict[str, str]:
  """The performance pages' Markdown, from the manifest's files in `directory`:
  index, setup and every page a present suite feeds (`pages_of`)."""
  manifest, present = load_suites(directory)
  shown = dict(manifest, suites={n: e for n, e in manifest["suites"].items() if n in present})
  suites = with_empty(manifest, present)
  names = pages_of(manifest, present)
  drawn, files = figures(suites), manifest.get("figures", {})
  link = lambda page: charts.figure_link(drawn.get(page), files.get(page))
  writers = {
      "index": lambda: index.index_page(shown, suites, names),
      "setup": lambda: setup_page.setup_page(shown, present),
      "platforms": lambda: platforms.platforms_page(suites),
      "attention": lambda: attention.attention_page(suites, link("attention")),
      "kernels": lambda: kernels.kernels_page(suites, link("kernels")),
      "models": lambda: models.models_page(shown, suites, link("models")),
      "decoding": lambda: decoding.decoding_page(shown, suites),
      "grid": lambda: grid.grid_page(shown, suites, link("grid")),
  }
  # Sections that end in a blank line meet the next one's: one blank line between blocks.
  return {f"{name}.md": re.sub(r"\n{3,}", "\n\n", writers[name]()).rstrip("\n") + "\n"
          for name in names}


def drawn_figures(directory: str) -> dict[str, charts.Figure | charts.HeatMap]:
  """The figures of the pages `render_pages` writes, by the manifest's file name."""
  manifest, present = load_suites(directory)
  drawn, names = figures(with_empty(manifest, present)), pages_of(manifest, present)
  return {file: drawn[page] for page, file in manifest.get("figures", {}).items()
          if page in drawn and page in names}
