"""The fused kernel's regression floor: today's time may not exceed the recorded one by more than 10%.

``python -m echo_vllm.bench.floor FUSED_JSON [--floor FLOOR_JSON]``
reads the emulated whole-kernel time per rank that ``echo-vllm bench
fused --out DIR`` wrote (``DIR/fused.json``) for each case of the floor
file (default: ``fused_floor.json`` beside this module) and compares it
with the recorded figure. A floor file holds one entry per case::

    {"floors": [{"key": "emulated_per_rank", "world_size": 8, "size_mib": 64,
                 "recorded_us": 102.8, "copy_gbps": 4238}]}

(other keys, such as the device and date of the figure, are for the
reader). The kernel is bound by memory bandwidth, so when an entry names the
copy bandwidth measured beside its figure, the floor is scaled by the ratio
of that bandwidth to the one measured in today's run (``copy_gbps`` of
``fused.json``): the same floor then holds on any GPU the acceptance runs on.
Exits 0 when every case is within :data:`TOLERANCE`, 1 when one is slower
or missing (the GPU acceptance run, ``scripts/gpu_accept.sh``, counts that
as a failed step), 2 on unreadable input.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import NamedTuple

from ..cli_args import existing_file

#: How much slower than the recorded figure a run may be.
TOLERANCE = 0.10

#: The floor the acceptance judges by (shipped with the package).
DEFAULT_FLOOR = Path(__file__).with_name("fused_floor.json")


class Floor(NamedTuple):
    key: str
    """The ``times_us`` key of ``fused.json`` (``emulated_per_rank``)."""
    world_size: int
    size_mib: int
    recorded_us: float
    copy_gbps: float | None = None
    """The copy bandwidth measured beside ``recorded_us``; None: the floor is not scaled."""


def floors(doc: dict) -> list[Floor]:
    """The floors of a floor file's JSON document (``{"floors": [...]}``)."""
    return [Floor(str(f["key"]), int(f["world_size"]), int(f["size_mib"]), float(f["recorded_us"]),
                  float(f["copy_gbps"]) if f.get("copy_gbps") else None) for f in doc["floors"]]


def scale(f: Floor, fused: dict) -> tuple[float, str]:
    """The factor on ``f.recorded_us`` for this run's device, and how it was found."""
    if f.copy_gbps is None:
        return 1.0, ""
    measured = fused.get("copy_gbps")
    if not measured or measured <= 0:
        raise KeyError("copy_gbps")  # the floor names a bandwidth: a run that did not measure one cannot be judged
    device = fused.get("device", "this GPU")
    return f.copy_gbps / measured, f" (scaled by copy {f.copy_gbps:.0f} / {measured:.0f} GB/s on {device})"


def verdicts(fused: dict, recorded: list[Floor], tolerance: float = TOLERANCE) -> list[tuple[bool, str]]:
    """``(ok, reason)`` per recorded floor, against a ``fused.json`` document."""
    if not recorded:
        return [(False, "no floor recorded")]
    out = []
    for f in recorded:
        case = next((c for c in fused.get("cases", []) if c["world_size"] == f.world_size
                     and c["size_bytes"] == f.size_mib << 20), None)
        measured = None if case is None else case["times_us"].get(f.key)
        if measured is None:
            out.append((False, f"{f.key} P={f.world_size} {f.size_mib} MiB: not measured in this run"))
            continue
        factor, how = scale(f, fused)
        limit = f.recorded_us * factor * (1 + tolerance)
        ok = measured <= limit
        out.append((ok, f"{f.key} P={f.world_size} {f.size_mib} MiB: {measured:.1f} us, recorded {f.recorded_us} us, "
                        f"limit {limit:.1f} us{how} ({'ok' if ok else 'SLOWER'})"))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m echo_vllm.bench.floor", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    # regular files only: a FIFO or /dev/zero would block or fill the memory
    ap.add_argument("fused_json", type=existing_file, help="fused.json written by `echo-vllm bench fused --out DIR`")
    ap.add_argument("--floor", type=existing_file, default=str(DEFAULT_FLOOR),
                    help="the floor file (default: the package's fused_floor.json)")
    args = ap.parse_args(argv)
    try:
        recorded = floors(json.loads(Path(args.floor).read_text()))
    except OSError as e:
        print(f"floor: cannot read {args.floor}: {e}", file=sys.stderr)
        return 2
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        print(f"floor: {args.floor}: not a floor file ({type(e).__name__}: {e})", file=sys.stderr)
        return 2
    try:
        fused = json.loads(Path(args.fused_json).read_text())
        results = verdicts(fused, recorded)
    except (OSError, ValueError) as e:
        print(f"floor: cannot read the inputs: {e}", file=sys.stderr)
        return 2
    except (KeyError, TypeError, AttributeError) as e:  # JSON, but not what bench fused writes
        print(f"floor: {args.fused_json}: not a fused.json of `echo-vllm bench fused` ({type(e).__name__}: {e})",
              file=sys.stderr)
        return 2
    for ok, reason in results:
        print(("PASS " if ok else "FAIL ") + reason)
    return 0 if all(ok for ok, _ in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
