"""normconv.libc: the C library's calls, looked up once. Each is typed as declared, a call this libc lacks is None, and off
Linux every call is None and each caller takes its plain path (no write-back hint, no page let go, no exchange, no
trim) instead of failing."""

from __future__ import annotations

import ctypes
import os
import sys

import pytest
import torch

from normconv import libc

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="libc's calls are looked up on Linux only")


@pytest.fixture
def fresh():
    libc._libc.cache_clear()
    libc.c_function.cache_clear()
    yield
    libc._libc.cache_clear()
    libc.c_function.cache_clear()


@linux
def test_a_call_is_typed_as_declared_and_looked_up_once(fresh):
    getpid = libc.c_function("getpid", (), ctypes.c_int)
    assert getpid() == os.getpid()
    assert libc.c_function("getpid", (), ctypes.c_int) is getpid  # one object per signature
    strlen = libc.c_function("strlen", (ctypes.c_char_p,), ctypes.c_size_t)
    assert strlen(b"normconv") == 8
    with pytest.raises(ctypes.ArgumentError):  # typed: a str is not a char pointer
        strlen(12)


@linux
def test_a_call_this_libc_lacks_is_none(fresh):
    assert libc.c_function("normconv_no_such_call", (ctypes.c_int,), ctypes.c_int) is None


def test_off_linux_every_call_is_none_and_the_callers_take_their_plain_path(fresh, monkeypatch, tmp_path):
    from normconv.clone import let_go
    from normconv.io import durable
    from normconv.io.write import _exchange
    from normconv.stream.blocks import trim_heap

    monkeypatch.setattr(libc.sys, "platform", "darwin")
    assert libc.c_function("getpid", (), ctypes.c_int) is None
    with open(tmp_path / "f", "wb") as f:
        f.write(b"x" * 4096)
        f.flush()
        assert durable.start_writeback(f.fileno()) is False  # the later fsync writes it all
    t = torch.ones(1 << 20)
    assert not let_go(t) and bool((t == 1).all())
    (tmp_path / "a").write_text("a")
    (tmp_path / "b").write_text("b")
    assert _exchange(str(tmp_path / "a"), str(tmp_path / "b")) is False
    assert (tmp_path / "a").read_text() == "a"
    trim_heap()  # nothing to do, no error
