"""The ``ECHO_*`` variables: a bad value is one line naming it (with the
closest choice), an unknown ``ECHO_*`` name is a warning naming the
variable it is closest to."""

from __future__ import annotations

import pytest

from echo_vllm import envs
from echo_vllm.cli_args import UsageError


def test_values_read():
    assert envs.read({}) == envs.EchoEnv()
    got = envs.read({"ECHO_KERNELS": " CPU ", "ECHO_KERNEL_DIRECT_LAUNCH": "0", "ECHO_VLLM_CACHE": "/c"})
    assert (got.kernels, got.direct_launch, got.cache_dir) == ("numba", False, "/c")


@pytest.mark.parametrize("environ,message", [
    ({"ECHO_KERNELS": "junk"}, "ECHO_KERNELS='junk': choose one of auto, reference, triton, numba"),
    ({"ECHO_KERNELS": "trition"}, "; did you mean 'triton'?"),
    ({"ECHO_KERNELS": "fused"}, "(fused is EchoConfig.backend's choice, not a value here)"),
    ({"ECHO_KERNEL_DIRECT_LAUNCH": "yes"}, "ECHO_KERNEL_DIRECT_LAUNCH='yes': 0 or 1"),
])
def test_bad_values_are_one_line_usage_errors(environ, message):
    with pytest.raises(envs.EchoEnvError) as info:
        envs.read(environ)
    assert message in str(info.value) and "\n" not in str(info.value)
    assert isinstance(info.value, UsageError)


def test_unknown_echo_variables_are_named_with_the_closest_known_one():
    (line,) = envs.unknown_variables({"ECHO_KERNEL": "numba", "ECHO_KERNELS": "numba", "PATH": "/bin"})
    assert line.startswith("ECHO_KERNEL is not a variable echo-vllm reads; did you mean 'ECHO_KERNELS'?")
    assert envs.unknown_variables({"ECHO_KERNELS": "auto"}) == []


@pytest.mark.parametrize("value,message", [
    ("/etc/hostname", "ECHO_VLLM_CACHE='/etc/hostname': exists and is not a folder"),
    ("/proc/echo-vllm-x", "ECHO_VLLM_CACHE='/proc/echo-vllm-x': /proc, where it would be made, is not writable"),
    (" /tmp/echo-c", "ECHO_VLLM_CACHE=' /tmp/echo-c': begins or ends with a space"),  # was ./' '/tmp/echo-c
])
def test_a_cache_that_cannot_be_a_folder_is_refused(value, message):
    with pytest.raises(envs.EchoEnvError) as info:
        envs.read({"ECHO_VLLM_CACHE": value})
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_cache_folder_to_be_made_is_checked_not_made(tmp_path):
    assert envs.read({"ECHO_VLLM_CACHE": str(tmp_path / "new")}).cache_dir == str(tmp_path / "new")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "dangling").symlink_to(tmp_path / "missing")
    with pytest.raises(envs.EchoEnvError, match="dangling.* is a link to .*missing, which does not exist"):
        envs.read({"ECHO_VLLM_CACHE": str(tmp_path / "dangling")})


def test_a_quoted_tilde_in_the_cache_is_the_home_folder(tmp_path, monkeypatch):
    """An env file's ``ECHO_VLLM_CACHE=~/c`` was checked as $HOME/c but used
    as a folder named ``~`` in the current folder."""
    monkeypatch.setenv("HOME", str(tmp_path))
    assert envs.read({"ECHO_VLLM_CACHE": "~/c"}).cache_dir == str(tmp_path / "c")


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "on", "Yes", "y", " 1", "1 ", "t", "0", "false", "junk", ""])
def test_triton_interpret_is_read_as_triton_reads_it(value, monkeypatch):
    """``TRITON_INTERPRET=true`` runs Triton's interpreter, but Echo read it
    as off (refusing the triton backend on CPU: "set TRITON_INTERPRET=1");
    `` 1`` is off for Triton, but Echo read it as on (Triton then launched
    on CPU tensors)."""
    triton = pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert envs.read({"TRITON_INTERPRET": value}).triton_interpret is triton.knobs.runtime.interpret
