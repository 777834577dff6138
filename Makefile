# The two commands a new user runs (see README.md). Each creates .venv/ when it is missing.
.PHONY: run test setup setup-test clean

HOST ?= 127.0.0.1
PORT ?= 8000

run: setup  ## set up, then serve the default model over the OpenAI API on http://$(HOST):$(PORT)/v1
	.venv/bin/rivulet serve --model default --host $(HOST) --port $(PORT)

test: setup-test  ## set up, then run the whole test suite
	.venv/bin/python -m pytest -q

setup:
	bash scripts/setup.sh

setup-test:
	bash scripts/setup.sh test

clean:
	rm -rf .venv build *.egg-info
