"""Activation-aware weight quantization (AWQ, arXiv 2306.00978) of our Llama-family model, on the CPU.

More in docs/modules.md (folio/cli/awq.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from folio.core.executor.quant.formats import Int4Weight, check_group_size, quantize_int4

NUM_ALPHAS = 20
CLIP_RATIOS = [1.0 - 0.025 * i for i in range(21)]  # 1.0 down to 0.5


def _output_error(x: torch.Tensor, w: torch.Tensor, wq: torch.Tensor) -> float:
    # x: [T, K]; w, wq: [N, K]
    return (x @ (w - wq).t()).pow(2).mean().item()


def search_scale(x: torch.Tensor, w: torch.Tensor, group_size: int) -> torch.Tensor:
    """The per-input-channel scale ``s`` ([K]) minimising ``|x W^T - x (Q(W s) / s)^T|``."""
    mean_abs = x.abs().mean(0).clamp(min=1e-4)
    best, best_err = torch.ones_like(mean_abs), float("inf")
    for i in range(NUM_ALPHAS):
        s = mean_abs.pow(i / NUM_ALPHAS)
        s = s / (s.max() * s.min()).sqrt()
        wq = quantize_int4(w * s, group_size).dequantize() / s
        err = _output_error(x, w, wq)
        if err < best_err:
            best, best_err = s, err
    return best


def search_clip(x: torch.Tensor, w: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per (output channel, group) clip ratios ``[N, K/g]`` minimising each group's output error."""
    n, k = w.shape
    groups = k // group_size
    xg = x.reshape(x.shape[0], groups, group_size)  # [T, G, g]
    best_err = torch.full((n, groups), float("inf"))
    best = torch.ones(n, groups)
    for r in CLIP_RATIOS:
        clip = torch.full((n, groups), r)
        diff = (w - quantize_int4(w, group_size, clip).dequantize()).reshape(n, groups, group_size)
        err = torch.einsum("tgk,ngk->tng", xg, diff).pow(2).mean(0)  # [N, G]
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better, clip, best)
    return best


def run_calibration(model, seqs: list[list[int]], sink: Callable[[str, torch.Tensor], None]) -> None:
    """Forward ``seqs`` through ``model`` (one prefill each), handing every ``nn.Linear``'s input
    rows (fp32) to ``sink(module name, rows)`` through forward pre-hooks."""
    from folio.core.executor.kernels.attention import AttentionMetadata, TorchAttentionBackend

    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            hooks.append(module.register_forward_pre_hook(
                lambda mod, args, name=name: sink(name, args[0].detach().float())))
    spec, bs = model.spec, 16
    try:
        with torch.inference_mode():
            for seq in seqs:
                nb = (len(seq) + bs - 1) // bs
                shape = (nb, bs, spec.num_kv_heads, spec.head_dim)
                kv = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(spec.num_layers)]
                meta = AttentionMetadata.build([len(seq)], [len(seq)], [list(range(nb))], None, bs)
                model(torch.tensor(seq), meta.positions, kv, meta, TorchAttentionBackend())
    finally:
        for h in hooks:
            h.remove()


def _capture_inputs(model, seqs: list[list[int]]) -> dict[str, list[torch.Tensor]]:
    """Every projection's input rows over the calibration sequences."""
    captured: dict[str, list[torch.Tensor]] = {}
    run_calibration(model, seqs, lambda name, x: captured.setdefault(name, []).append(x))
    return captured


def awq_quantize(model, seqs: list[list[int]], group_size: int, search: bool = True,
                 progress: Callable[[], None] | None = None) -> tuple[dict[str, Int4Weight], dict[str, torch.Tensor]]:
    """(HF linear name -> ``Int4Weight``, HF name -> changed dense weight) for ``model`` (ours,
    dense fp32, not packed). ``search=False`` is plain round to nearest."""
    spec = model.spec
    for w in (spec.hidden_size, spec.intermediate_size, spec.num_heads * spec.head_dim):
        check_group_size((0, w), group_size, "a projection")
    inputs = _capture_inputs(model, seqs) if search else {}
    quant: dict[str, Int4Weight] = {}
    dense: dict[str, torch.Tensor] = {}
    q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        pre, hf = f"layers.{i}.", f"model.layers.{i}."
        x = {n: torch.cat(inputs[pre + n]) for n in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                                                     "mlp.down_proj")} if search else {}
        qkv_w, gate_up_w = attn.qkv_proj.weight.float(), mlp.gate_up_proj.weight.float()
        down_w, o_w = mlp.down_proj.weight.float(), attn.o_proj.weight.float()
        if search:
            s_qkv = search_scale(x["self_attn.qkv_proj"], qkv_w, group_size)
            s_gu = search_scale(x["mlp.gate_up_proj"], gate_up_w, group_size)
            s_down = search_scale(x["mlp.down_proj"], down_w, group_size)
            qkv_w, gate_up_w, down_w = qkv_w * s_qkv, gate_up_w * s_gu, down_w * s_down
            gate_up_w[spec.intermediate_size:] /= s_down.unsqueeze(1)  # up rows carry 1 / s_down
            dense[hf + "input_layernorm.weight"] = layer.input_layernorm.weight.float() / s_qkv
            dense[hf + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight.float() / s_gu
            x_gu = x["mlp.gate_up_proj"] / s_gu
            clip_gu = search_clip(x_gu, gate_up_w, group_size)
            clip_down = search_clip(x["mlp.down_proj"] / s_down, down_w, group_size)
            clip_o = search_clip(x["self_attn.o_proj"], o_w, group_size)
        else:
            clip_gu = clip_down = clip_o = None
        qkv = quantize_int4(qkv_w, group_size)
        gu = quantize_int4(gate_up_w, group_size, clip_gu)
        split = lambda w, sizes: [Int4Weight(q, s, z, group_size) for q, s, z in  # noqa: E731
                                  zip(w.q.split(sizes), w.scale.split(sizes), w.zero.split(sizes))]
        for name, part in zip("qkv", split(qkv, [q_size, kv_size, kv_size])):
            quant[f"{hf}self_attn.{name}_proj.weight"] = part
        gate, up = split(gu, [spec.intermediate_size, spec.intermediate_size])
        quant[hf + "mlp.gate_proj.weight"], quant[hf + "mlp.up_proj.weight"] = gate, up
        quant[hf + "self_attn.o_proj.weight"] = quantize_int4(o_w, group_size, clip_o)
        quant[hf + "mlp.down_proj.weight"] = quantize_int4(down_w, group_size, clip_down)
        for n in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            inputs.pop(pre + n, None)
        if progress is not None:
            progress()
    return quant, dense
