"""``echo-vllm``'s tools on bad input: one line naming the value and what
is allowed, exit 2, no traceback, and nothing started (demo, bench, eval,
train-demo; serve's own are tests/server/). The work each tool would start
is replaced by a tripwire, so a refusal that comes too late fails here."""

from __future__ import annotations

import pytest

from echo_vllm import cli


class Reached(Exception):
    """A tool got past its checks to the work."""


def _tripwire(*args, **kwargs):
    raise Reached("reached the work")


@pytest.fixture(autouse=True)
def no_work(monkeypatch):
    import echo_vllm.bench.allreduce_bench as allreduce_bench
    import echo_vllm.bench.kernels_bench as kernels_bench
    import echo_vllm.eval.accuracy as accuracy
    import echo_vllm.eval.demo as demo
    import echo_vllm.eval.depth as depth
    import echo_vllm.eval.perplexity as perplexity
    import echo_vllm.training.demo as train_demo

    monkeypatch.setattr(demo, "run_processes", _tripwire)
    monkeypatch.setattr(allreduce_bench, "_launch", _tripwire)
    monkeypatch.setattr(kernels_bench, "run_model", _tripwire)
    monkeypatch.setattr(kernels_bench, "verify", _tripwire)
    monkeypatch.setattr(train_demo, "train", _tripwire)
    monkeypatch.setattr(train_demo, "Corpus", type("NoCorpus", (), {"load": staticmethod(_tripwire)}))
    import echo_vllm.eval.models as models

    monkeypatch.setattr(models, "prepare_model", _tripwire)  # a registered model would be downloaded
    for module in (perplexity, depth):
        monkeypatch.setattr(module, "load_hf_model", _tripwire)
    monkeypatch.setattr(accuracy, "run_hf", _tripwire)
    monkeypatch.setattr(accuracy, "run_vllm", _tripwire)


