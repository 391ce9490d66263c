# offloadlab: `make lab` to get going, `make test` to test, `make book` for the static site.
#
#   TORCH=...   the torch requirement pip installs first (default: what pip picks for this
#               platform, the CUDA build on Linux GPU servers); CI pins TORCH=torch==2.13.0.
#   VENV=...    where the environment lives (default .venv); VENV=$$CONDA_PREFIX reuses an
#               activated conda environment made from environment.yml.

VENV        ?= .venv
PYTHON      ?= python3
TORCH       ?= torch
PY          := $(VENV)/bin/python
SPHINXOPTS  ?= -W --keep-going -n
LAB_ROOT    := $(if $(filter 0,$(shell id -u)),--allow-root)
OVERRIDES   := $(VENV)/share/jupyter/lab/settings/overrides.json

.PHONY: env lab test book clean

## env: create the environment if missing, install or update everything in it
env:
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[lab,book,test]"
	@# Open the Jupytext .md chapters as notebooks by default in JupyterLab.
	install -D -m 644 etc/jupyterlab-overrides.json $(OVERRIDES)

## lab: start JupyterLab on the book, chapter 1 open as a notebook
lab: env
	$(VENV)/bin/jupyter lab $(LAB_ROOT) book/01_memory_wall.md

## test: unit tests, every chapter and lab through nbval, and the static-site build
test: env
	$(PY) -m pytest

## book: build the static site into book/_build/html (executes every notebook)
book: env
	$(PY) -m sphinx $(SPHINXOPTS) -b html book book/_build/html

clean:
	rm -rf book/_build .pytest_cache
