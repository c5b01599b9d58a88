"""The lowered step's kernels, apart from the formats that package them: the step implementations
the strip pass puts where the neutral op was (``step_impls.py``: ``portable.py``, aten only, and
``triton_attend.py``, the CUDA step, built from ``attend_common.py``, ``attend_prefill.py`` and
``attend_decode.py``), the decode method's one-row projections (``triton_gemv.py``), a few-row GEMM that only the
benchmarks launch so far (``triton_skinny_gemm.py``) and what the Triton kernels share (``triton_base.py``).

A package of its own so that ``lowering/`` holds one module per output format and the passes that
rewrite the graph onto these ops import them from below. Importing the package imports nothing:
``triton`` (and the ops it defines) come only with the modules that need them.
"""
