"""compat.fresh_int_array_names: the workaround for torch 2.11's C++ wrapper reusing a size/stride
array name outside the block that declared it (its cache keyed on a bound method's transient id).
CI's torch keys on the buffer, so the workaround is off there; these tests force it on."""

from __future__ import annotations

import itertools

import torch
from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu
from torch._inductor.utils import IndentedBuffer

from offgraph_export.compat import fresh_int_array_names, int_array_cache_keyed_by_bound_method


def _bare_wrapper() -> CppWrapperCpu:
    """The state the array-name codegen reads, without a graph to generate."""
    wrapper = CppWrapperCpu.__new__(CppWrapperCpu)
    wrapper.int_array_id = itertools.count()
    wrapper.declared_int_array_vars = set()
    wrapper.codegen_int_array_var_cache = {}
    return wrapper


def test_each_use_declares_its_array_where_it_is_written_and_the_method_comes_back():
    original = CppWrapperCpu.__dict__["codegen_int_array_var"]
    wrapper = _bare_wrapper()
    outer, scoped = IndentedBuffer(), IndentedBuffer()
    with fresh_int_array_names(force=True):
        first = wrapper.codegen_int_array_var("{1L, 4096L}", scoped.writeline, known_statically=True)
        second = wrapper.codegen_int_array_var("{1L, 4096L}", outer.writeline, known_statically=True)
        again = wrapper.codegen_int_array_var("{1L, 4096L}", outer.writeline, known_statically=True)
    assert len({first, second, again}) == 3  # no name is looked up: each use declares its own
    assert f"{first}[] = {{1L, 4096L}}" in scoped.getvalue() and first not in outer.getvalue()
    assert f"{second}[] = {{1L, 4096L}}" in outer.getvalue()
    assert CppWrapperCpu.__dict__["codegen_int_array_var"] is original
    # unforced: replaced only on a torch whose cache keys on a bound method (2.11), else the cache stands
    with fresh_int_array_names():
        same = wrapper.codegen_int_array_var("{2L}", outer.writeline) == wrapper.codegen_int_array_var("{2L}", outer.writeline)
    assert same is not int_array_cache_keyed_by_bound_method()


def test_the_cache_is_recognized_by_its_source():
    """torch 2.11's form of the cache (keyed on ``id(writeline)``) turns the workaround on; 2.13's
    (keyed on the bound method's ``__self__``) leaves it off."""
    torch_2_11 = """
        cache_key = (
            int_array,
            id(writeline),
            known_statically,
            id(graph) if graph else None,
        )"""
    torch_2_13 = """
        writeline_id = (
            id(writeline.__self__) if hasattr(writeline, "__self__") else id(writeline)
        )"""
    assert int_array_cache_keyed_by_bound_method(torch_2_11)
    assert not int_array_cache_keyed_by_bound_method(torch_2_13)


def test_a_package_compiled_with_fresh_names_runs_like_eager(tmp_path):
    """The wrapper without the cache still compiles and computes the model (AOTInductor CPU)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.SiLU(), torch.nn.Linear(32, 8)).eval()
    x = torch.randn(3, 16)
    ep = torch.export.export(model, (x,))
    with fresh_int_array_names(force=True):
        path = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "m.pt2"))
    runner = torch._inductor.aoti_load_package(path)
    with torch.no_grad():
        torch.testing.assert_close(runner(x), model(x))
