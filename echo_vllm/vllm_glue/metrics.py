"""Echo's counters on vLLM's Prometheus ``/metrics``.

vLLM's API server answers ``/metrics``; Echo counts in the worker processes
(one per GPU, or one for the one-GPU emulation), two process hops away. The
mechanism is the one vLLM uses when it runs several API-server processes:
``prometheus_client`` multiprocess mode. With ``PROMETHEUS_MULTIPROC_DIR``
set, every process writes its metric values into memory-mapped files in that
directory, and vLLM's ``/metrics`` (``vllm.v1.metrics.prometheus.
get_prometheus_registry``) serves a ``MultiProcessCollector`` that sums them.
vLLM only turns the mode on for ``--api-server-count > 1``;
``echo-vllm serve --tp-comm echo`` turns it on always
(:func:`prepare_multiprocess_dir`, before anything imports
``prometheus_client``: the client picks its value store at import time), in
a private temporary folder or in the user's, which must hold nothing but an
earlier run's value files (:func:`judge_multiprocess_dir`; nothing else is
ever removed), and the variable is inherited by the engine-core and worker
processes.

Workers call :func:`publish` with :meth:`EchoStats.snapshot` (cumulative
counts) about once a second; it turns the totals into counter increments, so
calling it again with the same snapshot changes nothing, and a restarted
EchoStats (totals going down) counts from zero again.

Exported (``rank`` = tensor-parallel rank of the worker):

- ``echo:allreduce_calls_total{rank,path,reason}`` all-reduce calls by path
  (echo / exact) and reason (``echo``, or why it fell back: below_min_bytes,
  exact_last_call, ...; see ``echo_vllm.policy.Reason``)
- ``echo:wire_bytes_total{rank}`` bytes sent in Echo calls
- ``echo:equiv_16bit_bytes_total{rank}`` what a 16-bit all-reduce of the same
  calls would have sent (wire / equiv = the traffic ratio, ~0.28 at g=32)
- ``echo:exact_bytes_total{rank}`` input bytes of exact-path calls
- ``echo:rel_error_sum_total{rank}``, ``echo:rel_error_samples_total{rank}``
  sampled relative error |y - exact| / |exact| of Echo outputs (mean over a
  window = rate(sum) / rate(samples))
- ``echo:rel_error_mean{rank}`` the same mean since start (gauge)
- from the vLLM glue's StepStats, when present: ``echo:forwards_total{rank,kind}``
  (observed / replayed from a CUDA graph / mismatched call count / replayed
  with no captured plan, so missing from the call counters),
  ``echo:calls_per_forward{rank}``, ``echo:residual_rel_error{rank,stat}``
  (the residual stream's accumulated error, end_mean / max_mean, measured in
  emulation with ``--echo-emulate-measure``) and
  ``echo:residual_error_samples_total{rank}``
- ``echo:threshold_bytes{rank,bound}`` the message sizes Echo takes (min,
  max; measured at engine start with ``min_bytes=auto``)
- numerical health, right under real TP and CUDA graphs (the chain's
  outcome rides in each call's record, so replays count it from the plan;
  the non-finite checks are device ops captured into the graphs):
  ``echo:feedback_carried_total{rank}`` calls that absorbed the error the
  previous call left, ``echo:feedback_dropped_total{rank,reason}`` pending
  errors no call absorbed in the middle of a pass (``index_gap``,
  ``shape_changed``: a chain broke),
  ``echo:health_checked_total{rank}`` sampled Echo calls checked for
  NaN/Inf, ``echo:nonfinite_total{rank,where}`` those whose input / output
  held one, ``echo:saturated_total{rank}`` those whose output saturated
  (a sum beyond the dtype's range, decoded to +-max; ``echo_vllm.health``)
- the norm after the all-reduce (``rmsnorm_fusion``): ``echo:norm_calls_total{rank,how}``
  residual calls whose norm ran inside Echo (``how="fused"``) or after the
  reduce (the reason: the row too wide, ``exact path``), CUDA-graph replays
  included; ``echo:norm_fusion_sites{rank,outcome}`` Echo's all-reduces in
  the compiled graphs by what the pass did (``fused`` or why not), summed
  over the graphs compiled at start (empty when the compilation came from
  vLLM's cache)
- ``echo:model_bypass{rank,path}`` = 1 for each of the model's fused
  all-reduce paths that do not reach Echo's hook (logged at start;
  ``vllm_glue.bypass``)
- ``echo:config_info{...}`` = 1, labels = Echo's settings (API server)

Without the variable (plain ``vllm serve``), each worker keeps its values in
its own registry and nothing reaches ``/metrics`` unless the worker lives in
the API-server process.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import tempfile
import threading
from typing import Any, Callable, Mapping

from ..cli_args import env_path_problem

logger = logging.getLogger("echo_vllm")

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
PREFIX = "echo:"

_tmpdir: tempfile.TemporaryDirectory | None = None

#: prometheus_client's own value files, ``<kind>_<pid>.db`` (its
#: ``values.MmapedValue`` naming): the only files Echo ever removes.
PROMETHEUS_FILE = re.compile(r"(?:counter|histogram|summary|gauge_(?:live)?(?:all|min|max|sum|mostrecent))_(\d+)\.db")


class MultiprocessDirError(ValueError):
    """``PROMETHEUS_MULTIPROC_DIR`` names a folder the metrics cannot use;
    the message is one line and names the folder."""


def judge_multiprocess_dir(path: str, entries: list[tuple[str, bool]],
                           live: Callable[[int], bool]) -> tuple[str | None, list[str]]:
    """Whether a user's multiprocess folder may hold this server's metrics:
    ``(why not, or None; stale value files to remove)``.

    ``entries`` are the folder's ``(name, is a regular file)``; ``live(pid)``
    says whether a process other than this one runs with that pid. The
    folder must be empty or hold only prometheus_client's value files of
    processes that are gone (an earlier run's: left in place they would be
    summed into this server's ``/metrics``). Anything else is refused, never
    removed: a file of the user's, a folder, or the live files of another
    server sharing the folder.
    """
    foreign = sorted(name for name, regular in entries if not (regular and PROMETHEUS_FILE.fullmatch(name)))
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        return (f"{MULTIPROC_ENV}={path} holds {shown}, not prometheus_client's value files: the metrics need "
                "an empty folder (nothing of yours is removed); name an empty one, or unset it for a private "
                "temporary one"), []
    pids = {name: int(PROMETHEUS_FILE.fullmatch(name).group(1)) for name, _ in entries}
    running = sorted({pid for pid in pids.values() if live(pid)})
    if running:
        return (f"{MULTIPROC_ENV}={path} holds the metric files of running process(es) {running}: another "
                "server uses this folder; give each server its own, or unset it for a private temporary one"), []
    return None, sorted(pids)


def _pid_running(pid: int) -> bool:
    if pid == os.getpid():
        return False  # this process has written nothing yet: such files are an earlier run's
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    except OverflowError:
        return False
    return True


def _user_dir(path: str, remove: bool) -> list[str]:
    """Check (and make, if missing) the user's folder; returns the stale
    value files, removed if ``remove``. Raises :class:`MultiprocessDirError`."""
    problem = env_path_problem(path)  # a trailing space would make a new folder silently
    if problem:
        raise MultiprocessDirError(f"{MULTIPROC_ENV}={path!r}: {problem}")
    if os.path.lexists(path) and not os.path.isdir(path):
        raise MultiprocessDirError(f"{MULTIPROC_ENV}={path}: not a folder")
    try:
        os.makedirs(path, exist_ok=True)
        entries = [(e.name, e.is_file(follow_symlinks=False)) for e in os.scandir(path)]
    except OSError as e:
        raise MultiprocessDirError(f"{MULTIPROC_ENV}={path}: cannot use it as a folder ({e.strerror})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise MultiprocessDirError(f"{MULTIPROC_ENV}={path}: the folder is not writable")
    problem, stale = judge_multiprocess_dir(path, entries, _pid_running)
    if problem:
        raise MultiprocessDirError(problem)
    for name in stale if remove else ():
        os.remove(os.path.join(path, name))
    return stale


def prepare_multiprocess_dir(remove_stale: bool = True) -> tuple[str, list[str]]:
    """Turn on prometheus_client multiprocess mode for this process and the
    ones it starts; returns the directory and the stale value files in it,
    removed if ``remove_stale`` (``serve`` checks first, before vLLM imports
    the client, and removes only once every check has passed).

    Call before vLLM (or anything else) imports ``prometheus_client``.
    Without ``PROMETHEUS_MULTIPROC_DIR`` a private temporary folder is made
    (removed at exit). A folder the user set is used only as
    :func:`judge_multiprocess_dir` allows, else :class:`MultiprocessDirError`.
    """
    global _tmpdir
    path = os.environ.get(MULTIPROC_ENV)
    removed: list[str] = []
    if not path:
        _tmpdir = tempfile.TemporaryDirectory(prefix="echo-vllm-prometheus-")
        path = os.environ[MULTIPROC_ENV] = _tmpdir.name
    elif _tmpdir is None or path != _tmpdir.name:  # ours is checked when made
        if path.startswith("~"):  # quoted in an env file: the client would make a folder named ~ here
            path = os.environ[MULTIPROC_ENV] = os.path.expanduser(path)
        removed = _user_dir(path, remove_stale)
    _share_values()
    return path, removed


def _share_values() -> None:
    """Metrics created from now on write to ``PROMETHEUS_MULTIPROC_DIR``'s
    files: the client chose its value store when imported, which may have
    been before the variable was set (a Ray worker gets it from vLLM's
    executor after importing vLLM)."""
    if "prometheus_client" in sys.modules:
        from prometheus_client import values

        values.ValueClass = values.get_value_class()


def multiprocess_mode() -> bool:
    return bool(os.environ.get(MULTIPROC_ENV))


class EchoMetrics:
    """Echo's metrics in one registry, fed from cumulative snapshots."""

    def __init__(self, registry: Any = None):
        from prometheus_client import REGISTRY, Counter, Gauge

        registry = REGISTRY if registry is None else registry
        rank = ["rank"]
        self.calls = Counter(PREFIX + "allreduce_calls", "Echo all-reduce calls by path and reason.",
                             rank + ["path", "reason"], registry=registry)
        self.wire_bytes = Counter(PREFIX + "wire_bytes", "Bytes sent on the wire by Echo calls.",
                                  rank, registry=registry)
        self.level_bytes = Counter(PREFIX + "level_bytes", "Bytes sent by Echo calls inside this rank's host "
                                   "(level: in_host) and to other hosts (cross_host: what crosses the network).",
                                   rank + ["level"], registry=registry)
        self.equiv_bytes = Counter(
            PREFIX + "equiv_16bit_bytes",
            "Bytes a bandwidth-optimal 16-bit all-reduce of the same Echo calls would send.",
            rank, registry=registry)
        self.exact_bytes = Counter(PREFIX + "exact_bytes", "Input bytes of exact-path (16-bit) calls.",
                                   rank, registry=registry)
        self.rel_err_sum = Counter(PREFIX + "rel_error_sum",
                                   "Sum of sampled relative errors |y - exact| / |exact| of Echo outputs.",
                                   rank, registry=registry)
        self.rel_err_samples = Counter(PREFIX + "rel_error_samples", "Number of relative-error samples.",
                                       rank, registry=registry)
        self.rel_err_mean = Gauge(PREFIX + "rel_error_mean", "Mean sampled relative error since start.",
                                  rank, registry=registry, multiprocess_mode="mostrecent")
        # What the vLLM glue adds to the snapshot (StepStats), when present:
        self.forwards = Counter(PREFIX + "forwards", "Forward passes seen by Echo's glue, by kind "
                                "(observed: ran Python; replayed: CUDA-graph replay; mismatched: "
                                "call count differed from the learned one).",
                                rank + ["kind"], registry=registry)
        self.calls_per_forward = Gauge(PREFIX + "calls_per_forward", "Residual-stream all-reduces per "
                                       "forward pass (side calls not counted).",
                                       rank, registry=registry, multiprocess_mode="mostrecent")
        self.residual_samples = Counter(PREFIX + "residual_error_samples",
                                        "Forward passes whose residual-stream error was measured.",
                                        rank, registry=registry)
        self.residual_err = Gauge(PREFIX + "residual_rel_error",
                                  "Residual stream's accumulated relative communication error, mean over "
                                  "measured passes (stat: end_mean at the end of the pass, max_mean worst call).",
                                  rank + ["stat"], registry=registry, multiprocess_mode="mostrecent")
        self.thresholds = Gauge(PREFIX + "threshold_bytes",
                                "Message sizes Echo takes (bound: min, max; 0 = none), as measured at start "
                                "with min_bytes=auto.", rank + ["bound"], registry=registry,
                                multiprocess_mode="mostrecent")
        self.carried = Counter(PREFIX + "feedback_carried",
                               "Calls that absorbed the quantization error the previous call left.",
                               rank, registry=registry)
        self.dropped = Counter(PREFIX + "feedback_dropped",
                               "Carried errors no call absorbed in the middle of a pass: a chain broke "
                               "(reason: index_gap, shape_changed).",
                               rank + ["reason"], registry=registry)
        self.checked = Counter(PREFIX + "health_checked", "Sampled Echo calls checked for NaN/Inf.",
                               rank, registry=registry)
        self.nonfinite = Counter(PREFIX + "nonfinite", "Checked calls whose input (this rank's partial) or "
                                 "output held NaN/Inf (where: input, output).", rank + ["where"], registry=registry)
        self.saturated = Counter(PREFIX + "saturated", "Checked calls whose output held the largest finite value "
                                 "of its dtype: a sum beyond the dtype's range, which Echo decodes to +-max where "
                                 "the exact path gives +-inf.", rank, registry=registry)
        self.bypass = Gauge(PREFIX + "model_bypass", "The model's fused all-reduce paths that do not reach "
                            "Echo's hook (1 per path; logged at start).", rank + ["path"], registry=registry,
                            multiprocess_mode="mostrecent")
        self.norm_calls = Counter(PREFIX + "norm_calls", "Residual all-reduces followed by the add + RMSNorm, by "
                                  "how the norm ran (fused into Echo, or why not).", rank + ["how"],
                                  registry=registry)
        self.topology = Gauge(PREFIX + "topology", "How Echo crosses hosts on the TP group (topology: flat, "
                              "two_level) and why (reason; value always 1; logged at start).",
                              rank + ["topology", "reason"], registry=registry, multiprocess_mode="mostrecent")
        self.norm_sites = Gauge(PREFIX + "norm_fusion_sites", "Echo's all-reduces in the compiled graphs by what "
                                "the norm fusion pass did (fused, or why not).", rank + ["outcome"],
                                registry=registry, multiprocess_mode="mostrecent")
        self._last: dict[tuple, Any] = {}
        self._last_snapshot: dict[str, dict] = {}
        self._lock = threading.Lock()

    def _advance(self, key: tuple, total: float) -> float:
        """Increment that brings a counter from the last total to ``total``;
        a smaller total means the source restarted from zero."""
        last = self._last.get(key, 0)
        self._last[key] = total
        return total - last if total >= last else total

    def publish(self, snapshot: Mapping[str, Any], rank: int) -> None:
        """Bring the counters of ``rank`` up to ``snapshot`` (EchoStats.snapshot())."""
        r = str(int(rank))
        with self._lock:
            if self._last_snapshot.get(r) == snapshot:
                return
            for path_reason, total in (snapshot.get("calls") or {}).items():
                path, _, reason = str(path_reason).partition("/")
                delta = self._advance((r, "calls", path, reason), int(total))
                if delta:
                    self.calls.labels(r, path, reason or "unknown").inc(delta)
            for name, counter in (("wire_bytes", self.wire_bytes), ("equiv_16bit_bytes", self.equiv_bytes),
                                  ("exact_bytes", self.exact_bytes)):
                delta = self._advance((r, name), int(snapshot.get(name) or 0))
                if delta:
                    counter.labels(r).inc(delta)
            self._publish_error(snapshot, r)
            self._publish_forwards(snapshot, r)
            self._publish_health(snapshot, r)
            self._last_snapshot[r] = {k: dict(v) if isinstance(v, Mapping) else v for k, v in snapshot.items()}

    def _publish_error(self, snapshot: Mapping[str, Any], r: str) -> None:
        samples = int(snapshot.get("rel_err_samples") or 0)
        mean = snapshot.get("rel_err_mean")
        total = snapshot.get("rel_err_sum")
        if total is None:
            total = float(mean) * samples if mean is not None else 0.0
        last_n, last_sum = self._last.get((r, "rel_err"), (0, 0.0))
        if samples < last_n:  # the source restarted from zero
            last_n, last_sum = 0, 0.0
        if samples > last_n:
            # max(): mean * samples may come back a last bit lower than before
            self.rel_err_samples.labels(r).inc(samples - last_n)
            self.rel_err_sum.labels(r).inc(max(float(total) - last_sum, 0.0))
            self._last[(r, "rel_err")] = (samples, float(total))
        if mean is not None:
            self.rel_err_mean.labels(r).set(float(mean))


    def _publish_forwards(self, snapshot: Mapping[str, Any], r: str) -> None:
        for key, kind in _FORWARD_KINDS.items():
            if key in snapshot:
                delta = self._advance((r, key), int(snapshot[key] or 0))
                if delta:
                    self.forwards.labels(r, kind).inc(delta)
        if snapshot.get("calls_per_forward") is not None:
            self.calls_per_forward.labels(r).set(float(snapshot["calls_per_forward"]))
        if "residual_samples" in snapshot:
            delta = self._advance((r, "residual_samples"), int(snapshot["residual_samples"] or 0))
            if delta:
                self.residual_samples.labels(r).inc(delta)
        for key, stat in _RESIDUAL_STATS.items():
            if snapshot.get(key) is not None:
                self.residual_err.labels(r, stat).set(float(snapshot[key]))
        for bound in ("min", "max"):
            if snapshot.get(bound + "_bytes") is not None:
                self.thresholds.labels(r, bound).set(float(snapshot[bound + "_bytes"]))

    def _publish_health(self, snapshot: Mapping[str, Any], r: str) -> None:
        for name, counter in (("feedback_carried", self.carried), ("health_checked", self.checked),
                              ("saturated", self.saturated)):
            delta = self._advance((r, name), int(snapshot.get(name) or 0))
            if delta:
                counter.labels(r).inc(delta)
        for family, counter in (("feedback_dropped", self.dropped), ("nonfinite", self.nonfinite),
                                ("norm_calls", self.norm_calls), ("level_bytes", self.level_bytes)):
            for label, total in (snapshot.get(family) or {}).items():
                delta = self._advance((r, family, label), int(total))
                if delta:
                    counter.labels(r, str(label)).inc(delta)
        for path in snapshot.get("bypasses") or ():
            self.bypass.labels(r, str(path)).set(1)
        if snapshot.get("topology"):
            self.topology.labels(r, *map(str, snapshot["topology"])).set(1)
        for outcome, n in (snapshot.get("norm_sites") or {}).items():
            self.norm_sites.labels(r, str(outcome)).set(int(n))


_FORWARD_KINDS = {"forwards_observed": "observed", "forwards_replayed": "replayed",
                  "forwards_mismatched": "mismatched", "forwards_unplanned": "unplanned"}
_RESIDUAL_STATS = {"residual_err_end_mean": "end_mean", "residual_err_max_mean": "max_mean"}


def publish_config(labels: Mapping[str, Any], registry: Any = None) -> None:
    """``echo:config_info{...} 1``: which Echo settings this server runs."""
    from prometheus_client import REGISTRY, Gauge

    names = sorted(labels)
    gauge = Gauge(PREFIX + "config_info", "Echo settings of this server (value is always 1).",
                  names, registry=REGISTRY if registry is None else registry,
                  multiprocess_mode="mostrecent")
    gauge.labels(*(str(labels[n]) for n in names)).set(1)


_default: EchoMetrics | None = None
_default_lock = threading.Lock()
_warned: set[str] = set()


def _warn_once(key: str, message: str, *args: Any) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message, *args)


def publish(snapshot: Mapping[str, Any], rank: int) -> None:
    """Export one rank's cumulative Echo counters (call ~once a second).

    Idempotent (same snapshot -> no change) and cheap (a dict compare when
    nothing moved; a few mmap writes otherwise). Never raises: a failure is
    logged once and the serving path goes on.
    """
    global _default
    try:
        if _default is None:
            with _default_lock:
                if _default is None:
                    if multiprocess_mode():
                        _share_values()
                    else:
                        logger.info("echo: %s is not set; Echo metrics of this process (pid %d) reach "
                                    "/metrics only if it is the API server (run `echo-vllm serve`)",
                                    MULTIPROC_ENV, os.getpid())
                    _default = EchoMetrics()
        _default.publish(snapshot, rank)
    except Exception as e:  # metrics must never take the model down
        _warn_once(type(e).__name__, "echo: publishing metrics failed (%r); logged once", e)


__all__ = ["EchoMetrics", "MultiprocessDirError", "judge_multiprocess_dir", "prepare_multiprocess_dir",
           "publish", "publish_config"]
