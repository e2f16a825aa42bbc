"""Mixed precision chosen from the accelerator: bf16 where it is native, fp16 + loss scaling where only fp16
is fast, fp32 elsewhere.

The decision is a pure function of device facts (:func:`select_precision`), so every branch is testable on a
CPU by injecting the facts; :class:`AutoPrecision` detects the facts of the device the strategy really uses and
drives Lightning's own precision plugin for the choice.

Decision table (``select_precision``):

=====================================  ==============  ==========================================================
accelerator                            choice          why
=====================================  ==============  ==========================================================
CUDA, compute capability >= 8.0        ``bf16-mixed``  Ampere and newer (A100, H100, H200, L4, RTX 30/40): native
                                                       bf16 tensor cores; fp32's range, so no loss scaling
CUDA 7.x (V100 7.0, T4 7.5)            ``16-mixed``    fast fp16 tensor cores, no fast bf16 (``is_bf16_supported``
                                                       says True only through emulation); needs a GradScaler
CUDA < 7.0 (P100, K80)                 ``32-true``     little to gain from either half format
ROCm gfx90a / gfx94x / gfx95x /        ``bf16-mixed``  MI200, MI300, RDNA3+ have native bf16 matrix units
gfx11xx / gfx12xx
ROCm gfx908 (MI100)                    ``16-mixed``    fp16 matrix cores are the fast path
other ROCm                             ``32-true``
TPU / XLA                              ``bf16-true``   the XLA idiom: bf16 everywhere, no scaler
MPS with bf16 (macOS 14+)              ``bf16-mixed``
MPS without bf16                       ``32-true``     fp16 autocast with loss scaling is not reliable there
CPU with AVX512-BF16 / AMX-BF16 /      ``bf16-mixed``  native bf16 instructions
Arm BF16
CPU without them                       ``32-true``     emulated bf16 is slower than fp32
=====================================  ==============  ==========================================================

An ``allow`` list restricts the choice (e.g. never fp16): a disallowed choice falls back to the next one the
hardware supports (``bf16-mixed`` -> ``16-mixed`` -> ``32-true``).
"""

from __future__ import annotations

import functools
import importlib
import logging
import platform
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from lightning.fabric.utilities import rank_zero_info
from lightning.pytorch.plugins.precision import Precision

from lightning_resilient._checks import check_number
from lightning_resilient._namespaces import LIGHTNING_PYTORCH, PYTORCH_LIGHTNING, namespace_of
from lightning_resilient._warnings import warn

__all__ = ["AutoPrecision", "CHOICES", "PrecisionChoice", "PrecisionName", "choose_for_device", "detect_facts",
           "select_precision"]

log = logging.getLogger(__name__)

PrecisionName = Literal["bf16-mixed", "16-mixed", "32-true", "bf16-true"]
CHOICES = ("bf16-mixed", "16-mixed", "32-true", "bf16-true")
_ACCELERATORS = ("cuda", "rocm", "xla", "mps", "cpu")
_CPU_BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}  # x86 AVX512-BF16, AMX, and Arm's BF16 feature
_ROCM_BF16 = re.compile(r"^gfx(90a|94\d|95\d|11\d\d|12\d\d)")


@dataclass(frozen=True)
class PrecisionChoice:
    precision: str
    reason: str
    facts: dict[str, Any] = field(default_factory=dict)
    supported: tuple[str, ...] = ()


def _check_allow(allow: Iterable[str] | None) -> tuple[str, ...] | None:
    if allow is None:
        return None
    if isinstance(allow, str):
        raise TypeError(f"allow must be a list of precision names, not the string {allow!r}")
    out = tuple(allow)
    bad = [a for a in out if a not in CHOICES]
    if bad or not out:
        raise ValueError(f"allow must name some of {list(CHOICES)}, got {list(out)}")
    return out


