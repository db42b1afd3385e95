"""HF safetensors directories -> trainer param trees (MLLM-JAX layout), without torch."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open

from models import mappings_for

from .checkpoint import CheckpointError
from .tree import unflatten_params

_INDEX = "model.safetensors.index.json"


def hf_model_dir(model_dir: str | Path) -> Path:
    """``model_dir`` as a Path, or the error naming why it is no model directory: missing, a file,
    or holding no safetensors weights (checked without opening them)."""
    model_dir = Path(model_dir)
    if model_dir.exists() and not model_dir.is_dir():
        raise CheckpointError(f"{model_dir} is a file; load_hf takes the model's directory")
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory {model_dir} does not exist")
    if not (model_dir / _INDEX).exists() and next(model_dir.glob("*.safetensors"), None) is None:
        raise FileNotFoundError(f"no *.safetensors file in {model_dir}")
    return model_dir


def safetensors_files(model_dir: str | Path) -> dict[str, Path]:
    """HF tensor name -> the file holding it (single file or sharded with an index json)."""
    model_dir = hf_model_dir(model_dir)
    index = model_dir / _INDEX
    if index.exists():
        return _indexed_files(model_dir, index)
    files = sorted(model_dir.glob("*.safetensors"))
    names: dict[str, Path] = {}
    for file in files:
        for name in _open(file).keys():
            if name in names:
                raise CheckpointError(f"{model_dir}: tensor '{name}' is in both {names[name].name} and {file.name}")
            names[name] = file
    return names


def _indexed_files(model_dir: Path, index: Path) -> dict[str, Path]:
    """The index's weight map: tensor name -> a shard file of this directory (a bare name, as
    HF writes them: an absolute or ``..`` path would read outside the directory)."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{index} is not a valid safetensors index: {exc!r}") from exc
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: 'weight_map' must map tensor names to file names")
    located = {}
    for name, file in weight_map.items():
        if not isinstance(file, str) or not file or Path(file).is_absolute() or ".." in Path(file).parts:
            raise CheckpointError(f"{index}: tensor '{name}' maps to {file!r}; expected a file name in {model_dir}")
        located[name] = model_dir / file
    return located


def _open(file: Path):
    try:
        return safe_open(str(file), framework="numpy")
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read safetensors file {file}: {exc}") from exc


# Weights stored in these (safetensors' names) are the model's; narrower floats (float8) and
# integers are quantized values, which mean nothing without scales this reader does not apply.
_WEIGHT_DTYPES = ("F16", "BF16", "F32", "F64")


def _mappings(model_dir: Path) -> tuple[dict, list]:
    """``model_dir``'s config.json and the mapping table of its model type."""
    config_file = model_dir / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read {config_file}: {exc}") from exc
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_file} is not a JSON object")
    try:
        return config, mappings_for(config, where=str(config_file))
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None


def load_hf_params(model_dir: str | Path, dtype=np.float32) -> dict:
    """Read an HF checkpoint of a registered model type (``models.FAMILIES``) into a nested
    trainer param dict of numpy arrays.

    ``dtype=None`` keeps each tensor's stored dtype (bfloat16 comes back as ml_dtypes').
    Quantized checkpoints (a ``quantization_config``, or weights stored as integers or float8)
    are refused: their stored values are not the weights.
    """
    model_dir = Path(model_dir)
    located = safetensors_files(model_dir)
    config, mappings = _mappings(model_dir)
    if config.get("quantization_config"):
        method = config["quantization_config"]
        method = method.get("quant_method", method) if isinstance(method, dict) else method
        raise CheckpointError(
            f"{model_dir / 'config.json'}: a quantized checkpoint (quantization_config: {method!r:.60}); "
            "this reader takes unquantized float weights"
        )
    handles: dict[Path, object] = {}

    def read(name: str, trainer_path: str, transposed: bool) -> np.ndarray:
        file = located.get(name)
        if file is None:
            raise CheckpointError(f"{model_dir}: tensor '{name}' (for '{trainer_path}') is missing")
        if file not in handles:
            handles[file] = _open(file)
        try:
            stored = handles[file].get_slice(name).get_dtype()
            if stored in _WEIGHT_DTYPES:
                tensor = handles[file].get_tensor(name)
        except Exception as exc:  # safetensors raises its own error types on truncated data
            raise CheckpointError(f"{file}: cannot read tensor '{name}': {exc}") from exc
        if stored not in _WEIGHT_DTYPES:
            raise CheckpointError(
                f"{file}: tensor '{name}' (for '{trainer_path}') is stored as {stored}, not a float dtype "
                f"(quantized values?); this reader takes {', '.join(_WEIGHT_DTYPES)}"
            )
        tensor = tensor.T if transposed else tensor
        return np.ascontiguousarray(tensor, dtype=dtype or tensor.dtype)

    flat = {}
    for entry in mappings:
        if entry.stacked_experts:
            # One HF tensor per expert -> the trainer's [E, ...] stack.
            experts = [
                read(entry.hf.format(expert=expert), entry.trainer, entry.hf_transposed)
                for expert in range(int(config["num_experts"]))
            ]
            stored = [t.T.shape if entry.hf_transposed else t.shape for t in experts]
            for expert, shape in enumerate(stored):
                if shape != stored[0]:
                    raise CheckpointError(
                        f"{model_dir}: tensor '{entry.hf.format(expert=expert)}' has shape {shape}, "
                        f"expert 0's has {stored[0]} (for '{entry.trainer}')"
                    )
            flat[entry.trainer] = np.stack(experts)
        else:
            flat[entry.trainer] = read(entry.hf, entry.trainer, entry.hf_transposed)
    return unflatten_params(flat)


def hf_source(model_dir: str | Path, trainer_path: str) -> str | None:
    """Where ``model_dir``'s HF files hold the trainer leaf ``trainer_path``: its tensor (or
    per-expert tensors) and file, and the layout they store it in; None if no mapping entry
    names it."""
    model_dir = Path(model_dir)
    config, mappings = _mappings(model_dir)
    entry = next((m for m in mappings if m.trainer == trainer_path), None)
    if entry is None:
        return None
    layout = ", stored [out, in] (the trainer's [in, out] transposed)" if entry.hf_transposed else ""
    if entry.stacked_experts:
        return f"tensors '{entry.hf.format(expert='*')}' (one per expert){layout}"
    file = safetensors_files(model_dir).get(entry.hf)
    return f"tensor '{entry.hf}' in {file.name if file else 'no file of the directory'}{layout}"
