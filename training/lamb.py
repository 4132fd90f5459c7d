"""LAMB and LANS with true per-tensor trust ratios, also when DeepSpeed ZeRO-1/2 partitions the parameters.

ZeRO-1/2 flattens every parameter group into one buffer and gives each data-parallel rank one contiguous
slice of it as a single fp32 tensor. An optimizer that computes ``||w|| / ||update||`` on that slice mixes
layers and cuts tensors at slice boundaries. Here each optimizer tensor carries a *piece table*: the
consecutive pieces it is made of, and which original tensor each piece belongs to. Squared norms are summed
per piece, scattered into a vector with one slot per original tensor, summed over the data-parallel group
in one all-reduce, and every piece is then scaled by its own tensor's ratio. Without ZeRO every tensor is
one piece of itself and no communication happens. See docs/LAMB.md.
"""

from __future__ import annotations

import abc
import math
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as torch_dist
from torch import nn

__all__ = ["Lamb", "Lans", "bind_to_deepspeed", "build_param_groups"]


def build_param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two parameter groups in the BERT recipe's split: weights decay, biases and LayerNorm parameters do not.

    Optimizer-agnostic (plain ``params``/``weight_decay`` dicts), so AdamW takes them too. LAMB also
    skips the trust ratio where ``weight_decay`` is 0, as NVIDIA's BERT LAMB does (LANS does not). Tied
    parameters are listed once; frozen ones are left out. Empty groups are dropped.
    """
    if not _is_number(weight_decay, lambda v: v >= 0):
        raise ValueError(f"weight_decay must be a finite number >= 0, got {weight_decay!r}")
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    seen: set[int] = set()
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            if name == "bias" or isinstance(module, nn.LayerNorm):
                no_decay.append(param)
            else:
                decay.append(param)
    groups = [
        {"params": decay, "weight_decay": float(weight_decay)},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return [group for group in groups if group["params"]]


def _is_number(value: object, ok) -> bool:
    """A finite real number (Python's or NumPy's, not a bool) for which ok(value) holds."""
    return (isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
            and bool(ok(value)))


def _check_hyperparameters(group: dict, where: str) -> None:
    for name, ok, rule in (("lr", lambda v: v >= 0, ">= 0"), ("eps", lambda v: v > 0, "> 0"),
                           ("weight_decay", lambda v: v >= 0, ">= 0")):
        if not _is_number(group[name], ok):
            raise ValueError(f"{where}{name} must be a finite number {rule}, got {group[name]!r}")
    betas = group["betas"]
    if not (isinstance(betas, tuple | list) and len(betas) == 2
            and all(_is_number(b, lambda v: 0 <= v < 1) for b in betas)):
        raise ValueError(f"{where}betas must be two numbers in [0, 1), got {betas!r}")


@dataclass(frozen=True)
class _Pieces:
    """How one optimizer tensor splits into consecutive pieces of original tensors."""

    tensor: torch.Tensor  # the optimizer tensor this table describes (identity check)
    lengths: list[int]  # element counts; they add up to tensor.numel()
    owners: list[int]  # per piece: index of the original tensor, or the padding slot (num_tensors)
    # owners on tensor.device, for tables of several pieces (a ZeRO partition); None for a whole tensor
    owners_t: torch.Tensor | None = None


@dataclass(frozen=True)
class _Binding:
    """The partition layout handed over by bind_to_deepspeed."""

    pieces: dict[int, _Pieces] | None  # id(optimizer tensor) -> pieces; None: every tensor is whole
    num_tensors: int
    process_group: object | None  # data-parallel group to sum partial norms over; None: no all-reduce


class _LayerwiseOptimizer(torch.optim.Optimizer, abc.ABC):
    """Shared machinery: per-tensor squared norms over (possibly partitioned) optimizer tensors."""

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
    ):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        _check_hyperparameters(defaults, "")
        defaults["betas"] = tuple(betas)
        # Optimizer.__init__ calls add_param_group, which records the tensors we were built with.
        self._constructed: set[int] = set()
        self._binding: _Binding | None = None
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        # A group's own values override the defaults: checked as they will be used.
        _check_hyperparameters({**self.defaults, **param_group}, f"parameter group {len(self.param_groups)}: ")
        super().add_param_group(param_group)
        self._constructed.update(id(p) for p in self.param_groups[-1]["params"])

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        # Optimizer.load_state_dict comes here too, on a live (perhaps bound) optimizer: keep it as is.
        # A copy or an unpickled optimizer (Optimizer.__getstate__ keeps only defaults, state and
        # groups) steps its own parameters; a binding to an engine's partitions does not carry over.
        if not hasattr(self, "_binding"):
            self._constructed = {id(p) for group in self.param_groups for p in group["params"]}
            self._binding = None

    # ------------------------------------------------------------------ binding

    def _bind(self, binding: _Binding) -> None:
        self._binding = binding

    @staticmethod
    def _adaptive(group: dict) -> bool:
        return group["weight_decay"] != 0.0

    def _piece_tables(self, params: Sequence[torch.Tensor]) -> tuple[list[_Pieces], int, object | None]:
        """Piece tables for the tensors of this step, the number of tensor slots, and the group to reduce over."""
        binding = self._binding
        if binding is None:
            foreign = [p for p in params if id(p) not in self._constructed]
            if foreign:
                raise RuntimeError(
                    f"{type(self).__name__}: {len(foreign)} of the tensors it steps are not the parameters it was "
                    "built with (DeepSpeed ZeRO and mixed-precision wrappers replace them with flat fp32 "
                    "partitions or copies). Call training.lamb.bind_to_deepspeed(engine) right after "
                    "deepspeed.initialize, or the trust ratios would be computed per partition, not per tensor. "
                    "If this is raised inside deepspeed.initialize, the wrapper steps before it can be bound: "
                    "DeepSpeed's FP16_UnfusedOptimizer (bf16/fp16 without ZeRO) takes a zero-gradient step at "
                    "construction, which would also decay every weight once; use ZeRO stage 1 or 2 with bf16."
                )
        if binding is None or binding.pieces is None:
            return [_Pieces(p, [p.numel()], [index]) for index, p in enumerate(params)], len(params), None
        tables = []
        for p in params:
            table = binding.pieces.get(id(p))
            if table is None or table.tensor is not p:
                raise RuntimeError(
                    f"{type(self).__name__} is bound to a DeepSpeed partition layout, but steps a tensor of "
                    f"{p.numel()} elements that the layout does not know. Call bind_to_deepspeed(engine) again "
                    "after anything that rebuilds the DeepSpeed optimizer."
                )
            tables.append(table)
        return tables, binding.num_tensors, binding.process_group

    @staticmethod
    def _sum_squares(
        tensors: Sequence[torch.Tensor], tables: Sequence[_Pieces], out: torch.Tensor
    ) -> None:
        """Add, for each original tensor, the squared norm of its pieces found in `tensors` to `out[index]`.

        `out` has one slot per original tensor and one more, last, which collects padding and is never read.
        """
        if not tensors:
            return
        chunks: list[torch.Tensor] = []
        owners: list[int] = []
        for tensor, table in zip(tensors, tables):
            chunks.extend(torch.split(tensor.reshape(-1), table.lengths))
            owners.extend(table.owners)
        norms = torch.stack(torch._foreach_norm(chunks)).to(out.dtype)
        out.index_add_(0, torch.tensor(owners, dtype=torch.int64, device=out.device), norms.square())

    @staticmethod
    def _scale_by_piece(tensor: torch.Tensor, table: _Pieces, per_tensor: torch.Tensor) -> None:
        """tensor *= per_tensor[owner of each element], in place."""
        if len(table.lengths) == 1:
            tensor.mul_(per_tensor[table.owners[0]].to(tensor.device, tensor.dtype))
        else:
            # One device-side gather of the factors, then each piece (a view) scaled in place: no host
            # sync and no partition-sized temporary.
            factors = per_tensor.to(tensor.device)[table.owners_t].to(tensor.dtype)
            torch._foreach_mul_(list(torch.split(tensor.view(-1), table.lengths)), list(factors.unbind()))

    @staticmethod
    def _all_reduce(vector: torch.Tensor, process_group: object | None) -> None:
        if process_group is not None:
            torch_dist.all_reduce(vector, op=torch_dist.ReduceOp.SUM, group=process_group)

    @staticmethod
    def _trust_ratio(weight_sq: torch.Tensor, update_sq: torch.Tensor) -> torch.Tensor:
        """||w|| / ||u|| per tensor, 1 where either norm is 0 (LAMB paper, NVIDIA apex)."""
        weight_norm, update_norm = weight_sq.sqrt(), update_sq.sqrt()
        usable = (weight_norm > 0) & (update_norm > 0)
        return torch.where(usable, weight_norm / torch.where(usable, update_norm, 1.0), 1.0)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        stepped = self._stepped()
        all_params = [p for _, params in stepped for p in params]
        if all_params:  # under ZeRO every rank steps its partition of every group, so all ranks agree
            tables, num_tensors, process_group = self._piece_tables(all_params)
            self._update(stepped, {id(p): t for p, t in zip(all_params, tables)}, num_tensors, process_group)
        return loss

    @abc.abstractmethod
    def _update(self, stepped: list[tuple[dict, list[torch.Tensor]]], table_of: dict[int, _Pieces],
                num_tensors: int, process_group: object | None) -> None:
        """Update the tensors of `stepped` in place; `table_of[id(tensor)]` is its piece table."""

    def _stepped(self) -> list[tuple[dict, list[torch.Tensor]]]:
        stepped = []
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                for p in params:
                    if p.grad.is_sparse:
                        raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                stepped.append((group, params))
        return stepped

    @staticmethod
    def _denominator(exp_avg_sq: torch.Tensor, step: int, group: dict) -> torch.Tensor:
        """sqrt(v_hat) + eps in a new tensor."""
        return exp_avg_sq.sqrt().div_(math.sqrt(1 - group["betas"][1] ** step)).add_(group["eps"])

    def _moments(
        self, p: torch.Tensor, grad: torch.Tensor, group: dict
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Update and return the Adam moments of p from `grad`, and the step count."""
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["step"] += 1
        beta1, beta2 = group["betas"]
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        return exp_avg, exp_avg_sq, state["step"]


