"""What every Echo kernel takes: tile sizes, compiler options, argument checks, integer arguments.

Every stage kernel processes :data:`TILE_VALUES` values per program (whole
quantization groups, in the lane layout of ``tile``), and is compiled with
FMA contraction off: the references in ``echo_vllm.quant`` round every product
and sum separately (except where a product is exact and the kernels fuse
it on purpose), and the kernels must produce the same bits.

The wrappers check shapes, dtypes and strides on the host (plain Python on
tensor metadata: no device synchronisation, nothing allocated when the
caller supplies the output buffers), so bad input raises a clear error
instead of reading out of bounds. Everything else a launch needs that
depends only on the shapes and options (grid, layout-derived integers,
constexprs) is a ``direct_launch.LaunchPlan``, cached per wrapper, and the
launch itself goes through its ``Launcher``, which skips Triton's per-call
dispatch once a specialization is compiled (host time per eager call:
BENCHMARKS.md, "Host time of one call").
"""

from __future__ import annotations

import functools
import types
import torch

from ..config import ENCODERS
from ..quant import FEEDBACK_STORAGE, WIRE_DTYPE, WireLayout, feedback_row_len, inv_qmax_f32

#: Warps per program of the stage kernels.
NUM_WARPS = 4
#: Values per program of the stage kernels: 16 per thread, whatever the group size.
TILE_VALUES = 2048

#: Launch options shared by every kernel. ``enable_fp_fusion=False`` keeps
#: ``a - b * c`` from becoming one fused multiply-add.
LAUNCH_OPTIONS = {"num_warps": NUM_WARPS, "enable_fp_fusion": False}


def groups_per_program(layout: WireLayout) -> int:
    """Groups per program of the stage kernels for ``layout``'s group size."""
    return TILE_VALUES // layout.group_size


