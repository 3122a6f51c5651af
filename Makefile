# Two commands on a fresh machine: `make demo` (main job, CPU defaults) and `make test`.
# Both install what they need first (system packages when possible, then a virtualenv); both are idempotent.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
NOTEBOOKS := $(sort $(wildcard notebooks/[0-9]*.py))
DEMO_NOTEBOOKS := 00_flows_2d 01_shortcut_bc 02_aw_shortcut 03_reinflow 04_flow_sde 05_ablation_report 06_steering

.PHONY: install system-deps git-filter demo test test-fast unit nbval sync notebooks strip lab html check-pairs clean

install: system-deps $(STAMP) git-filter

# The one place for system packages (Vulkan for ManiSkill on CPU, OSMesa for Meta-World's frames): see flowlib/infra/sysdeps.py.
system-deps:
	@$(PYTHON) -m flowlib.sysdeps

# Saving a notebook in JupyterLab writes metadata that `make strip` removes (the Python patch version): this git filter
# strips it whenever git reads a notebook (status, diff, add), so opening and saving leaves the repository clean.
# Outputs are kept: they are nbval's references, refreshed on purpose by `make notebooks`.
git-filter: $(STAMP)
	@if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then \
		git config filter.nbstripout.clean '$(abspath $(PY)) -m nbstripout $(STRIP)' && \
		git config filter.nbstripout.smudge cat; fi

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU install path: keep the pin (the local CPU wheel); a plain `torch` pulls GBs of CUDA wheels.
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[dev,sim,metaworld,ray]"
	touch $@

demo: install
	@for nb in $(DEMO_NOTEBOOKS); do \
		echo "== $$nb (default parameters)"; \
		$(PY) -m flowlib.run $$nb || exit 1; \
	done
	@echo "Results: outputs/<notebook>/default/ (executed notebook, params.yaml, metrics, figures)"

# Unit tests and the notebooks' reference outputs, in one pytest run. Runs write to a temporary
# outputs root, so a test never resumes (or clobbers) one of your runs under outputs/.
test: install
	@tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	FLOWLIB_OUTPUTS=$$tmp $(PY) -m pytest tests notebooks --nbval-lax -v -rs --durations=15

# The quick lane (~3 min on 2 cores): the unit tests without a real simulator, a notebook run or a Ray head
# (the `sim` and `slow` markers, tests/conftest.py); `make test` still runs everything.
test-fast: install
	@tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	FLOWLIB_OUTPUTS=$$tmp $(PY) -m pytest tests -m "not sim and not slow" -q --durations=10

unit: install
	$(PY) -m pytest tests

# Re-pair every notebook from its .py source (keeps the .ipynb outputs of unchanged cells).
sync: install
	$(PY) -m jupytext --sync $(NOTEBOOKS)
	@$(MAKE) --no-print-directory strip

# Re-execute the notebooks on their defaults and store the outputs as the nbval references
# (progress as plain lines, as in a headless run: flowlib/infra/progress.py).
notebooks: install
	@for py in $(NOTEBOOKS); do \
		echo "== executing $$py"; \
		FLOWLIB_PROGRESS=lines $(PY) -m jupytext --sync --execute $$py || exit 1; \
	done
	@$(MAKE) --no-print-directory strip

# What changes at every execution (timestamps, random cell ids, the Python patch version) out of the .ipynb.
STRIP := --keep-output --keep-count --extra-keys "metadata.language_info.version"
strip: install
	$(VENV)/bin/nbstripout $(STRIP) $(NOTEBOOKS:.py=.ipynb)

# JupyterLab on the repository; notebooks/*.py open as notebooks (jupytext), outputs kept in the paired .ipynb.
# Its runs write outputs/<notebook>/lab unless they name a run (FLOWLIB_RUN_KIND=lab; make demo keeps default); saving
# strips what make strip strips, so an unchanged notebook stays as committed; closing a notebook's tab shuts its kernel
# down, and a kernel idle for 30 minutes is shut down too (flowlib/infra/lab.py writes the lab's settings).
LAB_SETTINGS := $(VENV)/share/jupyter/lab/settings
lab: install
	FLOWLIB_RUN_KIND=lab $(VENV)/bin/jupyter lab --notebook-dir=. $$([ "$$(id -u)" = 0 ] && echo --allow-root) \
		$$($(PY) -m flowlib.infra.lab $(LAB_SETTINGS)) notebooks/00_flows_2d.py

# The notebooks (reference outputs) as HTML pages under outputs/html/, equations rendered offline.
html: install
	$(PY) -m flowlib.export

check-pairs: install
	$(PY) -m pytest tests/test_notebooks.py

clean:
	rm -rf $(VENV) *.egg-info
