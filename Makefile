# offloadlab: `make lab` to get going, `make test` to test, `make book` for the static site.
#
#   PYTHON=...  the Python that makes the environment (default python3 on PATH); for a course
#               (`make course`) one that every user can run, such as Debian's /usr/bin/python3.
#   TORCH=...   the torch requirement pip installs first (default: what pip picks for this
#               platform, the CUDA build on Linux GPU servers); CI tests TORCH=torch==2.13.0.
#   VENV=...    where the environment lives (default .venv); VENV=$$CONDA_PREFIX reuses an
#               activated conda environment made from environment.yml.

VENV        ?= .venv
PYTHON      ?= python3
TORCH       ?= torch
PY          := $(VENV)/bin/python
SPHINXOPTS  ?= -W --keep-going -n
LAB_ROOT    := $(if $(filter 0,$(shell id -u)),--allow-root)
OVERRIDES   := $(VENV)/share/jupyter/lab/settings/overrides.json
KERNEL_CONF := $(VENV)/etc/ipython/ipython_kernel_config.py
MATHJAX     := book/_static/mathjax
PYODIDE     := book/_static/pyodide
# The calculators' Python: Pyodide's core (interpreter and standard library), no packages.
PYODIDE_NPM := pyodide@0.29.5

# nbgrader's server side, off for a reader alone (Lab's side: etc/self-study/labconfig).
NO_NBGRADER := {$(foreach e,formgrader course_list assignment_list validate_assignment,"nbgrader.server_extensions.$(e)": False,)"jupyterlab": True}
# What ruff lints and formats (pyproject.toml's [tool.ruff]); the notebooks are `make format`'s.
PYTHON_SOURCES := offloadlab course/offloadlab_course course/*.py tests tools
STUDENT_DIR ?= build/student
NBGRADER_DIR ?= build/nbgrader/source

.PHONY: env course lab test test-fast book book-student pdf student gpu-env gpu-check format clean

## env: create the environment if missing, install or update everything in it
env:
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[lab,book,test]" -e ./course
	@# Open the Jupytext .md chapters as notebooks by default in JupyterLab.
	install -D -m 644 etc/jupyterlab-overrides.json $(OVERRIDES)
	@# Every kernel of the environment draws figures as SVG in the book's style.
	install -D -m 644 etc/ipython_kernel_config.py $(KERNEL_CONF)

## course: the environment a JupyterHub's users share (book/course.md): the labs, JupyterHub,
## nbgrader and nbgitpuller, the Lab settings and the course's nbgrader settings inside it.
## Refuses a PYTHON, or a checkout, that the students could not read.
course:
	$(PYTHON) course/check_shared.py $(CURDIR)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[lab,course]" -e ./course
	install -D -m 644 etc/jupyterlab-overrides.json $(OVERRIDES)
	install -D -m 644 course/nbgrader_config.py $(VENV)/etc/jupyter/nbgrader_config.py

# An environment is made only when it is missing: targets that merely use one depend on this file.
$(PY):
	$(MAKE) env

## lab: start JupyterLab on the book; the URL it prints opens chapter 1 as a notebook
## (etc/jupyter_server_config.json: rooted at book/, the site's build files hidden). The labs
## are in labs/ with their worked answers folded; student/ holds each lab as a student gets it
## (stubs to fill in), written once and then left to the reader's work. nbgrader's menus are
## off (etc/self-study): they are for a course's hub.
lab: env
	$(PY) -m offloadlab_course.student --keep labs book/student
	JUPYTER_CONFIG_PATH=$(CURDIR)/etc/self-study $(VENV)/bin/jupyter lab $(LAB_ROOT) \
		--config=etc/jupyter_server_config.json '--ServerApp.jpserver_extensions=$(NO_NBGRADER)'

## test: ruff's lint and format check, unit tests, every chapter and lab through nbval, the
## static site and its browser checks, on up to four cores (what shares state runs on one:
## tests/conftest.py's worker_group); the 30 slowest are named at the end
test: env $(MATHJAX)/tex-chtml.js $(PYODIDE)/pyodide.asm.wasm
	$(PY) -m ruff check $(PYTHON_SOURCES)
	$(PY) -m ruff format --check $(PYTHON_SOURCES)
	$(PY) -m pytest -n auto --maxprocesses 4 --durations=30

## test-fast: ruff and the unit tests, without the notebooks, the site, the hub, the browser and
## the other slow ones (marked slow; tests/conftest.py lists the modules), on up to four cores: a
## contributor's check in a few minutes, in the environment as it is. `make test` runs everything.
test-fast: | $(PY)
	$(PY) -m ruff check $(PYTHON_SOURCES)
	$(PY) -m ruff format --check $(PYTHON_SOURCES)
	$(PY) -m pytest tests -m "not slow" -n auto --maxprocesses 4

## book: build the static site into book/_build/html (executes every notebook), with the book as
## a PDF it offers on every page; without Chromium, the site alone, saying it has no PDF
book: env $(MATHJAX)/tex-chtml.js $(PYODIDE)/pyodide.asm.wasm
	@if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then \
		$(MAKE) --no-print-directory pdf; \
	else \
		echo "make book: no Chromium here, so the site has no PDF (apt-get install chromium, then make book)"; \
	fi
	$(PY) -m sphinx $(SPHINXOPTS) -b html book book/_build/html

## book-student: the same site without the exercises' solutions, into book/_build/student
book-student: env $(MATHJAX)/tex-chtml.js $(PYODIDE)/pyodide.asm.wasm
	OFFLOADLAB_STUDENT=1 $(PY) -m sphinx $(SPHINXOPTS) -b html book book/_build/student

## pdf: the whole book as one PDF, book/_build/pdf/offloadlab.pdf: Chromium prints the single-page
## build (needs Debian's chromium) with a title page, contents with page numbers, bookmarks and
## running heads; `make book` runs it first and links the PDF from every page
pdf: env $(MATHJAX)/tex-chtml.js $(PYODIDE)/pyodide.asm.wasm
	$(PY) -m sphinx $(SPHINXOPTS) -b singlehtml book book/_build/singlehtml
	$(PY) tools/print_pdf.py book/_build/singlehtml book/_build/pdf/offloadlab.pdf

## student: the labs with their solutions replaced by stubs, into $(STUDENT_DIR) (no nbgrader
## needed), and as nbgrader source notebooks, one assignment per lab, into $(NBGRADER_DIR);
## uses the environment as it is (making one only if there is none), so an instructor who
## cannot write to it can still run it, with both folders set to places of their own
student: | $(PY)
	$(PY) -m offloadlab_course.student --force labs $(STUDENT_DIR)
	$(PY) -m offloadlab_course.student --force --nbgrader labs $(NBGRADER_DIR)

## gpu-env: the environment gpu-check runs in on a GPU machine: `make env` (TORCH=the CUDA build
## of torch for the driver) and the peers its benchmarks compare against (torchao, accelerate,
## deepspeed: the `peers` extra), installed beside that torch without replacing it
gpu-env: env
	$(PY) -m pip install --quiet -e ".[peers]"

## gpu-check: every GPU test, notebook (quick mode) and benchmark on a CUDA machine, results in
## build/gpu-check (and reference data in offloadlab/reference); without a GPU, the CPU parts only.
## It runs in the environment `make gpu-env` made and installs nothing (a bare `pip install torch`
## could replace the CUDA build that matches the driver). DeepSpeed's CPU Adam is built first,
## before anything is timed, and each part is killed at its own time limit.
## GPU_CHECK=--dry-run prints the plan instead: each part's pinned and device memory, estimated
## time and limit (add --profile NAME for another GPU). GPU_CHECK=--only PART runs one part (peers,
## tests, book, labs, probe, bench-link, bench-overlap, bench-adam, bench-offload,
## bench-activations, bench-prefetch, bench-nvme), each planned to fit a 10-minute command; the
## parts' results gather in one summary.
GPU_CHECK ?=
gpu-check:
	@test -x $(PY) || { echo "gpu-check: no environment in $(VENV); make one first: make gpu-env TORCH=<the torch build for this GPU's driver>"; exit 2; }
	$(PY) tools/gpu_check.py --out build/gpu-check $(GPU_CHECK)

## format: format the package, the tests and the tools with ruff (`make test` checks them: ruff
## check and ruff format --check, lines of at most 100 characters); rewrite every chapter and lab
## to the exact text Jupytext writes for it, so that saving
## in JupyterLab changes nothing (metadata and wrapping only; cells of checks and lab answers
## folded), and write citations and references to other chapters as links that Lab shows as
## "(Ren et al., 2021)" and the chapter's title (the site renders them as before)
format: env
	$(PY) -m ruff format $(PYTHON_SOURCES)
	$(PY) tools/format_notebooks.py
	$(PY) tools/lab_references.py

# MathJax served from the site itself, so pages render math offline (needs Node.js's npm once).
$(MATHJAX)/tex-chtml.js:
	npm install --no-save --no-audit --no-fund --prefix build/npm mathjax@3
	rm -rf $(MATHJAX) && mkdir -p $(MATHJAX)/output/chtml $(MATHJAX)/input/tex
	cp build/npm/node_modules/mathjax/es5/tex-chtml.js $(MATHJAX)/
	cp -r build/npm/node_modules/mathjax/es5/output/chtml/fonts $(MATHJAX)/output/chtml/
	cp -r build/npm/node_modules/mathjax/es5/input/tex/extensions $(MATHJAX)/input/tex/
	cp -r build/npm/node_modules/mathjax/es5/a11y build/npm/node_modules/mathjax/es5/ui $(MATHJAX)/

# Pyodide's core, served from the site itself for the live calculators (chapters 1, 3, 4, 5, 9),
# fetched by npm like MathJax: the loader, the WebAssembly interpreter, the standard library and
# the lock file it reads at start; none of Pyodide's packages (the calculators need none).
$(PYODIDE)/pyodide.asm.wasm:
	npm install --no-save --no-audit --no-fund --prefix build/npm-pyodide $(PYODIDE_NPM)
	rm -rf $(PYODIDE) && mkdir -p $(PYODIDE)
	cd build/npm-pyodide/node_modules/pyodide && cp pyodide.js pyodide.asm.js python_stdlib.zip \
	    pyodide-lock.json package.json $(CURDIR)/$(PYODIDE)/
	cp build/npm-pyodide/node_modules/pyodide/pyodide.asm.wasm $(PYODIDE)/

clean:
	rm -rf book/_build build .pytest_cache $(MATHJAX) $(PYODIDE)
