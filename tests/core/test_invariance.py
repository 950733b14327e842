"""Request isolation: a token's output bits never depend on who shares its batch.

Groups (and Hadamard blocks) never straddle two rows, and a value's owner
rank -- which sums it in stage 2 and keeps its stage-2 error -- follows
from its column alone (``quant``'s position-owned layout). So, through a
chain of calls with error feedback and an exact call that absorbs it,
rows of A reduced alone equal rows of A inside [A; B] and [B; A], bit for
bit. The kernels' versions: tests/kernels (interpreter) and the GPU.
"""

import pytest
import torch
from support.invariance import check_rows_independent

from echo_vllm import CallSlot, EchoConfig, StackedCommunicator, VirtualTransport


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "hidden,group",
    [(256, 32), (96, 16), (333, 32), (576, 128), (1000, 64), (40, 16)],
    ids=lambda v: str(v),
)
def test_rows_of_a_are_the_same_alone_and_in_any_batch(world, dtype, hidden, group):
    assert check_rows_independent(world, hidden, group, dtype, backend="reference", seed=world + hidden) == 8


@pytest.mark.parametrize("world,hidden,group", [(3, 333, 32), (8, 576, 128), (4, 4096, 32)])
def test_numba_backend_keeps_rows_independent(world, hidden, group):
    pytest.importorskip("numba")
    assert check_rows_independent(world, hidden, group, torch.bfloat16, backend="numba") == 8


@pytest.mark.parametrize("backend", ["reference", "numba"])
@pytest.mark.parametrize("world,hidden,group", [(3, 333, 32), (4, 96, 16), (8, 1000, 64)])
def test_int8_feedback_keeps_rows_independent(backend, world, hidden, group):
    """The int8 buffer's scales are per group (a block of 8 groups shares
    nothing but its bytes) and groups never span rows, so a row's stored
    errors, and its bits, still do not depend on its batch neighbours --
    here blocks do mix rows of A and B (a row owns fewer than 8 groups)."""
    if backend == "numba":
        pytest.importorskip("numba")
    assert check_rows_independent(world, hidden, group, torch.bfloat16, backend=backend, seed=world + hidden,
                                  feedback_dtype="int8") == 8


@pytest.mark.parametrize("backend", ["reference", "numba"])
@pytest.mark.parametrize("world,hidden,group,rotation_seed", [(3, 333, 32, 1), (4, 96, 16, 2), (8, 1000, 64, 3)])
def test_a_rotation_seed_keeps_rows_independent(backend, world, hidden, group, rotation_seed):
    """The sign flips depend on a value's column alone (its place in its group)."""
    if backend == "numba":
        pytest.importorskip("numba")
    assert check_rows_independent(world, hidden, group, torch.bfloat16, backend=backend, seed=world + hidden,
                                  rotation_seed=rotation_seed) == 8


def test_without_hadamard_too():
    assert check_rows_independent(4, 333, 32, torch.bfloat16, backend="reference", hadamard=False) == 8


@pytest.mark.parametrize("backend", ["reference", "numba"])
@pytest.mark.parametrize("world,hidden,group,feedback_dtype", [(3, 333, 32, "bfloat16"), (4, 96, 16, "int8"),
                                                               (8, 1000, 64, "float32")])
def test_signed_mse_keeps_rows_independent(backend, world, hidden, group, feedback_dtype):
    """signed_mse chooses each group's scale from that group alone (its
    largest value and its own squared errors), so rows stay independent."""
    if backend == "numba":
        pytest.importorskip("numba")
    assert check_rows_independent(world, hidden, group, torch.bfloat16, backend=backend, seed=world + hidden,
                                  feedback_dtype=feedback_dtype, encoder="signed_mse") == 8


def _paths(cfg: EchoConfig, tokens: int) -> list[str]:
    comm = StackedCommunicator(cfg, VirtualTransport(2))
    x = torch.zeros(2, tokens, 4096, dtype=torch.bfloat16)
    return [comm.should_echo(x, CallSlot(t, last_call=t == 9)).path.value for t in range(10)]


def test_batch_invariant_config_fixes_the_path_whatever_the_batch():
    """The size threshold makes the path depend on the batch (one token: 8 KiB,
    exact; 64 tokens: 512 KiB, Echo); ``batch_invariant`` takes the size out
    of the decision, leaving only the call index."""
    cfg = EchoConfig()  # min_bytes 256 KiB
    assert _paths(cfg, 1) != _paths(cfg, 64)
    inv = cfg.replace(batch_invariant=True)
    assert _paths(inv, 1) == _paths(inv, 64) == _paths(inv, 4096)
    expected = ["exact"] * cfg.first_exact_calls + ["echo"] * (9 - cfg.first_exact_calls) + ["exact"]
    assert _paths(inv, 1) == expected


def test_batch_invariant_refuses_stochastic_rounding():
    from echo_vllm import EchoConfigError

    with pytest.raises(EchoConfigError, match="batch_invariant"):
        EchoConfig(batch_invariant=True, rounding="stochastic")
