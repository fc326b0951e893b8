# The two commands a user needs: `make demo` and `make test`. Both bring the services up.
SHELL := /bin/bash
PY := .venv/bin/python
VENV_STAMP := .venv/.installed

.PHONY: venv services services-down demo test test-fast lint typecheck pytest pytest-pg18 bench clean docs docs-serve package \
	after-suite after-pg18 after-wheel-quickstart after-wheel-testing after-wheel-snippets

venv: $(VENV_STAMP)

$(VENV_STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[all,testing]' --group dev
	touch $@

services: venv
	scripts/services up

services-down:
	scripts/services down

lint: venv
	.venv/bin/ruff check consumer_idem handlers examples tests scripts benchmarks docs/snippets
	.venv/bin/ruff format --check consumer_idem handlers examples tests scripts benchmarks docs/snippets
	.venv/bin/lint-imports

typecheck: venv
	.venv/bin/mypy

pytest: venv
	.venv/bin/pytest

# The Postgres-only test files again on PostgreSQL 18 (embedded, 127.0.0.1:5436; the list is in
# the script), beside the PostgreSQL 15 service the whole suite runs on.
pytest-pg18: venv services
	scripts/pytest-pg18

test: venv lint typecheck docs package services
	.venv/bin/pytest
	$(MAKE) --no-print-directory -j4 --output-sync=target after-suite

# After the suite, side by side (each one's output kept together): the Postgres-only files on
# PostgreSQL 18, and the built wheel as users install it (the quickstart, a new pytest project
# with only the testing extra, every guide's programs with only the extras their page names).
# They share no database and mostly wait on pip, so together they take the time of the longest.
after-suite: after-pg18 after-wheel-quickstart after-wheel-testing after-wheel-snippets
after-pg18:
	scripts/pytest-pg18
after-wheel-quickstart:
	scripts/wheel-quickstart
after-wheel-testing:
	scripts/wheel-testing
after-wheel-snippets:
	scripts/wheel-snippets

# Seconds, no service needed: the pure tests (keys, fingerprints, signatures, verdicts, options).
test-fast: venv
	.venv/bin/pytest -q -m "not services and not slow"

# The docs site into site/ (git-ignored). --strict: a broken link or include fails the build.
docs: venv
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict

# The docs site, live on http://127.0.0.1:8000 while you edit (mkdocs serve).
docs-serve: venv
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs serve

# The wheel and sdist into dist/ (git-ignored), checked as the package index will render them.
package: venv
	rm -rf dist
	$(PY) -m build --outdir dist .
	.venv/bin/twine check --strict dist/*

demo: venv services
	$(PY) -m examples.demo

bench: venv services
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) -m benchmarks.run

clean:
	rm -rf .venv .pytest_cache .mypy_cache .ruff_cache .hypothesis site dist .venv-lower
