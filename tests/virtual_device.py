"""A second device on a CPU-only machine, so that device mistakes fail in the CPU test suite.

Inside ``with virtual_device():`` a tensor moved to or created on ``"vgpu"`` (PyTorch's PrivateUse1
device, renamed) is a :class:`OnVirtualDevice` tensor: its values live in CPU memory, but it reports
``device(type='vgpu', index=0)`` and is refused wherever CUDA refuses a GPU tensor — in an operation
with a CPU tensor of one or more dimensions (CPU scalars and CPU index tensors are allowed, as on
CUDA) and in ``.numpy()``. ``.cpu()`` / ``.to("cpu")`` give plain CPU tensors back.

Every ATen operation, forward and backward, passes through :class:`_Checks` (a
:class:`~torch.utils._python_dispatch.TorchDispatchMode`), which checks devices the way a GPU's
kernels do, runs the operation on the CPU values and tags the results. A few tensor methods that
PyTorch runs outside the dispatcher (``torch.tensor(..., device=)``, list indices, ``.tolist()``,
``.numpy()``, ``copy.deepcopy``) are handled by :class:`_Methods` (a
:class:`~torch.overrides.TorchFunctionMode`).

Limit: activation checkpointing's backward aborts the process on this device (PyTorch's Python device
guard), so the device reports the host's free memory to longprobe's planner, as a GPU reports its own:
the probes' ``checkpoint="auto"`` then runs unchecked at test sizes, as it does on a GPU. And
``torch.inference_mode`` is ``torch.no_grad`` here (inference tensors cannot be wrapped).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.backend_registration import _DummyBackendModule, _setup_privateuseone_for_python_backend

import probe.memory.planner
import probe.probes.attribution

NAME = "vgpu"
DEVICE = f"{NAME}:0"
aten = torch.ops.aten
# operations whose second argument may hold CPU index tensors for a GPU tensor, as on CUDA
INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
COPIES = {aten.copy_.default, aten._to_copy.default}  # they copy between devices by design
CREATES = {torch.tensor, torch.as_tensor}


class OnVirtualDevice(torch.Tensor):
    """CPU values (``values``) that report the virtual device."""

    values: torch.Tensor

    @staticmethod
    def __new__(cls, values: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls, values.shape, strides=values.stride(), storage_offset=values.storage_offset(),
            dtype=values.dtype, layout=values.layout, device=torch.device(DEVICE),
            requires_grad=values.requires_grad,
        )  # fmt: skip

    def __init__(self, values: torch.Tensor):
        self.values = values

    def __repr__(self) -> str:
        return f"OnVirtualDevice({self.values!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"{func}: a {NAME} tensor used outside `with virtual_device():`")


def _names_device(device) -> bool:
    return isinstance(device, (str, torch.device)) and torch.device(device).type == NAME


def _values(value):
    return value.values if isinstance(value, OnVirtualDevice) else value


def _tag(value):
    return OnVirtualDevice(value) if torch.is_tensor(value) else value


class _Checks(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        everything = tree_flatten((args, kwargs))[0]
        checked = tree_flatten((args[:1] if func in INDEXING else args, kwargs))[0]
        there = any(isinstance(t, OnVirtualDevice) for t in everything)
        on_cpu = [t for t in checked if torch.is_tensor(t) and not isinstance(t, OnVirtualDevice) and t.dim()]
        if there and on_cpu and func not in COPIES:
            raise RuntimeError(
                f"Expected all tensors to be on the same device, but found at least two devices, {DEVICE} "
                f"and cpu! ({func}, CPU tensors of shapes {[tuple(t.shape) for t in on_cpu]})"
            )
        if "device" in kwargs and kwargs["device"] is not None:
            there = _names_device(kwargs["device"])  # a factory, or .to(device)
            kwargs["device"] = torch.device("cpu")
        if func is aten.copy_.default:
            there = isinstance(args[0], OnVirtualDevice)  # the destination keeps its device
        found = func(*tree_map(_values, args), **tree_map(_values, kwargs))
        return tree_map(_tag, found) if there else found


class _Methods(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        this = args[0] if args else None
        if func in CREATES and _names_device(kwargs.get("device")):
            return OnVirtualDevice(func(*args, **{**kwargs, "device": "cpu"}))
        if not isinstance(this, OnVirtualDevice):
            return func(*args, **kwargs)
        if func is torch.Tensor.numpy:
            raise TypeError(
                f"can't convert {DEVICE} device type tensor to numpy. Use Tensor.cpu() to copy the tensor "
                "to host memory first."
            )
        if func is torch.Tensor.__deepcopy__:
            return OnVirtualDevice(copy.deepcopy(this.values, args[1]))
        if func is torch.Tensor.tolist:
            return this.values.tolist()  # a copy to the host, as on CUDA
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__):
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            index = tuple(torch.tensor(i) if isinstance(i, list) else i for i in index)
            return func(this, index, *args[2:], **kwargs)
        return func(*args, **kwargs)


def register() -> None:
    """Make ``"vgpu"`` a device type of this process: once, before its first backward (the autograd
    engine sizes its device queues then), and never in a process with a GPU (the registered
    PrivateUse1 device would become the accelerator whose streams CUDA's backward asks for).

    The device then is the process's accelerator, which accelerate (1.16; not the earlier versions we
    ran) asks to empty its cache whenever it moves a weight: :func:`torch.accelerator.empty_cache` is
    documented as a no-op for an allocator not initialized, but asserts for a Python device, which has
    no caching allocator at all; the device keeps no cache, so here it is the documented no-op."""
    if torch._C._get_privateuse1_backend_name() != NAME:
        _setup_privateuseone_for_python_backend(NAME, backend_module=_Backend())
        torch.accelerator.empty_cache = _keeps_no_cache


def _keeps_no_cache() -> None:
    """:func:`torch.accelerator.empty_cache` for the virtual device: nothing is cached to release."""


class _Backend(_DummyBackendModule):
    """What PyTorch asks of a device's module (autocast in checkpointing, RNG state)."""

    def get_amp_supported_dtype(self) -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16]

    def get_rng_state(self, device=None) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor, device=None) -> None:
        torch.set_rng_state(state)


@contextlib.contextmanager
def virtual_device() -> Iterator[str]:
    """Make ``"vgpu"`` a device for the duration (see the module docstring); yields its name."""
    if torch._C._get_privateuse1_backend_name() != NAME:
        raise RuntimeError("virtual_device.register() must run first, before the process's first backward")
    host = probe.memory.planner.available_memory("cpu")

    def available_memory(device="cpu"):
        return host if torch.device(device).type == NAME else found(device)

    found = probe.memory.planner.available_memory
    with (
        mock.patch("probe.memory.planner.available_memory", available_memory),
        mock.patch("torch.inference_mode", torch.no_grad),  # inference tensors refuse wrapper subclasses
        _Methods(),
        _Checks(),
    ):
        yield NAME
