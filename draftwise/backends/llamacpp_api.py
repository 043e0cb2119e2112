"""llama.cpp's C API through llama-cpp-python's ctypes bindings: every raw call the llama.cpp backend makes.

llama_cpp is imported on first use, so that draftwise runs without the optional extra (`draftwise[llamacpp]`).
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import numpy as np
import torch

from draftwise.errors import DraftwiseError

INSTALL_HINT = ("the llama.cpp backend needs llama-cpp-python: pip install 'draftwise[llamacpp]' (it compiles "
                "llama.cpp, about 6 minutes on 2 cores)")


def llama_cpp_module():
    """The llama_cpp bindings, or a DraftwiseError that says how to install them."""
    try:
        import llama_cpp
    except ImportError as err:
        raise DraftwiseError(INSTALL_HINT) from err
    return llama_cpp


@dataclass(frozen=True)
class LlamaSettings:
    """How the context is made. The defaults are those under which a position's logits do not depend on the call
    that computed them (with every pass at least llamacpp.MIN_WIDTH tokens wide per row):

    - repack False: llama.cpp's CPU "repack" buffers run groups of 4 rows through one kernel and the rest through
      another, whose sums round differently;
    - flash_attn False: its CPU kernel takes a different path for one query, for long caches and for many queries;
    - kv_unified False: a stream per sequence keeps each position in the same cache cell (a shared stream
      interleaves sequences, and the reduction over keys would group a position with different neighbours).
    """

    threads: int = 0  # 0: torch's thread count, the process's one setting (the physical cores unless set)
    batch: int = 512  # most tokens one llama_decode takes; bigger inputs are cut in chunks
    repack: bool = False
    flash_attn: bool = False
    kv_unified: bool = False

    def thread_count(self) -> int:
        """The threads of every llama_decode. Not every core the process may run on: ggml's threads spin at each
        barrier, so more of them than the process is given (torch.set_num_threads, OMP_NUM_THREADS, a hyperthread
        twin) make every decode wait on a thread that another one took the core from."""
        return self.threads or torch.get_num_threads()


class LlamaContext:
    """One model file, one context with `sequences` sequence ids (0 .. sequences-1), each of `positions` cells."""

    def __init__(self, path: str, sequences: int, positions: int, settings: LlamaSettings = LlamaSettings()):
        lib = self._lib = llama_cpp_module()
        lib.llama_backend_init()
        _quiet(lib)
        params = lib.llama_model_default_params()
        params.n_gpu_layers = 0
        params.use_extra_bufts = settings.repack
        self._model = lib.llama_model_load_from_file(os.fsencode(path), params)
        if not self._model:
            raise DraftwiseError(f"llama.cpp could not load {path}; if it is a model of the store, "
                                 "`draftwise models pull NAME --force` fetches it again")
        threads = settings.thread_count()
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = positions * (1 if settings.kv_unified else sequences)  # (split evenly among the streams)
        cparams.n_batch = cparams.n_ubatch = settings.batch  # one micro-batch: a decode is never split
        cparams.n_seq_max = sequences
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED if settings.flash_attn else \
            lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cparams.kv_unified = settings.kv_unified
        cparams.no_perf = True
        self._ctx = lib.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            lib.llama_model_free(self._model)
            raise DraftwiseError(f"llama.cpp could not make a context of {sequences} x {positions} positions")
        self._memory = lib.llama_get_memory(self._ctx)
        self.vocab_size = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self._model))
        self.trained_context = lib.llama_model_n_ctx_train(self._model)
        self.batch_size = settings.batch
        self._batch = lib.llama_batch_init(settings.batch, 0, 1)

    def decode(self, tokens: list[int], positions: list[int], sequences: list[int],
               outputs: list[bool]) -> np.ndarray:
        """One llama_decode; the logits of the tokens marked in outputs, in order: float32 [outputs, vocab]."""
        n = len(tokens)
        if not 0 < n <= self.batch_size:
            raise DraftwiseError(f"a llama.cpp decode takes 1 to {self.batch_size} tokens, got {n}")
        batch = self._batch
        batch.n_tokens = n
        np.ctypeslib.as_array(batch.token, (n,))[:] = tokens
        np.ctypeslib.as_array(batch.pos, (n,))[:] = positions
        np.ctypeslib.as_array(batch.n_seq_id, (n,))[:] = 1
        np.ctypeslib.as_array(batch.logits, (n,))[:] = outputs
        for i, seq in enumerate(sequences):
            batch.seq_id[i][0] = seq
        status = self._lib.llama_decode(self._ctx, batch)
        if status != 0:
            raise DraftwiseError(f"llama_decode failed with status {status} ({n} tokens; 1: no room in the cache)")
        count = sum(outputs)
        if not count:
            return np.empty((0, self.vocab_size), dtype=np.float32)
        pointer = self._lib.llama_get_logits(self._ctx)
        return np.ctypeslib.as_array(pointer, (count, self.vocab_size)).copy()  # [outputs, vocab]

    def forget(self, sequence: int, start: int = 0) -> None:
        """Drop the sequence's cached positions from start on."""
        if not self._lib.llama_memory_seq_rm(self._memory, sequence, start, -1):
            raise DraftwiseError(f"llama.cpp could not drop positions {start}.. of sequence {sequence}")

    def close(self) -> None:
        if self._ctx:
            self._lib.llama_batch_free(self._batch)
            self._lib.llama_free(self._ctx)
            self._lib.llama_model_free(self._model)
            self._ctx = self._model = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # (at interpreter exit the bindings may be gone already)
            pass


GGML_LOG_LEVEL_ERROR = 4  # (ggml.h's enum ggml_log_level)
_SILENT = []  # the log callback, kept alive as long as llama.cpp may call it


def _quiet(lib) -> None:
    """llama.cpp logs every load and context to stderr; keep its errors only."""
    if _SILENT:
        return

    @lib.llama_log_callback
    def drop(level, text, _user):
        if level == GGML_LOG_LEVEL_ERROR and text:
            os.write(2, text)

    _SILENT.append(drop)
    lib.llama_log_set(drop, ctypes.c_void_p(0))
