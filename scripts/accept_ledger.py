"""Which GPU acceptance runs passed on GPU code identical to a commit's.

    python3 scripts/accept_ledger.py [COMMIT] [--results DIR]

The acceptance (``scripts/gpu_accept.sh``) is five runs. Each writes an
``accept_summary.txt``: a line ``GPU acceptance run N, commit SHA, DATE,
DEVICE``, then ``PASS``/``FAIL`` and a step's name per step. The summaries
are kept under ``eval/results/gpu/accept/`` (several runs may share a file).

A run counts for COMMIT (default HEAD) when the commit it ran on has the
same GPU code: ``git diff`` between the two shows no change outside
:data:`NOT_RUN_ON_GPU`, and BENCHMARKS.md's accept-floor lines (the one
part of a document a run reads) are equal. So runs of one tree made in two
sessions, with only documents and results committed between them, add up;
any change to code, tests or scripts starts the count again.

COMMIT is proven when each of the five runs passed on such a commit and no
run failed on one (a failure on the same code is never outvoted by a later
pass: it is a defect or a flaky check, and says so). Runs a device call cut
at its limit wrote no summary and count as not run.

Exit status: 0 proven, 1 not proven, 2 bad input (an unknown COMMIT, a
results folder that does not exist, a summary that does not parse).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from echo_vllm.bench.floor import floors

#: The acceptance's runs (``gpu_accept.sh 1`` ... ``5``).
RUNS = (1, 2, 3, 4, 5)

#: Paths no acceptance run reads, as git pathspecs: changes there keep a run's result.
NOT_RUN_ON_GPU = (
    "**/*.md",  # documents (BENCHMARKS.md's accept-floor lines are compared apart)
    "docs/**",
    "eval/results/**",  # measured results, this ledger's input among them
    ".ci/**",  # CI's driver: the CPU machine only
    "Dockerfile",
    ".dockerignore",
    "docker/**",  # the image is built and smoke-tested apart (docker/build_and_smoke.sh)
    "scripts/accept_ledger.py",  # this ledger and its test: the CPU machine only
    "tests/test_accept_ledger.py",
)

_HEADER = re.compile(r"^GPU acceptance run (\d+), commit (\S+), ([^,]+), (.*)$")
_STEP = re.compile(r"^\s+(PASS|FAIL) (\S+)")


class LedgerError(ValueError):
    """Input the ledger cannot read: named, never guessed around."""


@dataclass(frozen=True)
class RunResult:
    run: int
    commit: str
    when: str
    device: str
    steps: tuple[tuple[str, bool], ...]
    """(step name, passed) in the order the run made them."""

    @property
    def passed(self) -> bool:
        return bool(self.steps) and all(ok for _, ok in self.steps)


def parse_summary(text: str, source: str) -> list[RunResult]:
    """Every run in one ``accept_summary.txt`` text. Other lines are passed
    over (a vLLM engine's log once leaked into one); a step line before any
    header, or a header with no steps, is refused by name."""
    runs: list[RunResult] = []
    header, steps = None, []

    def close():
        if header is None:
            return
        if not steps:
            raise LedgerError(f"{source}: run {header[0]} on {header[1]} lists no steps")
        runs.append(RunResult(header[0], header[1], header[2], header[3], tuple(steps)))

    for n, line in enumerate(text.splitlines(), 1):
        if m := _HEADER.match(line):
            close()
            header, steps = (int(m[1]), m[2], m[3].strip(), m[4].strip()), []
            if header[0] not in RUNS:
                raise LedgerError(f"{source}:{n}: run {header[0]} is not one of {RUNS}")
        elif m := _STEP.match(line):
            if header is None:
                raise LedgerError(f"{source}:{n}: a step line before any 'GPU acceptance run' line")
            steps.append((m[2], m[1] == "PASS"))
    close()
    return runs


def read_results(folder: Path) -> list[RunResult]:
    """Every run of every ``accept_summary.txt`` under ``folder``."""
    if not folder.is_dir():
        raise LedgerError(f"--results {folder}: not a folder")
    return [r for f in sorted(folder.rglob("accept_summary.txt"))
            for r in parse_summary(f.read_text(encoding="utf-8"), str(f))]


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)


def resolve(repo: Path, commit: str) -> str | None:
    """The full hash of ``commit`` in ``repo``, or None when git does not know it."""
    out = _git(repo, "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}")
    return out.stdout.strip() if out.returncode == 0 else None


def _floors(repo: Path, commit: str) -> list:
    out = _git(repo, "show", f"{commit}:BENCHMARKS.md")
    return floors(out.stdout) if out.returncode == 0 else []


def same_gpu_code(repo: Path, a: str, b: str) -> tuple[bool, str]:
    """Whether commits ``a`` and ``b`` run the same code on the GPU, and why not."""
    excludes = [f":(exclude,glob){p}" for p in NOT_RUN_ON_GPU]
    diff = _git(repo, "diff", "--name-only", a, b, "--", ".", *excludes)
    if diff.returncode != 0:
        raise LedgerError(f"git diff {a} {b}: {diff.stderr.strip()}")
    changed = diff.stdout.split()
    if changed:
        more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        return False, f"GPU code differs: {', '.join(changed[:3])}{more}"
    if _floors(repo, a) != _floors(repo, b):
        return False, "BENCHMARKS.md's accept-floor lines differ"
    return True, "same GPU code"


def verdict(counted: list[RunResult]) -> tuple[bool, str]:
    """Proven or not, from the runs that ran on the same GPU code, with the reason."""
    failed = sorted({r.run for r in counted if not r.passed})
    missing = [n for n in RUNS if not any(r.run == n and r.passed for r in counted)]
    if failed:
        return False, f"run(s) {', '.join(map(str, failed))} failed on this GPU code"
    if missing:
        return False, f"run(s) {', '.join(map(str, missing))} not passed on this GPU code"
    devices = sorted({r.device for r in counted})
    return True, f"all {len(RUNS)} runs passed on this GPU code ({', '.join(devices)})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("commit", nargs="?", default="HEAD", help="the commit to judge (default HEAD)")
    ap.add_argument("--results", type=Path, default=Path("eval/results/gpu/accept"),
                    help="the folder of stored summaries (default eval/results/gpu/accept)")
    ap.add_argument("--repo", type=Path, default=Path("."), help="the git repository (default .)")
    args = ap.parse_args(argv)
    try:
        target = resolve(args.repo, args.commit)
        if target is None:
            raise LedgerError(f"{args.commit}: not a commit of {args.repo}")
        runs = read_results(args.results)
        counted = []
        print(f"GPU acceptance of {target[:12]} (runs from {args.results}):")
        for r in runs:
            full = resolve(args.repo, r.commit)
            ok, why = (False, "commit unknown to git") if full is None else same_gpu_code(args.repo, full, target)
            failed = [name for name, passed in r.steps if not passed]
            print(f"  run {r.run} on {r.commit:<9} {r.when:<18} {'PASS' if r.passed else 'FAIL':<4} "
                  f"{'counts' if ok else 'does not count'}: {why}"
                  + (f" (failed: {', '.join(failed)})" if failed else ""))
            if ok:
                counted.append(r)
        proven, why = verdict(counted)
    except LedgerError as e:
        print(f"accept_ledger: {e}", file=sys.stderr)
        return 2
    print(f"{'PROVEN' if proven else 'NOT PROVEN'}: {why}")
    return 0 if proven else 1


if __name__ == "__main__":
    sys.exit(main())
