# Quick start:  make demo   (CPU hot-swap demo: 4 workers + 1 warm spare, one SIGKILL)
#               make test   (the test suite without its long cases, CPU only; make test-all: every test)
PY      := .venv/bin/python
STAMP   := .venv/.installed
TORCH   := torch==2.13.0

.PHONY: demo test test-slow test-all bench sim figures reproduce clean

$(STAMP): pyproject.toml
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev,slurm]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m deadpool.train experiment=cpu_hotswap

# the invariants first, then the outcomes (-m results: measured or simulated results checked
# against targets), reported apart. The long multi-process cases (-m slow) are test-slow's, but
# for the `core` ones (a recovery of each kind, with real processes); CI runs test-all
test: $(STAMP)
	$(PY) -m pytest -q -m "(core or not slow) and not results" --durations=15 tests
	@echo "== outcomes, not invariants (-m results): measured and simulated results against their targets =="
	$(PY) -m pytest -q -m results tests

test-slow: $(STAMP)
	$(PY) -m pytest -q -m "slow and not core and not results" --durations=25 tests

test-all: test test-slow

sim: $(STAMP)
	$(PY) -m sim.run

figures: $(STAMP)
	$(PY) -m paper_figures

# make reproduce [reproduce.scale=small]: rerun every measurement and sweep, then draw (conf/reproduce.yaml)
reproduce: $(STAMP)
	$(PY) -m experiments.reproduce reproduce.scale=$(or $(reproduce.scale),full)

bench: $(STAMP)
	$(PY) experiments/bench_runtime.py
	$(PY) experiments/bench_sim.py

clean:
	rm -rf .venv outputs multirun
