# Two entry points, both self-installing on a fresh machine: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test typecheck setup clean

$(STAMP): pyproject.toml scripts/setup.sh
	VENV=$(VENV) scripts/setup.sh

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/echo-node demo $(ARGS)

# Two workers: the multi-process tests one after another on one, the in-process modules on the
# other (tests/conftest.py). `make test XDIST=` runs everything in one process.
XDIST ?= -n 2
test: $(STAMP)
	$(PY) -m pytest $(XDIST) $(PYTEST_ARGS)

# mypy --strict on protocol/, the default checks on echo_node/, bootstrap/ and benchmarks/.
typecheck: $(STAMP)
	PY=$(PY) scripts/typecheck.sh

clean:
	rm -rf $(VENV) build *.egg-info
