# Two commands for a fresh machine with Python 3.11: `make demo` and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[test,embedded]'
	touch $@

.PHONY: demo test matrix clean
demo: $(VENV)/.installed   ## run the ledger example (embedded Redis unless REDIS_URL is set)
	$(VENV)/bin/python -m example_project.demo

test: $(VENV)/.installed   ## run the test suite (the README's test command)
	$(VENV)/bin/python -m pytest -q -n 2 --dist loadfile

matrix: $(VENV)/.installed   ## the version matrix (README "Compatibility"); QUICK=1 for --quick
	$(VENV)/bin/python -m tests.matrix $(if $(QUICK),--quick)

clean:
	rm -rf $(VENV)
