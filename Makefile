# Two commands on a fresh machine: `make demo` and `make test` (both set everything up).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
FMNIST := /usr/share/datasets/fashion-mnist
# Without this the SuperLink runs `uv sync` for the app and pulls a multi-GB CUDA torch.
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION := 1
# Flower's processes start each other from PATH.
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: setup data tools demo test durations test-kernels lint bench clean

setup: $(VENV)/.installed

# torch first, the CPU build; the project's range (torch>=2.0.1,<3) then leaves it alone.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $@

# Debian's Fashion-MNIST where apt exists; otherwise the app downloads it with checksums.
data:
	@if [ ! -f $(FMNIST)/train-images-idx3-ubyte.gz ] && command -v apt-get >/dev/null; then \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get install -y -qq dataset-fashion-mnist >/dev/null 2>&1 || \
		{ $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq dataset-fashion-mnist; }; \
	fi

# openssl (TLS certificates) and ssh-keygen (SuperNode keys) for the deployment tests;
# podman (with runc, for sandboxes where crun cannot set up cgroups) and mmdebstrap (the
# local base image) for the container tests. podman-compose comes with the dev extras.
# chromium: the MLflow UI in a real browser (tests/test_tracking.py).
TOOLS = openssl:openssl ssh-keygen:openssh-client mmdebstrap:mmdebstrap podman:podman runc:runc \
	chromium:chromium

tools:
	@missing=""; for pair in $(TOOLS); do \
		command -v $${pair%%:*} >/dev/null || missing="$$missing $${pair#*:}"; \
	done; \
	if [ -n "$$missing" ] && command -v apt-get >/dev/null; then \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get install -y -qq $$missing >/dev/null 2>&1 || \
		{ $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq $$missing; }; \
	fi

# The main job: FedPSA as its paper defines it (server step as written, eq. 20) on the
# paper's kind of split (Dirichlet 0.1, Hsu et al.), run locally on every core; then a
# one-screen summary. RUN_CONFIG's keys come last and override these (README, Two commands).
# A demo run before this one is moved aside to runs/demo.previous-<time>, never deleted.
DEMO_NAME = demo
DEMO_CONFIG = strategy=fedpsa server-step=spec partition=dirichlet dirichlet-alpha=0.1 \
	dirichlet-convention=hsu max-virtual-time=535680 eval-interval=8640 run-name=$(DEMO_NAME)

demo: setup data
	$(BIN)/fedstale run --local --overwrite --run-config "$(DEMO_CONFIG)" --run-config "$(RUN_CONFIG)"
	$(BIN)/fedstale compare runs/$(DEMO_NAME) --out runs/$(DEMO_NAME)/summary --last 10 --target 0.8

# --durations: the slowest tests' share of the run, in every CI log. Two pytest-xdist
# workers (one per core here); the tests that start real SuperNodes, containers or a Ray
# cluster run one after another on one worker (xdist_group "deployments"), the tests that
# build and use the wheel's virtualenvs on one worker (xdist_group "venvs").
TEST_WORKERS ?= 2
test: setup data tools
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=15

# Each test is bounded by its measured time (tests/timing.py, tests/durations.json): after a
# test grows on purpose, record the table again (each test's slowest recorded time is kept).
durations: setup data tools
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --record-durations tests/durations.json

# The suite under kernel settings that change the numerics on an x86 box (docs/testing.md, Golden
# runs on any CPU): each must pass as the default does.
KERNEL_SETTINGS = "ATEN_CPU_CAPABILITY=default OMP_NUM_THREADS=1" \
	"ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2" "OPENBLAS_CORETYPE=Haswell"

test-kernels: setup data tools
	@for setting in $(KERNEL_SETTINGS); do \
		echo "== $$setting"; env $$setting $(BIN)/python -m pytest -q || exit 1; \
	done

lint: setup
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

bench: setup data
	$(BIN)/python -m bench.throughput

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
