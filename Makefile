# celery-redis-lua developer commands. `make test` is what CI runs (.ci/run).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

.PHONY: venv demo test test-all compat compat-ci lint manifest docs bench bench-all chaos dist clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test,hiredis]'
	touch $(STAMP)

## A tour on an embedded Valkey (or BROKER_URL=redis://... make demo; CLUSTER=1 for a cluster).
demo: venv
	$(BIN)/python -m scripts.demo $(BROKER_URL) $(if $(CLUSTER),--cluster)

## Run the whole test suite against throwaway Valkey and Redis servers.
test: venv
	$(BIN)/pytest

## Also the slow tests (chaos smoke runs and the like).
test-all: venv
	$(BIN)/pytest -m ''

## The version matrix (noxfile.py): kombu/Celery 5.4-5.7 x redis-py 5.0, 6, 7, 8, each with and
## without hiredis, on Valkey and Redis; a compatibility subset of the suite per combination
## (~2-3 min each, 32 of them). NOX_ARGS='-s "compat(5.4-redis5.0)"' runs one (nox -l lists them).
## Each full session records its run in docs/compat.json and rewrites the tested versions of
## README.md and docs/getting-started.md from it (scripts/compatdoc.py).
compat: venv
	$(BIN)/nox $(or $(NOX_ARGS),-t compat)

## The oldest declared combination (kombu/Celery 5.4, redis-py 5.0, no hiredis): its smoke subset.
compat-ci: venv
	$(BIN)/nox -s compat-ci $(NOX_ARGS)

## ruff on the Python, luacheck (Debian package lua-check) on the scripts, mypy --strict on
## the package (its configuration and per-module overrides: [tool.mypy] in pyproject.toml).
lint: venv
	$(BIN)/ruff check python tests scripts
	luacheck lua
	$(BIN)/mypy

## Rewrite lua/manifest.json after changing a script (bump its version first).
manifest: venv
	$(BIN)/python -m scripts.gen_manifest

## The documentation site (mkdocs.yml) into build/site: regenerates docs/scripts.md from the
## script headers, the options table of docs/configuration.md from options.py, and the tested
## versions of README.md and docs/getting-started.md from docs/compat.json (a test fails when
## any is stale), then builds with --strict: any warning, a broken link or anchor
## among them, fails it. NO_MKDOCS_2_WARNING silences mkdocs-material's end-of-life banner.
docs: venv
	$(BIN)/pip install --quiet -e '.[docs]'
	$(BIN)/python -m scripts.docgen
	$(BIN)/python -m scripts.optionsdoc
	$(BIN)/python -m scripts.compatdoc
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

## Script-level benchmark: our scripts against the stock kombu protocol, same server, same run.
bench: venv
	$(BIN)/python -m scripts.bench.lua_level

## Transport benchmark: ours vs stock kombu Redis, celery-redis-plus and RabbitMQ, kombu and
## Celery level (~10 min; ARGS=--quick for ~2 min). Writes bench-results/ and docs/bench/latest.*.
bench-all: venv
	$(BIN)/pip install --quiet -e '.[test,bench]'
	$(BIN)/python -m scripts.bench $(ARGS)

## Chaos harness: workers, a producer and seeded faults, then a verdict on the ledger.
## ARGS='--profile smoke|long --broker valkey|redis-aof|redis-aof-always|valkey-aof-always|...
##       --transport ours|stock --seed N [--faults power_loss,worker_kill,...]'. Writes
## bench-results/chaos-*.json and docs/RELIABILITY.md.
chaos: venv
	$(BIN)/python -m scripts.chaos $(ARGS)

## Build the sdist and the wheel into dist/ and check them (twine check).
dist: venv
	rm -rf dist
	$(BIN)/python -m build --outdir dist
	$(BIN)/python -m twine check --strict dist/*

clean:
	rm -rf $(VENV) dist build .pytest_cache .ruff_cache .hypothesis .nox
