"""``offgraph-export run --tokens ... --json`` on the compiled example generates the tokens plain
greedy decoding of the eager model gives. The oracle keeps no cache between tokens: every token is
the argmax of a fresh forward of the example factory's model over the whole sequence so far (its
neutral op over a reference cache created empty for that forward, i.e. masked attention over the
full sequence), so none of the runtime's or the check's machinery (storage, rows, growth, chunked
prefill, sessions) is shared with it."""

from __future__ import annotations

import json

import torch
from click.testing import CliRunner

from offgraph_export.cli.main import cli
from offgraph_export.frontends import load_bundle
from offgraph_export.reference import ReferenceCaches
from tests.conftest import EXAMPLE

PROMPT_LEN = 40  # more than max_write (32): the CLI prefills in two chunks
NEW = 30  # 40 + 30 tokens wrap the ring layer's 16 + 32 - 1 = 47 rows


def _eager_greedy(prompt: list[int], new: int) -> tuple[list[int], float]:
    """Greedy tokens by full recomputation, and the smallest top-1/top-2 logit margin seen."""
    bundle = load_bundle(EXAMPLE)
    model = bundle.model
    layer_ids = [block.attention.layer_id for block in model.layers]
    ids, out, margin = list(prompt), [], float("inf")
    with torch.no_grad():
        for _ in range(new):
            caches = ReferenceCaches(bundle.cache_config, layer_ids)  # empty: no history kept
            with caches.activate():
                logits = model(*bundle.make_inputs(torch.tensor([ids]), 0))
            assert caches.committed_length == len(ids)  # one forward over the whole sequence
            top2 = logits[0, -1].topk(2).values
            margin = min(margin, float(top2[0] - top2[1]))
            token = int(logits[0, -1].argmax())
            out.append(token)
            ids.append(token)
    return out, margin


def test_cli_run_json_matches_eager_greedy(example_artifact):
    prompt = torch.randint(0, 256, (PROMPT_LEN,), generator=torch.Generator().manual_seed(11)).tolist()
    expected, margin = _eager_greedy(prompt, NEW)
    assert margin > 1e-3, "a near tie in the oracle's argmax: the comparison would hinge on rounding"
    assert len(set(expected)) > 3, "degenerate generation proves little"

    result = CliRunner().invoke(
        cli,
        ["run", str(example_artifact), "--model", EXAMPLE, "--tokens", ",".join(map(str, prompt)),
         "--max-new-tokens", str(NEW), "--json"],
    )
    assert result.exit_code == 0, (result.stdout, result.stderr)
    out = json.loads(result.stdout)
    assert out["prompt_tokens"] == prompt
    assert out["new_tokens"] == expected
    assert out["text"] == bytes(expected).decode("utf-8", errors="replace")
    metrics = out["metrics"]
    # two prefill chunks, then one step per new token but the last (it is returned, not fed)
    assert metrics["committed_length"] == PROMPT_LEN + NEW - 1
    assert metrics["steps"] == 2 + NEW - 1 and metrics["failed_steps"] == 0
