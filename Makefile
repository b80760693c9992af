# Two commands matter on a fresh machine: `make demo` and `make test`.
# Both create .venv and install everything they need into it.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
# A CPU wheel of torch lies on disk on the build machines; pinning it here
# keeps pip from pulling a multi-gigabyte CUDA build where no GPU exists.
TORCH_SPEC ?= torch==2.13.0

.PHONY: venv demo test test-fast bench protos protos-check config-docs lint clean

venv: $(STAMP)

$(STAMP): pyproject.toml daemon/snapshot/_kernels.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[dev]"
	touch $(STAMP)

demo: venv
	$(VENV)/bin/stalwart demo

test: venv
	bash scripts/install-system-deps.sh
	$(PY) scripts/gen_protos.py --check
	$(PY) scripts/gen_config_docs.py --check
	$(PY) scripts/readme_demo.py --check
	$(VENV)/bin/ruff check .
	# Unit tests share the cores; the multiprocess tests each need both, so run one at a time.
	$(PY) -m pytest -q -m "not multiprocess" -n 2
	$(PY) -m pytest -q -m multiprocess

test-fast: venv
	$(PY) -m pytest -q -m "not multiprocess" -n 2

bench: venv
	mkdir -p out
	$(VENV)/bin/stalwart bench all --quick --json out/bench.json

protos: venv
	$(PY) scripts/gen_protos.py

protos-check: venv
	$(PY) scripts/gen_protos.py --check

# The configuration table in docs/operations.md, from SCHEMA in daemon/config_schema.py.
config-docs: venv
	$(PY) scripts/gen_config_docs.py

lint: venv
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis out
