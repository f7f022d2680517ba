"""The performance pages (docs/performance/*.md) and their figures, rendered from
the curated benchmark JSON by `python -m experiments.benchmark_figures`.

  common.py        suite files, comparisons within a run, tables and sections
  charts.py        the figures' types and drawing
  pages.py         which pages are written; each page's Markdown and figure
  index.py, setup_page.py, platforms.py, attention.py, kernels.py, models.py,
  decoding.py      one page each
  grid.py          the shape grid page, judged by grid_records.py
"""
