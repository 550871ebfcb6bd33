"""Hugging Face Qwen3 checkpoints: load a local folder into our model, export ours back.

A folder holds config.json, model.safetensors or model.safetensors.index.json with its shards,
and tokenizer.json.  Weights are checked name by name and shape by shape against the model's
abstract structure before anything is placed on the device, so a bad folder fails with a message
naming the file and tensor instead of a shape error deep inside jit.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from dspark_jax.config import Qwen3Config
from dspark_jax.errors import CheckpointError
from dspark_jax.models.qwen3 import Qwen3ForCausalLM, abstract_model

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}

# Our stacked per-layer parameter -> the Hugging Face tensors it is made of (concatenated along
# the output axis) and whether they are Linear weights ([out, in] in HF, [in, out] here).
_LAYER_PARAMS = {
    ("self_attn", "qkv_proj", "kernel"): (("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"), True),
    ("self_attn", "qkv_proj", "bias"): (("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"), False),
    ("self_attn", "o_proj", "kernel"): (("self_attn.o_proj.weight",), True),
    ("self_attn", "o_proj", "bias"): (("self_attn.o_proj.bias",), False),
    ("self_attn", "q_norm", "weight"): (("self_attn.q_norm.weight",), False),
    ("self_attn", "k_norm", "weight"): (("self_attn.k_norm.weight",), False),
    ("mlp", "gate_up_proj", "kernel"): (("mlp.gate_proj.weight", "mlp.up_proj.weight"), True),
    ("mlp", "down_proj", "kernel"): (("mlp.down_proj.weight",), True),
    ("input_layernorm", "weight"): (("input_layernorm.weight",), False),
    ("post_attention_layernorm", "weight"): (("post_attention_layernorm.weight",), False),
}
_HF_LAYER_SUFFIXES = {sfx for sfxs, _ in _LAYER_PARAMS.values() for sfx in sfxs}


def _output_split(path: tuple[str, ...], cfg: Qwen3Config) -> list[int]:
    """Output widths of the HF tensors fused into `path` (for splitting on export)."""
    D = cfg.head_dim
    if path[1] == "qkv_proj":
        return [cfg.num_attention_heads * D, cfg.num_key_value_heads * D, cfg.num_key_value_heads * D]
    if path[1] == "gate_up_proj":
        return [cfg.intermediate_size, cfg.intermediate_size]
    return []


_TOP_MAP = {
    "model.embed_tokens.weight": (("embed_tokens", "embedding"), False),
    "model.norm.weight": (("norm", "weight"), False),
    "lm_head.weight": (("lm_head", "kernel"), True),
}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def resolve_dtype(name: str | None, config: Qwen3Config):
    name = name or config.dtype
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; choose from {sorted(_DTYPES)}")
    return _DTYPES[name]


def _weight_files(folder: Path) -> list[Path]:
    if (folder / INDEX_FILE).exists():
        try:
            weight_map = json.loads((folder / INDEX_FILE).read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{folder / INDEX_FILE}: malformed index ({e})") from None
        files = [folder / f for f in sorted(set(weight_map.values()))]
        for f in files:
            if not f.exists():
                raise CheckpointError(f"{folder}: shard {f.name} named in {INDEX_FILE} is missing")
        return files
    if (folder / SINGLE_FILE).exists():
        return [folder / SINGLE_FILE]
    raise CheckpointError(f"{folder}: no {SINGLE_FILE} or {INDEX_FILE} found")


def _read_tensors(files: list[Path]):
    """Yield (name, numpy array) from safetensors files, turning corruption into CheckpointError."""
    for f in files:
        try:
            with safe_open(str(f), framework="numpy") as st:
                for name in st.keys():
                    yield name, st.get_tensor(name)
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{f}: unreadable or truncated safetensors file ({e})") from None


def _set(tree: dict, path: tuple[str, ...], value):
    for p in path[:-1]:
        tree = tree.setdefault(p, {})
    tree[path[-1]] = value


def _get(tree: dict, path: tuple[str, ...]):
    for p in path:
        tree = tree[p]
    return tree


def load_model(folder: str | Path, *, dtype: str | None = None) -> tuple[Qwen3Config, Qwen3ForCausalLM]:
    """Load config.json + safetensors weights from a local folder into a Qwen3ForCausalLM."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"model folder {folder} does not exist")
    if not (folder / "config.json").exists():
        raise CheckpointError(f"{folder}: config.json is missing")
    cfg = Qwen3Config.from_file(folder / "config.json")
    jdtype = resolve_dtype(dtype, cfg)
    abstract = abstract_model(cfg, jdtype)
    graphdef, abs_state = nnx.split(abstract)
    expected = nnx.to_pure_dict(abs_state)
    L = cfg.num_hidden_layers

    top: dict = {}
    hf_layers: dict[str, list] = {sfx: [None] * L for sfx in _HF_LAYER_SUFFIXES}
    for name, arr in _read_tensors(_weight_files(folder)):
        m = _LAYER_RE.match(name)
        if m and m.group(2) in _HF_LAYER_SUFFIXES:
            i = int(m.group(1))
            if i >= L:
                raise CheckpointError(f"{folder}: tensor {name} but config has {L} layers")
            hf_layers[m.group(2)][i] = arr
        elif name in _TOP_MAP:
            path, transpose = _TOP_MAP[name]
            if path[0] == "lm_head" and cfg.tie_word_embeddings:
                continue  # some exports write the tied head anyway
            _set(top, path, arr.T if transpose else arr)
        elif name.startswith("model.layers.") and "rotary_emb" in name:
            continue
        else:
            raise CheckpointError(f"{folder}: unexpected tensor {name!r} for a Qwen3 checkpoint")

    loaded: dict = {}
    for path, (suffixes, is_kernel) in _LAYER_PARAMS.items():
        try:
            _get(expected["layers"], path)
        except KeyError as missing:
            if any(a is not None for sfx in suffixes for a in hf_layers[sfx]):
                raise CheckpointError(f"{folder}: {suffixes[0]} present but the config disables it") from missing
            continue
        per_layer = []
        for i in range(L):
            parts = []
            for sfx in suffixes:
                a = hf_layers[sfx][i]
                if a is None:
                    raise CheckpointError(f"{folder}: layer {i} is missing {sfx}")
                parts.append(a.T if is_kernel else a)
            try:
                per_layer.append(np.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0])
            except ValueError:
                raise CheckpointError(
                    f"{folder}: layer {i}: shapes {[p.shape for p in parts]} of {suffixes} do not fit together"
                ) from None
        if len({a.shape for a in per_layer}) != 1:
            raise CheckpointError(f"{folder}: {suffixes[0]} has different shapes across layers")
        _set(loaded, ("layers",) + path, np.stack(per_layer))
    for path, _ in _TOP_MAP.values():
        try:
            _get(expected, path)
        except KeyError:
            continue
        try:
            _set(loaded, path, _get(top, path))
        except KeyError:
            raise CheckpointError(f"{folder}: missing tensor for {'.'.join(path)}") from None

    def place(exp, arr, path):
        if arr.shape != exp.shape:
            raise CheckpointError(
                f"{folder}: shape mismatch for {'/'.join(str(getattr(k, 'key', k)) for k in path)}: "
                f"checkpoint has {tuple(arr.shape)}, config implies {tuple(exp.shape)}"
            )
        return jnp.asarray(arr).astype(exp.dtype)

    values = jax.tree_util.tree_map_with_path(
        lambda p, exp: place(exp, _get(loaded, tuple(k.key for k in p)), p), expected
    )
    nnx.replace_by_pure_dict(abs_state, values)
    model = nnx.merge(graphdef, abs_state)
    n = tokenizer_vocab_size(folder)
    if n is not None and n < cfg.vocab_size:
        model.num_tokens = n  # LM-head rows past the tokenizer (padding) must never be produced
    return cfg, model