def _decide(accelerator: str, *, capability: tuple[int, int] | None, arch: str | None,
            cpu_flags: Iterable[str] | None, mps_bf16: bool | None) -> tuple[str, str, tuple[str, ...]]:
    """(choice, reason, what the hardware supports well, best first)."""
    if accelerator == "cuda":
        if capability is None:
            raise ValueError("accelerator='cuda' needs capability=(major, minor)")
        cc = f"{capability[0]}.{capability[1]}"
        if capability >= (8, 0):
            return "bf16-mixed", f"compute capability {cc} >= 8.0: native bf16, no loss scaling", \
                ("bf16-mixed", "16-mixed", "32-true")
        if capability >= (7, 0):
            return "16-mixed", (f"compute capability {cc}: fast fp16 tensor cores but no native bf16, so fp16 with"
                                " a dynamic GradScaler"), ("16-mixed", "32-true")
        return "32-true", f"compute capability {cc} < 7.0: no fast half-precision path", ("32-true",)
    if accelerator == "rocm":
        name = (arch or "").split(":")[0]
        if _ROCM_BF16.match(name):
            return "bf16-mixed", f"ROCm {name}: native bf16 matrix units", ("bf16-mixed", "16-mixed", "32-true")
        if name.startswith("gfx908"):
            return "16-mixed", f"ROCm {name} (MI100): fp16 matrix cores are the fast path", ("16-mixed", "32-true")
        return "32-true", f"ROCm {name or 'unknown architecture'}: no native bf16", ("32-true",)
    if accelerator == "xla":
        return "bf16-true", "TPU/XLA: bf16 throughout is the XLA idiom, no loss scaling", ("bf16-true", "32-true")
    if accelerator == "mps":
        if mps_bf16:
            return "bf16-mixed", "MPS with bf16 support (macOS 14+)", ("bf16-mixed", "32-true")
        return "32-true", "MPS without bf16 (macOS < 14 or an older torch)", ("32-true",)
    if accelerator == "cpu":
        flags = set(cpu_flags or ())
        native = sorted(flags & _CPU_BF16_FLAGS)
        if native:
            return "bf16-mixed", f"CPU with native bf16 instructions ({', '.join(native)})", ("bf16-mixed", "32-true")
        return "32-true", "CPU without native bf16 instructions (AVX512-BF16, AMX, Arm BF16)", ("32-true",)
    raise ValueError(f"accelerator must be one of {list(_ACCELERATORS)}, got {accelerator!r}")


def _choose(accelerator: str, *, capability: tuple[int, int] | None = None, arch: str | None = None,
            cpu_flags: Iterable[str] | None = None, mps_bf16: bool | None = None,
            allow: Iterable[str] | None = None, override: str | None = None) -> PrecisionChoice:
    facts = {"accelerator": accelerator, "capability": capability, "arch": arch, "mps_bf16": mps_bf16}
    if override is not None:
        if override not in CHOICES:
            raise ValueError(f"precision override must be one of {list(CHOICES)}, got {override!r}")
        return PrecisionChoice(override, "set explicitly", facts, (override,))
    allowed = _check_allow(allow)
    choice, reason, supported = _decide(accelerator, capability=capability, arch=arch, cpu_flags=cpu_flags,
                                        mps_bf16=mps_bf16)
    if allowed is not None and choice not in allowed:
        options = [c for c in supported if c in allowed]
        if "32-true" in allowed and "32-true" not in options:
            options.append("32-true")  # fp32 runs everywhere
        if not options:
            raise ValueError(f"none of allow={list(allowed)} runs well on this device ({reason});"
                             " add '32-true' to allow")
        reason = f"{reason}; {choice} is not in allow={list(allowed)}, so {options[0]}"
        choice = options[0]
    return PrecisionChoice(choice, reason, facts, supported)


