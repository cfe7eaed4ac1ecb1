# Two commands on a fresh machine:  make demo  (set up + train)   make test  (set up + tests)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python

.PHONY: setup demo test bench clean

$(VENV)/.installed: requirements/cpu.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements/cpu.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $@

setup: $(VENV)/.installed

# The default job: the `small` model learns Python's own standard library, on 2 local processes.
demo: setup
	$(PY) -m threefold train --nproc 2 --model small --data stdlib --seq-len 128 --global-batch 16 \
		--steps 300 --lr 2e-3 --set train.warmup_steps=20 --out runs/demo --overwrite
	@echo "metrics: runs/demo/metrics.jsonl   loss curve: runs/demo/loss.png"

# Two workers (pytest-xdist), each taking whole files (tests/conftest.py orders them). glibc's malloc
# keeps freed blocks below 1 GiB in the heap instead of returning each to the kernel (a CPU step frees
# and reallocates the same buffers: every page faulted in again, ~10% of a distributed file's time).
test: setup
	MALLOC_MMAP_THRESHOLD_=1073741824 MALLOC_TRIM_THRESHOLD_=4294967296 $(PY) -m pytest -q -n 2 --dist loadfile

bench: setup
	$(PY) bench/dp_vs_ddp.py

clean:
	rm -rf $(VENV) runs .pytest_cache
