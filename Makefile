# Two commands: `make run` (set up + the main job on embedded defaults) and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export TIDEFLOW_HOME ?= $(CURDIR)/.tideflow

.PHONY: run test test-fast test-slow journey bench setup clean prometheus browser gpu-check docs

setup: $(STAMP)

# torch comes from the CPU wheel on this disk via constraints.txt; the project is installed editable.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt torch==2.13.0
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev]' --config-settings editable_mode=compat
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/tideflow release

test: $(STAMP) prometheus browser
	$(BIN)/python -m pytest -q -m "not slow"

# The inner loop: the tests that start no process and no server (tests/conftest.py marks the others `fleet`).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not fleet"

test-slow: $(STAMP) prometheus
	$(BIN)/python -m pytest -q -m slow

# The reference pages generated from the code (docs/reference/cli.md, config.md); tests/test_reference.py
# fails when they drift.
docs: $(STAMP)
	$(BIN)/python scripts/reference.py

# The operator's day from the Prefect UI alone (also part of test-slow): tests/flows/test_operator_journey.py
journey: $(STAMP)
	$(BIN)/python -m pytest -q tests/flows/test_operator_journey.py

# Every claim's benchmark (guidellm_crosscheck.py and peer_vllm.py need their own venvs: see their docstrings).
BENCHES := decode serving stream_curve http_overhead fairness mixed_step kernel_ops weights pd ep warm tidal failover profile_engine router_stall router_kill chaos
bench: $(STAMP)
	for b in $(BENCHES); do $(BIN)/python benchmarks/$$b.py || exit 1; done

# The canary tests start a real Prometheus (Debian's package, which brings promtool); installs it when missing.
prometheus:
	command -v prometheus >/dev/null || { apt-get update && apt-get install -y prometheus; }

# The release test opens the Prefect UI in Debian's headless chromium through its chromedriver.
browser:
	command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
		{ apt-get update && apt-get install -y --no-install-recommends chromium chromium-driver; }

# On a machine with a GPU: the GPU path end to end in under 8 minutes (needs torch built for CUDA and nvcc).
gpu-check:
	bash scripts/gpu_check.sh

clean:
	rm -rf $(VENV) .tideflow
