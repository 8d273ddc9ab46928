"""LoRA adapters on a transformers causal LM, through ``peft``, injected in place.

:func:`apply_lora` turns the model's target ``nn.Linear`` layers into peft LoRA layers *inside the
transformers model object*: the model keeps its class, its ``forward``, its decoder layers and
its output head, so every code path that takes a transformers model (the packed forward, the
last-layer shortcut, gradient checkpointing, ``generate``) runs the adapted model unchanged. Only
the adapter weights are trainable. The peft wrapper made on the way is kept beside the model
(:func:`peft_model`) for what peft itself does: writing and reading an adapter directory.

What the rest reads:

- :func:`has_adapters`, :func:`adapter_state` / :func:`load_adapter_state` (the trainable tensors only:
  what a checkpoint keeps), :func:`adapters_off` (the base model's forward, e.g. a reference
  policy);
- :func:`merged_state_dict` (the weights with the adapters merged in, under the base model's own
  names: what a rollout engine or a plain model directory takes) and :func:`merged_copy`;
- :func:`save_adapter_dir` / :func:`is_adapter_dir`: an adapter directory (``adapter_config.json``,
  ``adapter_model.safetensors`` as peft writes them, the tokenizer, and ``base_model.json`` naming
  the base model spec), loadable by ``peft.PeftModel.from_pretrained`` and by
  :func:`agents.models.load`.

This module lives on the agent side (no learner import), so that :mod:`agents.models` can rebuild
a LoRA checkpoint or an adapter directory.
"""

from __future__ import annotations

import contextlib
import copy
import json
import pickle
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The attention and MLP projections of Llama / Qwen2 / Mistral-style decoders (SmolLM2 and the
tiny presets included)."""
ADAPTER_CONFIG = "adapter_config.json"
BASE_FILE = "base_model.json"
"""In an adapter directory: ``{"model": <spec>}``, the base model spec the adapters belong to."""
_PEFT = "_memopd_peft"  # where the peft wrapper is kept on the model (not a submodule)


class LoRAError(ValueError):
    """LoRA cannot be applied as asked (peft missing, no module of that name); one clear line."""


def require_peft() -> Any:
    try:
        import peft
    except ImportError:
        raise LoRAError("LoRA needs peft: pip install peft (or the project's lora extra: pip install -e '.[lora]')"
                        ) from None
    return peft


def linear_names(model: torch.nn.Module) -> set[str]:
    """The last name part of every ``nn.Linear`` of ``model`` (the names ``--lora-targets`` takes)."""
    return {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n}


ALL_LINEAR = "all-linear"
"""``--lora-targets all-linear``: every linear layer but the output head (peft's name for it)."""


def resolve_targets(model: torch.nn.Module, targets: Sequence[str]) -> list[str]:
    """The layers that get adapters. ``all-linear``: every linear layer but the output head. The
    default (:data:`DEFAULT_TARGETS`, a Llama-style decoder's projections) on a model that lacks
    some of them (fused projections: Phi3's ``qkv_proj`` and ``gate_up_proj``, GPT-NeoX's
    ``query_key_value``) also means every linear layer but the head: the same coverage, in that
    family's names. Any other list is taken as given (and checked by :func:`check_targets`)."""
    targets = list(targets)
    have = linear_names(model)
    if targets == [ALL_LINEAR] or (targets == list(DEFAULT_TARGETS) and not set(targets) <= have):
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        heads = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if m is head and n}
        return sorted(have - heads)
    return targets


def check_targets(model: torch.nn.Module, targets: Sequence[str]) -> None:
    """Every name in ``targets`` must be a linear layer of ``model`` (LoRAError naming those that exist)."""
    have = linear_names(model)
    missing = [t for t in targets if t not in have]
    if missing:
        raise LoRAError(f"--lora-targets {','.join(missing)}: {type(model).__name__} has no linear layer of that "
                        f"name; its linear layers: {','.join(sorted(have))}")


def apply_lora(model: torch.nn.Module, r: int, alpha: float, dropout: float = 0.0,
               targets: Sequence[str] = DEFAULT_TARGETS, base: str | None = None) -> torch.nn.Module:
    """Inject LoRA adapters of rank ``r`` (scale ``alpha / r``) into ``targets`` of ``model``, in
    place; freezes everything else. Returns ``model`` (the same object). peft initialises B to
    zero, so the adapted model starts equal to the base model. ``base``: the model spec the
    adapters belong to (written into an adapter directory)."""
    peft = require_peft()
    targets = resolve_targets(model, targets)
    check_targets(model, targets)
    config = peft.LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, bias="none",
                             task_type="CAUSAL_LM")
    wrapper = peft.get_peft_model(model, config)
    if wrapper.get_base_model() is not model:  # pragma: no cover - peft changed how it wraps
        raise LoRAError("peft did not inject the adapters in place; this peft version is not supported")
    if base is not None:
        wrapper.peft_config["default"].base_model_name_or_path = str(base)
    object.__setattr__(model, _PEFT, wrapper)  # not registered as a submodule: no cycle in modules()
    return model


