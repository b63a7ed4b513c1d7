"""Which MPI libraries get device buffers straight into the (non-blocking) collectives, and the staging note.

Pure logic against fake MPI objects; the real libraries were run on a lent GPU machine (docs/benchmarks.md,
"GPU: ..."), where Open MPI 4.1.4 built with CUDA says MPIX_Query_cuda_support() = 1 and still reduces a
device buffer in MPI_Iallreduce on the CPU.
"""

from __future__ import annotations

import logging

import pytest

from clusterctl.collective import cuda


class FakeInfo:
    def __init__(self, kinds):
        self.kinds = kinds

    def Get(self, key):
        assert key == "mpi_memory_alloc_kinds"
        return self.kinds

    def Free(self):
        pass


class FakeMPI:
    class Exception(Exception):
        pass

    def __init__(self, vendor, version_line=""):
        self.vendor = vendor
        self.version_line = version_line

    def get_vendor(self):
        if self.vendor is None:
            raise AttributeError("get_vendor")
        return (self.vendor, (0, 0, 0))

    def Get_library_version(self):
        return self.version_line


class FakeComm:
    def __init__(self, kinds=None, MPI=None):
        self.kinds = kinds
        self.MPI = MPI

    def Get_info(self):
        if self.kinds is None:
            raise FakeMPI.Exception("no info")
        return FakeInfo(self.kinds)


class FakeLib:
    def __init__(self, answer):
        self.answer = answer

    @property
    def MPIX_Query_cuda_support(self):
        answer = self.answer

        def query():
            return answer
        return query


@pytest.fixture
def libmpi(monkeypatch):
    """Make the 'loaded libmpi' one whose MPIX_Query_cuda_support returns the given answer (None: no libmpi)."""
    def use(answer, name="libmpi.so.40"):
        paths = [] if answer is None else [f"/opt/mpi/lib/{name}"]
        monkeypatch.setattr(cuda, "_loaded_libmpi", lambda: paths)
        monkeypatch.setattr(cuda.ctypes, "CDLL", lambda path: FakeLib(answer))
    return use


def test_mpich_listing_a_cuda_memory_kind_takes_device_buffers(libmpi):
    libmpi(None)
    aware, how = cuda.detect_cuda_aware(FakeComm("mpi,system,cuda"), FakeMPI("MPICH"))
    assert aware and "mpi_memory_alloc_kinds=mpi,system,cuda" in how


def test_mpich_whose_mpix_query_says_yes_takes_device_buffers(libmpi):
    libmpi(1, "libmpi.so.12")
    aware, how = cuda.detect_cuda_aware(FakeComm("mpi,system"), FakeMPI("MPICH"))
    assert aware and how == "MPIX_Query_cuda_support() = 1 in libmpi.so.12"


def test_cuda_aware_open_mpi_is_staged_because_its_device_support_is_blocking_only(libmpi):
    libmpi(1)
    aware, how = cuda.detect_cuda_aware(FakeComm(None), FakeMPI("Open MPI"))
    assert not aware
    assert how.startswith("MPIX_Query_cuda_support() = 1 in libmpi.so.40") and "blocking collectives only" in how


def test_open_mpi_is_recognised_from_its_version_string_without_get_vendor(libmpi):
    libmpi(1)
    mpi = FakeMPI(None, "Open MPI v4.1.4, package: Open MPI root@build Distribution, ident: 4.1.4")
    aware, how = cuda.detect_cuda_aware(FakeComm(None), mpi)
    assert not aware and "blocking collectives only" in how


def test_a_library_that_says_no_is_staged(libmpi):
    libmpi(0, "libmpi.so.12")
    assert cuda.detect_cuda_aware(FakeComm("mpi,system"), FakeMPI("MPICH")) == (
        False, "MPIX_Query_cuda_support() = 0 in libmpi.so.12")
    libmpi(None)
    assert cuda.detect_cuda_aware(FakeComm(None), FakeMPI("MPICH")) == (
        False, "no cuda memory kind (mpi_memory_alloc_kinds=unset)")


def test_the_answer_is_cached_the_env_overrides_it_and_the_note_says_why(libmpi, monkeypatch, caplog):
    libmpi(1)
    mpi = FakeMPI("Open MPI")
    c = FakeComm(None, mpi)
    c.comm = c
    monkeypatch.setattr(cuda, "_answers", {})
    monkeypatch.setattr(cuda, "_noted", False)
    monkeypatch.delenv(cuda.CUDA_AWARE_ENV, raising=False)
    assert cuda.cuda_aware(c) is False
    libmpi(0)                                         # asked once per communicator
    assert cuda.cuda_aware(c) is False and cuda._answers[id(c)][1].startswith("MPIX_Query_cuda_support() = 1")
    with caplog.at_level(logging.WARNING, logger="clusterctl.collective"):
        cuda.note_staging(c)
        cuda.note_staging(c)
    notes = [r.getMessage() for r in caplog.records]
    assert len(notes) == 1, notes
    assert "staged through pinned host memory" in notes[0] and "blocking collectives only" in notes[0]
    monkeypatch.setenv(cuda.CUDA_AWARE_ENV, "1")
    assert cuda.cuda_aware(c) is True
    monkeypatch.setenv(cuda.CUDA_AWARE_ENV, "0")
    assert cuda.cuda_aware(c) is False
    monkeypatch.setattr(cuda, "_noted", False)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="clusterctl.collective"):
        cuda.note_staging(c)
    assert f"({cuda.CUDA_AWARE_ENV}=0;" in caplog.records[0].getMessage()
