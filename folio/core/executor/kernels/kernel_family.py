"""A family of CUDA kernels compiled as a module of its own (MoE, LoRA): ``KernelFamily`` sets one up
(its instances per dtype, every instance, its source, a launcher per device) and ``FamilyLauncher``
launches its kernels on torch's current stream."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from folio.core.executor.kernels import cuda_kernels as ck


@dataclass(frozen=True)
class KernelFamily:
    """Kernels compiled as a module of their own (MoE, LoRA), set up once here: the instances one
    dtype asks for (``names``), every instance (what the compile test and the emulation build), the
    module's source, and a launcher per device on torch's current stream."""

    what: str  # "MoE kernels": the errors name it
    source: str  # the file of cuda/
    dtypes: tuple[str, ...]  # the dtypes built
    names_of: Callable[[str], object]  # a built dtype -> its names (a dataclass of name expressions or None)
    needs_cupy: str  # what the error says runs on these kernels when CuPy is missing
    module_per_dtype: bool = False  # compile one dtype's instances at a time, else every instance at once
    _launchers: dict = field(default_factory=dict, compare=False, repr=False)

    def names(self, dtype: str):
        ck.built_type(dtype, self.dtypes, self.what)
        return self.names_of(dtype)

    def all_name_expressions(self) -> list[str]:
        return sorted({n for dtype in self.dtypes for n in vars(self.names(dtype)).values() if n})

    def module_source(self) -> str:
        """The family's file with our headers inlined (``cuda_kernels.source_of``)."""
        return ck.source_of(self.source)

    def launcher(self, device) -> "FamilyLauncher":
        """The launcher of ``device`` (a CUDA ``torch.device``), made once per process."""
        if device.type != "cuda":
            raise ValueError(f"the {self.what} run on a CUDA device (tensors on {device}); pass launcher= to emulate")
        try:
            import cupy  # noqa: F401
        except ImportError as e:
            raise ValueError(f"{self.needs_cupy}, which need CuPy (pip install 'folio[cuda12]' or 'folio[cuda13]')") from e
        import torch

        device_id = device.index if device.index is not None else torch.cuda.current_device()
        if device_id not in self._launchers:
            self._launchers[device_id] = FamilyLauncher(self, torch.device("cuda", device_id))
        return self._launchers[device_id]


class FamilyLauncher:
    """Launches a ``KernelFamily``'s kernels (its module compiled once per process) on torch's current stream."""

    def __init__(self, family: KernelFamily, device):
        from folio.core.executor.kernels.cuda_backend import CupyLauncher

        self.family = family
        self._streams = CupyLauncher(device)  # its view of torch's current stream
        self.num_sms = self._streams.num_sms

    def launch(self, names, kernel: str, grid, block, args, device) -> None:
        module = (tuple(sorted(n for n in vars(names).values() if n)) if self.family.module_per_dtype
                  else tuple(self.family.all_name_expressions()))
        self._streams.launch_from(self.family.source, module, getattr(names, kernel), grid, block, args, device)