#: (argv, what the one error line must say)
BAD = [
    (["demo", "-p", "0"], "argument --world-size/-p: 0: must be from 2 to 64"),
    (["demo", "-p", "200"], "200: must be from 2 to 64 (no tensor-parallel group is larger; each is a process here)"),
    (["demo", "--tokens", "0"], "argument --tokens: 0: must be from 1 to 65536"),
    (["demo", "--hidden", "-1"], "argument --hidden: -1: must be from 1"),
    (["demo", "--hidden", "64Q"], "argument --hidden: not an integer: '64Q'"),
    (["demo", "--layers", "129"], "129: must be from 1 to 128"),
    (["demo", "--tokens", "65536", "--hidden", "65536"], "= 4294967296 values per call: at most 4194304"),
    (["demo", "--seed", "99999999999999999999"], "must be from 0 to 4294967295"),
    (["demo", "--out", "/proc/echo-vllm-x"], "argument --out: /proc/echo-vllm-x: /proc, where it would be made, "
                                            "is not writable"),
    (["bench", "allreduce", "--factor", "1"], "argument --factor: 1: must be from 2 to 1024 (a factor of 1 or less "
                                              "never reaches the largest size)"),
    (["bench", "allreduce", "--factor", "0"], "0: must be from 2 to 1024"),
    (["bench", "allreduce", "--min-size", "0"], "argument --min-size: 0: must be from 2"),
    (["bench", "allreduce", "--min-size", "64Q"], "not a byte count: '64Q'"),
    (["bench", "allreduce", "--min-size=-1M"], "not a byte count: '-1M'"),
    (["bench", "allreduce", "--min-size", "1M", "--max-size", "64k"],
     "smallest size 1 MiB is above the largest 64 KiB (--min-size / --max-size): nothing to measure"),
    (["bench", "allreduce", "--max-size", "64k"], "smallest size 1 MiB is above the largest 64 KiB"),  # gloo default
    (["bench", "allreduce", "--world-size", "0"], "argument --world-size: 0: must be from 2 to 64"),
    (["bench", "allreduce", "--group-size", "48"], "invalid choice: 48 (choose from 16, 32, 64, 128)"),
    (["bench", "allreduce", "--echo-backends", "tritn"], "'tritn': choose from auto,reference,triton,numba,fused; "
                                                         "did you mean 'triton'?"),
    (["bench", "kernels", "--model-only", "--min-size", "0"], "argument --min-size: 0: must be from 2"),
    (["bench", "kernels", "--model-only", "--min-size", "1M", "--max-size", "64k"], "smallest size 1 MiB is above"),
    (["bench", "kernels", "--model-only", "--world-sizes", "1,4"], "1: must be from 2 to 64"),
    (["bench", "kernels", "--model-only", "--efficiency", "0"], "0: must be a finite number above 0 to 1"),
    (["bench", "kernels", "--model-only", "--copy-gbps", "nan"], "nan: must be a finite number above 0"),
    (["bench", "kernels", "--device", "gpu"], "'gpu': not a device (cpu, cuda, cuda:N)"),
    (["bench", "fused", "--sizes", "64Q"], "not a byte count: '64Q'"),
    (["bench", "fused", "--plans", "100:8:3"], "'100:8:3': expected tile_values:num_warps:per_sm"),
    (["train-demo", "--steps", "-1"], "argument --steps: -1: must be from 1 to 10000000"),
    (["train-demo", "--tp", "1"], "argument --tp: 1: must be from 2 to 64"),
    (["train-demo", "--tp", "3"], "--tp 3 and the model's sizes: vocab_size=256 must be divisible by P=3"),
    (["train-demo", "--seq", "0"], "argument --seq: 0: must be from 1"),
    (["train-demo", "--batch", "0"], "argument --batch: 0: must be from 1"),
    (["train-demo", "--hidden", "0"], "argument --hidden: 0: must be from 1"),
    (["train-demo", "--lr", "nan"], "nan: must be a finite number above 0 to 10"),
    (["train-demo", "--data", "/nonexistent/corpus"], "argument --data: /nonexistent/corpus: no such folder"),
    (["train-demo", "--data", "/tmp"], "--data /tmp: no prepared corpus in it"),
    (["train-demo", "--report", "/nonexistent/runs"], "argument --report: /nonexistent/runs: no such folder"),
    (["train-demo", "--modes", "exact,fast"], "'fast': choose from exact,naive,echo"),
    (["train-demo", "--out", "/proc/echo-vllm-x"], "/proc, where it would be made, is not writable"),
    (["eval", "perplexity", "--tokens", "0"], "argument --tokens: 0: must be from 2"),
    (["eval", "perplexity", "--tp", "1"], "TP size must be at least 2"),
    (["eval", "perplexity", "--batch-size", "0"], "0: must be from 1 to 1024"),
    (["eval", "perplexity", "--variants", "bogus"], "unknown variant 'bogus'"),
    (["eval", "perplexity", "--variants", "naive:group_sise=16"], "unknown option 'group_sise'; did you mean "
                                                                  "'group_size'?"),
    (["eval", "perplexity", "--variants", "naive", "naive"], "duplicate variants in ['naive', 'naive']"),
    (["eval", "perplexity", "--variants", "naive", "naive:"], "variants 'naive' and 'naive:' are one setting"),
    (["eval", "accuracy", "--variants", "naive:group_size= 16", "naive:group_size =16"],
     "variants 'naive:group_size= 16' and 'naive:group_size =16' are one setting"),  # one results file
    (["eval", "perplexity", "--exact-calls", "0-99999999999"], "expected 0 <= I <= J < 65536"),
    (["eval", "perplexity", "--texts"], "nothing to score: give --texts or --lambada N"),
    (["eval", "perplexity", "--stem", "../x"], "not a file name stem"),
    (["eval", "perplexity", "--texts", "hamlet", "/nonexistent/play.txt"], "text '/nonexistent/play.txt': no such file"),
    (["eval", "depth", "--text", "missing.txt"], "text 'missing.txt': no such file"),
    (["eval", "perplexity", "--model", "/nonexistent/model"], "'/nonexistent/model' is neither a local HF model "
                                                              "folder"),
    (["eval", "depth", "--text", "", "--lambada", "0"], "nothing to measure: --text '' needs --lambada N"),
    (["eval", "accuracy", "--limit", "-1"], "-1: must be a finite number above 0"),
    (["eval", "accuracy", "--batch-size", "x"], "'x': expected 'auto' or an integer from 1 to 4096"),
    (["eval", "accuracy", "--gpu-memory-utilization", "2"], "2: must be a finite number above 0 to 1"),
    (["eval", "ttft", "--server-timeout", "nan"], "nan: must be a finite number above 0 to 86400"),
    (["eval", "ttft", "--input-lens", "0"], "argument --input-lens: 0: must be from 1"),
    (["eval", "ttft", "--base-url", "ftp://host"], "expected http://HOST[:PORT]"),
    (["eval", "ttft", "--labels", "a", "b"], "several --labels need --launch"),
    (["eval", "ttft", "--launch", "true serve", "--labels", "a", "b"], "has no {mode} or {mode_args}"),
    (["eval", "ttft", "--launch", "serve 'x", "--labels", "a"], "not a command line (No closing quotation)"),
    (["eval", "ttft", "--report", "--out", "/tmp/echo-vllm-no-such-results"], "no ttft_*.json or raw_*.json in"),
    (["eval", "bundle", "--part-mib", "0"], "argument --part-mib: 0: must be from 1"),
    # a negative-looking size: the option's own parser judges it (argparse said "expected one argument")
    (["bench", "allreduce", "--sizes", "-1M"], "argument --sizes: not a byte count: '-1M'"),
    (["bench", "kernels", "--model-only", "--min-size", "-64k"], "argument --min-size: not a byte count: '-64k'"),
    # a look-alike of '-' (a document's dash): named, with the ASCII spelling, on every tool
    (["demo", "\u2014out", "x"], "'\u2014out' begins with '\u2014' (U+2014 EM DASH), which only looks like '-'"),
    (["bench", "kernels", "\u2013\u2013model-only"], "(U+2013 EN DASH), which only looks like '-' (pasted from a "
                                                     "document or a web page?); type --model-only"),
    (["train-demo", "--steps", "\u22121"], "'\u22121' begins with '\u2212' (U+2212 MINUS SIGN)"),
    (["eval", "perplexity", "\uff0d\uff0dtokens", "8"], "(U+FF0D FULLWIDTH HYPHEN-MINUS)"),
    # --out names the file system would refuse after the run (File name too long, RecursionError)
    (["demo", "--out", "/tmp/" + "x" * 300], "the name 'xxxx"),
    (["train-demo", "--out", "/tmp" + "/d" * 3000], "3001 levels deep: at most 256"),
    (["bench", "kernels", "--out", "/tmp/" + "y" * 256], "bytes: the file system takes at most 255"),
    (["eval", "perplexity", "--out", "/tmp" + "/a" * 2040], "levels deep: at most 256"),
    # an --out that would look like another folder
    (["demo", "--out", "res "], "argument --out: 'res ': begins or ends with a space"),
    (["bench", "kernels", "--out", "res\u200b"], r"holds '\u200b' (U+200B ZERO WIDTH SPACE), which does not print"),
    # the harness's --model: a URL's password was printed (and handed to vLLM); a 5000-byte name raised OSError
    (["eval", "perplexity", "--model", "https://bob:hunter2@host/m"], "argument --model: 'https://bob:***@host/m': a "
                                                                     "URL with a password"),
    (["eval", "accuracy", "--model", "https://bob:hunter2@host/m"], "'https://bob:***@host/m': a URL with a password"),
    (["eval", "depth", "--model", "/x/" + "m" * 5000], "is 5000 bytes: the file system takes at most 255"),
    (["eval", "prepare-model", "https://bob:hunter2@host/m"], "argument name: 'https://bob:***@host/m': a URL"),
    (["eval", "prepare-model", "m" * 300], "is 300 bytes: the file system takes at most 255"),
    (["eval", "perplexity", "--group-sizes"], "argument --group-sizes: expected at least one argument"),
    (["eval", "perplexity", "--group-sizes", "16", "16"], "--group-sizes 16 16: a group size is given twice"),
    (["eval", "perplexity", "--texts", "/dev/zero"], "text '/dev/zero': not a regular file"),
]


