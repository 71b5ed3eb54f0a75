# The few commands a newcomer types. Everything runs inside .venv (created on first use).
PY      ?= python3
VENV    ?= .venv
BIN      = $(VENV)/bin
# the per-user models directory, as minirun finds it ($MINIRUN_MODELS, else ~/.cache/minirun/models)
MODELS  ?= $(or $(MINIRUN_MODELS),$(or $(XDG_CACHE_HOME),$(HOME)/.cache)/minirun/models)
MODEL   ?= $(MODELS)/SmolLM2-135M-Instruct
ARGS    ?=

.PHONY: setup pull chat test test-fast check-cuda bench clean

$(BIN)/minirun: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# the CPU build of torch first (on these machines it is on disk); then the project
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,ray]'
	# compile the Numba kernels once (cached on disk): the first answer then runs at full speed
	$(BIN)/python scripts/warmup_kernels.py
	touch $(BIN)/minirun

setup: $(BIN)/minirun

$(MODEL)/config.json: | setup
	$(BIN)/minirun pull smollm2 --models-dir $(MODELS)

pull: $(MODEL)/config.json

chat: pull
	$(BIN)/minirun chat $(MODEL) $(ARGS)

# the tests spread over the machine's cores (pytest-xdist; an idle worker takes tests queued for
# another, and the slow tier is queued first); test-fast leaves out the slow tier
# (whole-script rehearsals) and the Ray replicas
test: setup
	$(BIN)/python -m pytest -q -n auto --dist worksteal $(ARGS)

test-fast: setup
	$(BIN)/python -m pytest -q -n auto --dist worksteal -m "not slow and not ray" $(ARGS)

check-cuda:
	bash scripts/check_cuda.sh

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
