"""LAMB / LANS: per-tensor trust ratios, alone and under DeepSpeed ZeRO-1/2 and BF16_Optimizer partitions."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from modeling import BertConfig, BertForPreTraining
from training.lamb import Lamb, Lans, build_param_groups


# ------------------------------------------------------------------ straightforward references, one tensor at a time
def reference_lamb_step(params, grads, states, groups_wd, lr, betas, eps, adapt_no_decay=False):
    """Textbook LAMB with apex's BERT conventions; `states` holds (m, v, t) per tensor."""
    beta1, beta2 = betas
    for i, (w, g, wd) in enumerate(zip(params, grads, groups_wd)):
        m, v, t = states[i]
        t += 1
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        u = (m / (1 - beta1**t)) / ((v / (1 - beta2**t)).sqrt() + eps) + wd * w
        ratio = 1.0
        if wd != 0 or adapt_no_decay:
            wn, un = w.norm().item(), u.norm().item()
            ratio = wn / un if wn > 0 and un > 0 else 1.0
        params[i] = w - lr * ratio * u
        states[i] = (m, v, t)


def reference_lans_step(params, grads, states, groups_wd, lr, betas, eps):
    """LANS as written in Zheng et al. 2020 / apex's reference test, one tensor at a time."""
    beta1, beta2 = betas
    for i, (w, g, wd) in enumerate(zip(params, grads, groups_wd)):
        m, v, t = states[i]
        t += 1
        g = g / (g.norm() + eps)
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        denom = (v / (1 - beta2**t)).sqrt() + eps
        r_m = (m / (1 - beta1**t)) / denom + wd * w
        r_c = g / denom + wd * w
        tm = tc = 1.0
        if wd != 0:
            wn = w.norm().item()
            tm = wn / r_m.norm().item() if wn > 0 and r_m.norm() > 0 else 1.0
            tc = wn / r_c.norm().item() if wn > 0 and r_c.norm() > 0 else 1.0
        params[i] = w - lr * (beta1 * tm * r_m + (1 - beta1) * tc * r_c)
        states[i] = (m, v, t)


class Straddler(nn.Module):
    """Linear and LayerNorm layers of odd sizes, so ZeRO partition boundaries cut through tensors."""

    def __init__(self, width: int = 37, depth: int = 3):
        super().__init__()
        self.inp = nn.Linear(11, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width), nn.GELU()) for _ in range(depth)
        )
        self.out = nn.Linear(width, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return nn.functional.cross_entropy(self.out(h), y)


def batches(count: int, rank: int = 0, world: int = 1, batch: int = 8, seed: int = 1234):
    """Deterministic batches; rank r of `world` gets rows [r*batch, (r+1)*batch) of each global batch."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        x = torch.randn(batch * world, 11, generator=gen)
        y = torch.randint(0, 5, (batch * world,), generator=gen)
        out.append((x[rank * batch : (rank + 1) * batch], y[rank * batch : (rank + 1) * batch]))
    return out


def make_model(seed: int = 0) -> Straddler:
    torch.manual_seed(seed)
    model = Straddler()
    # LayerNorm starts at (1, 0); perturb it so no-decay tensors have non-trivial values too.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def run_reference(kind: str, steps: int, world: int = 1, lr: float = 2e-2, wd: float = 0.01):
    """Single process, unpartitioned: the mean gradient over `world` ranks' micro-batches, reference rule."""
    model = make_model()
    groups = build_param_groups(model, wd)
    params = [p for g in groups for p in g["params"]]
    wds = [g["weight_decay"] for g in groups for _ in g["params"]]
    values = [p.detach().clone() for p in params]
    states = [(torch.zeros_like(v), torch.zeros_like(v), 0) for v in values]
    per_rank = [batches(steps, r, world) for r in range(world)]
    for step in range(steps):
        with torch.no_grad():
            for p, v in zip(params, values):
                p.copy_(v)
        model.zero_grad()
        for r in range(world):
            x, y = per_rank[r][step]
            (model(x, y) / world).backward()
        grads = [p.grad.detach().clone() for p in params]
        if kind == "lamb":
            reference_lamb_step(values, grads, states, wds, lr, (0.9, 0.999), 1e-6)
        else:
            reference_lans_step(values, grads, states, wds, lr, (0.9, 0.999), 1e-6)
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: v for p, v in zip(params, values)}


