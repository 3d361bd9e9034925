"""Parameters and peak training memory of a transformer from its config: admission before any allocation.

Pure arithmetic over a Hugging Face config.json (GPT-2 or BERT-style key names), standard library only,
so the API can refuse a job that cannot fit any worker and a worker can refuse one that cannot fit its
device, both before a single weight exists.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # attribute reads only: this module stays standard library at run time
    from core.adapters import AdapterConfig

Head = Literal["causal-lm", "classifier"]

# Families whose MLP is gated (SwiGLU/GeGLU: gate, up and down matrices) and whose positions are rotary (no table).
GATED_MLP = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "gemma", "gemma2",
                       "gemma3", "gemma3_text", "phi3", "olmo", "olmo2", "granite", "granitemoe", "gpt_oss"})
# Families whose attention runs the eager path (scores materialised): gpt-oss's sink logits have no SDPA kernel.
# Every other family runs SDPA, whose CPU and CUDA kernels keep no seq_len^2 scores (flash or memory-efficient).
EAGER_ATTENTION = frozenset({"gpt_oss"})
# The config keys of a mixture of experts: how many experts each MoE layer has, how many a token uses, and the width
# of one expert's MLP (absent: the model's intermediate_size).
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
ACTIVE_EXPERT_KEYS = ("num_experts_per_tok", "moe_topk", "top_k")
# The runtime a training process holds besides the model: CUDA context and kernels, or Python, torch and the
# tokenized data on a CPU. Measured at 0.4-0.6 GB for both; rounded up.
RUNTIME_BYTES = 1024**3
# A LoRA target's role by its module name across families (Llama, GPT-2, BERT): the shape it has.
LORA_SHAPES = {"q_proj": "q", "query": "q", "k_proj": "k", "key": "k", "v_proj": "v", "value": "v", "o_proj": "o",
               "out_proj": "o", "gate_proj": "gate", "up_proj": "up", "c_fc": "up", "intermediate.dense": "up",
               "down_proj": "down", "dense": "o", "c_proj": "o", "c_attn": "q"}
# Hugging Face modules keep about twice the minimal set of activations for backward (see training_memory).
ACTIVATION_FACTOR = 2.0
# QLoRA's base (bitsandbytes' NF4, blocks of 64 weights): 4 bits a weight, one 8-bit absmax a block and, with double
# quantization, one fp32 scale per 256 absmax values: 4 + 8/64 + 32/(64 x 256) = 4.127 bits, 0.516 bytes a weight.
NF4_BYTES = (4 + 8 / 64 + 32 / (64 * 256)) / 8
# Logit values one chunk of the chunked loss holds (worker.engines.training.token_loss): 64 MB in fp32.
CHUNK_VALUES = 2**24


@dataclass(frozen=True)
class Architecture:
    """The sizes of a decoder or encoder stack that decide its parameters and activations."""

    layers: int
    hidden: int
    heads: int
    intermediate: int
    vocab: int
    positions: int  # rows of a learned position table (0 for rotary positions)
    type_vocab: int  # BERT's token-type table
    kv_hidden: int  # width of the key and value projections (hidden unless grouped-query attention)
    gated_mlp: bool
    tied_head: bool  # the LM head shares the token embedding (GPT-2, BERT) or is its own matrix (Llama)
    q_hidden: int = 0  # width of the query projection and the attention output (heads x head_dim; 0: hidden)
    experts: int = 1  # a mixture of experts' MLPs per layer (1: a dense model); each `intermediate` wide
    active_experts: int = 1  # the experts each token runs through (its activations; all experts' weights train)
    eager_attention: bool = False  # attention scores materialised (EAGER_ATTENTION), not an SDPA kernel


@dataclass(frozen=True)
class MemoryEstimate:
    """Peak memory of one optimizer step, in bytes, by what holds it."""

    parameters: int
    states_bytes: int  # weights, gradients and AdamW moments (and autocast's cast copies of the weights)
    activations_bytes: int  # saved for backward over one micro-batch, the output logits included
    runtime_bytes: int
    tokens: int  # in one micro-batch: batch_size x sequence length
    checkpointing: bool = False  # gradient checkpointing: each layer's activations recomputed in backward

    @property
    def total_bytes(self) -> int:
        """What the device must hold at the peak."""
        return self.states_bytes + self.activations_bytes + self.runtime_bytes

    @property
    def fixed_bytes(self) -> int:
        """What no smaller batch can reduce: model states and runtime."""
        return self.states_bytes + self.runtime_bytes

    def describe(self) -> str:
        """'9.1 GB (1.2B parameters: 8.5 GB of weights, gradients and AdamW states, ...)' for error messages."""
        return (f"{format_bytes(self.total_bytes)} ({_count(self.parameters)} parameters: "
                f"{format_bytes(self.states_bytes)} of weights, gradients and AdamW states, "
                f"{format_bytes(self.activations_bytes)} of activations for {self.tokens} tokens per micro-batch"
                f"{' with gradient checkpointing' if self.checkpointing else ''}, "
                f"{format_bytes(self.runtime_bytes)} of runtime)")


def architecture(config: Mapping[str, Any]) -> Architecture | None:
    """The stack's sizes from a config.json's keys (GPT-2, BERT, DistilBERT, Llama names); None when unknown."""

    def first(*names: str) -> int | None:
        for name in names:
            value = config.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
        return None

    layers = first("num_hidden_layers", "n_layer", "n_layers", "num_layers")
    hidden = first("hidden_size", "n_embd", "d_model", "dim")
    vocab = first("vocab_size")
    if layers is None or hidden is None or vocab is None:
        return None
    heads = first("num_attention_heads", "n_head", "n_heads") or 1
    model_type = str(config.get("model_type", ""))
    gated = model_type in GATED_MLP
    rotary = gated or "rope_theta" in config or "rotary_dim" in config
    kv_heads = first("num_key_value_heads") or heads
    head_dim = first("head_dim")
    experts = first(*EXPERT_COUNT_KEYS) or 1
    intermediate = first("intermediate_size", "n_inner", "hidden_dim", "ffn_dim") or 4 * hidden
    if experts > 1:
        intermediate = first("moe_intermediate_size") or intermediate
    return Architecture(
        layers=layers, hidden=hidden, heads=heads, q_hidden=hidden if head_dim is None else heads * head_dim,
        intermediate=intermediate,
        vocab=vocab, positions=0 if rotary else (first("max_position_embeddings", "n_positions") or 0),
        type_vocab=first("type_vocab_size") or 0,
        kv_hidden=(hidden // heads if head_dim is None else head_dim) * kv_heads, gated_mlp=gated,
        tied_head=bool(config.get("tie_word_embeddings", True)), experts=experts,
        active_experts=min(experts, first(*ACTIVE_EXPERT_KEYS) or 1) if experts > 1 else 1,
        eager_attention=model_type in EAGER_ATTENTION or config.get("_attn_implementation") == "eager",
    )


def parameter_count(arch: Architecture, head: Head, num_labels: int = 2) -> int:
    """Parameters of the stack with a causal-LM head or a sequence-classification head (BERT pooler + linear)."""
    h, i = arch.hidden, arch.intermediate
    q = arch.q_hidden or h
    attention = 2 * h * q + 2 * h * arch.kv_hidden + q + h + 2 * arch.kv_hidden  # q, o and k, v, with biases
    mlp = 3 * h * i if arch.gated_mlp else 2 * h * i + i + h
    if arch.experts > 1:  # every expert's MLP, and the router's [experts, hidden] scores
        mlp = arch.experts * mlp + arch.experts * h
    norms = 4 * h  # two LayerNorms (weight and bias) per layer
    embeddings = (arch.vocab + arch.positions + arch.type_vocab) * h + 2 * h  # and one more LayerNorm
    total = arch.layers * (attention + mlp + norms) + embeddings
    if head == "causal-lm":
        return total + (0 if arch.tied_head else arch.vocab * h)
    return total + h * h + h + h * num_labels + num_labels  # pooler and classifier


def adapter_parameter_count(arch: Architecture, r: int, target_modules: str | Sequence[str], head: Head = "causal-lm",
                            num_labels: int = 2) -> int:
    """LoRA parameters: r x (in + out) for each targeted linear layer of each block ('all-linear': every one;
    names: those matching LORA_SHAPES, an unknown name counted as a hidden x hidden layer), and a classifier's
    new output layer, which trains in full (PEFT's modules_to_save)."""
    h, i, kv = arch.hidden, arch.intermediate, arch.kv_hidden
    q = arch.q_hidden or h
    shapes = {"q": (h, q), "k": (h, kv), "v": (h, kv), "o": (q, h), "up": (h, i), "down": (i, h)}
    if arch.gated_mlp:
        shapes["gate"] = (h, i)
    if isinstance(target_modules, str):
        chosen = list(shapes.values())
    else:
        chosen = [shapes.get(LORA_SHAPES.get(name.rsplit(".", 1)[-1], ""), (h, h)) for name in target_modules]
    per_layer = sum(r * (rows + cols) for rows, cols in chosen)
    new_head = 0 if head == "causal-lm" else h * num_labels + num_labels  # PEFT trains the classifier, not the pooler
    return arch.layers * per_layer + new_head


def quantized_parameter_count(arch: Architecture) -> int:
    """Weights a 4-bit base holds in NF4: the matrices of each block's linear layers (attention and a dense MLP).
    Embeddings, norms, biases, the output layer and a mixture's fused expert weights (not linear layers) stay as
    they are."""
    h, q, kv = arch.hidden, arch.q_hidden or arch.hidden, arch.kv_hidden
    mlp = (3 if arch.gated_mlp else 2) * h * arch.intermediate if arch.experts == 1 else 0
    return arch.layers * (2 * h * q + 2 * h * kv + mlp)


def adapter_sizes(arch: Architecture | None, adapter: AdapterConfig | None, head: Head = "causal-lm",
                  num_labels: int = 2) -> dict[str, Any]:
    """training_memory's arguments for a job's adapter: the parameters that train (None: all of them) and whether
    the frozen base is quantized (QLoRA)."""
    if arch is None or adapter is None:
        return {"trainable": None, "quantized_base": False}
    return {"trainable": adapter_parameter_count(arch, adapter.r, adapter.target_modules, head, num_labels),
            "quantized_base": adapter.quantize_base is not None}


def fitting_memory(arch: Architecture, *, limit: int | None, checkpointing: bool | None,
                   **kwargs: Any) -> MemoryEstimate:
    """training_memory with gradient checkpointing as the job asks, or (None: auto) on only when the job does not
    fit `limit` bytes without it: recomputing each layer costs about a third more compute per step."""
    if checkpointing is None:
        plain = training_memory(arch, checkpointing=False, **kwargs)
        if limit is None or plain.total_bytes <= limit:
            return plain
        checkpointing = True
    return training_memory(arch, checkpointing=checkpointing, **kwargs)


def training_memory(arch: Architecture, *, head: Head, batch_size: int, seq_len: int, precision: str,
                    fused_attention: bool | None = None, num_labels: int = 2, trainable: int | None = None,
                    checkpointing: bool = False, chunked_loss: bool = False, loss_tokens: int | None = None,
                    shards: int = 1, quantized_base: bool = False) -> MemoryEstimate:
    """Peak memory of one AdamW step over a micro-batch of batch_size sequences of seq_len tokens.

    Assumptions, matching the engines: weights, gradients and both AdamW moments in fp32 (16 bytes per
    parameter); with fp16/bf16 autocast another 2 bytes per parameter for the cast weights kept for
    backward. Activations saved for backward, per token and layer: the minimal set of Korthikanti et al.
    2022 ("Reducing Activation Recomputation": the layer input, both LayerNorm outputs, q, k, v, the
    attention output, the MLP input, its pre- and post-activation: 8 x hidden + 2 x intermediate values,
    plus two byte-per-value dropout masks), doubled because Hugging Face modules save more than that
    (GPT-2's tanh GELU is six elementwise ops that each keep their input; dropout keeps output and mask):
    measured at 1.6-2.2x on CPU. Without fused attention (SDPA's flash or memory-efficient kernels, which
    CUDA and CPUs have; None: the architecture's, see EAGER_ATTENTION) the heads x seq_len scores per token
    are kept too: scores, probabilities, dropped probabilities and their mask. A causal LM adds its logits
    over the vocabulary: the model's output, their fp32 log-softmax and its gradient (and an fp32 copy under
    autocast). Gradient accumulation adds nothing: the peak is one micro-batch. Checked against measured
    peaks in tests/unit/test_estimate.py and bench/training_memory.py.
    With `trainable` (a LoRA adapter's parameters, adapter_parameter_count) only those have gradients and
    AdamW moments: the frozen rest holds its fp32 weights (4 bytes each) and autocast's cast copies. With
    `quantized_base` (QLoRA, with `trainable`) the frozen linear layers' weights (quantized_parameter_count) take
    NF4_BYTES each and no cast copy: the 4-bit kernels dequantize one matrix at a time in the compute dtype, and save
    the 4-bit weight for backward (counted as one layer's weights dequantized).

    With `checkpointing` each layer keeps only its input (hidden values per token) and one layer at a time holds
    its full activations again while backward recomputes it. With `chunked_loss` (token_loss.py) only the
    `loss_tokens` positions that carry a target (default: all) reach the output layer, CHUNK_VALUES logits at a
    time: the logits cost one chunk, not the micro-batch.
    """
    parameters = parameter_count(arch, head, num_labels)
    half = precision in ("fp16", "bf16")
    value = 2 if half else 4
    cast = 2 if half else 0
    if trainable is None:
        states = parameters * (16 + cast)
    else:
        states = parameters * (4 + cast) + trainable * (16 + cast)
        if quantized_base:
            quantized = quantized_parameter_count(arch)
            states += int(quantized * NF4_BYTES) + quantized // arch.layers * value - quantized * (4 + cast)
    if shards > 1:  # FSDP: a device keeps its part of these, and gathers one layer's full parameters as it runs
        states = states // shards + parameters // arch.layers * value
    h, i = arch.hidden, arch.intermediate
    # gate and up outputs, and the activation's: in each expert a token runs through (and the router's scores)
    mlp_values = (3 * i if arch.gated_mlp else 2 * i) * arch.active_experts + (arch.experts if arch.experts > 1 else 0)
    per_layer = ACTIVATION_FACTOR * (value * (8 * h + mlp_values) + 2 * h)
    scores_kept = arch.eager_attention if fused_attention is None else not fused_attention
    if scores_kept:
        per_layer += arch.heads * seq_len * (3 * value + 1)
    embeddings = value * 3 * h  # the embeddings' sum, norm and dropout
    tokens = batch_size * seq_len
    if checkpointing:  # every layer's input, and one layer's activations during its recompute
        activations = tokens * (arch.layers * value * h + embeddings) + int(tokens * per_layer)
    else:
        activations = tokens * (int(arch.layers * per_layer) + embeddings)
    if head == "causal-lm":
        # the output layer's logits, their fp32 copy and log-softmax and its gradient (and autocast's copy)
        per_logit = value + 4 + 4 + (4 if half else 0)
        if chunked_loss:
            targets = tokens if loss_tokens is None else min(loss_tokens, tokens)
            chunk = min(targets, max(1, CHUNK_VALUES // arch.vocab))
            activations += chunk * arch.vocab * per_logit + targets * 2 * value * h  # and the rows' hidden and grad
        else:
            activations += tokens * arch.vocab * per_logit
    return MemoryEstimate(parameters=parameters, states_bytes=states, activations_bytes=activations,
                          runtime_bytes=RUNTIME_BYTES, tokens=tokens, checkpointing=checkpointing)


def load_model_config(reference: str) -> dict[str, Any] | None:
    """config.json of a local model folder, or of a hub id already in the local cache; None when neither."""
    return cached_json(reference, "config.json")


def cached_json(reference: str, name: str) -> dict[str, Any] | None:
    """A JSON object file `name` of a local model folder or a cached hub id; None when absent or not an object."""
    path = cached_file(reference, name)
    if path is None:
        return None
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def cached_file(reference: str, name: str) -> Path | None:
    """One file of a local model folder, or of a hub id already in the local cache; None when not there."""
    folder = Path(reference)
    path: Path | None = folder / name if folder.is_dir() else None
    if path is None:
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(reference, name)
        except Exception:  # noqa: BLE001 - no cache or a malformed id: there is simply no file
            return None
        path = Path(cached) if isinstance(cached, str) else None
    return path if path is not None and path.is_file() else None


def format_bytes(size: float) -> str:
    """Bytes in decimal units for people: '812.3 MB', '2.8 TB'."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(size) < 1000 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    raise AssertionError("unreachable")


def _count(parameters: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if parameters >= scale:
            return f"{parameters / scale:.1f}{unit}"
    return str(parameters)
