"""GPT-2 weights for serving, read straight from safetensors: no HF model class, each weight held once.

Why not `AutoModelForCausalLM`: importing HF's modeling code pulls in its generation utilities and, with
them, scikit-learn, SciPy, pandas, pyarrow and accelerate (boto3 included): about 200 MiB resident in a
generation worker before any weight (measured: 304 MiB for torch + the tokenizer and config classes,
510 MiB with the modeling imports). The serving forward pass (lm_loading.Gpt2Runner) needs only tensors.
"""

from __future__ import annotations

import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoConfig, PretrainedConfig

from worker.engines.device import DevicePlan, linear, pack_linear

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"  # a sharded checkpoint
PROJECTIONS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")  # Conv1D: weight [in, out]
# GPT-2's activation names (HF's ACT2FN) that the serving forward supports.
ACTIVATIONS = {
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"), "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu, "relu": F.relu, "silu": F.silu, "swish": F.silu,
}
_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


@dataclass
class Gpt2Weights:
    """A GPT-2 checkpoint's config, eos ids and tensors by name without the `transformer.` prefix.

    On the CPU the large tensors (embeddings, projections, LM head) stay lazily mapped from the checkpoint file
    in its own dtype (a page becomes resident when read: of the embedding table, only the rows looked up) and
    are cast when packed or looked up; the small ones, and on a GPU all, are copies in the plan's device and
    dtype. `regions` says where each tensor lies in its file's mapping, so pages read once can be dropped.
    """

    config: PretrainedConfig
    eos_token_ids: frozenset[int]
    tensors: dict[str, torch.Tensor]
    regions: dict[str, tuple[mmap.mmap, int, int]]  # name -> (mapping, first byte, end byte)
    tied: bool  # the LM head is the token embedding
    dtype: torch.dtype  # the dtype the forward pass computes in

    def cast_all(self) -> None:
        """Copy every tensor still in another dtype (mapped from the file) into the compute dtype."""
        for name, tensor in self.tensors.items():
            if tensor.dtype != self.dtype:
                self.tensors[name] = tensor.to(self.dtype)


def resolve_folder(model: str | Path) -> Path:
    """The local folder of a checkpoint: `model` itself, or the hub snapshot's (config, tokenizer, safetensors only)."""
    folder = Path(model)
    if folder.is_dir():
        return folder
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(model), allow_patterns=["*.json", "*.safetensors", "*.txt"]))


def model_type(model: str | Path) -> str:
    """config.json's model_type of a checkpoint folder or hub id (no weights read)."""
    return str(json.loads((resolve_folder(model) / "config.json").read_text()).get("model_type"))


