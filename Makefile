# The front door. `make help` lists the targets.
.PHONY: help run test fuzz openapi lint fmt db faults bench-writes compose-test

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{ printf "  %-14s %s\n", $$1, $$2 }'

run: ## set everything up and run mnemo on the local PostgreSQL
	bash scripts/run.sh

test: ## set up PostgreSQL if needed, then lint and run the whole test suite
	bash scripts/test.sh

fuzz: ## the OpenAPI fuzz test with many more generated cases (MNEMO_FUZZ_EXAMPLES, default 500 per operation)
	MNEMO_FUZZ_EXAMPLES=$${MNEMO_FUZZ_EXAMPLES:-500} bash scripts/test.sh --test openapi

openapi: ## write the API's OpenAPI document to docs/openapi.json
	cargo run -q -p mnemo-runbook -- openapi > docs/openapi.json

lint: ## cargo fmt --check and clippy -D warnings
	cargo fmt --all --check
	cargo clippy --workspace --all-targets -- -D warnings

fmt: ## format the code
	cargo fmt --all

db: ## install and start the local PostgreSQL with pgvector (idempotent)
	bash scripts/setup-postgres.sh

faults: ## the fault suite, about 24 minutes (docs/benchmarks.md, "Faults"): worker kills, PostgreSQL restarts, embedding and chat endpoint outages, a full disk, under load
	bash scripts/faults.sh

bench-writes: ## the write benchmark (docs/benchmarks.md)
	bash scripts/bench.sh writes

compose-test: ## docker-compose.yml for real: local images, PostgreSQL, two workers, restart, a worker killed (4½ min the first time, then 1–2; needs a Docker engine, so not in make test)
	bash scripts/compose-test.sh