class Lamb(_LayerwiseOptimizer):
    """LAMB (You et al. 2019) as NVIDIA's BERT recipe runs it (apex FusedLAMB, ``use_nvlamb=False``).

    m, v: Adam moments with bias correction; u = m_hat / (sqrt(v_hat) + eps) + weight_decay * w;
    w -= lr * (||w|| / ||u||) * u with norms per original tensor. Groups with weight_decay 0 (biases and
    LayerNorm) get ratio 1, as apex does without ``use_nvlamb``. Gradient clipping is not done here: DeepSpeed's
    ``gradient_clipping`` clips by the global norm before this step, as the recipe does.
    """

    def _update(self, stepped: list[tuple[dict, list[torch.Tensor]]], table_of: dict[int, _Pieces],
                num_tensors: int, process_group: object | None) -> None:
        updates: list[tuple[dict, torch.Tensor, torch.Tensor]] = []
        for group, params in stepped:
            beta1 = group["betas"][0]
            for p in params:
                exp_avg, exp_avg_sq, step = self._moments(p, p.grad, group)
                # m_hat / (sqrt(v_hat) + eps), built in one partition-sized buffer
                update = self._denominator(exp_avg_sq, step, group)
                torch.div(exp_avg, update, out=update).div_(1 - beta1**step)
                if group["weight_decay"] != 0.0:
                    update.add_(p, alpha=group["weight_decay"])
                updates.append((group, p, update))

        adaptive = [(p, u) for group, p, u in updates if self._adaptive(group)]
        ratio = None
        if adaptive:
            device = adaptive[0][0].device
            sums = torch.zeros(2, num_tensors + 1, dtype=torch.float32, device=device)
            adaptive_tables = [table_of[id(p)] for p, _ in adaptive]
            self._sum_squares([p for p, _ in adaptive], adaptive_tables, sums[0])
            self._sum_squares([u for _, u in adaptive], adaptive_tables, sums[1])
            self._all_reduce(sums, process_group)
            ratio = self._trust_ratio(sums[0], sums[1])

        for group, p, update in updates:
            if self._adaptive(group):
                self._scale_by_piece(update, table_of[id(p)], ratio)
            p.add_(update, alpha=-group["lr"])


