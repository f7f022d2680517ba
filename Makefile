# Two commands, each doing its own set-up on a fresh clone:
#   make demo   train a small model on CPU and print the loss falling
#   make test   the whole test suite
# `.python-version` makes pyenv's python3 a 3.12; python3.12 is tried first.
BOOT_PYTHON ?= $(shell command -v python3.12 2>/dev/null || echo python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test clean

$(STAMP): setup.py
	$(BOOT_PYTHON) -c 'import sys; assert sys.version_info >= (3, 12), "probjax_hk needs Python >= 3.12, got " + sys.version'
	$(BOOT_PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	d=$$(mktemp -d) && JAX_PLATFORMS=cpu $(PY) -m experiments.train --steps=200 --output_dir=$$d && JAX_PLATFORMS=cpu $(PY) -m experiments.train --steps=300 --output_dir=$$d && JAX_PLATFORMS=cpu $(PY) -m experiments.train --model=unet --steps=300 --output_dir=$$d/unet

test: $(STAMP)
	JAX_PLATFORMS=cpu $(PY) -m pytest -n 2 -q tests

clean:
	rm -rf $(VENV) *.egg-info