def select_precision(
    accelerator: str | None = None,
    *,
    capability: tuple[int, int] | None = None,
    arch: str | None = None,
    cpu_flags: Iterable[str] | None = None,
    mps_bf16: bool | None = None,
    allow: Iterable[str] | None = None,
    device: torch.device | str | None = None,
) -> str:
    """The Lightning precision string for an accelerator, from the decision table in this module's docstring.

    Facts not given are detected from ``device`` (default: the current CUDA device if there is one, else the
    CPU)::

        select_precision(accelerator="cuda", capability=(7, 5))     # T4 -> "16-mixed"
        select_precision(accelerator="cpu", cpu_flags={"avx2"})     # -> "32-true"
        select_precision()                                           # this machine
    """
    if accelerator is None:
        detected = detect_facts(device)
        accelerator = detected.pop("accelerator")
        capability = capability if capability is not None else detected.get("capability")
        arch = arch if arch is not None else detected.get("arch")
        cpu_flags = cpu_flags if cpu_flags is not None else detected.get("cpu_flags")
        mps_bf16 = mps_bf16 if mps_bf16 is not None else detected.get("mps_bf16")
    return _choose(accelerator, capability=capability, arch=arch, cpu_flags=cpu_flags, mps_bf16=mps_bf16,
                   allow=allow).precision


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        text = ""
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    if not flags and platform.system() == "Darwin" and platform.machine() == "arm64":
        flags.add("bf16")  # Apple M2 and later implement Arm BF16; M1 does not, but exposes no flag list
    return flags


