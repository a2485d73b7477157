"""tests/compile_cache.py: one compile per key and run, shared through the
folder by concurrent askers, and keyed by the sources."""

from __future__ import annotations

import threading
import time

import compile_cache
import pytest

from k3jax.tools.aot import PtxasReport

REPORT = PtxasReport(name="grouped_matmul_m64_3", registers=168, spill_store_bytes=4,
                     spill_load_bytes=8, warnings=("ptxas warning : one",), smem_bytes=221_264,
                     grid=(132, 1, 1))


class Compiler:
    """A compile function that counts its calls and takes ``seconds``."""

    def __init__(self, seconds: float = 0.0):
        self.calls = 0
        self.seconds = seconds

    def __call__(self) -> list[PtxasReport]:
        self.calls += 1
        time.sleep(self.seconds)
        return [REPORT]


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv(compile_cache.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(compile_cache, "_memory", {})
    return tmp_path


def test_a_key_compiles_once_and_reads_back_equal_reports(folder):
    compile = Compiler()
    assert compile_cache.cached_reports("k", compile) == (REPORT,)
    compile_cache._memory.clear()      # another process: only the folder is shared
    assert compile_cache.cached_reports("k", compile) == (REPORT,)
    assert compile.calls == 1
    assert compile_cache.cached_reports("other", compile) == (REPORT,) and compile.calls == 2


def test_concurrent_askers_wait_for_one_compile(folder):
    compile = Compiler(seconds=0.5)
    got = []

    def ask():
        got.append(compile_cache.cached_reports("slow", compile))

    threads = [threading.Thread(target=ask) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert compile.calls == 1 and got == [(REPORT,)] * 3


def test_a_failed_compile_is_not_kept(folder):
    def fail():
        raise RuntimeError("ptxas died")

    with pytest.raises(RuntimeError, match="ptxas died"):
        compile_cache.cached_reports("k", fail)
    compile = Compiler()
    assert compile_cache.cached_reports("k", compile) == (REPORT,) and compile.calls == 1


def test_changed_sources_miss_the_folder(folder, monkeypatch):
    compile = Compiler()
    compile_cache.cached_reports("k", compile)
    compile_cache._memory.clear()
    monkeypatch.setattr(compile_cache, "source_key", lambda: "sources after an edit")
    compile_cache.cached_reports("k", compile)
    assert compile.calls == 2


def test_source_key_follows_the_kernel_sources(tmp_path, monkeypatch):
    (tmp_path / "pallas_kernels" / "op").mkdir(parents=True)
    (tmp_path / "benchmarks").mkdir()
    kernel = tmp_path / "pallas_kernels" / "op" / "kernel.py"
    kernel.write_text("BLOCK = 64\n")
    monkeypatch.setattr(compile_cache, "REPO", tmp_path)
    monkeypatch.setattr(compile_cache, "SOURCE_FILES", ())
    before = compile_cache.source_key.__wrapped__()
    assert compile_cache.source_key.__wrapped__() == before
    kernel.write_text("BLOCK = 128\n")
    assert compile_cache.source_key.__wrapped__() != before


def test_without_a_folder_the_process_remembers(monkeypatch):
    monkeypatch.delenv(compile_cache.CACHE_ENV, raising=False)
    monkeypatch.setattr(compile_cache, "_memory", {})
    compile = Compiler()
    compile_cache.cached_reports("k", compile)
    compile_cache.cached_reports("k", compile)
    assert compile.calls == 1


def test_unknown_configuration_is_named():
    with pytest.raises(KeyError, match="'no such kernel' is not a configuration"):
        compile_cache.kernel_reports("no such kernel")


def test_run_folder_is_shared_by_the_workers(tmp_path):
    assert compile_cache.run_folder(tmp_path / "popen-gw0", xdist_worker=True) \
        == compile_cache.run_folder(tmp_path / "popen-gw1", xdist_worker=True)
    assert compile_cache.run_folder(tmp_path, xdist_worker=False).parent == tmp_path
