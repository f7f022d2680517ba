# Two commands, each doing its own set-up on a fresh clone:
#   make demo   train a small model on CPU and print the loss falling
#   make test   the whole test suite on JAX_VERSION, then the tests that a JAX
#               release can break on JAX_NEXT (a second venv; both set below);
#               its last line is its wall time, "test: N s"
# and, on a CUDA machine, make gpu-check (below).
# `.python-version` makes pyenv's python3 a 3.12; python3.12 is tried first.
BOOT_PYTHON ?= $(shell command -v python3.12 2>/dev/null || echo python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The JAX releases tested (pyproject.toml admits >=0.11.2,<0.13). The first is
# the GPU machines' and runs every test. The second runs what a release can
# break, the tests marked `jax_release` by this rule (tests/conftest.py holds
# the lists): every test of the files that exercise JAX's moving parts as a
# whole, one file per mechanism (the Triton and shared lowering, shard_map,
# the ops per shard, the sequence pass and the ring, expert parallelism, fit on
# a mesh, several processes, checkpoints, the README's examples, the wheel's
# install), every test that lowers for Hopper (the `hopper_lowering` fixture),
# and per kernel one interpret-mode numerics test against its reference. A new
# kernel adds its numerics test to the list; collection fails on a listed test
# that no longer exists.
JAX_VERSION := 0.11.2
JAX_NEXT := 0.12.0.1
# Inside .venv/, which .gitignore covers and `make clean` removes.
VENV_NEXT := $(VENV)/jax-next
STAMP_NEXT := $(VENV_NEXT)/.installed
NEXT_TESTS := -m jax_release tests
# Two workers for CI's two cores; a file stays on one worker, so a module's
# 8-device subprocess runs once. Files go out in collection order, which
# tests/conftest.py makes longest first when TEST_CACHE holds the last run's
# times. The 30 slowest tests close each log.
PYTEST := -m pytest -n 2 --dist loadfile --no-loadscope-reorder -q --durations=30
# TEST_CACHE=DIR keeps the tests' compilation cache in DIR from one run to the
# next (by default each run has a fresh one, tests/conftest.py). Its entries
# are keyed on the compiled program, the jax/jaxlib release and the XLA flags,
# so an entry serves only the same program; most of a run's time is XLA:CPU
# compiling, which a warm cache skips. .ci/run sets it; the folder is emptied
# once it holds more than TEST_CACHE_MAX_MB.
TEST_CACHE ?=
TEST_CACHE_MAX_MB ?= 4096
TEST_ENV := JAX_PLATFORMS=cpu $(if $(TEST_CACHE),PROBJAX_HK_TEST_COMPILE_CACHE=$(TEST_CACHE))

# $(call install_venv,DIR,JAX): a venv in DIR with the package (editable), its
# test extra and that JAX release.
define install_venv
	$(BOOT_PYTHON) -c 'import sys; assert sys.version_info >= (3, 12), "probjax_hk needs Python >= 3.12, got " + sys.version'
	$(BOOT_PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install -q --upgrade pip
	$(1)/bin/python -m pip install -q -e '.[test]' 'jax==$(2)' 'jaxlib==$(2)'
	touch $(1)/.installed
endef

.PHONY: demo test test-suite test-jax-next clean

$(STAMP): pyproject.toml
	$(call install_venv,$(VENV),$(JAX_VERSION))

$(STAMP_NEXT): pyproject.toml
	$(call install_venv,$(VENV_NEXT),$(JAX_NEXT))

demo: $(STAMP)
	d=$$(mktemp -d) && JAX_PLATFORMS=cpu $(PY) -m experiments.train --steps=200 --output_dir=$$d && JAX_PLATFORMS=cpu $(PY) -m experiments.train --steps=300 --output_dir=$$d && JAX_PLATFORMS=cpu $(PY) -m experiments.train --model=unet --steps=300 --output_dir=$$d/unet

# The second venv installs while the first suite runs (pip waits on the
# network and the disk, the suite on the CPU); both parts run even when one
# fails, and the exit status is theirs.
test:
	@start=$$(date +%s); \
	if [ -n "$(TEST_CACHE)" ] && [ -d "$(TEST_CACHE)" ]; then \
	  size=$$(du -sm "$(TEST_CACHE)" | cut -f1); \
	  echo "compilation cache: $(TEST_CACHE), $$size MB"; \
	  if [ $$size -gt $(TEST_CACHE_MAX_MB) ]; then echo "over $(TEST_CACHE_MAX_MB) MB: emptied"; rm -rf "$(TEST_CACHE)"; fi; \
	fi; \
	$(MAKE) --no-print-directory $(STAMP) && $(MAKE) --no-print-directory -j2 test-suite $(STAMP_NEXT); \
	first=$$?; \
	$(MAKE) --no-print-directory test-jax-next; \
	second=$$?; \
	echo "test: $$(( $$(date +%s) - start )) s"; \
	[ $$first -eq 0 ] && [ $$second -eq 0 ]

test-suite: $(STAMP)
	$(TEST_ENV) $(PY) $(PYTEST) tests

test-jax-next: $(STAMP_NEXT)
	$(TEST_ENV) $(VENV_NEXT)/bin/python $(PYTEST) $(NEXT_TESTS)

# make gpu-check: every kernel path checked on this machine's GPU, the first
# command on a new GPU (BUILD_NOTES.md, "Running the benchmarks on a CUDA
# machine"). It runs GPU_PYTHON, a Python with JAX for CUDA and this package
# installed, not the CPU-only .venv that `make test` builds.
GPU_PYTHON ?= python3
.PHONY: gpu-check

gpu-check:
	$(GPU_PYTHON) -m experiments.gpu_check

# make docs: the documentation site into docs/_build/html, warnings as errors.
DOCS_STAMP := $(VENV)/.docs-installed
.PHONY: docs

$(DOCS_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[docs]'
	touch $@

docs: $(DOCS_STAMP)
	JAX_PLATFORMS=cpu $(PY) -m sphinx -W --keep-going -b html docs docs/_build/html

clean:
	rm -rf $(VENV) *.egg-info
