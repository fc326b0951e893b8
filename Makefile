# The two commands a user needs: `make demo` and `make test`. Both bring the services up.
SHELL := /bin/bash
PY := .venv/bin/python
VENV_STAMP := .venv/.installed

.PHONY: venv services services-down demo test lint typecheck pytest bench clean

venv: $(VENV_STAMP)

$(VENV_STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

services: venv
	scripts/services up

services-down:
	scripts/services down

lint: venv
	.venv/bin/ruff check consumer_idem handlers examples tests scripts benchmarks
	.venv/bin/ruff format --check consumer_idem handlers examples tests scripts benchmarks

typecheck: venv
	.venv/bin/mypy

pytest: venv
	.venv/bin/pytest

test: venv lint typecheck services
	.venv/bin/pytest

demo: venv services
	$(PY) -m examples.demo

bench: venv services
	$(PY) -m benchmarks.run

clean:
	rm -rf .venv .pytest_cache .mypy_cache .ruff_cache .hypothesis
