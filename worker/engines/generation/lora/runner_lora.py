"""Per-row LoRA adapters inside the serving decoder (DecoderRunner): gathered matmuls over its joined projections.

DecoderRunner joins q/k/v into one matmul and gate/up into another, so the adapters are stacked the same way:
per layer and joined projection ("qkv", "o", "gate_up", "down") one A tensor [slots, parts * R, in] (each
slot's parts side by side, R = max rank, lower ranks zero-padded) and, per part, one B^T tensor
[slots, R, part out] pre-scaled by alpha / r. Slot 0 stays zero: the base rows. Once per forward `plan` turns
the flat tokens' slots (decode rows, then each prompt's padded positions) into the U distinct adapters used and a
0/1 mask of each token's own rank block; every joined projection then adds
    t = (x A_U^T) * mask          one matmul for all parts of all used adapters (they share the input x)
    y[:, part] += t[:, part] B_part,U   one matmul per part (no zero blocks, unlike one block-diagonal B)
(Punica's BGMV, S-LoRA): the gather reads each used adapter once, not once per row as a per-row gather followed by
bmm does (on a CPU that copy cost 2-4x the base projection in a decode step), and the extra work is U * r / out of
the base matmul's. Where the tokens spread over several adapters evenly enough (`_grouped`), they are grouped by
adapter instead, each group padded to the largest, and multiplied by their own adapter only: one batched matmul
for A and one per part for B (with 16 adapters over 32 decode rows the masked matmul's U-fold work was a third of
the step at hidden 512; grouped, a few small copies). Writing a slot copies tensors only; reading the adapter
folder happens before (`adapter_cache.load_lora_weights`, off the decode loop). The stacks are allocated when the
first adapter arrives (a base that serves none holds nothing more) and grow when an adapter of a higher rank than
they hold arrives.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from worker.engines.generation.lora.adapter_cache import BASE_SLOT, PROJECTIONS, Key, LoraWeights

# Joined projection -> the PEFT projections it holds, in the order DecoderRunner concatenates their weights.
PARTS: dict[str, tuple[str, ...]] = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
                                     "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}
MIN_RANK = 8


def _pow2(value: int) -> int:
    return 1 << max(0, value - 1).bit_length()


@dataclass
class Grouped:
    """The adapted tokens grouped by adapter, each group padded to the largest (`width` rows): `gather` [U * width]
    picks each padded row's token (pads take token 0: their results are never read), `scatter` [N] each token's
    padded row (a base token's: the zero row appended after the U * width)."""

    gather: torch.Tensor
    scatter: torch.Tensor
    width: int


@dataclass
class TokenPlan:
    """The adapters one forward uses (U of them) and each token's mask, built once and shared by every layer;
    `grouped` where the tokens spread over several adapters evenly enough to go grouped (see RunnerLora.add)."""

    used: torch.Tensor  # [U] slots (no base slot)
    rows: torch.Tensor  # [N, U]: 1 where the token's adapter is that used adapter
    rank: int
    masks: dict[int, torch.Tensor] = field(default_factory=dict)
    grouped: Grouped | None = None

    def mask(self, parts: int) -> torch.Tensor:
        """[N, U * parts * rank]: 1 on the token's own adapter block (all parts), 0 elsewhere."""
        if parts not in self.masks:
            self.masks[parts] = self.rows.repeat_interleave(parts * self.rank, dim=1)
        return self.masks[parts]


class RunnerLora:
    """Adapter slots over a DecoderRunner's joined projections: capacity slots plus the zero slot 0."""

    def __init__(self, hidden: int, outputs: dict[str, tuple[int, ...]], inputs: dict[str, int], n_layer: int, *,
                 capacity: int, max_rank: int, device: torch.device, dtype: torch.dtype) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity, self.n_layer, self.device, self.dtype = capacity, n_layer, device, dtype
        self.outputs, self.inputs = outputs, inputs  # joined name -> each part's output width; -> input width
        self.max_rank = 0
        self.a: dict[tuple[int, str], torch.Tensor] = {}
        self.b: dict[tuple[int, str], list[torch.Tensor]] = {}
        self._decode: list[int] = []
        self._prompts: list[int] = []
        self.plan: TokenPlan | None = None
        # The used adapters' blocks side by side, per projection, kept while the next forwards use the same
        # adapters (decode steps mostly do): a step then reads them without gathering them again.
        self._gathered: dict[tuple[int, str], tuple[torch.Tensor, list[torch.Tensor]]] = {}
        self._gathered_for: tuple[int, ...] = ()
        self._first_rank = max(MIN_RANK, _pow2(max_rank))  # the stacks are allocated by the first write

    @property
    def nbytes(self) -> int:
        """Bytes of the stacked tensors."""
        tensors = [*self.a.values(), *(t for parts in self.b.values() for t in parts)]
        return sum(t.numel() * t.element_size() for t in tensors)

    def _grow(self, rank: int) -> None:
        """Re-stack with room for rank `rank`, keeping the resident adapters (rare: a larger adapter arrived)."""
        old_rank, old_a, old_b = self.max_rank, self.a, self.b
        self.a, self.b, self._gathered = {}, {}, {}
        for layer in range(self.n_layer):
            for name, widths in self.outputs.items():
                key = (layer, name)
                a = torch.zeros(self.capacity + 1, len(widths) * rank, self.inputs[name], device=self.device,
                                dtype=self.dtype)
                b = [torch.zeros(self.capacity + 1, rank, width, device=self.device, dtype=self.dtype)
                     for width in widths]
                if key in old_a:
                    for part in range(len(widths)):
                        a[:, part * rank:part * rank + old_rank] = old_a[key][:, part * old_rank:(part + 1) * old_rank]
                        b[part][:, :old_rank] = old_b[key][part]
                self.a[key], self.b[key] = a, b
        self.max_rank = rank

    def check(self, weights: LoraWeights) -> None:
        """Refuse (ValueError) an adapter whose layers or shapes this base does not have."""
        for (layer, projection), (lora_a, lora_b) in weights.layers.items():
            name = next((n for n, parts in PARTS.items() if projection in parts), None)
            if name is None or not 0 <= layer < self.n_layer:
                raise ValueError(f"adapter {weights.name} adapts layer {layer} {projection}, which the base lacks")
            width = self.outputs[name][PARTS[name].index(projection)]
            if lora_a.shape[1] != self.inputs[name] or lora_b.shape[0] != width:
                raise ValueError(f"adapter {weights.name}: {projection} of layer {layer} is {lora_b.shape[0]} x "
                                 f"{lora_a.shape[1]}, the base's is {width} x {self.inputs[name]}: another base model")

    def write(self, slot: int, weights: LoraWeights) -> None:
        """Copy an adapter into slot 1..capacity (zeroing what it does not adapt), growing the rank if needed."""
        if not 1 <= slot <= self.capacity:
            raise ValueError(f"slot {slot} is not one of 1..{self.capacity}")
        self.check(weights)
        self._gathered = {}
        if weights.rank > self.max_rank:
            self._grow(max(self._first_rank, _pow2(weights.rank)))
        rank = self.max_rank
        for (layer, name), a in self.a.items():
            a[slot].zero_()
            for part, projection in enumerate(PARTS[name]):
                self.b[(layer, name)][part][slot].zero_()
                found = weights.layers.get((layer, projection))
                if found is not None:
                    lora_a, lora_b = found
                    a[slot, part * rank:part * rank + weights.rank].copy_(lora_a)
                    self.b[(layer, name)][part][slot, :weights.rank].copy_(lora_b.T)

    def set_rows(self, decode: list[int], prompts: list[int]) -> None:
        """The slots of the next forward's decode rows (in row order) and of its new prompts (in prompt order)."""
        self._decode, self._prompts = decode, prompts

    def begin(self, batch: int, prompts: int, width: int) -> None:
        """Build the forward's plan: `batch` decode tokens, then `prompts` prompts of `width` padded tokens each."""
        slots = self._decode[:batch] + [s for s in self._prompts[:prompts] for _ in range(width)]
        if len(slots) != batch + prompts * width:
            raise RuntimeError(f"adapter slots for {len(self._decode)} rows and {len(self._prompts)} prompts; the "
                               f"forward has {batch} and {prompts}")
        self.plan = None
        if not any(slot != BASE_SLOT for slot in slots):
            return
        tokens = torch.tensor(slots, device=self.device)
        ids = tuple(sorted(set(slots) - {BASE_SLOT}))
        if ids != self._gathered_for:
            self._gathered, self._gathered_for = {}, ids
        used = torch.tensor(ids, device=self.device)
        rows = (tokens[:, None] == used[None, :]).to(self.dtype)
        self.plan = TokenPlan(used=used, rows=rows, rank=self.max_rank, grouped=_grouped(slots, ids, self.device))

    def add(self, layer: int, name: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out (x through joined projection `name` of `layer`, [N, sum of part widths]) plus each token's update."""
        plan = self.plan
        if plan is None:
            return out
        a, bs = self._blocks((layer, name), plan.used)
        if plan.grouped is not None:
            return out + self._grouped_update(x, a, bs, plan.grouped)
        t = (x @ a.T) * plan.mask(len(bs))  # [N, U * parts * R]
        if len(bs) == 1:
            return out + t @ bs[0]
        t = t.view(x.shape[0], len(plan.used), len(bs), self.max_rank)
        pieces = [t[:, :, part].reshape(x.shape[0], -1) @ b for part, b in enumerate(bs)]
        return out + torch.cat(pieces, dim=-1)

    def _grouped_update(self, x: torch.Tensor, a: torch.Tensor, bs: list[torch.Tensor],
                        grouped: Grouped) -> torch.Tensor:
        """Each token's update with its own adapter only: the tokens grouped by adapter, one batched matmul for A
        (all parts) and one per part for B, then each token takes its group's row. [N, sum of part widths]."""
        used, rank = len(bs[0]) // self.max_rank, self.max_rank
        groups = x.index_select(0, grouped.gather).view(used, grouped.width, x.shape[1])
        t = torch.bmm(groups, a.view(used, -1, x.shape[1]).transpose(1, 2))  # [U, width, parts * R]
        pieces = [torch.bmm(t[:, :, part * rank:(part + 1) * rank], b.view(used, rank, -1))
                  for part, b in enumerate(bs)]
        y = torch.cat(pieces, dim=-1).view(used * grouped.width, -1)
        y = torch.cat([y, y.new_zeros(1, y.shape[1])])  # the base tokens' row
        return y.index_select(0, grouped.scatter)

    def _blocks(self, key: tuple[int, str], used: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A [U * parts * R, in] and each part's B [U * R, out] of the used adapters (each read once)."""
        found = self._gathered.get(key)
        if found is None:
            first, count = self._gathered_for[0], len(self._gathered_for)
            if self._gathered_for[-1] - first + 1 == count:  # consecutive slots: views, no copy
                found = (self.a[key][first:first + count].flatten(0, 1),
                         [b[first:first + count].flatten(0, 1) for b in self.b[key]])
            else:
                found = (self.a[key].index_select(0, used).flatten(0, 1),
                         [b.index_select(0, used).flatten(0, 1) for b in self.b[key]])
            self._gathered[key] = found
        return found


def _grouped(slots: list[int], used: tuple[int, ...], device: torch.device) -> Grouped | None:
    """The grouped layout of a forward's tokens, or None where the masked matmul does less work: one adapter (the
    mask costs nothing then), or groups so uneven that padding them to the largest would copy more rows than the
    masked matmul multiplies (the grouped path's work is U * width rows of rank R; the masked one's N rows of
    U * R)."""
    if len(used) < 2:
        return None
    members: dict[int, list[int]] = {slot: [] for slot in used}
    for token, slot in enumerate(slots):
        if slot != BASE_SLOT:
            members[slot].append(token)
    width = max(len(tokens) for tokens in members.values())
    if len(used) * width > 2 * len(slots):
        return None
    gather, scatter = [], [len(used) * width] * len(slots)
    for group, slot in enumerate(used):
        for row, token in enumerate(members[slot]):
            scatter[token] = group * width + row
        gather += members[slot] + [0] * (width - len(members[slot]))
    return Grouped(torch.tensor(gather, device=device), torch.tensor(scatter, device=device), width)


def runner_lora(runner, *, capacity: int, max_rank: int = MIN_RANK) -> RunnerLora:
    """Empty adapter slots shaped for a DecoderRunner's weights (in its device and compute dtype)."""
    hidden = runner.weights.embed.shape[1]
    intermediate = runner.config.intermediate_size
    outputs = {"qkv": (runner.q_size, runner.kv_size, runner.kv_size), "o": (hidden,),
               "gate_up": (intermediate, intermediate), "down": (hidden,)}
    inputs = {"qkv": hidden, "o": runner.q_size, "gate_up": hidden, "down": intermediate}
    return RunnerLora(hidden, outputs, inputs, runner.n_layer, capacity=capacity, max_rank=max_rank,
                      device=runner.device, dtype=runner.dtype)


__all__ = ["PARTS", "PROJECTIONS", "Key", "RunnerLora", "TokenPlan", "runner_lora"]
