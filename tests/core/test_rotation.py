"""Walsh-Hadamard rotation: orthonormality, round trip, and what it buys; its seeded sign flips."""

import pytest
import torch

from echo_vllm import CallSlot, EchoConfig, FeedbackChain, Path, StackedCommunicator, VirtualTransport
from echo_vllm.emulation import EmulatedTP
from echo_vllm.rotation import fwht, hadamard_matrix, hadamard_orthonormal, sign_flips, sign_vector


@pytest.mark.parametrize("g", [16, 32, 64, 128])
def test_matrix_is_orthogonal_and_symmetric(g):
    w = hadamard_matrix(g)
    assert torch.equal(w, w.T)
    assert torch.equal(w @ w, g * torch.eye(g, dtype=w.dtype))
    assert torch.equal(w.abs(), torch.ones_like(w))


@pytest.mark.parametrize("g", [16, 32, 128])
def test_fwht_matches_matrix_and_round_trips(g):
    torch.manual_seed(g)
    x = torch.randn(50, g, dtype=torch.float64)
    # the butterflies compute x @ W (fp64: exact up to ~1e-15 relative)
    assert torch.allclose(fwht(x), x @ hadamard_matrix(g), rtol=0, atol=1e-12)
    # unnormalized round trip W W x / g: exact on integers in fp32 ...
    xi = torch.randint(-1000, 1000, (50, g)).float()
    assert torch.equal(fwht(fwht(xi)) * (1.0 / g), xi)
    # ... and within fp32 rounding on reals: each butterfly level adds at
    # most one rounding of the running magnitude, log2(g) levels each way.
    x32 = x.float()
    back = hadamard_orthonormal(hadamard_orthonormal(x32))
    levels = 2 * g.bit_length()
    bound = levels * 2**-24 * x32.abs().amax(-1, keepdim=True) * g**0.5
    assert torch.all((back - x32).abs() <= bound)


def test_fwht_rejects_non_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        fwht(torch.zeros(3, 24))


def _echo(cfg, xs):
    comm = StackedCommunicator(cfg, VirtualTransport(xs.shape[0]))
    return comm.all_reduce(xs, slot=CallSlot(0), path=Path.ECHO, chain=FeedbackChain(xs.shape[0]))


def test_rotated_echo_equals_plain_echo_on_rotated_inputs():
    """rot^-1(Echo_plain(rot(x))) == Echo_rotated(x), bit for bit: the sum
    commutes with the rotation, so stage 2 and feedback live rotated."""
    g, p = 32, 3
    torch.manual_seed(3)
    xs = torch.randn(p, 10, 4 * g).bfloat16()
    cfg = EchoConfig(min_bytes=0, group_size=g)
    rotated = _echo(cfg.replace(hadamard=True), xs)
    pre = fwht(xs.float().reshape(p, -1, g)).reshape(xs.shape)
    plain = _echo(cfg.replace(hadamard=False), pre).float()  # fp32 in, fp32 out
    post = (fwht(plain.reshape(-1, g)) * (1.0 / g)).reshape(rotated.shape).to(rotated.dtype)
    assert torch.equal(rotated, post)


def test_rotation_lowers_error_on_outlier_channels():
    """Activations with a few huge channels: without rotation the outlier sets
    every group's scale and its neighbours round to zero."""
    g, p = 32, 4
    torch.manual_seed(4)
    xs = torch.randn(p, 64, 1024)
    xs[..., ::97] *= 60.0  # a few large channels, as in real LLM activations
    xs = xs.bfloat16()
    exact = xs.double().sum(0)
    normal = torch.ones(xs.shape[-1], dtype=torch.bool)
    normal[::97] = False
    cfg = EchoConfig(min_bytes=0, group_size=g, exact_last_call=False)
    err, err_normal = {}, {}
    for h in (False, True):
        e = _echo(cfg.replace(hadamard=h), xs).double() - exact
        err[h] = (e.norm() / exact.norm()).item()
        err_normal[h] = (e[:, normal].norm() / exact[:, normal].norm()).item()
    # The issue asks for the direction: rotation lowers the error overall and
    # on the ordinary channels that share a group with an outlier.
    assert err[True] < err[False], err
    assert err_normal[True] < err_normal[False], err_normal


# -- sign flips (EchoConfig.rotation_seed) -------------------------------------------------


