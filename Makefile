# The README's commands: `make demo`, `make test` and `make test-fast`. Each builds .venv on first use:
# torch==2.13.0 first (a CPU build that is on this kind of machine), then the project with
# its test tools, matplotlib (the demo's loss curve PNG) and pyarrow (Parquet input).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[dev,plot,parquet]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/swarmtrain demo --baseline

# Everything: ruff, the unit tier, then the live tier (real p2pd daemons and swarms) in
# three workers, each file whole in one worker, the longest files first (tests/live/
# conftest.py says why). One live test alone waits on timers and peers more than on the
# cores, but three together keep both cores of a 2-core machine busy: the tier is bound by
# CPU (much of it the imports and p2pd daemons of the processes it starts), so a fourth
# worker does not shorten it.
# Beside those workers, the tests that fork hivemind averagers from the test process
# itself run in a plain pytest process (its output printed when it ends): forked from an
# xdist worker (which runs threads of its own), an averager child now and then never
# started. The floods (a thousand requests, thousands of streams and records) run last,
# alone: beside them, other tests' timeouts measured the flood, not the code.
FORKS_AVERAGERS := tests/live/test_averaging.py tests/live/test_diloco_load.py
FLOODS := tests/live/test_flood.py tests/live/test_sybil.py
APART := $(FORKS_AVERAGERS) $(FLOODS)
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/pytest tests/unit -n 2 --durations=10
	forks_log=$$(mktemp); \
	$(BIN)/pytest $(FORKS_AVERAGERS) --durations=5 > $$forks_log 2>&1 & forks=$$!; \
	$(BIN)/pytest tests/live -n 3 --dist loadfile --no-loadscope-reorder --durations=10 \
		$(APART:%=--ignore=%); live=$$?; \
	wait $$forks; forked=$$?; cat $$forks_log; rm -f $$forks_log; \
	test $$live = 0 && test $$forked = 0
	$(BIN)/pytest $(FLOODS) --durations=5

# The unit tier alone: no processes, no sockets, under a minute (in two workers: it is
# CPU-bound).
test-fast: $(STAMP)
	$(BIN)/pytest tests/unit -n 2 --durations=10
