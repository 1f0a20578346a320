# The course's two commands:  `make lab`  and  `make test`.
# Both create .venv on first use and install the pinned versions into it
# (torch first: on these machines any torch spec but the pin pulls a CUDA build).

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PORT   ?= 8888
STAMP  := $(VENV)/.dtlab-installed
# pytest-xdist processes for `make test`'s tests (much of the suite waits on engines,
# timeouts and kernels, so 2 helps on 2 cores). The chapters run one at a time: two
# chapters starting 4 engines each at once on 2 cores once left one engine unregistered
# after 120 s
WORKERS ?= 2

.PHONY: lab test install clean figures browser

lab: $(STAMP)
	$(BIN)/dtlab lab --port $(PORT) $(LAB_ARGS)

test: $(STAMP)
	$(BIN)/ruff check dtlab tests notebooks cluster
	$(BIN)/ruff format --check dtlab tests notebooks cluster
	$(BIN)/python -m pytest -n $(WORKERS) --durations=20 tests
	DTLAB_SUBSTITUTE_SOLUTIONS=1 $(BIN)/python -m pytest --nbval-lax --nbval-current-env --nbval-cell-timeout=300 \
		-p tests.nbval_guard notebooks

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$$(grep '^torch==' constraints.txt)"
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[test]"
	touch $(STAMP)

# The README's picture, from a real run on 4 CPU engines.
figures: $(STAMP)
	$(BIN)/python -m dtlab.lab.snapshot docs/dashboard.png

# Only the real-browser test (JupyterLab driven by Chromium), with screenshots kept.
browser: $(STAMP)
	DTLAB_SAVE_SCREENSHOTS=1 $(BIN)/python -m pytest -m browser tests

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
