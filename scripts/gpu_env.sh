# Sourced by the GPU scripts (from the repo root): the environment the GPU machine needs.
# AOTInductor packages segfault on load there without the system C++ runtime preloaded.
export LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libstdc++.so.6
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# pydantic v2 travels as wheels in .whl/ (carried by the device call) when the machine lacks it.
if ! python3 -c 'import pydantic, sys; sys.exit(pydantic.VERSION < "2")' 2>/dev/null; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
  fi
fi