def detect_facts(device: torch.device | str | None = None) -> dict[str, Any]:
    """The facts the decision needs, read from the real device."""
    dev = torch.device(device) if device is not None else (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        if getattr(torch.version, "hip", None):
            return {"accelerator": "rocm", "arch": getattr(props, "gcnArchName", ""), "name": props.name}
        return {"accelerator": "cuda", "capability": torch.cuda.get_device_capability(index), "name": props.name,
                "bf16_native": torch.cuda.is_bf16_supported(including_emulation=False)}
    if dev.type == "mps":
        newer = getattr(torch.backends.mps, "is_macos_or_newer", None)
        return {"accelerator": "mps", "mps_bf16": bool(newer(14, 0)) if callable(newer) else False}
    if dev.type == "xla":
        return {"accelerator": "xla"}
    return {"accelerator": "cpu", "cpu_flags": _cpu_flags(), "name": platform.processor() or platform.machine()}


def choose_for_device(device: torch.device | str | None = None, *, allow: Iterable[str] | None = None,
                      override: str | None = None) -> PrecisionChoice:
    """The full decision (choice, reason, facts) for a real device, its facts detected."""
    facts = detect_facts(device)
    return _choose(facts.pop("accelerator"), capability=facts.get("capability"), arch=facts.get("arch"),
                   cpu_flags=facts.get("cpu_flags"), mps_bf16=facts.get("mps_bf16"), allow=allow, override=override)


_DELEGATED = ("_after_closure", "_clip_gradients", "_wrap_closure", "backward", "clip_grad_by_norm",
              "clip_grad_by_value", "clip_gradients", "connect", "convert_input", "convert_output",
              "forward_context", "main_params", "module_init_context", "optimizer_step", "post_backward",
              "pre_backward", "predict_step_context", "teardown", "tensor_init_context", "test_step_context",
              "train_step_context", "unscale_gradients", "val_step_context")


class AutoPrecision(Precision):
    """A Lightning precision plugin that picks bf16-mixed, 16-mixed (with a GradScaler) or 32-true itself.

    It works under a ``lightning.pytorch`` Trainer and a ``pytorch_lightning`` one: made in a program that has
    imported ``pytorch_lightning``, it is a ``Precision`` of both namespaces (see :func:`_for_both_namespaces`), and
    it drives the precision classes of the Trainer that sets it up.

    The choice is made for the device the strategy actually trains on (when Lightning sets the model up) and
    logged in one line; ``.precision`` carries it, as on Lightning's own plugins. It is saved in the checkpoint
    with the GradScaler state; resuming under a different choice (another node type) keeps going: the scaler
    state is dropped, or a fresh scaler is started, with a warning.

    Example::

        Trainer(plugins=[AutoPrecision()])                    # bf16 on A100/H100, fp16+scaler on V100/T4
        Trainer(plugins=[AutoPrecision(allow=["bf16-mixed", "32-true"])])   # never fp16

    Passing ``precision=`` to the Trainer as well raises Lightning's "Received both precision= and plugins=" error.
    Under FSDP, which requires its own precision class, use :meth:`for_fsdp`.

    Args:
        precision: skip detection and use this choice.
        allow: precision names that may be chosen; a disallowed choice falls back to the next one the hardware
            supports.
        init_scale: the GradScaler's initial scale when fp16 is chosen.
    """

    # The signature of __init__: inspect.signature (and LightningCLI's parser with it) reads __new__'s when a class
    # defines one.
    def __new__(cls, *, precision: PrecisionName | None = None, allow: list[PrecisionName] | None = None,
                init_scale: float = 2.0**16) -> AutoPrecision:
        if cls is AutoPrecision and PYTORCH_LIGHTNING in sys.modules:
            cls = _for_both_namespaces()
        return super().__new__(cls)

    def __init__(self, *, precision: PrecisionName | None = None, allow: list[PrecisionName] | None = None,
                 init_scale: float = 2.0**16) -> None:
        super().__init__()
        if precision is not None and precision not in CHOICES:
            raise ValueError(f"precision must be one of {list(CHOICES)} or None, got {precision!r}")
        self.allow = _check_allow(allow)
        self.init_scale = check_number("init_scale", init_scale, hint="the GradScaler's initial scale")
        if self.init_scale <= 0:
            raise ValueError(f"init_scale must be a positive number, got {init_scale!r}")
        self.override = precision
        self.choice: PrecisionChoice | None = None
        self._device_type = "cpu"
        self._namespace = LIGHTNING_PYTORCH  # of the Trainer: its precision classes are the ones driven
        self._inner: Any = Precision()  # a precision plugin of the Trainer's namespace
        self._choose_for(None, announce=False)  # a provisional choice, for hooks Lightning calls before setup

    # -- the choice --------------------------------------------------------------------------------------------
    def choose(self, device: torch.device | str | None) -> PrecisionChoice:
        """Decide for ``device`` (facts detected from it) without changing this plugin."""
        return choose_for_device(device, allow=self.allow, override=self.override)

    def _choose_for(self, device: torch.device | str | None, *, announce: bool,
                    namespace: str = LIGHTNING_PYTORCH) -> None:
        choice = self.choose(device)
        dev = torch.device(device) if device is not None else torch.device(
            "cuda" if torch.cuda.is_available() else "cpu")
        if (self.choice is None or choice.precision != self.choice.precision or dev.type != self._device_type
                or namespace != self._namespace):
            self._inner = self._plugin_for(choice.precision, dev.type, namespace)
        self.choice = choice
        self._device_type = dev.type
        self._namespace = namespace
        if announce:
            rank_zero_info(f"AutoPrecision: {choice.precision} on {dev} ({choice.reason})")

    def _plugin_for(self, precision: str, device_type: str, namespace: str) -> Any:
        # The Trainer's own namespace: its hooks call that namespace's trainer functions and isinstance checks.
        plugins = importlib.import_module(f"{namespace}.plugins.precision")
        if precision == "32-true":
            return plugins.Precision()
        if precision in ("bf16-mixed", "16-mixed"):
            scaler = torch.amp.GradScaler(device_type, init_scale=self.init_scale) if precision == "16-mixed" \
                else None
            return plugins.MixedPrecision(precision, device_type, scaler=scaler)
        if device_type == "xla":  # pragma: no cover - needs torch_xla
            return plugins.XLAPrecision(precision)
        return plugins.HalfPrecision(precision)

    # The base declares a Literal of every Lightning precision; ours is always one of CHOICES, held as a str.
    @property  # type: ignore[override]
    def precision(self) -> str:
        return self.choice.precision if self.choice is not None else "32-true"

    @precision.setter
    def precision(self, value: str) -> None:
        pass  # the base class assigns a default; the choice owns the value

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        return getattr(self._inner, "scaler", None)

    @classmethod
    def for_fsdp(cls, *, device: torch.device | str | None = None, allow: list[PrecisionName] | None = None) -> Any:
        """An ``FSDPPrecision`` with the automatic choice, for ``FSDPStrategy`` (which accepts no other class)."""
        from lightning.pytorch.plugins.precision import FSDPPrecision

        choice = choose_for_device(device, allow=allow)
        rank_zero_info(f"AutoPrecision (FSDP): {choice.precision} ({choice.reason})")
        return FSDPPrecision(choice.precision)  # type: ignore[arg-type]

    # -- Lightning hooks -----------------------------------------------------------------------------------------
    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        # Called by Strategy.setup before anything trains: the first point where the real device is known.
        trainer = getattr(module, "_trainer", None)
        device = trainer.strategy.root_device if trainer is not None else None
        self._choose_for(device, announce=True,
                         namespace=namespace_of(trainer) if trainer is not None else self._namespace)
        converted: torch.nn.Module = self._inner.convert_module(module)
        return converted

    def state_dict(self) -> dict[str, Any]:
        inner = self._inner.state_dict()
        return {"precision": self.precision, "scaler": inner or None}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("precision")
        scaler_state = state_dict.get("scaler")
        self._restore(saved, scaler_state, source="AutoPrecision")

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # A checkpoint from Lightning's own MixedPrecision (precision="16-mixed") carries its scaler under
        # "MixedPrecision": adopt it, so switching to AutoPrecision does not reset the loss scale.
        if type(self).__qualname__ not in checkpoint and "MixedPrecision" in checkpoint:
            self._restore("16-mixed" if checkpoint["MixedPrecision"] else "bf16-mixed",
                          checkpoint["MixedPrecision"] or None, source="MixedPrecision")

    def _restore(self, saved: str | None, scaler_state: dict[str, Any] | None, *, source: str) -> None:
        current = self.precision
        if saved == current:
            if scaler_state and self.scaler is not None:
                self._inner.load_state_dict(scaler_state)
            return
        if scaler_state and self.scaler is not None:
            # fp16 -> fp16 on another device type: the loss scale still describes the model's gradients.
            self._inner.load_state_dict(scaler_state)
            return
        if scaler_state:
            message = (f"resuming a {saved} checkpoint under {current}: its GradScaler state (scale"
                       f" {scaler_state.get('scale')}) is not needed and was dropped")
        elif self.scaler is not None:
            message = (f"resuming a {saved or 'fp32'} checkpoint under {current}: no GradScaler state to restore,"
                       f" the loss scale starts fresh at {self.init_scale:g}")
        else:
            message = f"resuming a {saved} checkpoint under {current}"
        log.warning(message)
        warn(message, RuntimeWarning)


def _delegate(name: str) -> Any:
    def method(self: AutoPrecision, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._inner, name)(*args, **kwargs)

    method.__name__ = name
    method.__doc__ = f"Delegates to the chosen Lightning precision plugin's ``{name}``."
    return method


for _name in _DELEGATED:
    setattr(AutoPrecision, _name, _delegate(_name))


@functools.cache
def _for_both_namespaces() -> type[AutoPrecision]:
    """``AutoPrecision`` that is also a ``pytorch_lightning`` ``Precision``, which that namespace's Trainer requires
    of a precision plugin (by ``isinstance``: its ``Precision`` is no ABC, so registering cannot do it).

    Made only in a program that has imported ``pytorch_lightning`` itself: importing it here would move where every
    Lightning log line goes (both namespaces set ``lightning_utilities``' rank-zero logger, the last import wins), so
    a user's settings for the ``lightning.pytorch`` logger would stop applying. Its name is ``AutoPrecision``, which
    is the key of its state in a checkpoint, so either class resumes the other's checkpoints."""
    from pytorch_lightning.plugins.precision import Precision as StandalonePrecision

    def reduce(self: AutoPrecision) -> tuple[Any, ...]:
        return _revive, (), self.__dict__.copy()  # by a function: the class is not reachable by its name

    return type("AutoPrecision", (AutoPrecision, StandalonePrecision), {
        "__module__": __name__, "__qualname__": "AutoPrecision", "__doc__": AutoPrecision.__doc__,
        "__reduce__": reduce})


def _revive() -> AutoPrecision:
    """An ``AutoPrecision`` of both namespaces, its state restored by pickle (``ddp_spawn``, ``deepcopy``)."""
    revived: AutoPrecision = object.__new__(_for_both_namespaces())
    return revived