def tokenizer_vocab_size(folder: str | Path) -> int | None:
    """Tokens tokenizer.json defines, added tokens included (None without the file)."""
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)
    except Exception as e:  # tokenizers raises a bare Exception on parse errors
        raise CheckpointError(f"{path}: cannot parse tokenizer ({e})") from None


def save_model(folder: str | Path, cfg: Qwen3Config, model: Qwen3ForCausalLM, *, dtype: str | None = None) -> None:
    """Write config.json + model.safetensors in the Hugging Face layout transformers reads."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    out_dtype = np.dtype(ml_dtypes.bfloat16) if (dtype or cfg.dtype) == "bfloat16" else np.dtype(dtype or cfg.dtype)
    state = nnx.to_pure_dict(nnx.state(model))
    tensors: dict[str, np.ndarray] = {}

    def put(name, arr, transpose):
        a = np.asarray(jax.device_get(arr)).astype(out_dtype)
        tensors[name] = np.ascontiguousarray(a.T if transpose else a)

    for name, (path, transpose) in _TOP_MAP.items():
        try:
            put(name, _get(state, path), transpose)
        except KeyError:
            pass
    for path, (suffixes, is_kernel) in _LAYER_PARAMS.items():
        try:
            stacked = np.asarray(jax.device_get(_get(state["layers"], path)))
        except KeyError:
            continue
        parts = np.split(stacked, np.cumsum(_output_split(path, cfg))[:-1], axis=-1) if len(suffixes) > 1 else [stacked]
        for sfx, part in zip(suffixes, parts):
            for i in range(cfg.num_hidden_layers):
                put(f"model.layers.{i}.{sfx}", part[i], is_kernel)
    save_file(tensors, str(folder / SINGLE_FILE), metadata={"format": "pt"})
    d = cfg.to_hf_dict()
    d["torch_dtype"] = "bfloat16" if out_dtype == np.dtype(ml_dtypes.bfloat16) else str(out_dtype)
    (folder / "config.json").write_text(json.dumps(d, indent=2) + "\n")


def _has(tree: dict, path: tuple[str, ...]) -> bool:
    try:
        _get(tree, path)
        return True
    except KeyError:
        return False


def hf_tensors(cfg: Qwen3Config, params: dict):
    """(Hugging Face name, [out, in] numpy array) of a model's pure-dict params, in checkpoint
    order, one tensor at a time (layer stacks are sliced, fused projections split)."""
    def arr(a):
        return np.asarray(jax.device_get(a))

    yield "model.embed_tokens.weight", arr(params["embed_tokens"]["embedding"])
    stacks = {}
    for path, (suffixes, is_kernel) in _LAYER_PARAMS.items():
        if not _has(params["layers"], path):
            continue
        stacked = arr(_get(params["layers"], path))
        split = np.cumsum(_output_split(path, cfg))[:-1] if len(suffixes) > 1 else []
        stacks[path] = (suffixes, is_kernel, stacked, split)
    for i in range(cfg.num_hidden_layers):
        for suffixes, is_kernel, stacked, split in stacks.values():
            parts = np.split(stacked[i], split, axis=-1) if len(suffixes) > 1 else [stacked[i]]
            for sfx, part in zip(suffixes, parts):
                yield f"model.layers.{i}.{sfx}", np.ascontiguousarray(part.T if is_kernel else part)
    yield "model.norm.weight", arr(params["norm"]["weight"])
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", np.ascontiguousarray(arr(params["lm_head"]["kernel"]).T)


def write_hf_checkpoint(folder: str | Path, cfg: Qwen3Config, params: dict, *, max_shard_bytes: int = 5 * 10**9,
                        progress: bool = False) -> list[Path]:
    """config.json + safetensors in the Hugging Face layout from pure-dict params (numpy or jax,
    already in the storage dtype): one model.safetensors, or shards of at most max_shard_bytes
    (a single larger tensor gets a shard of its own) with model.safetensors.index.json."""
    from tqdm.auto import tqdm

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    n_layer = sum(len(sfx) for path, (sfx, _) in _LAYER_PARAMS.items() if _has(params["layers"], path))
    n_tensors = 2 + cfg.num_hidden_layers * n_layer + (not cfg.tie_word_embeddings)
    written: list[tuple[Path, list[str]]] = []
    cur: dict[str, np.ndarray] = {}
    cur_bytes = total = 0
    dtype = None

    def flush():
        nonlocal cur, cur_bytes
        if cur:
            tmp = folder / f"model-{len(written) + 1:05d}.safetensors.part"
            save_file(cur, str(tmp), metadata={"format": "pt"})
            written.append((tmp, list(cur)))
        cur, cur_bytes = {}, 0

    for name, a in tqdm(hf_tensors(cfg, params), total=n_tensors, desc="write target", unit="tensor",
                        disable=not progress):
        dtype = a.dtype if dtype is None else dtype
        if cur and cur_bytes + a.nbytes > max_shard_bytes:
            flush()
        cur[name] = a
        cur_bytes += a.nbytes
        total += a.nbytes
    flush()
    files = []
    if len(written) == 1:
        dst = folder / SINGLE_FILE
        written[0][0].rename(dst)
        files.append(dst)
    else:
        weight_map = {}
        for k, (tmp, names) in enumerate(written):
            dst = folder / f"model-{k + 1:05d}-of-{len(written):05d}.safetensors"
            tmp.rename(dst)
            files.append(dst)
            weight_map.update({n: dst.name for n in names})
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    d = cfg.to_hf_dict()
    d["torch_dtype"] = "bfloat16" if dtype == np.dtype(ml_dtypes.bfloat16) else str(dtype)
    (folder / "config.json").write_text(json.dumps(d, indent=2) + "\n")
    return files
