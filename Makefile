# Two commands matter: `make demo` and `make test`. Both build the environment they need.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# DeepSpeed compiles small C++ ops on first use; keep them with the venv so a second run is fast.
export TORCH_EXTENSIONS_DIR ?= $(abspath $(VENV))/torch_extensions
export DS_ACCELERATOR ?= cpu

.PHONY: venv test lint demo clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found; install Python 3.11 or run 'make PYTHON=python3.x ...'"; exit 1; }
	@# DeepSpeed's CPU communication op is compiled at the first training start (a C++ compiler and Python.h).
	@command -v $${CXX:-c++} >/dev/null || { echo "error: no C++ compiler ($${CXX:-c++}), which DeepSpeed needs to compile its CPU communication op; install one (Debian/Ubuntu: apt-get install g++)"; exit 1; }
	@$(PYTHON) -c "import os, sysconfig; raise SystemExit(not os.path.isfile(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))" || { echo "error: no Python.h for $(PYTHON), which DeepSpeed needs to compile its CPU communication op; install the headers (Debian/Ubuntu: apt-get install python3.11-dev)"; exit 1; }
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[cpu,dev]'
	@touch $@

lint: venv
	$(VENV)/bin/ruff check .

test: lint
	$(PY) -m pytest $(PYTEST_ARGS)

demo: venv
	$(PY) scripts/demo.py $(DEMO_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache results/demo