def run_optimizer(cls, steps: int, lr: float = 2e-2, wd: float = 0.01):
    model = make_model()
    opt = cls(build_param_groups(model, wd), lr=lr, betas=(0.9, 0.999), eps=1e-6)
    for x, y in batches(steps):
        opt.zero_grad()
        model(x, y).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


# ------------------------------------------------------------------ single process


def test_param_groups_split_bias_and_layernorm_on_bert():
    config = BertConfig.from_json_file("configs/models/bert-tiny.json")
    model = BertForPreTraining(config)
    groups = build_param_groups(model, weight_decay=0.01)
    names = {id(p): n for n, p in model.named_parameters()}
    decay = [names[id(p)] for p in groups[0]["params"]]
    no_decay = [names[id(p)] for p in groups[1]["params"]]
    assert [g["weight_decay"] for g in groups] == [0.01, 0.0]
    # every parameter exactly once (the tied word embedding / decoder weight is one parameter)
    assert sorted(decay + no_decay) == sorted(names.values())
    assert all(n.endswith("bias") or ".LayerNorm." in n for n in no_decay)
    assert all(n.endswith("weight") and "LayerNorm" not in n for n in decay)
    assert "cls.predictions.bias" in no_decay and "bert.embeddings.word_embeddings.weight" in decay
    assert len(no_decay) == 28 and len(decay) == 18
    # optimizer-agnostic: AdamW takes the same groups
    torch.optim.AdamW(groups, lr=1e-3)
    with pytest.raises(ValueError, match="weight_decay"):
        build_param_groups(model, weight_decay=-1.0)


@pytest.mark.parametrize("kind, cls", [("lamb", Lamb), ("lans", Lans)])
def test_matches_reference_unpartitioned(kind, cls):
    steps = 6
    ours = run_optimizer(cls, steps)
    ref = run_reference(kind, steps)
    assert max_abs_diff(ours, ref) < 1e-6
    # and it moved: the check is not vacuous
    start = {n: p.detach() for n, p in make_model().named_parameters()}
    assert max_abs_diff(ours, start) > 1e-3


def test_trust_ratio_only_where_weights_decay():
    """Bias/LayerNorm tensors take the plain Adam step (ratio 1); weights take ||w||/||u|| of their own tensor."""
    model = make_model()
    lr = 1e-2
    opt = Lamb(build_param_groups(model, 0.01), lr=lr, eps=1e-6)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = batches(1)[0]
    model(x, y).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    layer_norm = {
        f"{m}.{n}"
        for m, mod in model.named_modules()
        if isinstance(mod, nn.LayerNorm)
        for n, _ in mod.named_parameters()
    }
    assert len(layer_norm) == 6
    for name, p in model.named_parameters():
        g = grads[name]
        adam = g / (g.abs() + 1e-6)  # first step: m_hat = g, sqrt(v_hat) = |g|
        if name.endswith("bias") or name in layer_norm:
            expected = before[name] - lr * adam
        else:
            u = adam + 0.01 * before[name]
            expected = before[name] - lr * before[name].norm() / u.norm() * u
        torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-6, msg=name)


def test_replaced_parameters_without_binding_are_refused():
    model = make_model()
    opt = Lamb(build_param_groups(model, 0.01))
    flat = torch.cat([p.detach().reshape(-1) for p in opt.param_groups[0]["params"]]).requires_grad_()
    flat.grad = torch.ones_like(flat)
    opt.param_groups[0]["params"] = [flat]  # what ZeRO does to a client optimizer
    with pytest.raises(RuntimeError, match="bind_to_deepspeed"):
        opt.step()


def test_rejects_bad_hyperparameters():
    params = [nn.Parameter(torch.ones(3))]
    with pytest.raises(ValueError, match="betas"):
        Lamb(params, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="eps"):
        Lans(params, eps=0.0)
    assert math.isclose(Lamb(params).defaults["eps"], 1e-6)