class Lans(_LayerwiseOptimizer):
    """LANS (Zheng et al. 2020), the optimizer of the Gaudi BERT-1.5B recipe, with exact per-tensor norms.

    g_hat = g / (||g|| + eps) per original tensor; m, v: Adam moments of g_hat with bias correction;
    r_m = m_hat / (sqrt(v_hat) + eps) + wd * w and r_c = g_hat / (sqrt(v_hat) + eps) + wd * w;
    w -= lr * (beta1 * ||w||/||r_m|| * r_m + (1 - beta1) * ||w||/||r_c|| * r_c).
    Every tensor's gradient is normalised and every tensor gets both trust ratios, also where weight_decay
    is 0 (biases, LayerNorm): the paper's Algorithm 2, apex ``FusedLANS`` and Habana's ``LANS`` have no
    exemption, unlike apex's LAMB without ``use_nvlamb``. Under ZeRO this takes two small all-reduces per
    client step: the gradient norms are needed before the moments, the update norms after them. DeepSpeed's
    fp32 ZeRO optimizer steps the client once per parameter group (4 all-reduces with build_param_groups'
    two groups); BF16_Optimizer steps it once (2).
    """

    def _update(self, stepped: list[tuple[dict, list[torch.Tensor]]], table_of: dict[int, _Pieces],
                num_tensors: int, process_group: object | None) -> None:
        all_params = [p for _, params in stepped for p in params]
        tables = [table_of[id(p)] for p in all_params]
        device = all_params[0].device

        # Gradient and weight norms of every tensor in one all-reduce.
        first = torch.zeros(2, num_tensors + 1, dtype=torch.float32, device=device)
        self._sum_squares([p.grad for p in all_params], tables, first[0])
        self._sum_squares(all_params, tables, first[1])
        self._all_reduce(first, process_group)
        grad_norm = first[0].sqrt()

        pending: list[tuple[dict, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        for group, params in stepped:
            beta1 = group["betas"][0]
            inverse_norm = 1.0 / (grad_norm + group["eps"])
            for p in params:
                grad = p.grad.clone()
                self._scale_by_piece(grad, table_of[id(p)], inverse_norm)
                exp_avg, exp_avg_sq, step = self._moments(p, grad, group)
                update_m = self._denominator(exp_avg_sq, step, group)
                update_c = grad.div_(update_m)
                torch.div(exp_avg, update_m, out=update_m).div_(1 - beta1**step)
                if group["weight_decay"] != 0.0:
                    update_m.add_(p, alpha=group["weight_decay"])
                    update_c.add_(p, alpha=group["weight_decay"])
                pending.append((group, p, update_m, update_c))

        # Both trust ratios of every tensor, in the order of all_params.
        second = torch.zeros(2, num_tensors + 1, dtype=torch.float32, device=device)
        self._sum_squares([m for _, _, m, _ in pending], tables, second[0])
        self._sum_squares([c for _, _, _, c in pending], tables, second[1])
        self._all_reduce(second, process_group)
        ratio_m = self._trust_ratio(first[1], second[0])
        ratio_c = self._trust_ratio(first[1], second[1])

        for group, p, update_m, update_c in pending:
            beta1 = group["betas"][0]
            self._scale_by_piece(update_m, table_of[id(p)], ratio_m)
            self._scale_by_piece(update_c, table_of[id(p)], ratio_c)
            p.add_(update_m, alpha=-group["lr"] * beta1)
            p.add_(update_c, alpha=-group["lr"] * (1 - beta1))


# ---------------------------------------------------------------------------------------- DeepSpeed

# (start in the rank's flat partition, element count, index of the original tensor, its values there)
_Fragment = tuple[int, int, int, torch.Tensor]


def bind_to_deepspeed(engine) -> None:
    """Tell the engine's client Lamb/Lans where each original tensor lies in its ZeRO partitions.

    Call once right after ``deepspeed.initialize``. The layout survives ``engine.load_checkpoint`` (DeepSpeed
    copies into the same partition tensors). Supported: ZeRO-1/2 (DeepSpeedZeroOptimizer, also with
    ``round_robin_gradients``), bf16 with fp32 gradient accumulation (BF16_Optimizer), and fp32 without
    ZeRO (no wrapper), where each tensor stays whole and nothing is communicated.
    """
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    stage = engine.zero_optimization_stage()
    if stage >= 3:
        raise ValueError(
            f"bind_to_deepspeed: ZeRO stage {stage} partitions each parameter separately and is not supported "
            "by training.lamb; use zero_optimization.stage 1 or 2 for LAMB/LANS"
        )
    wrapper = engine.optimizer
    if isinstance(wrapper, _LayerwiseOptimizer):
        wrapper._bind(_Binding(pieces=None, num_tensors=0, process_group=None))
        return
    client = getattr(wrapper, "optimizer", None)
    if not isinstance(client, _LayerwiseOptimizer):
        raise TypeError(
            f"bind_to_deepspeed: the engine's optimizer wraps {type(client).__name__}, not training.lamb.Lamb or "
            "Lans; pass the Lamb/Lans instance as deepspeed.initialize(optimizer=...)"
        )
    if isinstance(wrapper, DeepSpeedZeroOptimizer):
        lp_groups, read_fragments = wrapper.bit16_groups, _zero_fragments
    elif isinstance(wrapper, BF16_Optimizer):
        lp_groups, read_fragments = wrapper.bf16_groups, _linked_fragments
    else:
        raise TypeError(
            f"bind_to_deepspeed: DeepSpeed wrapped the optimizer in {type(wrapper).__name__}, whose parameter "
            "layout training.lamb does not know (supported: DeepSpeedZeroOptimizer, BF16_Optimizer, or none "
            "for fp32 without ZeRO); use ZeRO stage 1 or 2."
        )
    process_groups = list(wrapper.real_dp_process_group)
    if any(g is not process_groups[0] for g in process_groups):
        raise ValueError(
            "bind_to_deepspeed: the parameter groups use different data-parallel groups (MoE experts); "
            "training.lamb sums partial norms over one group and does not support that"
        )
    if len(lp_groups) != len(client.param_groups):
        raise RuntimeError(
            f"bind_to_deepspeed: DeepSpeed has {len(lp_groups)} parameter groups but the optimizer has "
            f"{len(client.param_groups)}"
        )
    flats = []
    for group_index, group in enumerate(client.param_groups):
        if len(group["params"]) != 1:
            raise RuntimeError(
                f"bind_to_deepspeed: optimizer group {group_index} holds {len(group['params'])} tensors; a ZeRO "
                "partition is one flat tensor. Call bind_to_deepspeed right after deepspeed.initialize."
            )
        flats.append(group["params"][0])
    fragments = [read_fragments(wrapper, i) for i in range(len(flats))]
    client._bind(
        _piece_tables_from_fragments(flats, fragments, [len(g) for g in lp_groups], process_groups[0])
    )


def _zero_fragments(wrapper, group_index: int) -> list[_Fragment]:
    """DeepSpeedZeroOptimizer: the flat buffer holds the tensors in round-robin order at known offsets and
    rank r owns elements [r * partition_size, (r + 1) * partition_size)."""
    rank = torch_dist.get_rank(group=wrapper.real_dp_process_group[group_index])
    size = int(wrapper.partition_size[group_index])
    low, high = rank * size, (rank + 1) * size
    ordered = wrapper.round_robin_bit16_groups[group_index]
    all_offsets = getattr(wrapper, "round_robin_bit16_offsets", None)
    if all_offsets is not None:
        offsets = list(all_offsets[group_index])
    else:  # DeepSpeed before per-parameter alignment padding: tensors are packed back to back
        offsets, position = [], 0
        for p in ordered:
            offsets.append(position)
            position += p.numel()
    index_of = {id(p): i for i, p in enumerate(wrapper.bit16_groups[group_index])}
    fragments = []
    for p, offset in zip(ordered, offsets):
        start, end = max(offset, low), min(offset + p.numel(), high)
        if start < end:
            values = p.detach().reshape(-1)[start - offset : end - offset]
            fragments.append((start - low, end - start, index_of[id(p)], values))
    return fragments


def _linked_fragments(wrapper, group_index: int) -> list[_Fragment]:
    """BF16_Optimizer: the fragment addresses DeepSpeed links into every model parameter
    (``param._hp_mapping``, the ones its universal checkpoints use)."""
    fragments = []
    for index, lp in enumerate(wrapper.bf16_groups[group_index]):
        mapping = getattr(lp, "_hp_mapping", None)
        if mapping is not None:  # None: the tensor lies entirely in other ranks' partitions
            address = mapping.get_hp_fragment_address()
            fragments.append((address.start, address.numel, index, mapping.lp_fragment.reshape(-1)))
    return fragments


def _piece_tables_from_fragments(
    flats: Sequence[torch.Tensor],
    fragments: Sequence[list[_Fragment]],
    group_sizes: Sequence[int],
    process_group,
) -> _Binding:
    """Piece tables covering each flat partition; tensors are numbered group after group."""
    num_tensors = sum(group_sizes)  # slot num_tensors of every norm vector collects padding
    tables: dict[int, _Pieces] = {}
    first_index = 0
    for group_index, (flat, group_fragments) in enumerate(zip(flats, fragments)):
        lengths: list[int] = []
        owners: list[int] = []
        position = 0
        for start, numel, index, values in sorted(group_fragments, key=lambda f: f[0]):
            # The partition must hold this tensor's values where the layout says: a check of the layout.
            held = flat.detach()[start : start + numel]
            if start < position or held.numel() != numel or not torch.equal(held.to(values.dtype), values):
                raise RuntimeError(
                    f"bind_to_deepspeed: parameter {index} of group {group_index} is not where this DeepSpeed "
                    f"version's layout says in the optimizer's partition (elements {start}..{start + numel}); "
                    "call bind_to_deepspeed right after deepspeed.initialize, before any step"
                )
            if start > position:  # alignment padding between tensors
                lengths.append(start - position)
                owners.append(num_tensors)
            lengths.append(numel)
            owners.append(first_index + index)
            position = start + numel
        if position < flat.numel():  # padding at the end of the last partition
            lengths.append(flat.numel() - position)
            owners.append(num_tensors)
        first_index += group_sizes[group_index]
        tables[id(flat)] = _Pieces(
            flat,
            lengths,
            owners,
            torch.tensor(owners, dtype=torch.int64, device=flat.device),
        )
    return _Binding(pieces=tables, num_tensors=num_tensors, process_group=process_group)
