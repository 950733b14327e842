"""How the GPUs of one host are linked: native peer atomics and NVLink.

Read through ctypes from the NVIDIA driver's own libraries (``libcuda.so.1``
for the CUDA attribute, ``libnvidia-ml.so.1`` for NVML), which every driver
installs: no Python package is needed, and nothing here runs per call (the
fused backend's :func:`~echo_vllm.backends.fused.probe` asks once per
group). Each answer is None where it cannot be read (no driver, a call that
fails, a device the library does not know); the pure decision
(:func:`~echo_vllm.backends.fused.fused_availability`) says what an unknown
means. Call with CUDA initialised in the process (torch has, once it has
touched a GPU).
"""

from __future__ import annotations

import ctypes
import functools

#: ``CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED`` (cuda.h): atomic
#: operations over the link are native (NVLink), not emulated or refused.
_NATIVE_ATOMICS = 0x03
#: ``NVML_P2P_CAPS_INDEX_NVLINK`` and ``NVML_P2P_STATUS_OK`` (nvml.h): the
#: query vLLM's custom all-reduce makes (``is_fully_connected``).
_NVML_NVLINK = 2
_NVML_OK = 0


@functools.lru_cache(maxsize=1)
def _cuda():
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        return lib if lib.cuInit(0) == 0 else None
    except OSError:
        return None


@functools.lru_cache(maxsize=1)
def _nvml():
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
        return lib if lib.nvmlInit_v2() == _NVML_OK else None
    except (OSError, AttributeError):
        return None


def _device(lib, ordinal: int):
    dev = ctypes.c_int()
    return dev if lib.cuDeviceGet(ctypes.byref(dev), int(ordinal)) == 0 else None


def native_atomics(src: int, dst: int) -> bool | None:
    """Whether GPU ``src`` performs native atomics on GPU ``dst``'s memory
    over peer access (CUDA ordinals of this process, ``src != dst``)."""
    lib = _cuda()
    if lib is None:
        return None
    a, b = _device(lib, src), _device(lib, dst)
    if a is None or b is None:
        return None
    value = ctypes.c_int()
    if lib.cuDeviceGetP2PAttribute(ctypes.byref(value), _NATIVE_ATOMICS, a, b) != 0:
        return None
    return bool(value.value)


def pci_bus_id(ordinal: int) -> str | None:
    """The PCI bus id (``0000:18:00.0``) of CUDA device ``ordinal``: a name
    for a GPU that every process and NVML share."""
    lib = _cuda()
    dev = None if lib is None else _device(lib, ordinal)
    if dev is None:
        return None
    buf = ctypes.create_string_buffer(32)
    if lib.cuDeviceGetPCIBusId(buf, len(buf), dev) != 0:
        return None
    return buf.value.decode()


def nvlink(bus_a: str | None, bus_b: str | None) -> bool | None:
    """Whether NVML reports an NVLink peer path between the GPUs at PCI bus
    ids ``bus_a`` and ``bus_b`` (vLLM's test for "fully connected")."""
    lib = _nvml()
    if lib is None or not bus_a or not bus_b:
        return None
    handles = []
    for bus in (bus_a, bus_b):
        h = ctypes.c_void_p()
        if lib.nvmlDeviceGetHandleByPciBusId_v2(bus.encode(), ctypes.byref(h)) != _NVML_OK:
            return None
        handles.append(h)
    status = ctypes.c_int()
    if lib.nvmlDeviceGetP2PStatus(handles[0], handles[1], _NVML_NVLINK, ctypes.byref(status)) != _NVML_OK:
        return None
    return status.value == _NVML_OK


__all__ = ["native_atomics", "nvlink", "pci_bus_id"]
