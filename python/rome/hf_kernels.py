"""RoME as the CPU kernel behind transformers' ``rotary_pos_emb`` hub-kernel hook.

transformers 5.x decorates the ``apply_rotary_pos_emb`` of its modeling modules with
``@use_kernel_forward_from_hub("rotary_pos_emb")`` and attaches it to the attention classes with
``@use_kernelized_func(apply_rotary_pos_emb)``. With the Hugging Face ``kernels`` package active,
the decorator turns each module's function into a one-off ``nn.Module`` instance, and
``kernels.kernelize`` replaces that instance's ``forward`` by the layer the registered mapping
names for the layer name, the device type and the mode. transformers' own mapping has no CPU entry
for ``rotary_pos_emb``; :func:`kernel_mapping` supplies one that loads RoME from this package (no
hub, no network)::

    import kernels, rome.hf
    kernels.register_kernel_mapping(rome.hf.kernel_mapping())
    kernels.kernelize(model, device="cpu", mode=kernels.Mode.INFERENCE)
    # or model.use_kernels = True (transformers merges its mapping, which keeps our CPU entry)
    # or simply: rome.hf.kernelize(model)

One layer serves every decorated function: it finds the function the hook wraps and runs RoME's
replacement for that function's form (the same syntax-tree match as :func:`rome.hf.patch_model`:
Llama's, partial rotary, the fp32 up-casting forms, gpt-oss's half tables, ...), or the function
itself for a form RoME does not know. So a kernelized model computes what the unkernelized one
does, up to RoME's rounding (see :mod:`rome.hf`).

The hooked function is one object per modeling module: kernelizing one model switches every model
of that architecture in the process (:func:`unkernelize` switches them back).

The hook reaches ``apply_rotary_pos_emb`` only. No rotary embedding module (the classes that
build cos/sin from ``inv_freq``) carries a hub-kernel decorator in transformers 5.24 (the hooked
layers are ``rotary_pos_emb``, RMSNorm variants and a few MoE, attention and other layers), so
the exact table-free cos/sin builder cannot go this way: :func:`rome.hf.patch_model` installs it.

transformers only activates the hook with a ``kernels`` version it accepts (5.23 and 5.24 want
``0.18.2 <= kernels < 0.19``); with another, its decorators are no-ops and there is nothing to
kernelize: :func:`kernelize` warns then, and :func:`rome.hf.patch_model` is the way.
"""

import inspect
import logging
import types
import warnings
from typing import Callable, Dict, List, Optional

import torch

__all__ = ["LAYER_NAME", "RotaryPosEmb", "RomeRepository", "kernel_mapping", "kernelize",
           "unkernelize", "kernelized_functions"]

LAYER_NAME = "rotary_pos_emb"

# hook class (one per decorated function) -> what RoME runs for it
_DISPATCH: Dict[type, Callable] = {}


def _hooked_function(hook_class: type) -> Optional[Callable]:
    """The function a ``use_kernel_forward_from_hub`` hook class wraps: kernels builds its forward
    as a closure over it (``func``)."""
    forward = getattr(hook_class, "forward", None)
    cells = getattr(forward, "__closure__", None)
    if not cells:
        return None
    free = dict(zip(forward.__code__.co_freevars, cells))
    cell = free.get("func")
    fn = cell.cell_contents if cell is not None else None
    return fn if inspect.isfunction(fn) else None


def _resolve(hook_class: type) -> Callable:
    from . import hf as _hf  # here: rome.hf imports this module at its end

    original = _hooked_function(hook_class)
    if original is None:
        # No function to read (the layer used on its own): the Llama formula, which is also
        # what the hub's rotary kernels implement for this name. Narrower tables rotate the
        # leading lanes (partial rotary).
        runner = _hf._apply_partial_rotary_pos_emb
    else:
        # rome.hf's form matcher reads a module's apply_rotary_pos_emb: give it the function.
        holder = types.ModuleType(getattr(original, "__module__", None) or "hooked")
        holder.apply_rotary_pos_emb = original
        replacement, _ = _hf._contract(holder)
        runner = replacement if replacement is not None else original
    _DISPATCH[hook_class] = runner
    return runner


class RotaryPosEmb(torch.nn.Module):
    """The layer :class:`RomeRepository` loads. Stateless, with the forward signature of
    transformers' hooked ``apply_rotary_pos_emb`` (kernels checks both); ``self`` is the hook
    instance of the modeling module being served."""

    has_backward = True  # RoME's op has autograd (q, k, cos, sin)
    # kernels falls back to the original function when kernelizing for torch.compile.
    can_torch_compile = False

    def forward(self, q, k, cos, sin, unsqueeze_dim=1):
        runner = _DISPATCH.get(type(self)) or _resolve(type(self))
        return runner(q, k, cos, sin, unsqueeze_dim)


