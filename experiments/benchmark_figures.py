r"""Renders the performance pages (docs/performance/*.md) from the curated benchmark JSON.

    python -m experiments.benchmark_figures [--benchmarks docs/benchmarks] \
        [--pages docs/performance]

`docs/benchmarks/manifest.json` names one JSON file per suite, the pages it
feeds and the benchmark program and command that write it; this program reads
those files and no others. A suite file is either what a benchmark program
writes, one run (`{"environment": ..., "rows": [...]}`), or a merge of several
runs (`{"sources": {run id: {"environment", "commit", "blob"}}, "rows": [...]}`,
every row naming its run in `source`; `commit` and `blob` find the original
file in git). Where several runs measured one configuration, its table row
comes from the newest of them, and every ratio is taken between rows of one
run. No number is typed here: rerun this after a benchmark and commit the pages
with the JSON (tests/experiments/test_benchmark_figures.py fails when they
differ).

A suite whose file is not in the directory is left out: the pages it alone
feeds are not written, and the index and setup pages neither link nor list
it. Dropping a measured file in under the manifest's name and rerunning this
program adds its pages. The platforms page is always written: what each
default runs on each GPU kind, from the committed dispatch tables
(`ops/dispatch_tables/*.json`), and the `gpu_check` runs where present.

The pages are built by `experiments/figures/`, one module per page; this
program writes them.
"""

import os

from absl import app
from absl import flags

from experiments.figures.charts import Figure, HeatMap, draw
from experiments.figures.common import (Record, Suite, cell, compare, load_manifest, load_suite,
                                        load_suites, newest_rows, ratio_text, run_label)
from experiments.figures.grid_records import count_target
from experiments.figures.pages import PAGES, drawn_figures, render_pages
from experiments.figures.platforms import DEFAULTS
from experiments.figures.setup_page import NOT_RECORDED, cuda_version_text, cudnn_version_text

__all__ = ["DEFAULTS", "NOT_RECORDED", "PAGES", "Figure", "HeatMap", "Record", "Suite", "cell",
           "compare", "count_target", "cuda_version_text", "cudnn_version_text", "draw",
           "drawn_figures", "load_manifest", "load_suite", "load_suites", "newest_rows",
           "ratio_text", "render_pages", "run_label"]

_BENCHMARKS = flags.DEFINE_string("benchmarks", "docs/benchmarks",
                                  "Directory of manifest.json and the suite files.")
_PAGES = flags.DEFINE_string("pages", "docs/performance", "Where the pages are written.")


def main(argv):
  del argv
  os.makedirs(_PAGES.value, exist_ok=True)
  for name, text in render_pages(_BENCHMARKS.value).items():
    path = os.path.join(_PAGES.value, name)
    with open(path, "w") as f:
      f.write(text)
    print(f"wrote {path}")
  for file, figure in drawn_figures(_BENCHMARKS.value).items():
    path = os.path.join(_BENCHMARKS.value, file)
    draw(figure, path)
    print(f"wrote {path}")


if __name__ == "__main__":
  app.run(main)
