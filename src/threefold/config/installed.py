"""What a setting needs installed, checked with the config before any process starts: the trackers'
libraries (`run.trackers`) and torchao's MX training pieces (`precision.compute=mxfp8`). torch is not
imported here; torchao only when mxfp8 is asked for."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import warnings

from ..errors import ConfigError

BLOCK = 32  # MX elements per scale (OCP MX: k = 32)
NEEDS = (0, 18)  # the torchao release whose MX training pieces threefold uses (pinned 0.18.0)

# tracker -> (the module it imports, the pip command that installs it)
PACKAGES = {"tensorboard": ("tensorboard", "pip install tensorboard"),
            "wandb": ("wandb", "pip install wandb"),
            "mlflow": ("mlflow", "pip install mlflow-skinny")}


def chosen(run) -> tuple[str, ...]:
    """The trackers a RunConfig asks for: `run.trackers`, with tensorboard when `run.tensorboard` is on."""
    names = [n.strip() for n in run.trackers.split(",") if n.strip()]
    if run.tensorboard:
        names.append("tensorboard")
    return tuple(dict.fromkeys(names))


def check_installed(run) -> None:
    """Refuse a tracker whose library is not installed, in one line naming the package and its pip command
    (config check time: before any process starts)."""
    for name in chosen(run):
        module, pip = PACKAGES[name]
        if importlib.util.find_spec(module) is None:
            key = "run.trackers" if name in run.trackers else "run.tensorboard"
            raise ConfigError(key, f"{name} needs the {module} package, which is not installed; {pip}")


@contextlib.contextmanager
def quiet_torchao():
    """Silence torchao's import-time complaints about CUDA extensions a CPU build cannot load."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(cpp extension|\\.so|C\\+\\+ extension|_C).*")
        warnings.filterwarnings("ignore", category=UserWarning, module="torchao.*")
        quiet = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
        levels = [q.level for q in quiet]
        for q in quiet:
            q.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for q, level in zip(quiet, levels):
                q.setLevel(level)


def torchao_mx():
    """(MXTensor, KernelPreference, ScaleCalculationMode) from the installed torchao."""
    with quiet_torchao():
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import MXTensor
        from torchao.quantization.quantize_.common.kernel_preference import KernelPreference
    return MXTensor, KernelPreference, ScaleCalculationMode


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def mx_support() -> str | None:
    """None where the installed torchao trains in MXFP8, else what is installed instead (for one line)."""
    try:
        with quiet_torchao():
            import torchao
    except ImportError:
        return "torchao is not installed"
    version = getattr(torchao, "__version__", "unknown")
    if _version(version) < NEEDS:
        return f"torchao {version} is installed"
    try:
        torchao_mx()
    except (ImportError, AttributeError) as e:
        return f"torchao {version} lacks its MX training pieces ({e})"
    return None


def mxfp8_refusal(tp: int, dims: dict[str, int]) -> tuple[str, str] | None:
    """(key, one-line reason) when `precision.compute=mxfp8` cannot run: torchao without MX training, or
    a dimension tensor parallelism splits that leaves a rank a part of a 32-element block. `dims`: the
    model's key -> features that tp splits (attention width, MLP features)."""
    missing = mx_support()
    if missing is not None:
        need = ".".join(map(str, NEEDS))
        return ("precision.compute", f"mxfp8 needs torchao>={need} (torchao.prototype.mx_formats); {missing}: "
                                     f"pip install 'torchao>={need}', or use precision.compute=fp8")
    for key, features in dims.items():
        if tp > 1 and (features % tp or (features // tp) % BLOCK):
            return ("parallel.tp", f"mxfp8 scales blocks of {BLOCK} features, and {key}={features} split over "
                                   f"tp={tp} leaves {features / tp:g} per rank; choose a tp that leaves a multiple "
                                   f"of {BLOCK} (or precision.compute=fp8)")
    return None