class RomeRepository:
    """A ``kernels`` repository that loads :class:`RotaryPosEmb` from this package (no hub)."""

    def load(self):
        return RotaryPosEmb

    # kernels memoizes loaded layers per repository and deep-copies mappings: all are one.
    def __eq__(self, other):
        return isinstance(other, RomeRepository)

    def __hash__(self):
        return hash(RomeRepository)

    def __str__(self):
        return "rome (local, CPU)"

    __repr__ = __str__


def kernel_mapping() -> dict:
    """The mapping for ``kernels.register_kernel_mapping`` / ``kernels.use_kernel_mapping``:
    ``rotary_pos_emb`` on CPU -> RoME, for every mode (inference and training; kernelizing for
    torch.compile keeps transformers' function)."""
    return {LAYER_NAME: {"cpu": RomeRepository()}}


def _hooks(model: torch.nn.Module) -> List[torch.nn.Module]:
    found = []
    for sub in model.modules():
        for fn in getattr(sub, "_kernel_funcs", {}).values():
            if getattr(type(fn), "kernel_layer_name", None) == LAYER_NAME and \
                    all(fn is not h for h in found):
                found.append(fn)
    return found


def _runs_rome(hook: torch.nn.Module) -> bool:
    """kernelize bound RoME's forward to this hook instance."""
    return getattr(hook.__dict__.get("forward"), "__func__", None) is RotaryPosEmb.forward


def kernelized_functions(model: torch.nn.Module) -> List[str]:
    """Modules (by name) whose ``rotary_pos_emb`` hook, attached to `model`, now runs RoME."""
    return [
        getattr(_hooked_function(type(h)), "__module__", None) or type(h).__qualname__
        for h in _hooks(model) if _runs_rome(h)
    ]


def _why_no_hooks() -> str:
    try:
        from transformers.utils import import_utils
        from importlib.metadata import version

        if not import_utils.is_kernels_available():
            return (f"transformers {version('transformers')} does not activate its hub-kernel "
                    f"decorators with kernels {version('kernels')} (it wants "
                    f"{import_utils.KERNELS_MIN_VERSION} <= kernels < "
                    f"{import_utils.KERNELS_MAX_VERSION})")
    except Exception:  # noqa: BLE001 - only for the message
        pass
    return "no attention layer of the model carries a rotary_pos_emb hook"


def kernelize(model: torch.nn.Module, mode=None) -> torch.nn.Module:
    """Routes `model`'s ``rotary_pos_emb`` hooks to RoME on CPU: registers :func:`kernel_mapping`
    (so later ``kernels.kernelize`` / ``model.use_kernels = True`` calls keep RoME on CPU) and
    runs ``kernels.kernelize(model, device="cpu", mode=mode)`` with RoME's mapping alone, so no
    other hooked layer looks for a hub kernel (they keep their forward). `mode` defaults to
    ``Mode.INFERENCE`` (``Mode.TRAINING`` for a model in training mode). Warns when no hook runs
    RoME afterwards. Returns the model."""
    import kernels

    if mode is None:
        mode = kernels.Mode.TRAINING if model.training else kernels.Mode.INFERENCE
    kernels.register_kernel_mapping(kernel_mapping())
    # kernels warns once per hooked layer without a mapping (RMSNorm, SiLU, ...): expected here.
    kernels_log = logging.getLogger("kernels.layer.layer")
    level = kernels_log.level
    kernels_log.setLevel(logging.ERROR)
    try:
        with kernels.use_kernel_mapping(kernel_mapping(), inherit_mapping=False):
            kernels.kernelize(model, device="cpu", mode=mode)
    finally:
        kernels_log.setLevel(level)
    if not kernelized_functions(model):
        reason = _why_no_hooks() if not _hooks(model) else \
            "the hooks kept their forward (torch.compile mode?)"
        warnings.warn(f"rome.hf.kernelize: RoME serves no rotary_pos_emb hook ({reason}); "
                      f"rome.hf.patch_model(model) patches the modeling modules directly",
                      stacklevel=2)
    return model


def unkernelize(model: torch.nn.Module) -> None:
    """Gives the ``rotary_pos_emb`` hooks attached to `model` their own forward back (for every
    model of those architectures: the hooks are per modeling module)."""
    for hook in _hooks(model):
        if _runs_rome(hook):
            del hook.__dict__["forward"]