def load_gpt2(model: str | Path, plan: DevicePlan) -> Gpt2Weights:
    """Config and weights of a GPT-2 safetensors checkpoint (a .bin is never unpickled), on the plan's device."""
    folder = resolve_folder(model)
    config = AutoConfig.from_pretrained(folder, trust_remote_code=False)  # checked before any weight is read
    if config.model_type != "gpt2":
        raise ValueError(f"{model}: model_type {config.model_type!r} is not supported; the engine serves GPT-2 only")
    if getattr(config, "add_cross_attention", False):
        raise ValueError(f"{model}: GPT-2 with cross-attention is not supported")
    if config.activation_function not in ACTIVATIONS:
        raise ValueError(f"{model}: activation {config.activation_function!r} is not supported")
    tensors: dict[str, torch.Tensor] = {}
    regions: dict[str, tuple[mmap.mmap, int, int]] = {}
    for file in safetensors_files(folder):
        for name, (tensor, region) in map_tensors(file).items():
            tensors[name.removeprefix("transformer.")] = tensor
            regions[name.removeprefix("transformer.")] = region
    expected = ["wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias"] + [
        f"h.{i}.{part}.{kind}" for i in range(config.n_layer)
        for part in ("ln_1", "ln_2", *PROJECTIONS) for kind in ("weight", "bias")]
    missing = [name for name in expected if name not in tensors]
    if missing:
        raise ValueError(f"{model}: the checkpoint lacks {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
    tied = "lm_head.weight" not in tensors or bool(getattr(config, "tie_word_embeddings", True))
    if tied:
        tensors.pop("lm_head.weight", None)
    # For inference the weights themselves are cast (no autocast): half the memory and no per-op casts. On the
    # CPU the large ones are cast one at a time as they are packed (or rows as they are looked up), so a bf16
    # model never holds an fp32 copy of its whole checkpoint.
    dtype = plan.autocast_dtype or torch.float32
    on_cpu = torch.device(plan.device).type == "cpu"
    tensors = {name: t if on_cpu and _is_large(name) else t.to(device=plan.device, dtype=dtype)
               for name, t in tensors.items()}
    return Gpt2Weights(config, eos_ids(folder, config), tensors, regions, tied, dtype)


def _is_large(name: str) -> bool:
    """The embeddings, the LM head and the projections' weights: all but a few MiB of a checkpoint."""
    return name in ("wte.weight", "wpe.weight", "lm_head.weight") or \
        name.split(".", 2)[-1].removesuffix(".weight") in PROJECTIONS and name.endswith(".weight")


def pack_weights(weights: Gpt2Weights) -> list[tuple[torch.Tensor, ...]] | None:
    """oneDNN-packed [out, in] copies (compute dtype) of every projection and of the LM head; None without oneDNN.

    Each weight is read from the mapping, cast, packed, and its pages dropped right after, so the packed copy
    is the only resident one and loading never holds more than one layer's weights twice. The mapped originals
    of the projections (and of an untied LM head) leave `weights.tensors` once packing succeeded.
    """
    config, tensors, dtype = weights.config, weights.tensors, weights.dtype
    names = [[f"h.{i}.{part}.weight" for part in PROJECTIONS] for i in range(config.n_layer)]
    head = "wte.weight" if weights.tied else "lm_head.weight"
    try:
        with torch.inference_mode():
            def pack(name: str, transposed: bool) -> torch.Tensor:
                weight = _cast(tensors[name], dtype, weights.regions[name])
                packed = pack_linear(weight.t() if transposed else weight)
                if not packed.is_mkldnn:
                    raise NotImplementedError("oneDNN cannot pack this weight")
                _drop_pages(*weights.regions[name])  # a tied embedding's lookups page their rows back in
                return packed

            # Probe once: a build without these ops, or one that computes differently, keeps plain matmuls.
            probe = torch.randn(4, config.n_embd).to(dtype)
            first, bias = names[0][0], tensors["h.0.attn.c_attn.bias"]
            expected = (probe @ tensors[first].to(dtype) + bias).float()
            layers = [tuple(pack(name, True) for name in group) for group in names]
            layers.append((pack(head, False),))
            got = linear(probe, layers[0][0], bias).float()
            tolerance = 1e-4 if dtype == torch.float32 else 2e-2  # bf16 keeps 8 bits of mantissa
            if not torch.allclose(got, expected, rtol=tolerance, atol=tolerance):
                return None
    except (AttributeError, RuntimeError, NotImplementedError):
        return None
    for name in [n for group in names for n in group] + ([] if weights.tied else ["lm_head.weight"]):
        del tensors[name]  # the packed copy is the only one now
    return layers


def _cast(tensor: torch.Tensor, dtype: torch.dtype, region: tuple[mmap.mmap, int, int],
          chunk_bytes: int = 16 << 20) -> torch.Tensor:
    """A mapped tensor in `dtype`, cast `chunk_bytes` of it at a time with the pages read dropped as it goes.

    Without this a tied bf16 LM head would briefly hold the whole fp32 table resident beside its bf16 copy.
    """
    if tensor.dtype == dtype:
        return tensor
    out = torch.empty(tensor.shape, dtype=dtype)
    mapping, begin, end = region
    row_bytes = tensor[0].numel() * tensor.element_size() if tensor.dim() > 1 else tensor.element_size()
    rows = max(1, chunk_bytes // max(1, row_bytes))
    for at in range(0, tensor.shape[0], rows):
        out[at: at + rows] = tensor[at: at + rows]
        _drop_pages(mapping, begin + at * row_bytes, min(end, begin + (at + rows) * row_bytes))
    return out


def _drop_pages(mapping: mmap.mmap, begin: int, end: int) -> None:
    """Release the resident pages of a read-only stretch of a private file mapping (a later read refaults them)."""
    start = begin - begin % mmap.PAGESIZE
    if end > start and hasattr(mmap, "MADV_DONTNEED"):
        mapping.madvise(mmap.MADV_DONTNEED, start, end - start)


def safetensors_files(folder: Path) -> list[Path]:
    single, index = folder / WEIGHTS_FILE, folder / INDEX_FILE
    if single.is_file():
        return [single]
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / shard for shard in shards]
    raise OSError(f"{folder}: no safetensors weights ({WEIGHTS_FILE}); other formats are not loaded (no unpickling)")


def map_tensors(file: Path) -> dict[str, tuple[torch.Tensor, tuple[mmap.mmap, int, int]]]:
    """Every tensor of a safetensors file as a view of a private (copy-on-write) mapping: read lazily, by page."""
    with file.open("rb") as handle:
        (header_size,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(header_size))
        mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
    start = 8 + header_size
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if entry["dtype"] not in _DTYPES:
            raise ValueError(f"{file}: tensor {name} has dtype {entry['dtype']}, not a float")
        dtype = _DTYPES[entry["dtype"]]
        begin, end = entry["data_offsets"]
        count = (end - begin) // dtype.itemsize
        flat = torch.frombuffer(mapping, dtype=dtype, count=count, offset=start + begin) if count else \
            torch.empty(0, dtype=dtype)
        tensors[name] = (flat.view(entry["shape"]), (mapping, start + begin, start + end))
    return tensors


def eos_ids(folder: Path, config: PretrainedConfig) -> frozenset[int]:
    """The ids that end a choice: generation_config.json's eos, else the model config's."""
    eos = None
    generation = folder / "generation_config.json"
    if generation.is_file():
        eos = json.loads(generation.read_text()).get("eos_token_id")
    if eos is None:
        eos = config.eos_token_id
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)