@pytest.mark.parametrize("argv,message", BAD, ids=[" ".join(a)[:80] for a, _ in BAD])
def test_bad_input_is_one_line_exit_2(argv, message, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0], err
    assert "Traceback" not in err and "hunter2" not in err


#: (variable, value, what the one error line must say): read by worker processes and caches mid-run
BAD_ENV = [
    ("ECHO_KERNELS", "trition", "ECHO_KERNELS='trition': choose one of auto, reference, triton, numba; "
                                "did you mean 'triton'?"),
    ("ECHO_KERNEL_DIRECT_LAUNCH", "2", "ECHO_KERNEL_DIRECT_LAUNCH='2': 0 or 1"),
    ("ECHO_VLLM_CACHE", "/etc/hostname", "ECHO_VLLM_CACHE='/etc/hostname': exists and is not a folder"),
]
ENV_COMMANDS = [["demo", "-p", "2", "-l", "1"],
                ["bench", "allreduce", "--backend", "gloo", "--world-size", "2", "--sizes", "1k"],
                ["train-demo", "--steps", "1"], ["eval", "perplexity", "--tokens", "16"]]


@pytest.mark.parametrize("argv", ENV_COMMANDS, ids=[a[0] for a in ENV_COMMANDS])
@pytest.mark.parametrize("name,value,message", BAD_ENV, ids=[n for n, _, _ in BAD_ENV])
def test_bad_environment_is_refused_before_any_process_starts(argv, name, value, message, monkeypatch, capsys):
    monkeypatch.setenv(name, value)
    assert cli.main(argv) == 2  # the tripwires would raise Reached
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err, err


#: (argv, the result file each run writes into --out)
WRITERS = [
    (["demo"], "demo.json"),
    (["demo"], "demo.png"),
    (["train-demo", "--steps", "1"], "train_echo.json"),
    (["train-demo", "--steps", "1"], "train_table.md"),
    (["bench", "kernels", "--model-only"], "kernels.json"),
    (["bench", "allreduce", "--backend", "gloo", "--world-size", "3"], "allreduce_gloo_p3.png"),
    (["eval", "perplexity", "--stem", "pp"], "pp.md"),
    (["eval", "depth"], "depth.png"),
]


@pytest.mark.parametrize("argv,name", WRITERS, ids=[f"{a[0]}-{n}" for a, n in WRITERS])
def test_a_folder_at_a_result_name_is_refused_before_the_work(argv, name, capsys, tmp_path):
    """The result file could not replace it: refused before the work (the
    tripwires), not after the run; the folder is left as it was."""
    (tmp_path / name).mkdir()
    (tmp_path / name / "keep").write_text("mine")
    assert cli.main([*argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{name} is a folder, where the tool writes its result file" in err, err
    assert (tmp_path / name / "keep").read_text() == "mine"