def has_adapters(model: Any) -> bool:
    return any(_is_lora_layer(m) for m in model.modules()) if isinstance(model, torch.nn.Module) else False


def peft_model(model: torch.nn.Module) -> Any:
    """The peft wrapper around ``model`` (made by :func:`apply_lora`; a deep copy keeps its own)."""
    wrapper = model.__dict__.get(_PEFT)
    if wrapper is None:
        raise LoRAError(f"{type(model).__name__} carries no LoRA adapters")
    return wrapper


def _is_lora_layer(m: torch.nn.Module) -> bool:
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return False
    return isinstance(m, LoraLayer)


def trainable_names(model: torch.nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainable tensors of a model with adapters (the adapters, plus e.g. a critic's value
    head), under their names in ``model.state_dict()``."""
    names = set(trainable_names(model))
    return {k: v for k, v in model.state_dict().items() if k in names}


def load_adapter_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    """Load what :func:`adapter_state` saved; returns (missing, unexpected) among the trainable names."""
    names = set(trainable_names(model))
    missing = sorted(names - set(state))
    unexpected = sorted(set(state) - names)
    model.load_state_dict({k: v for k, v in state.items() if k in names}, strict=False)
    return missing, unexpected


@contextlib.contextmanager
def adapters_off(model: Any) -> Iterator[Any]:
    """Within the block, ``model``'s forward is its base model's (every LoRA layer bypassed); a
    no-op for a model without adapters. Which parameters are trainable is left as it was (peft's
    switch also flips the adapters' ``requires_grad``)."""
    layers = [m for m in model.modules() if _is_lora_layer(m)] if isinstance(model, torch.nn.Module) else []
    if not layers:
        yield model
        return
    was = [m.disable_adapters for m in layers]
    grads = [(p, p.requires_grad) for p in model.parameters()]
    try:
        for m in layers:
            m.enable_adapters(False)
        yield model
    finally:
        for m, w in zip(layers, was):
            m.enable_adapters(not w)
        for p, g in grads:
            p.requires_grad_(g)


def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s weights with every adapter merged in (W + B A alpha / r), under the base model's
    own names (what a model directory or a vLLM engine takes); ``model`` is not changed. Without
    adapters: its state dict."""
    if not has_adapters(model):
        return dict(model.state_dict())
    deltas = {}
    for name, m in model.named_modules():
        if _is_lora_layer(m) and not m.disable_adapters:
            with torch.no_grad():
                parts = [m.get_delta_weight(a) for a in m.active_adapters if a in m.lora_A]
            if parts:
                deltas[f"{name}.base_layer.weight"] = sum(parts[1:], parts[0])
    out = {}
    for k, v in model.state_dict().items():
        if ".lora_" in k:
            continue
        if k in deltas:
            v = (v + deltas[k].to(v.dtype)).detach()
        out[k.replace(".base_layer.", ".")] = v
    return out


def merged_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A plain transformers model equal to ``model`` with its adapters merged (peft's
    ``merge_and_unload``) on a copy; ``model`` itself keeps its adapters. Without adapters: ``model``."""
    if not has_adapters(model):
        return model
    plain = copy.deepcopy(peft_model(model)).merge_and_unload()
    plain.__dict__.pop(_PEFT, None)
    plain.requires_grad_(True)
    return plain


def save_adapter_dir(path: str | Path, model: torch.nn.Module, base: str | None = None) -> Path:
    """Write ``model``'s adapters as peft writes them (``adapter_config.json``,
    ``adapter_model.safetensors``) and ``base_model.json`` naming the base model spec ``base``
    (default: the one given to :func:`apply_lora`)."""
    path = Path(path)
    wrapper = peft_model(model)
    base = base or wrapper.peft_config["default"].base_model_name_or_path
    wrapper.save_pretrained(str(path), save_embedding_layers=False)  # adapters only; no hub lookup
    cfg_file = path / ADAPTER_CONFIG
    cfg = json.loads(cfg_file.read_text())
    cfg["base_model_name_or_path"] = base
    cfg_file.write_text(json.dumps(cfg, indent=2))
    (path / BASE_FILE).write_text(json.dumps({"model": base}))
    return path


class AdapterWriter:
    """What :func:`agents.models.save_pretrained` takes to write an adapter directory atomically:
    ``save_pretrained(dir)`` writes ``model``'s adapters into ``dir`` (or ``dir/sub``)."""

    def __init__(self, model: torch.nn.Module, sub: str | None = None, base: str | None = None):
        self.model, self.sub, self.base = model, sub, base

    def save_pretrained(self, directory: str | Path) -> None:
        save_adapter_dir(Path(directory) / self.sub if self.sub else directory, self.model, self.base)


def is_adapter_dir(path: str | Path) -> bool:
    p = Path(path)
    return (p / ADAPTER_CONFIG).is_file() and not (p / "config.json").is_file()


def adapter_base(path: str | Path) -> str:
    """The base model spec of an adapter directory (``base_model.json``, else peft's config)."""
    p = Path(path)
    if (p / BASE_FILE).is_file():
        try:
            return str(json.loads((p / BASE_FILE).read_text())["model"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise LoRAError(f"{p / BASE_FILE}: unreadable ({type(exc).__name__}: {exc}); it names the base model "
                            "as {\"model\": SPEC}") from None
    base = read_adapter_config(p).get("base_model_name_or_path")
    if not base:
        raise LoRAError(f"{p / ADAPTER_CONFIG}: names no base_model_name_or_path, and there is no {BASE_FILE}")
    return str(base)


ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
"""The adapter weight files peft reads, in its order of preference."""


def read_adapter_config(path: str | Path) -> dict[str, Any]:
    file = Path(path) / ADAPTER_CONFIG
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise LoRAError(f"{file}: unreadable ({type(exc).__name__}: {exc})") from None
    if not isinstance(config, dict):
        raise LoRAError(f"{file}: not a JSON object (peft's adapter config)")
    return config


def read_adapter_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The adapter tensors of directory ``path``: ``adapter_model.safetensors``, else a pickled
    ``adapter_model.bin`` read as weights only (a pickle of other objects is refused: loading it
    could run code)."""
    p = Path(path)
    file = next((p / name for name in ADAPTER_WEIGHTS if (p / name).is_file()), None)
    if file is None:
        raise LoRAError(f"{p}: no adapter weights ({' or '.join(ADAPTER_WEIGHTS)})")
    try:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(file))
        else:
            state = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise LoRAError(f"{file}: refused: it pickles objects other than tensors, and loading them could run code; "
                        "save the adapters with peft's save_pretrained (adapter_model.safetensors)") from None
    except Exception as exc:  # noqa: BLE001 - a damaged file raises many types
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise LoRAError(f"{file}: unreadable as adapter weights ({type(exc).__name__}: {first}); save the adapters "
                        "with peft's save_pretrained (adapter_model.safetensors)") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise LoRAError(f"{file}: not a dict of tensors (a state dict of adapter weights)")
    return state


def check_adapter_dir(path: str | Path) -> None:
    """The adapter directory's config and weights agree before peft reads them: every LoRA A
    matrix has the rank ``r`` that ``adapter_config.json`` names (or its ``rank_pattern``'s)."""
    config = read_adapter_config(path)
    state = read_adapter_weights(path)
    r, pattern = config.get("r"), config.get("rank_pattern") or {}
    for key, tensor in state.items():
        if ".lora_A" not in key or tensor.dim() != 2:
            continue
        want = next((v for k, v in pattern.items() if k in key), r)
        if isinstance(want, int) and tensor.shape[0] != want:
            raise LoRAError(f"{Path(path) / ADAPTER_CONFIG} says r = {want}, but its weights have rank "
                            f"{tensor.shape[0]} ({key}: {list(tensor.shape)}); set \"r\": {tensor.shape[0]} there, "
                            "or use the config the adapters were saved with")


def load_adapters(model: torch.nn.Module, path: str | Path, merge: bool = True) -> torch.nn.Module:
    """``model`` (the base) with the adapters of directory ``path``: merged into plain weights
    (default), or kept as adapters (the returned model then carries them, as :func:`apply_lora`'s).
    A config that disagrees with the weights, or weights that cannot be read safely, are a
    :class:`LoRAError` that names the file."""
    peft = require_peft()
    check_adapter_dir(path)
    try:
        wrapper = peft.PeftModel.from_pretrained(model, str(path), is_trainable=not merge)
    except Exception as exc:  # noqa: BLE001 - peft raises many types for a directory it cannot use
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise LoRAError(f"{path}: peft cannot load these adapters onto the base model ({type(exc).__name__}: "
                        f"{first})") from None
    if merge:
        return wrapper.merge_and_unload()
    inner = wrapper.get_base_model()
    object.__setattr__(inner, _PEFT, wrapper)
    return inner


__all__ = ["ADAPTER_WEIGHTS", "ALL_LINEAR", "AdapterWriter", "DEFAULT_TARGETS", "LoRAError", "adapter_base", "check_adapter_dir",
           "read_adapter_config", "read_adapter_weights", "adapter_state", "adapters_off", "apply_lora",
           "check_targets", "has_adapters", "is_adapter_dir", "linear_names", "load_adapter_state", "load_adapters",
           "merged_copy", "merged_state_dict", "peft_model", "require_peft", "resolve_targets", "save_adapter_dir",
           "trainable_names"]
