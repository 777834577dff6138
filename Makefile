# The two commands a new user runs (see README.md). Each creates .venv/ when it is missing.
.PHONY: run test setup setup-test clean

PROMPT ?= Write a haiku about a mountain river.

run: setup  ## set up, then generate from the default model
	.venv/bin/rivulet generate --chat --prompt "$(PROMPT)" --max-tokens 64

test: setup-test  ## set up, then run the whole test suite
	.venv/bin/python -m pytest -q

setup:
	bash scripts/setup.sh

setup-test:
	bash scripts/setup.sh test

clean:
	rm -rf .venv build *.egg-info
