"""Draws the repository's architecture from its imports: docs/architecture.svg.

Folders are boxes, in layers (programs, models, ops, the ops' shared
machinery; tests/ mirrors the packages and imports all of them, so it is left
out); an arrow A -> B means some module of A imports one of B.
The picture is computed from the source, so it cannot drift from the code:
tests/test_contributing.py re-renders it and compares.

Usage: python -m experiments.architecture [--output=docs/architecture.svg]
"""

import ast
import collections
import html
import pathlib

from absl import app
from absl import flags

_ROOT = pathlib.Path(__file__).resolve().parent.parent

# (box, label, row); a module belongs to the first box whose prefix it has.
_BOXES = (
    ("experiments", "experiments/\nbenchmarks, jobs, gpu_check", 0),
    ("probjax_hk.ssm", "probjax_hk/ssm/\nSSMCell and five cells", 1),
    ("probjax_hk", "probjax_hk/\nmodels, attention, generate", 1),
    ("probjax_hk.training", "probjax_hk/training/\nfit, checkpoints", 1),
    ("ops.<op>", "ops/<op>/  (nine ops)\napi, reference, xla, kernels,\nconfigs + tuned.json", 2),
    ("ops.tuning", "ops/tuning.py\ntuned.json loader", 3),
    ("ops.registry", "ops/registry.py\nimplementations by name", 3),
    ("ops._private", "ops/_*.py\nsharding, shapes, lowering", 3),
    ("ops._measured", "ops/_measured.py\ndispatch_tables/*.json", 3),
)
_BOX_W, _BOX_H, _GAP_X, _GAP_Y, _MARGIN = 230, 70, 30, 70, 20


def box_of(module: str) -> str | None:
  """The box a dotted module name belongs to (None: outside the repository)."""
  parts = module.split(".")
  if parts[0] == "experiments":
    return parts[0]
  if parts[0] == "probjax_hk":
    if len(parts) > 1 and parts[1] in ("ssm", "training"):
      return f"probjax_hk.{parts[1]}"
    return "probjax_hk"
  if parts[0] == "ops":
    if len(parts) == 1:
      return "ops.<op>"  # the package's public names are the ops'
    if parts[1] in ("registry", "tuning", "_measured"):
      return f"ops.{parts[1]}"
    return "ops._private" if parts[1].startswith("_") else "ops.<op>"
  return None


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(_ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> set[tuple[str, str]]:
  """(from box, to box) for every import between two different boxes."""
  edges = set()
  for top in ("probjax_hk", "ops", "experiments"):  # tests/ import everything
    for path in sorted((_ROOT / top).rglob("*.py")):
      source = box_of(_module_name(path))
      for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
          names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "ops":
          names = [f"ops.{alias.name}" for alias in node.names]  # modules or op functions
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
          names = [node.module]
        targets = {box_of(n) for n in names} - {None, source}
        edges.update((source, target) for target in targets)
  return edges


def _positions() -> dict[str, tuple[float, float]]:
  rows = collections.defaultdict(list)
  for name, _, row in _BOXES:
    rows[row].append(name)
  widest = max(len(names) for names in rows.values())
  width = widest * _BOX_W + (widest - 1) * _GAP_X
  positions = {}
  for row, names in rows.items():
    row_width = len(names) * _BOX_W + (len(names) - 1) * _GAP_X
    x0 = _MARGIN + (width - row_width) / 2
    for i, name in enumerate(names):
      positions[name] = (x0 + i * (_BOX_W + _GAP_X), _MARGIN + row * (_BOX_H + _GAP_Y))
  return positions


def _arrow(source: tuple[float, float], target: tuple[float, float]) -> str:
  """Bottom to top between rows; side to side between neighbours of a row,
  and under the boxes between others of a row."""
  (x1, y1), (x2, y2) = source, target
  style = 'fill="none" stroke="#555" stroke-opacity="0.6" marker-end="url(#arrow)"'
  if y1 != y2:
    down = y2 > y1
    start = (x1 + _BOX_W / 2, y1 + (_BOX_H if down else 0))
    end = (x2 + _BOX_W / 2, y2 + (0 if down else _BOX_H))
    return f'<path d="M {start[0]:.0f} {start[1]:.0f} L {end[0]:.0f} {end[1]:.0f}" {style}/>'
  if abs(x2 - x1) <= _BOX_W + _GAP_X:
    start = (x1 + (_BOX_W if x2 > x1 else 0), y1 + _BOX_H / 2)
    end = (x2 + (0 if x2 > x1 else _BOX_W), y2 + _BOX_H / 2)
    return f'<path d="M {start[0]:.0f} {start[1]:.0f} L {end[0]:.0f} {end[1]:.0f}" {style}/>'
  bottom = y1 + _BOX_H
  a, b = x1 + _BOX_W / 2, x2 + _BOX_W / 2
  return (f'<path d="M {a:.0f} {bottom:.0f} Q {(a + b) / 2:.0f} {bottom + 2 * _MARGIN:.0f} '
          f'{b:.0f} {bottom:.0f}" {style}/>')


def render(edges: set[tuple[str, str]]) -> str:
  """The SVG text of the boxes and the arrows between them."""
  positions = _positions()
  width = max(x for x, _ in positions.values()) + _BOX_W + _MARGIN
  height = max(y for _, y in positions.values()) + _BOX_H + 2 * _MARGIN
  out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
         f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="sans-serif" font-size="12">',
         '<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" '
         'markerHeight="7" orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z" '
         'fill="#555"/></marker></defs>']
  for source, target in sorted(edges):
    out.append(_arrow(positions[source], positions[target]))
  for name, label, _ in _BOXES:
    x, y = positions[name]
    out.append(f'<rect x="{x:.0f}" y="{y:.0f}" width="{_BOX_W}" height="{_BOX_H}" rx="6" '
               'fill="#eef3fb" stroke="#36c"/>')
    lines = label.split("\n")
    for i, line in enumerate(lines):
      weight = ' font-weight="bold"' if i == 0 else ""
      ty = y + _BOX_H / 2 + (i - (len(lines) - 1) / 2) * 15 + 4
      out.append(f'<text x="{x + _BOX_W / 2:.0f}" y="{ty:.0f}" text-anchor="middle"'
                 f'{weight}>{html.escape(line)}</text>')
  out.append("</svg>")
  return "\n".join(out) + "\n"


def main(argv):
  del argv
  pathlib.Path(flags.FLAGS.output).write_text(render(imports()))


if __name__ == "__main__":
  # Defined here, not on import: tests import `render` beside programs whose
  # own --output flag would collide.
  flags.DEFINE_string("output", str(_ROOT / "docs" / "architecture.svg"), "Where to write the SVG.")
  app.run(main)
