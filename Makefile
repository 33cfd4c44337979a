# Two commands for users: `make demo` (the main job) and `make test`. Both build .venv on first use.
PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
# Where torch comes from on a machine without CUDA. Empty: pip's own configuration (PyPI, or a local
# wheel where the machine has one). On a CPU laptop set TORCH_INDEX=https://download.pytorch.org/whl/cpu
# to fetch the ~200 MB CPU build instead of PyPI's multi-GB CUDA build.
TORCH_INDEX ?=
PY := $(VENV)/bin/python
STAMP := $(VENV)/.mlmkit-installed
PYTEST_ARGS ?=
# Optional extras installed into .venv: add mpi for Cluster(profile="mpi") (`make env EXTRAS=test,mpi`).
EXTRAS ?= test
# The stamp lists the extras installed so far; asking for one it lacks (`make env EXTRAS=test,mpi` on
# a .venv built by `make test`) installs again, keeping the extras already there.
comma := ,
space := $(subst ,, )
WANT_EXTRAS := $(subst $(comma),$(space),$(EXTRAS))
HAVE_EXTRAS := $(shell cat $(STAMP) 2>/dev/null)
ALL_EXTRAS := $(subst $(space),$(comma),$(sort $(WANT_EXTRAS) $(HAVE_EXTRAS)))

.PHONY: demo test bench lab env clean FORCE

env: $(STAMP)

ifneq ($(filter-out $(HAVE_EXTRAS),$(WANT_EXTRAS)),)
$(STAMP): FORCE
endif

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	  echo "mlmkit: CUDA GPU found, installing torch==$(TORCH_VERSION) (CUDA build)"; \
	  $(PY) -m pip install -q "torch==$(TORCH_VERSION)"; \
	elif [ -n "$(TORCH_INDEX)" ]; then \
	  echo "mlmkit: no CUDA GPU, installing torch==$(TORCH_VERSION) from $(TORCH_INDEX)"; \
	  $(PY) -m pip install -q "torch==$(TORCH_VERSION)" --index-url "$(TORCH_INDEX)"; \
	else \
	  echo "mlmkit: no CUDA GPU, installing torch==$(TORCH_VERSION)"; \
	  $(PY) -m pip install -q "torch==$(TORCH_VERSION)"; \
	fi
	$(PY) -m pip install -q -e ".[$(ALL_EXTRAS)]"
	@echo "$(sort $(WANT_EXTRAS) $(HAVE_EXTRAS))" > $(STAMP)

demo: $(STAMP)
	$(PY) -m mlmkit.demo

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m benchmarks

lab: $(STAMP)
	$(VENV)/bin/jupyter lab --ip 127.0.0.1 notebooks/

clean:
	rm -rf $(VENV) reports artifacts