def programs(layout: WireLayout) -> int:
    """Programs along the group axis for one chunk of ``layout``."""
    return -(-layout.chunk_groups // groups_per_program(layout))


#: Largest qmax whose codes (q + 8, q down to -(qmax + 1) for signed_mse) fit a nibble.
MAX_QMAX = 7

INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: The feedback buffer's formats (``quant.FEEDBACK_STORAGE``): every kernel reads and writes all three.
FEEDBACK_DTYPES = tuple(FEEDBACK_STORAGE.values())


@functools.lru_cache(maxsize=None, typed=True)
def quantizer_constants(qmax: int, encoder: str = "absmax") -> types.MappingProxyType:
    """The constexprs of the quantizer: ``ENCODER`` and ``INV_QMAX``,
    ``fp32(1/qmax)``, exactly the value absmax's reference multiplies by
    (the kernels need no clamp to qmax, ``tile.quantize``); signed_mse
    quantizes for the 4-bit wire (qmax 7) with ``tile.SIGNED_MSE_MULTIPLIERS``.
    Cached: building the fp32 value costs a tensor, which is not something
    to do per call."""
    if not isinstance(qmax, int) or isinstance(qmax, bool) or not 1 <= qmax <= MAX_QMAX:
        raise ValueError(f"qmax={qmax!r}: the 4-bit kernels support 1..{MAX_QMAX}")
    if encoder not in ENCODERS:
        raise ValueError(f"encoder={encoder!r}: the kernels support {', '.join(ENCODERS)}")
    if encoder == "signed_mse" and qmax != MAX_QMAX:
        raise ValueError(f"qmax={qmax}: the kernels' signed_mse writes the 4-bit wire's codes (qmax {MAX_QMAX})")
    return types.MappingProxyType({"INV_QMAX": float(inv_qmax_f32(qmax)), "ENCODER": encoder})


#: Plans cached per wrapper: distinct (layout, rows, options) seen at once.
PLAN_CACHE_SIZE = 1024


def check_rows(name: str, t: torch.Tensor, rows: int, min_cols: int, dtypes) -> None:
    """``t`` must be ``[rows, >= min_cols]`` of one of ``dtypes`` with unit
    column stride (rows may be strided)."""
    if t.dim() != 2 or t.shape[0] != rows or t.shape[1] < min_cols:
        raise ValueError(f"{name}: expected shape [{rows}, >= {min_cols}], got {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name}: dtype {t.dtype} not in {dtypes}")
    if t.stride(1) != 1 and t.shape[1] > 1:
        raise ValueError(f"{name}: the last dimension must be contiguous")


#: Threads of a warp.
WARP_THREADS = 32
#: Values of a group one thread holds in the lane layout (``tile.V``).
LANE_VALUES = 8


def lane_layout(cols: int, tile_values: int, num_warps: int, *tensors: torch.Tensor) -> bool:
    """Whether a program's tile of ``tile_values`` values on ``num_warps``
    warps is in the lane layout of ``tile`` (a thread holds 8 consecutive
    values of a group, a group's lanes on consecutive threads), so that the
    kernels may use lane shuffles (``tile.lanes_hold``); otherwise they take
    the layout-agnostic butterflies, same bits. It needs both:

    - a lane for every thread (``tile_values >= 8 * 32 * num_warps``): a
      smaller tile spreads the threads along a lane's values;
    - every message row of ``tensors`` (``[R, numel]`` or ``[numel]``)
      starting on 16 bytes, as Triton can prove from its specializations
      (pointers, ``cols`` and row strides divisible by 16): else it lays the
      loads and stores out in narrower pieces."""
    if tile_values < LANE_VALUES * WARP_THREADS * num_warps or cols % 16:
        return False
    return all(t.data_ptr() % 16 == 0 and (t.dim() < 2 or t.shape[0] == 1 or t.stride(0) % 16 == 0)
               for t in tensors)


def check_flips(flips: int, layout: WireLayout) -> int:
    """A sign pattern of ``layout``'s groups (``rotation.sign_flips``): an
    integer of at most ``group_size`` bits; returned as the plain int the
    kernels' ``FLIPS`` constexpr takes."""
    if not isinstance(flips, int) or isinstance(flips, bool) or not 0 <= flips < 1 << layout.group_size:
        raise ValueError(f"flips={flips!r:.60}: expected a sign pattern of {layout.group_size} bits "
                         "(rotation.sign_flips)")
    return int(flips)


def check_feedback(feedback: torch.Tensor, rows: int, layout: WireLayout) -> None:
    """A buffer of ``rows`` rows in one of ``quant``'s formats, long enough
    for the message's ``padded_numel`` values (int8: its blocks,
    ``quant.feedback_row_len``), int8 rows 16-byte aligned as its blocks are
    (the kernels access a lane's codes as one 64-bit word, scales as 16-bit)."""
    if feedback.dtype not in FEEDBACK_DTYPES:
        raise TypeError(f"feedback: dtype {feedback.dtype} not in {FEEDBACK_DTYPES}")
    check_rows("feedback", feedback, rows, feedback_row_len(layout.padded_numel, feedback.dtype, layout.group_size),
               FEEDBACK_DTYPES)
    if feedback.dtype == torch.int8 and (feedback.data_ptr() % 16 or (rows > 1 and feedback.stride(0) % 16)):
        raise ValueError(f"feedback: int8 rows must start 16-byte aligned (data_ptr % 16 = "
                         f"{feedback.data_ptr() % 16}, row stride {feedback.stride(0)})")


def check_wire(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    """A wire buffer: contiguous uint8 of exactly ``shape``."""
    if tuple(t.shape) != shape or t.dtype != WIRE_DTYPE or not t.is_contiguous():
        raise ValueError(
            f"{name}: expected a contiguous uint8 tensor of shape {shape}, "
            f"got {t.dtype} {tuple(t.shape)} (contiguous={t.is_contiguous()})"
        )


def check_device(first: torch.Tensor, *others: torch.Tensor | None) -> None:
    device = first.device
    for t in others:
        if t is not None and t.device != device:
            devices = {str(u.device) for u in (first, *others) if u is not None}
            raise ValueError(f"tensors on different devices: {sorted(devices)}")


def wire_or_new(out: torch.Tensor | None, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=WIRE_DTYPE, device=like.device)
    check_wire("out", out, shape)
    return out


def message_ints(layout: WireLayout) -> tuple[int, int, int]:
    """The message's shape as the kernels address it (:func:`tile.message_offsets`):
    ``row_groups, cols, msg_groups``; a rank's column block must have fewer
    than 2**31 columns (:func:`tile.block_offsets`)."""
    if layout.row_groups * layout.group_size >= 2**31:
        raise ValueError(f"cols={layout.cols}: a rank's column block of {layout.row_groups * layout.group_size} "
                         f"values exceeds the kernels' int32 columns")
    return (layout.row_groups, layout.cols, layout.rows * layout.row_groups)


def chunk_ints(layout: WireLayout) -> tuple[int, int, int, int]:
    """Runtime sizes every wire kernel takes, in its parameter order:
    ``chunk_numel, chunk_groups, chunk_bytes, payload_bytes``."""
    return (layout.chunk_numel, layout.chunk_groups, layout.chunk_bytes, layout.payload_bytes)
