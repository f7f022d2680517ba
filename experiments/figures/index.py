"""The index page: every present suite's headlines and the contents."""

from experiments.figures import attention
from experiments.figures import decoding
from experiments.figures import grid
from experiments.figures import grid_records
from experiments.figures import kernels
from experiments.figures import models
from experiments.figures.common import Suite, not_measured, ratio_text


def index_page(manifest: dict, suites: dict[str, Suite], pages: list[str]) -> str:
  """The index: headlines of every suite present and a contents list of `pages`."""
  out = ["# Performance", "",
         "Measured on one GPU, this library beside the peers timed in the same run. "
         "These pages are generated from the JSON in `docs/benchmarks/` by "
         "`python -m experiments.benchmark_figures`; ratios are this library's time over "
         "the peer's (below 1 is faster).", "", "## Headlines", ""]
  headlines = attention.attention_headlines(attention.attention_records(suites["attention"]))
  for r in models.newest_train_steps(suites["models"]):
    headlines.append(f"- {models.MODEL_NAMES.get(r.config['model'], r.config['model'])} train "
                     f"step ({r.config['dtype']}, {r.config['tokens']} tokens): "
                     f"{ratio_text(r.ratio('default', 'cudnn'))} x cuDNN attention's.")
  headlines += kernels.scan_headlines(kernels.scan_records(suites["ssm_scans"]))
  headlines += kernels.chunked_headlines(kernels.chunked_records(suites["chunked_ops"]))
  headlines += kernels.gmm_section(suites["moe"])[0]
  if "decoding" in pages:
    headlines += decoding.decoding_headlines(suites["decode"])
  if "grid" in pages:
    headlines += grid.grid_headlines(grid_records.grid_targets(suites))
  out += headlines if headlines else [not_measured("The benchmarks")]
  out += ["", "Machines, timing and the files behind each page are on the setup page.", "",
          "```{toctree}", ":maxdepth: 1", ""] + [p for p in pages if p != "index"] + ["```", ""]
  return "\n".join(out)