def _splitmix64_numpy(state: int, n: int) -> list[int]:
    """splitmix64's first ``n`` outputs from ``state`` in numpy's wrapping
    uint64 arithmetic: an implementation independent of ``rotation``'s."""
    import numpy as np

    with np.errstate(over="ignore"):
        z = np.uint64(state) + np.arange(1, n + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return [int(v) for v in z]


@pytest.mark.parametrize("g", [16, 32, 64, 128])
def test_sign_flips_are_splitmix64_bits_and_seed_0_flips_nothing(g):
    assert sign_flips(0, g) == 0
    for seed in (1, 2, 12345, (1 << 63) - 1):
        words = _splitmix64_numpy(seed, 2)
        want = (words[0] | words[1] << 64) & ((1 << g) - 1)
        assert sign_flips(seed, g) == want and 0 <= want < 1 << g
    assert torch.equal(sign_vector(sign_flips(7, g), g),
                       torch.tensor([-1.0 if sign_flips(7, g) >> i & 1 else 1.0 for i in range(g)]))
    assert torch.equal(sign_vector(0, g), torch.ones(g))


def test_every_position_is_flipped_by_half_the_seeds():
    """Over 4096 seeds each of the 128 positions is flipped 2048 times on
    average, binomial with standard deviation 32: within 5 of them (a
    fair coin leaves that band with probability 6e-7 per position), and
    no two seeds draw the same pattern."""
    seeds = range(1, 4097)
    patterns = [sign_flips(s, 128) for s in seeds]
    assert len(set(patterns)) == len(patterns)
    for i in range(128):
        assert abs(sum(p >> i & 1 for p in patterns) - 2048) <= 5 * 32, i


def _column_signs(flips: int, g: int, cols: int) -> torch.Tensor:
    """The sign of each column of a row (its place in its group)."""
    return sign_vector(flips, g).repeat(-(-cols // g))[:cols]


def _forward(cfg: EchoConfig, partials: list[torch.Tensor]) -> list[torch.Tensor]:
    """One forward pass of calls (the first and the last exact, the others
    Echo with the error carried) over virtual ranks."""
    tp = EmulatedTP(partials[0].shape[0], cfg, calls_per_forward=len(partials))
    tp.begin_forward()
    out = [tp.reduce(x) for x in partials]
    tp.end_forward()
    return out


@pytest.mark.parametrize("backend", ["reference", "numba"])
@pytest.mark.parametrize("feedback_dtype", ["float32", "bfloat16", "int8"])
def test_a_seeded_rotation_is_the_shipped_one_between_two_sign_flips(backend, feedback_dtype):
    """Echo under seed s of inputs x is D Echo_0(D x), bit for bit, call
    after call of a chain (D: the seed's signs by column), the exact calls
    that absorb the carried error included: the signs go on before the
    Hadamard and come off after its inverse, and the carried error lives in
    the flipped, rotated domain. So a seed changes the bits and, for inputs
    whose distribution is symmetric under sign flips, not the statistics."""
    if backend == "numba":
        pytest.importorskip("numba")
    g, p, seed = 32, 3, 11
    torch.manual_seed(5)
    partials = [(torch.randn(p, 4, 3 * g + 5) * (1 + 30 * (torch.arange(3 * g + 5) % 17 == 0))).bfloat16()
                for _ in range(5)]
    cfg = EchoConfig(min_bytes=0, group_size=g, first_exact_calls=1, feedback_dtype=feedback_dtype, backend=backend)
    d = _column_signs(sign_flips(seed, g), g, 3 * g + 5).bfloat16()
    seeded = _forward(cfg.replace(rotation_seed=seed), partials)
    shipped = _forward(cfg, [x * d for x in partials])  # x * d: exact (a sign)
    for t, (a, b) in enumerate(zip(seeded, shipped)):
        assert torch.equal(a.view(torch.int16), (b * d).view(torch.int16)), t
    other = _forward(cfg.replace(rotation_seed=seed + 1), partials)
    assert not torch.equal(seeded[2], other[2]) and not torch.equal(seeded[2], _forward(cfg, partials)[2])


def test_seeds_give_the_same_error_statistics():
    """Inputs drawn from a distribution symmetric under sign flips (Gaussian
    partials with outlier channels): each seed's mean relative error over
    48 inputs equals seed 0's within 5 standard errors of the difference of
    two such means (the identity above makes their distributions equal)."""
    g, p, n = 32, 4, 48
    gen = torch.Generator().manual_seed(9)
    scale = 1 + 40 * (torch.arange(256) % 37 == 0)
    xs = [(torch.randn(p, 8, 256, generator=gen) * scale).bfloat16() for _ in range(n)]
    cfg = EchoConfig(min_bytes=0, group_size=g, exact_last_call=False)

    def errors(seed):
        comm = StackedCommunicator(cfg.replace(rotation_seed=seed), VirtualTransport(p))
        out = []
        for x in xs:
            exact = x.double().sum(0)
            y = comm.all_reduce(x, slot=CallSlot(0), path=Path.ECHO, chain=FeedbackChain(p))
            out.append(((y.double() - exact).norm() / exact.norm()).item())
        return torch.tensor(out, dtype=torch.float64)

    base = errors(0)
    for seed in (1, 2, 3, 4):
        e = errors(seed)
        se = (base.var() / n + e.var() / n).sqrt()
        assert abs(e.mean() - base.mean()) <= 5 * se, (seed, e.mean().item(), base.mean().item(), se.item())
        assert not torch.equal(e, base)  # other bits
