#!/usr/bin/env bash
# The ExecuTorch CUDA delegate on the GPU machine: export the example to a .pte + .ptd with the
# CUDA backend, read both specs back from the delegate's CompileSpecs and the program's constant
# methods, and show that this runtime refuses to run it (the pip runtime has no CUDA backend).
# executorch 1.2.0 (the last release whose metadata accepts torch 2.11) and its pure-Python
# dependencies travel as wheels in .whl-executorch/ (carried by the device call):
#   pip download --no-deps --only-binary :all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
#     --platform manylinux2014_x86_64 --implementation cp -d .whl-executorch \
#     executorch==1.2.0 ruamel.yaml ruamel.yaml.clib flatbuffers tabulate
# Usage: scripts/gpu_executorch_cuda.sh OUT_DIR
set -uo pipefail
OUT=${1:?usage: scripts/gpu_executorch_cuda.sh OUT_DIR}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/etsite .whl-executorch/*.whl
export PYTHONPATH="$PYTHONPATH:/tmp/etsite"
chmod +x /tmp/etsite/executorch/data/bin/flatc
export PATH="/tmp/etsite/executorch/data/bin:$PATH"   # ExecuTorch's .ptd writer runs flatc
status=0
PTE=/tmp/offgraph_et/tiny_cuda.pte
python3 -m offgraph_export export examples/tiny_llama.py:build -o "$PTE" --format executorch --device cuda --json \
  > "$OUT/et_export.log" 2>&1 || status=1
tail -2 "$OUT/et_export.log"
ls -la /tmp/offgraph_et | tee -a "$OUT/et_export.log"
python3 -m offgraph_export inspect "$PTE" > "$OUT/et_inspect.txt" 2>&1 || status=1
head -8 "$OUT/et_inspect.txt"
python3 - "$PTE" <<'PY' 2>&1 | tee "$OUT/et_delegates.txt" || status=1
import json, sys
from executorch.exir._serialize._program import deserialize_pte_binary
from offgraph_export.lowering.executorch import delegate_width_specs, read_pte_specs
path = sys.argv[1]
specs = read_pte_specs(path)
buffer = open(path, "rb").read()
program = deserialize_pte_binary(buffer)
program = getattr(program, "program", program)
plan = next(p for p in program.execution_plan if p.name == "forward")
for d in plan.delegates:
    keys = {s.key: bytes(s.value) for s in d.compile_specs}
    print("delegate", d.id, "compile spec keys:", sorted(keys))
    assert json.loads(keys["offgraph_kv_manifest"]) == json.loads(specs.manifest.to_json()), "manifest differs"
for index, width, sizes in delegate_width_specs(buffer):
    print("delegate", index, "width spec", width.format() if width else None, "arg sizes", sizes[:3])
print("specs device", specs.device, "step width", specs.step_width.format())
PY
python3 -m offgraph_export check "$PTE" --model examples/tiny_llama.py:build > "$OUT/et_check.txt" 2>&1
echo "check exit $? (2 expected: no CUDA backend in this runtime)"; head -2 "$OUT/et_check.txt"
echo "status $status"
exit $status
