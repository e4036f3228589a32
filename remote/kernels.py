"""Kernel policy and binding detection for hybrid (Gated DeltaNet) Qwen models.

Transformers picks the linear-attention kernels once, when it imports the model's modeling module
(KERNELS.md): fla + causal-conv1d when importable ("fast"), its reference PyTorch code otherwise.
So the policy must be applied in a fresh process *before* that import:

    policy  = "fast"  -> fla and causal_conv1d must import and a CUDA GPU must exist, else WorkerError
              "torch" -> hide fla and causal_conv1d (sys.modules[...] = None) so the torch path binds
              "any"   -> whatever is installed, except that without a GPU the torch path is forced
                         (fla with CPU tensors fails: "0 active drivers")

After the import, `bound_kernels` reads what transformers really bound. transformers has shipped three
binding schemes since qwen3_5 appeared (5.2); each is recognised by its shape, never by a version number:
  per-layer attributes (5.2-5.14): `linear_attn` holds each function as an instance attribute (each
           binds on its own; the module flag `is_fast_path_available` is only their AND).
  hub-fallback closure (5.15-5.24): four module-level functions wrapped by
           `use_kernel_func_from_hub_with_fallback`; the implementation is its closure's `implementation`.
  function modules (>= 5.25, and 5.15-5.24 where the `kernels` package is installed): `kernels`'
           `use_kernel_forward_from_hub` turns each wrapped function into an instance of a one-off
           `nn.Module` class ("Func") whose `forward` calls it; the function is that forward's closure
           `func`. transformers 5.25 made `kernels` a dependency, so every 5.25 host has this scheme.
A module that matches none of them is reported as an unknown scheme, naming the transformers version,
with no function taken as bound to anything: a guess would say "torch fallback" of fast kernels (the
seed story the other way round). The policy `fast` refuses it.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from remote.events import WorkerError

POLICIES = ("fast", "torch", "any")
FAST_PACKAGES = ("fla", "causal_conv1d")
# The four module-level kernel functions of qwen3_5 / qwen3_5_moe / qwen3_next (transformers >= 5.15).
KERNEL_FUNCTIONS = (
    "causal_conv1d_fn",
    "causal_conv1d_update",
    "torch_chunk_gated_delta_rule",
    "torch_recurrent_gated_delta_rule",
)
# transformers <= 5.14: the per-layer attribute of `linear_attn` holding each function.
_LEGACY_LAYER_ATTRS = {
    "causal_conv1d_fn": "causal_conv1d_fn",
    "causal_conv1d_update": "causal_conv1d_update",
    "torch_chunk_gated_delta_rule": "chunk_gated_delta_rule",
    "torch_recurrent_gated_delta_rule": "recurrent_gated_delta_rule",
}
_LEGACY_MODULE_ATTRS = {
    "causal_conv1d_fn": "causal_conv1d_fn",
    "causal_conv1d_update": "causal_conv1d_update",
    "torch_chunk_gated_delta_rule": "chunk_gated_delta_rule",
    "torch_recurrent_gated_delta_rule": "fused_recurrent_gated_delta_rule",
}


def package_status(name: str) -> dict[str, Any]:
    """Import `name` and report {"importable", "version", "error"} (a broken install is not importable)."""
    if name in sys.modules and sys.modules[name] is None:
        return {"importable": False, "version": None, "error": "hidden by the torch kernel policy"}
    try:
        module = importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - any import failure means "not usable here"
        return {"importable": False, "version": None, "error": f"{type(exc).__name__}: {exc}"[:300]}
    return {"importable": True, "version": str(getattr(module, "__version__", "unknown")), "error": None}


def cuda_available() -> bool:
    """True when torch sees a CUDA device (does not allocate GPU memory)."""
    import torch

    return bool(torch.cuda.is_available())


def modeling_module_name(model_type: str) -> str:
    """`qwen3_5_text` -> `transformers.models.qwen3_5.modeling_qwen3_5` (text configs share the module)."""
    base = model_type.removesuffix("_text")
    return f"transformers.models.{base}.modeling_{base}"


def _modeling_imported() -> list[str]:
    return [n for n in sys.modules if n.startswith("transformers.models.") and ".modeling_" in n
            and any(k in n for k in ("qwen3_5", "qwen3_next"))]


def force_torch_path() -> None:
    """Hide fla and causal_conv1d from this process so transformers binds its torch code.

    Too late if a modeling module of this process already bound fast kernels: that is an error.
    """
    for name in _modeling_imported():
        if any(is_fast_impl(m) for m in bound_kernels(sys.modules[name])["bound"].values()):
            raise WorkerError(f"cannot force the torch path: {name} already bound fast kernels in this process",
                              "kernels")
    for name in FAST_PACKAGES:
        sys.modules[name] = None  # type: ignore[assignment]


def apply_policy(policy: str, device: str) -> dict[str, Any]:
    """Apply kernel `policy` for `device` ("cpu" | "cuda"); return what was decided and why.

    Must run before transformers imports the model's modeling module; raises WorkerError on a
    policy this host cannot honour, before any weights are read or GPU memory is touched.
    """
    if policy not in POLICIES:
        raise WorkerError(f"unknown kernel policy {policy!r}: expected one of {', '.join(POLICIES)}", "--kernels")
    if policy == "torch":
        force_torch_path()
        return {"policy": policy, "effective": "torch", "reason": "policy torch: fla and causal_conv1d hidden"}
    has_cuda = device == "cuda" and cuda_available()
    if policy == "fast":
        status = {name: package_status(name) for name in FAST_PACKAGES}
        missing = [n for n, s in status.items() if not s["importable"]]
        if not has_cuda or missing:
            facts = [f"CUDA GPU: {'yes' if has_cuda else 'no' if device == 'cuda' else f'not used (device {device})'}"]
            for name, s in status.items():
                facts.append(f"{name}: {s['version'] if s['importable'] else 'not importable (' + str(s['error']) + ')'}")
            raise WorkerError(
                "kernel policy 'fast' needs fla and causal_conv1d on a CUDA GPU; this host has: " + "; ".join(facts),
                "--kernels",
            )
        return {"policy": policy, "effective": "fast", "reason": "fla and causal_conv1d import; CUDA present"}
    if not has_cuda:
        # fla binds even without a GPU and then fails in the forward: force the torch path ourselves.
        force_torch_path()
        return {"policy": policy, "effective": "torch", "reason": f"no CUDA GPU used (device {device}): torch path forced"}
    return {"policy": policy, "effective": "as-installed", "reason": "CUDA present: transformers binds what is installed"}


# Each scheme's name says which transformers releases have it: the probe table shows it as it is.
SCHEME_LEGACY = "per-layer attributes (transformers 5.2-5.14)"
SCHEME_CLOSURE = "hub-fallback closure (transformers 5.15-5.24)"
SCHEME_FUNC_MODULES = "function modules (transformers >= 5.25; 5.15-5.24 with kernels)"
UNKNOWN_SCHEME_PREFIX = "unknown binding scheme"
# The transformers releases this code was tested against (tests/test_transformers_matrix.py): the
# worker extra of pyproject.toml says the same (tests check it), and `probe` warns on a host outside.
TESTED_TRANSFORMERS = ">=5.2,<=5.25.0"


def _closure_value(fn: Any, name: str) -> Any | None:
    """The closure variable `name` of function `fn` (None when it has none)."""
    code = getattr(fn, "__code__", None)
    cells = getattr(fn, "__closure__", None)
    if code is None or not cells or name not in code.co_freevars:
        return None
    try:
        return cells[code.co_freevars.index(name)].cell_contents
    except ValueError:  # an empty cell
        return None


def _implementation_of(fn: Any) -> Any | None:
    """The `implementation` closure variable of a hub-fallback wrapper, following `__wrapped__`."""
    seen = 0
    while fn is not None and seen < 8:
        impl = _closure_value(fn, "implementation")
        if impl is not None:
            return impl
        fn = getattr(fn, "__wrapped__", None)
        seen += 1
    return None


def _function_of_module(obj: Any) -> Any | None:
    """The function a `kernels` function module ("Func") calls: its class's `forward` closure `func`.

    An instance with a `forward` of its own was `kernelize`d (a hub kernel swapped in, which the
    workers never ask for: no `use_kernels`): no known shape, so it is reported unknown, not guessed."""
    forward = getattr(type(obj), "forward", None)
    if forward is None or isinstance(obj, type) or "forward" in getattr(obj, "__dict__", {}):
        return None
    return _closure_value(forward, "func")


def _resolve(obj: Any) -> tuple[str, Any] | None:
    """(scheme, implementation) for one module-level kernel name, or None for a shape not known."""
    func = _function_of_module(obj)
    if func is not None:
        impl = _implementation_of(func)
        return (SCHEME_FUNC_MODULES, impl) if impl is not None else None
    impl = _implementation_of(obj)
    return (SCHEME_CLOSURE, impl) if impl is not None else None


def _impl_module(impl: Any, fallback: str) -> str:
    if impl is None:
        return fallback
    return str(getattr(impl, "__module__", None) or fallback)


def transformers_version() -> str:
    """The transformers version this process imports ("unknown" when it cannot tell)."""
    module = sys.modules.get("transformers")
    version = getattr(module, "__version__", None)
    if version is None:
        try:
            version = importlib.metadata.version("transformers")
        except importlib.metadata.PackageNotFoundError:
            version = "unknown"
    return str(version)


def is_unknown_scheme(scheme: str | None) -> bool:
    return bool(scheme) and str(scheme).startswith(UNKNOWN_SCHEME_PREFIX)


def bound_kernels(module: ModuleType, model: Any = None) -> dict[str, Any]:
    """What transformers bound in `module` for the four kernel functions.

    Returns {"scheme", "module", "transformers", "bound": {fn: implementation module or None}, "fast"}.
    Under the per-layer scheme the attributes of `model`'s first `linear_attn` are read when it is
    given (else the module's names). An unknown scheme binds every function to None, never fast.
    """
    name = module.__name__
    version = transformers_version()
    if hasattr(module, "is_fast_path_available"):
        # Each function binds on its own there: `is_fast_path_available` is only the AND of the four
        # (fla present and causal-conv1d missing leaves it False while the delta rules run on fla), so
        # it says nothing per function. The layer's attribute is what its forward calls: None or the
        # modeling module's own torch function for the torch path; without a model, the module-level
        # name (None when the package is missing).
        layer = _first_linear_attn(model) if model is not None else None
        bound = {}
        for fn in KERNEL_FUNCTIONS:
            if layer is not None and hasattr(layer, _LEGACY_LAYER_ATTRS[fn]):
                impl = getattr(layer, _LEGACY_LAYER_ATTRS[fn])
            else:
                impl = getattr(module, _LEGACY_MODULE_ATTRS[fn], None)
            bound[fn] = _impl_module(impl, name)
        return _binding(SCHEME_LEGACY, name, version, bound)
    resolved = {fn: _resolve(getattr(module, fn)) if hasattr(module, fn) else None for fn in KERNEL_FUNCTIONS}
    schemes = {r[0] for r in resolved.values() if r is not None}
    if None in resolved.values() or len(schemes) != 1:
        return _binding(f"{UNKNOWN_SCHEME_PREFIX} (transformers {version})", name, version,
                        dict.fromkeys(KERNEL_FUNCTIONS))
    bound = {fn: _impl_module(r[1], name) for fn, r in resolved.items() if r is not None}
    return _binding(schemes.pop(), name, version, bound)


def _binding(scheme: str, module: str, version: str, bound: dict[str, str | None]) -> dict[str, Any]:
    fast = bool(bound) and all(is_fast_impl(m) for m in bound.values())
    return {"scheme": scheme, "module": module, "transformers": version, "bound": bound, "fast": fast}


def _first_linear_attn(model: Any) -> Any | None:
    for mod in model.modules():
        if hasattr(mod, "linear_attn"):
            return mod.linear_attn
    return None


def is_fast_impl(module_name: str | None) -> bool:
    """True for an implementation from fla or causal_conv1d (None, under an unknown scheme: not known)."""
    return module_name is not None and module_name.split(".")[0] in FAST_PACKAGES


def require_fast(binding: dict[str, Any]) -> None:
    """Under policy `fast`: fail unless every kernel function is bound to fla / causal_conv1d.
    A scheme this code does not recognise refuses too, naming it: what runs there is not known."""
    scheme = binding.get("scheme")
    if is_unknown_scheme(scheme):
        raise WorkerError(f"kernel policy 'fast' but transformers binds its kernels under an {scheme}, which "
                          f"dflash-ops cannot read (tested: transformers {TESTED_TRANSFORMERS}); "
                          f"which kernels would run is not known", "kernels")
    slow = {fn: m for fn, m in binding["bound"].items() if not is_fast_impl(m)}
    if slow:
        listing = ", ".join(f"{fn} -> {m}" for fn, m in slow.items())
        raise WorkerError(f"kernel policy 'fast' but transformers bound the torch path for: {listing}", "kernels")


def import_modeling(model_type: str) -> ModuleType:
    """Import the modeling module for `model_type` (binding its kernels); clear error when unknown."""
    name = modeling_module_name(model_type)
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        raise WorkerError(f"model type {model_type!r}: transformers has no module {name} ({exc})", "config.json") from exc


@contextlib.contextmanager
def count_kernel_calls(module: ModuleType) -> Iterator[dict[str, int]]:
    """Count calls of the four module-level kernel functions while inside (the modeling code looks
    them up as module globals at call time, so wrapping the globals sees every call)."""
    counts = {fn: 0 for fn in KERNEL_FUNCTIONS}
    originals = {fn: getattr(module, fn) for fn in KERNEL_FUNCTIONS if hasattr(module, fn)}

    def wrap(fn_name: str, fn: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            counts[fn_name] += 1
            return fn(*args, **kwargs)

        counted.__wrapped__ = fn  # type: ignore[attr-defined]
        return counted

    for fn_name, fn in originals.items():
        setattr(module, fn_name, wrap(fn_name, fn))
    try:
        yield counts
    finally:
        for fn_name, fn in originals.items():
            setattr(module, fn_name, fn)


def autotune_choices(roots: tuple[str, ...] = ("fla", "remote")) -> dict[str, dict[str, str]]:
    """The configs Triton's autotuner chose in this process, per kernel: {kernel: {key: config}}.

    fla's kernels are `triton.autotune`d by timing; which config wins can differ from one process
    to the next (an empty Triton cache, other input shapes when it tuned, timing noise), and configs
    that tile or split a reduction differently round differently in bf16. Recorded in the manifest
    so two runs whose hidden states differ can be told apart from a real change. Read from the
    autotuners in the loaded modules under `roots`; {} when Triton was never imported.
    """
    autotuner = sys.modules.get("triton.runtime.autotuner")
    tuner_type = getattr(autotuner, "Autotuner", None)
    if not isinstance(tuner_type, type):
        return {}
    wrapper_types = tuple(t for t in (tuner_type, getattr(autotuner, "Heuristics", None)) if isinstance(t, type))
    found: dict[str, dict[str, str]] = {}
    seen: set[int] = set()
    for module_name, module in list(sys.modules.items()):
        if module is None or module_name.split(".")[0] not in roots:
            continue
        for obj in list(vars(module).values()):
            tuners = []
            depth = 0
            while isinstance(obj, wrapper_types) and depth < 8:
                if isinstance(obj, tuner_type):
                    tuners.append(obj)
                obj = getattr(obj, "fn", None)
                depth += 1
            if not tuners or id(tuners[0]) in seen:
                continue
            seen.add(id(tuners[0]))
            inner = getattr(obj, "fn", obj)  # the JIT function's Python function
            kernel = f"{getattr(inner, '__module__', module_name)}.{getattr(inner, '__qualname__', '?')}"
            for tuner in tuners:
                for key, config in dict(getattr(tuner, "cache", None) or {}).items():
                    found.setdefault(kernel, {})[str(key)] = str(config)
    return {k: dict(sorted(v.items())) for k, v in sorted(found.items())}
