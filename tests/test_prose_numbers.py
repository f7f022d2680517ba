"""Numbers in prose come from one place: measured figures from the benchmark
data, version bounds from pyproject.toml.

Timings and speed ratios are data: `docs/benchmarks/*.json`, rendered into the
performance pages (`docs/performance/`) by `python -m
experiments.benchmark_figures`, which `tests/experiments/test_benchmark_figures.py`
checks against the JSON. A figure copied by hand into the README or a user
guide goes stale when the benchmarks are rerun, so those pages carry none:
they link to the performance pages instead. This test scans their prose (code
blocks and inline code left out) for anything that reads like a measurement
and names each one it finds.
"""

import glob
import os
import re
import tomllib

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PAGES = sorted([os.path.join(_ROOT, "README.md"), os.path.join(_ROOT, "docs", "index.md")]
                + glob.glob(os.path.join(_ROOT, "docs", "guide", "*.md")))

_NUMBER = r"\d+(?:[.,]\d+)?"
_RANGE = rf"{_NUMBER}(?:\s*-\s*{_NUMBER})?"
_MEASURED = re.compile(
    # A ratio: "0.68x", "10.9 x faster", "0.99-1.03x" (not a shape: "128 x 128").
    rf"(?<![\w.]){_RANGE}\s?x(?!\w)(?!\s*\d)"
    # A time or a rate: "0.183 ms", "570 TFLOP/s", "2.2 TB/s", "48 steps/s".
    rf"|(?<![\w.]){_RANGE}\s?(?:ms|us|µs|ns|[GT]FLOP/s|[GMT]B/s|steps/s|tokens/s)(?!\w)"
    # A share of a peer's time or rate: "0.68-0.78 of cuDNN's time",
    # "0.85 (fwd+bwd) of one dense matmul's rate".
    rf"|(?<![\w.])\d\.\d+(?:\s*-\s*\d\.\d+)?\s+(?:\([^)]*\)\s+)?of\b[^.;]*?\b(?:time|rate|speed)\b"
    # "N times faster", "30 % slower".
    rf"|(?<![\w.]){_RANGE}\s?(?:times|%)\s+(?:faster|slower|less|more)\b")


def _prose(text: str) -> str:
  """The text with fenced code blocks and inline code blanked (line numbers kept)."""
  text = re.sub(r"^(```|~~~).*?^\1", lambda m: "\n" * m.group(0).count("\n"), text,
                flags=re.S | re.M)
  return re.sub(r"`[^`\n]*`", "``", text)


def measured_figures(text: str) -> list[tuple[int, str]]:
  """(line, figure) for each measured-looking figure in the prose of `text`."""
  found = []
  for number, line in enumerate(_prose(text).split("\n"), 1):
    found += [(number, m.group(0)) for m in _MEASURED.finditer(line)]
  return found


@pytest.mark.parametrize("page", _PAGES, ids=lambda p: os.path.relpath(p, _ROOT))
def test_no_hand_copied_measurements(page):
  with open(page) as f:
    found = measured_figures(f.read())
  assert not found, (
      f"{os.path.relpath(page, _ROOT)} quotes measured figures "
      + ", ".join(f"line {n}: {fig!r}" for n, fig in found)
      + "; link to the performance pages (docs/performance/), which are rendered "
      "from docs/benchmarks/*.json, instead of copying numbers by hand")


# What the scan must flag (figures this repository's README once carried) and
# what it must leave alone (versions, shapes, options, code).
_FLAGGED = (
    "on an H200 its fwd+bwd takes 0.68-0.78 of cuDNN's time at head size 32",
    "level with cuDNN, 0.99-1.03x; full and causal",
    "the selective scan's fwd+bwd is 10.9x faster than",
    "and 8.3x at 128, and",
    "the Mamba model's train step takes 0.14 of its time with the XLA scan",
    "at 0.79 (forward) and 0.85 (fwd+bwd) of one dense matmul's rate",
    "the bare 10-step scan takes 0.183 ms",
    "fit is 2.9 x slower there",
    "at 570 TFLOP/s",
    "runs at 2.2 TB/s on them",
    "about 30 % faster",
)
_LEFT_ALONE = (
    "JAX 0.11.2 and < 0.13, Python >= 3.12, dm-haiku 0.0.17",
    "more than 128 x 128 query rows, a 4x4 patch, MLP x4",
    "the `temperature` (`0.8`), `top_p=0.9`",
    "```python\ny = 10.9x\n```",
    "`make test` takes about 30 minutes on two CPU cores",
    "E / k times the arithmetic the routing needs",
)


@pytest.mark.parametrize("text", _FLAGGED)
def test_the_scan_flags_a_measurement(text):
  assert measured_figures(text), text


@pytest.mark.parametrize("text", _LEFT_ALONE)
def test_the_scan_leaves_versions_shapes_and_code_alone(text):
  assert not measured_figures(text), text


_SPECIFIER = re.compile(r"(>=|<=|==|<|>)\s*(\d[\w.]*)")


def _requirement(line: str) -> tuple[str, set[str]]:
  name = re.match(r"[\w.-]+", line).group(0)
  return name.lower(), {op + version for op, version in _SPECIFIER.findall(line)}


def test_build_notes_states_pyprojects_version_bounds():
  with open(os.path.join(_ROOT, "pyproject.toml"), "rb") as f:
    required = dict(_requirement(r) for r in tomllib.load(f)["project"]["dependencies"])
  with open(os.path.join(_ROOT, "BUILD_NOTES.md")) as f:
    notes = f.read()
  versions = notes[notes.index("## Versions"):]
  versions = versions[:versions.index("\n## ", 1)]
  checked = []
  for row in re.findall(r"^\| ([^|]+) \| ([^|]+) \|", versions, re.M):
    bounds = {op + version for op, version in _SPECIFIER.findall(row[1])}
    for name in re.findall(r"[\w.-]+", row[0].replace("`", "")):
      if name.lower() in required and bounds:
        assert bounds == required[name.lower()], (
            f"BUILD_NOTES.md, Versions: {name} {sorted(bounds)}; pyproject.toml says "
            f"{sorted(required[name.lower()])}")
        checked.append(name.lower())
  assert {"jax", "jaxlib", "dm-haiku", "orbax-checkpoint"} <= set(checked), checked
