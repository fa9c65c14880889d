# celery-redis-lua developer commands. `make test` is what CI runs (.ci/run).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

.PHONY: venv demo test test-all lint manifest bench bench-all clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test,hiredis]'
	touch $(STAMP)

## A tour on an embedded Valkey (or BROKER_URL=redis://... make demo).
demo: venv
	$(BIN)/python scripts/demo.py $(BROKER_URL)

## Run the whole test suite against throwaway Valkey and Redis servers.
test: venv
	$(BIN)/pytest

## Also the slow tests (chaos smoke runs and the like).
test-all: venv
	$(BIN)/pytest -m ''

## ruff on the Python, luacheck (Debian package lua-check) on the scripts.
lint: venv
	$(BIN)/ruff check python tests scripts
	luacheck lua

## Rewrite lua/manifest.json after changing a script (bump its version first).
manifest: venv
	$(BIN)/python scripts/gen_manifest.py

## Regenerate docs/scripts.md from the script headers (a test fails when it is stale).
.PHONY: scripts-doc
scripts-doc: venv
	$(BIN)/python -m celery_redis_lua.docgen

## Script-level benchmark: our scripts against the stock kombu protocol, same server, same run.
bench: venv
	$(BIN)/python scripts/bench_scripts.py

## Transport benchmark: ours vs stock kombu Redis, celery-redis-plus and RabbitMQ (~10 min;
## ARGS=--quick for ~2 min). Writes bench-results/ and docs/bench/latest.{json,png,md}.
bench-all: venv
	$(BIN)/pip install --quiet -e '.[test,bench]'
	$(BIN)/python -m scripts.bench $(ARGS)

clean:
	rm -rf $(VENV) dist build .pytest_cache .ruff_cache .hypothesis

## Chaos harness (issue 6): ARGS='--profile smoke|long --broker valkey|redis-aof|redis-aof-always
## --transport ours|stock --seed N'. Writes bench-results/chaos-*.json and docs/RELIABILITY.md.
.PHONY: chaos
chaos: venv
	$(BIN)/python -m scripts.chaos $(ARGS)
