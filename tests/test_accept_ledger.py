"""scripts/accept_ledger.py: runs of one GPU code add up, any code change
starts the count again, and a failure on the same code is never outvoted."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("accept_ledger", ROOT / "scripts" / "accept_ledger.py")
ledger = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = ledger  # dataclasses look their module up
_spec.loader.exec_module(ledger)

FLOOR = "<!-- accept-floor: fused emulated_per_rank P=8 64MiB 102.8 us -->"


def _summary(run: int, commit: str, *steps: str) -> str:
    lines = [f"GPU acceptance run {run}, commit {commit}, 2026-12-05T04:13Z, NVIDIA H200"]
    lines += [f"  {s:<4} step{i}                  rc={0 if s == 'PASS' else 1}    10s" for i, s in enumerate(steps)]
    return "\n".join(lines) + "\n"


class Repo:
    """A git repository of a few commits, in the layout the ledger reads."""

    def __init__(self, path: Path):
        self.path = path
        path.mkdir(parents=True)
        self.git("init", "-q")
        self.write("echo_vllm/kernel.py", "x = 1\n")
        self.write("BENCHMARKS.md", f"# B\n{FLOOR}\n")

    def git(self, *args: str) -> str:
        return subprocess.run(["git", "-C", str(self.path), "-c", "user.name=t", "-c", "user.email=t@t",
                               "-c", "commit.gpgsign=false", *args],
                              check=True, capture_output=True, text=True).stdout.strip()

    def write(self, rel: str, text: str) -> None:
        f = self.path / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)

    def commit(self, message: str) -> str:
        self.git("add", "-A")
        self.git("commit", "-q", "-m", message)
        return self.git("rev-parse", "--short", "HEAD")

    def result(self, name: str, *runs: str) -> None:
        self.write(f"eval/results/gpu/accept/{name}/accept_summary.txt", "".join(runs))


@pytest.fixture
def repo(tmp_path):
    return Repo(tmp_path / "repo")


def _main(repo: Repo, *argv: str) -> int:
    return ledger.main(["--repo", str(repo.path), "--results", str(repo.path / "eval/results/gpu/accept"), *argv])


# -- reading summaries --------------------------------------------------------------------------------------

def test_parse_reads_runs_steps_and_passes_over_log_lines():
    text = _summary(1, "abc1234", "PASS", "PASS") + "(EngineCore pid=1) INFO a log line\n" + \
        _summary(2, "abc1234", "PASS", "FAIL")
    runs = ledger.parse_summary(text, "s.txt")
    assert [(r.run, r.commit, r.passed) for r in runs] == [(1, "abc1234", True), (2, "abc1234", False)]
    assert runs[1].steps == (("step0", True), ("step1", False))
    assert runs[0].device == "NVIDIA H200" and runs[0].when == "2026-12-05T04:13Z"


@pytest.mark.parametrize("text, says", [
    ("  PASS kernel_tests rc=0 1s\n", "before any"),
    ("GPU acceptance run 1, commit abc, 2026-12-05T04:13Z, H200\n", "lists no steps"),
    (_summary(6, "abc", "PASS"), "not one of"),
])
def test_parse_refuses_by_name(text, says):
    with pytest.raises(ledger.LedgerError, match=says):
        ledger.parse_summary(text, "s.txt")


# -- what counts as the same GPU code ----------------------------------------------------------------------

@pytest.mark.parametrize("rel, same", [
    ("README.md", True), ("docs/x.md", True), ("eval/results/gpu/y.json", True), (".ci/run", True),
    ("docker/build_and_smoke.sh", True), ("Dockerfile", True), ("scripts/accept_ledger.py", True),
    ("echo_vllm/kernel.py", False), ("tests/kernels/test_x.py", False), ("scripts/gpu_accept.sh", False),
    ("eval/gpu_eval.sh", False), ("pyproject.toml", False), ("server/README.txt", False),
])
def test_same_gpu_code_by_path(repo, rel, same):
    a = repo.commit("a")
    repo.write(rel, "changed\n")
    b = repo.commit("b")
    ok, why = ledger.same_gpu_code(repo.path, a, b)
    assert ok is same, why
    assert (rel in why) is (not same)


def test_floor_line_is_gpu_code(repo):
    a = repo.commit("a")
    repo.write("BENCHMARKS.md", "# B, reworded\n" + FLOOR + "\n")
    b = repo.commit("reworded")
    repo.write("BENCHMARKS.md", "# B\n" + FLOOR.replace("102.8", "90.0") + "\n")
    c = repo.commit("new floor")
    assert ledger.same_gpu_code(repo.path, a, b)[0]
    assert ledger.same_gpu_code(repo.path, a, c) == (False, "BENCHMARKS.md's accept-floor lines differ")


# -- the verdict ---------------------------------------------------------------------------------------------

def _run(n: int, passed: bool = True) -> ledger.RunResult:
    return ledger.RunResult(n, "abc", "t", "H200", (("s", passed),))


@pytest.mark.parametrize("runs, proven, says", [
    ([_run(1), _run(2), _run(3), _run(4), _run(5)], True, "all 5 runs"),
    ([_run(1), _run(2), _run(3), _run(4)], False, "5 not passed"),
    ([_run(1), _run(2)], False, "3, 4, 5 not passed"),
    ([_run(1), _run(2), _run(3, False), _run(3), _run(4), _run(5)], False, "3 failed"),
    ([], False, "1, 2, 3, 4, 5 not passed"),
])
def test_verdict(runs, proven, says):
    ok, why = ledger.verdict(runs)
    assert ok is proven and says in why


# -- the command ---------------------------------------------------------------------------------------------

def test_runs_of_two_sessions_add_up_across_document_commits(repo, capsys):
    a = repo.commit("code")
    repo.result("s1", _summary(1, a, "PASS"), _summary(2, a, "PASS"))
    b = repo.commit("results of runs 1 and 2")
    assert _main(repo, b) == 1
    assert "NOT PROVEN: run(s) 3, 4, 5 not passed" in capsys.readouterr().out
    repo.write("BENCHMARKS.md", "# B, the runs written up\n" + FLOOR + "\n")
    c = repo.commit("docs")
    repo.result("s2", _summary(3, c, "PASS"), _summary(4, c, "PASS"), _summary(5, c, "PASS"))
    d = repo.commit("results of runs 3, 4 and 5")
    assert _main(repo, d) == 0
    out = capsys.readouterr().out
    assert out.count(": same GPU code") == 5 and "PROVEN: all 5 runs passed on this GPU code (NVIDIA H200)" in out


def test_a_code_change_starts_the_count_again(repo, capsys):
    a = repo.commit("code")
    repo.result("s1", *(_summary(n, a, "PASS") for n in ledger.RUNS))
    b = repo.commit("results")
    assert _main(repo, b) == 0
    repo.write("echo_vllm/kernel.py", "x = 2\n")
    c = repo.commit("a kernel change")
    capsys.readouterr()
    assert _main(repo, c) == 1
    out = capsys.readouterr().out
    assert out.count("does not count: GPU code differs: echo_vllm/kernel.py") == len(ledger.RUNS)


def test_unknown_commits(repo, capsys):
    a = repo.commit("code")
    repo.result("s1", _summary(1, "0000000", "PASS"))
    repo.commit("a run on a commit git does not know")
    assert _main(repo) == 1
    assert "commit unknown to git" in capsys.readouterr().out
    assert _main(repo, "no-such-commit") == 2
    assert "not a commit" in capsys.readouterr().err
    assert ledger.main(["--repo", str(repo.path), "--results", str(repo.path / "nowhere"), a]) == 2
    assert "not a folder" in capsys.readouterr().err


# -- the real repository -------------------------------------------------------------------------------------

def _accept_paths() -> set[str]:
    """Every repository file gpu_accept.sh names (its scripts, test folders' files)."""
    text = (ROOT / "scripts" / "gpu_accept.sh").read_text()
    named = set(re.findall(r"(?<![\w./-])((?:scripts|server|tests|echo_vllm|eval)/[\w./-]+)", text))
    files = subprocess.run(["git", "-C", str(ROOT), "ls-files"], capture_output=True, text=True).stdout.split()
    return {f for f in files for n in named if f == n or f.startswith(n.rstrip("/") + "/")}


def test_nothing_the_acceptance_runs_is_excluded():
    if not (ROOT / ".git").exists():
        pytest.skip("needs the git checkout")
    excluded = set(subprocess.run(["git", "-C", str(ROOT), "ls-files", "--", *(f":(glob){p}" for p in
                                                                                ledger.NOT_RUN_ON_GPU)],
                                  capture_output=True, text=True).stdout.split())
    run = _accept_paths()
    assert {"scripts/gpu_fused_check.py", "scripts/gpu_vllm_check.py", "server/gpu_serve_check.sh"} <= run
    assert any(f.startswith("tests/kernels/") for f in run)
    assert not run & excluded
    # no package, server or kernel-test code is excluded: only documents, results and CPU-only tools
    assert not {f for f in excluded if f.endswith((".py", ".sh")) and f.startswith(("echo_vllm/", "server/"))}
    assert {f for f in excluded if f.startswith(("tests/", "scripts/"))} <= {
        "scripts/accept_ledger.py", "tests/test_accept_ledger.py"}
