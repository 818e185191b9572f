"""An EAGLE-3 style draft head (``EagleHead``), its files (``save_head``/``load_head``) and its
proposer (``EagleProposer``), which ``spec_control.make_proposer`` builds for ``"method": "eagle3"``.

More in docs/modules.md (folio/core/executor/runtime/spec_eagle.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from folio.core.executor.runtime.spec_decode import DraftTree, Proposal

HEAD_FILE, CARD_FILE = "head.safetensors", "card.json"
FORMAT = "folio-eagle3-v1"
HEADS_DIR = Path(__file__).resolve().parents[3] / "heads"  # heads shipped with the package: folio/heads/<name>/
MAX_PENDING = 8192  # features kept for a request the proposer is not asked about (logprob requests)


@dataclass(frozen=True)
class HeadConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    draft_vocab_size: int
    rms_norm_eps: float
    taps: tuple[int, ...]  # the target layers whose residual outputs are read (low, middle)

    @staticmethod
    def for_target(spec, draft_vocab_size: int, intermediate_size: int | None = None) -> "HeadConfig":
        n = spec.num_layers
        low = min(2, n // 4)
        taps = (low, max(low + 1, n // 2)) if n > 1 else (0, 0)
        return HeadConfig(spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim,
                          intermediate_size or spec.intermediate_size, min(draft_vocab_size, spec.vocab_size),
                          spec.rms_norm_eps, taps)


def target_fingerprint(model) -> str:
    """Who the head was trained on: the target's shape and a sample of its weights (the embedding
    rows and final norm, which every quantization keeps as they are)."""
    spec = json.dumps(dataclasses.asdict(model.spec), sort_keys=True, default=str).encode()
    digest = hashlib.sha256(spec)
    digest.update(model.embed_tokens.weight[:256].detach().float().cpu().numpy().tobytes())
    digest.update(model.norm.weight.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()[:32]


def _rms(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x if weight is None else x * weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as the target applies it (rotate-half; cos/sin ``[..., head_dim]`` broadcast over heads)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class EagleHead(nn.Module):
    """The head's parameters and its layer; the target's embedding, LM head rows and RoPE tables
    are attached by ``attach`` (they are not part of the head's file)."""

    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.cfg = cfg
        h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.embed_norm = nn.Parameter(torch.ones(h))
        self.feature_norm = nn.Parameter(torch.ones(h))
        self.qkv_proj = nn.Linear(2 * h, q + 2 * kv, bias=False)
        self.o_proj = nn.Linear(q, h, bias=False)
        self.post_norm = nn.Parameter(torch.ones(h))
        self.gate_up_proj = nn.Linear(h, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)
        self.norm = nn.Parameter(torch.ones(h))
        self.register_buffer("draft_to_target", torch.arange(cfg.draft_vocab_size, dtype=torch.long))
        self.scale = cfg.head_dim ** -0.5
        self.target: dict[str, torch.Tensor | nn.Module] = {}

    def attach(self, target_model) -> None:
        """The target's embedding table, its LM head rows for the draft vocabulary and its RoPE tables."""
        lm = target_model.embed_tokens.weight if target_model.lm_head is None else target_model.lm_head.weight
        dtype = self.dtype
        self.target = {"embed": target_model.embed_tokens,
                       "lm": lm.detach().index_select(0, self.draft_to_target.to(lm.device)).to(dtype),
                       "cos": target_model.rope_cos.to(dtype), "sin": target_model.rope_sin.to(dtype)}

    # ------------------------------------------------------------------ pieces of the layer
    def fuse(self, features: torch.Tensor) -> torch.Tensor:  # [..., 3 hidden] -> [..., hidden]
        eps = self.cfg.rms_norm_eps
        return self.fc(torch.cat([_rms(f, eps) for f in features.chunk(3, dim=-1)], dim=-1))

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.target["embed"](token_ids).to(self.dtype)

    def project(self, g: torch.Tensor, emb: torch.Tensor, positions: torch.Tensor):
        """q ``[..., heads, hd]``, k and v ``[..., kv_heads, hd]`` of the inputs ``(g, emb)``."""
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        x = torch.cat([_rms(emb, eps, self.embed_norm), _rms(g, eps, self.feature_norm)], dim=-1)
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        cos, sin = self.target["cos"][positions].unsqueeze(-2), self.target["sin"][positions].unsqueeze(-2)
        q = _rotate(q.unflatten(-1, (cfg.num_heads, cfg.head_dim)), cos, sin)
        k = _rotate(k.unflatten(-1, (cfg.num_kv_heads, cfg.head_dim)), cos, sin)
        return q, k, v.unflatten(-1, (cfg.num_kv_heads, cfg.head_dim))

    def finish(self, g: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The layer's output ``h`` from its input feature and the attention ``[..., heads, hd]``."""
        h = g + self.o_proj(attn.flatten(-2))
        gate, up = self.gate_up_proj(_rms(h, self.cfg.rms_norm_eps, self.post_norm)).chunk(2, dim=-1)
        return h + self.down_proj(F.silu(gate) * up)

    def logits(self, h: torch.Tensor) -> torch.Tensor:  # [..., draft_vocab]
        x, lm = _rms(h, self.cfg.rms_norm_eps, self.norm), self.target["lm"]
        return lm(x) if isinstance(lm, nn.Module) else F.linear(x, lm)

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.dtype

    def pack_for_cpu(self) -> None:
        """Serving on the CPU: the layer's linear maps and the LM rows in folio's int8 kernels
        (per-channel int8 weights, the activations in two int8 passes). A draft token then reads
        about a quarter of the fp32 bytes (21 MB at SmolLM2's head); training keeps the fp32 head."""
        if isinstance(self.fc, Int8Linear):  # packed already (a head shared by proposers)
            return
        for name in ("fc", "qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            setattr(self, name, Int8Linear(getattr(self, name).weight.detach()))
        self.target["lm"] = Int8Linear(self.target["lm"])


    def unrolled(self, features: torch.Tensor, next_ids: torch.Tensor, depth: int) -> list[torch.Tensor]:
        """Logits of each drafting step over padded sequences: ``features`` ``[B, T, 3 hidden]``
        (the target's at positions ``0..T-1``), ``next_ids`` ``[B, T]`` (token ``i + 1``). Step ``d``
        at index ``i`` is the ``d+1``-th draft made when the target's features end at ``i - d``:
        its input is step ``d-1``'s output at ``i - 1``, it attends to step 0's keys up to ``i - d``
        and to each later step's key on its own chain, exactly as the proposer's cache is laid out.
        Row ``i`` of step ``d`` predicts token ``i + 2``; rows ``i < d`` have no such chain."""
        num = features.shape[1]
        positions = torch.arange(num, device=features.device)
        emb = self.embed(next_ids)
        g = self.fuse(features)
        group = self.cfg.num_heads // self.cfg.num_kv_heads
        keys, values, out = [], [], []
        idx = torch.arange(num, device=features.device)
        for d in range(depth):
            if d:
                g = F.pad(h, (0, 0, 1, 0))[:, :num]  # step d-1's output at i - 1
            q, k, v = self.project(g, emb, positions)  # [B, T, heads, hd]
            keys.append(k.repeat_interleave(group, dim=2).transpose(1, 2))  # [B, heads, T, hd]
            values.append(v.repeat_interleave(group, dim=2).transpose(1, 2))
            q = q.transpose(1, 2)
            s0 = (q @ keys[0].transpose(-1, -2)) * self.scale
            s0 = s0.masked_fill(~(idx[None, :] <= idx[:, None] - d), float("-inf"))
            diag_v, diag_s = [], []
            for j in range(1, d + 1):  # step j's key on this chain sits at index i - (d - j)
                shift = d - j
                kj = F.pad(keys[j], (0, 0, shift, 0))[:, :, :num]
                diag_v.append(F.pad(values[j], (0, 0, shift, 0))[:, :, :num])
                diag_s.append((q * kj).sum(-1, keepdim=True) * self.scale)
            p = torch.softmax(torch.cat([s0, *diag_s], dim=-1).float(), dim=-1).to(q.dtype)
            attn = torch.nan_to_num(p[..., :num]) @ values[0]
            for j, vj in enumerate(diag_v):
                attn = attn + p[..., num + j:num + j + 1] * vj
            h = self.finish(g, attn.transpose(1, 2))
            out.append(self.logits(h))
        return out


# ---------------------------------------------------------------------- files
class Int8Linear(nn.Module):
    """``x @ W.T`` for any leading shape, W per-channel int8 in the CPU kernels (``QuantLinear``)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        from folio.core.executor.quant.formats import quantize_int8
        from folio.core.executor.quant.linear import QuantLinear

        self.inner = QuantLinear(quantize_int8(weight.float()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.reshape(-1, x.shape[-1]).contiguous()).view(*x.shape[:-1], self.inner.out_features)

    # ------------------------------------------------------------------ training: an unrolled chain
def save_head(head: EagleHead, folder: str | Path, card: dict) -> None:
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: (v.detach().to(torch.float16) if v.is_floating_point() else v.detach()).contiguous()
               for k, v in head.state_dict().items()}
    save_file(tensors, str(folder / HEAD_FILE))
    card = {"format": FORMAT, "config": dataclasses.asdict(head.cfg), **card}
    (folder / CARD_FILE).write_text(json.dumps(card, indent=2) + "\n")


def read_card(folder: str | Path) -> dict:
    path = Path(folder) / CARD_FILE
    try:
        card = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{folder} is not an eagle3 draft head: cannot read {CARD_FILE} ({exc})") from None
    if card.get("format") != FORMAT:
        raise ValueError(f"{path}: format {card.get('format')!r} is not {FORMAT!r}")
    return card


def load_head(folder: str | Path, target_model, dtype: torch.dtype, device: torch.device) -> EagleHead:
    """The head in ``folder`` for ``target_model``; ValueError when it was trained on another model."""
    from safetensors.torch import load_file

    card = read_card(folder)
    mine = target_fingerprint(target_model)
    theirs = card.get("target", {}).get("fingerprint")
    if theirs != mine:
        raise ValueError(f"the draft head in {folder} was trained for another model "
                         f"({card.get('target', {}).get('model', '?')}, fingerprint {theirs}); the served model's "
                         f"fingerprint is {mine}: train one for it with folio train-draft")
    cfg = card["config"]
    head = EagleHead(HeadConfig(**{**cfg, "taps": tuple(cfg["taps"])}))
    head.load_state_dict({k: v.to(torch.float32) if v.is_floating_point() else v
                          for k, v in load_file(str(Path(folder) / HEAD_FILE)).items()})
    head = head.to(device=device, dtype=dtype).eval()
    head.attach(target_model)
    return head


def shipped_head(target_model) -> Path:
    """The packaged head whose target is this model; ValueError naming what to do when none is."""
    mine = target_fingerprint(target_model)
    for card_path in sorted(HEADS_DIR.glob(f"*/{CARD_FILE}")):
        try:
            if json.loads(card_path.read_text()).get("target", {}).get("fingerprint") == mine:
                return card_path.parent
        except ValueError:
            continue
    raise ValueError('no eagle3 draft head ships for the served model: give "model": a folder that '
                     "folio train-draft wrote for it")


# ---------------------------------------------------------------------- the proposer
@dataclass
class _HeadSeq:
    slot: int
    first: int = -1  # the first position in the head's cache (-1: none yet)
    end: int = 0  # positions first..end-1 are in the cache, built from the target's features
    pend_start: int = 0  # the target's features not fed to the head yet: positions pend_start..
    parts: list[torch.Tensor] = dataclasses.field(default_factory=list)  # their rows, per step ([m, 3 hidden])
    num_pend: int = 0

    def pending(self) -> torch.Tensor:
        """The pending rows as one tensor (joined once, when they are read or cut)."""
        if len(self.parts) > 1:
            self.parts = [torch.cat(self.parts)]
        return self.parts[0]

    def keep(self, num: int) -> None:
        """Only the first ``num`` pending rows stay."""
        if num < self.num_pend:
            self.parts, self.num_pend = ([self.pending()[:num]] if num > 0 else []), max(0, num)


class EagleProposer:
    def __init__(self, head: EagleHead, target_model, k: int, device: torch.device):
        from folio.core.executor.quant import cpu_gemm

        if device.type == "cpu" and head.dtype == torch.float32 and cpu_gemm.available():
            head.pack_for_cpu()
        self.head, self.k, self.device = head, k, device
        self.target = target_model
        target_model.taps = head.cfg.taps
        cfg = head.cfg
        self.k_cache = torch.zeros(0, 0, cfg.num_kv_heads, cfg.head_dim, dtype=head.dtype, device=device)
        self.v_cache = self.k_cache.clone()
        self.seqs: dict[str, _HeadSeq] = {}
        self.free_slots: list[int] = []
        self.max_len = target_model.spec.max_position_embeddings
        self.num_proposals = 0

    # ------------------------------------------------------------------ the target's hidden states
    def observe(self, req_ids: list[str], starts: np.ndarray, counts: np.ndarray, hidden: torch.Tensor) -> None:
        """The forward pass computed ``counts[i]`` positions from ``starts[i]`` for ``req_ids[i]``
        (in that order along ``hidden``'s rows); their features wait for the next proposal."""
        tapped = self.target.tapped
        if len(tapped) != 2 or tapped[0].shape[0] != hidden.shape[0]:
            raise RuntimeError("the target model did not return the hidden states the draft head reads")
        feats = torch.cat([tapped[0], tapped[1], hidden.float()], dim=-1).to(self.head.dtype)
        row = 0
        for req_id, start, count in zip(req_ids, starts.tolist(), counts.tolist()):
            part = feats[row:row + count]
            row += count
            seq = self.seqs.get(req_id)
            if seq is None:
                seq = self.seqs[req_id] = _HeadSeq(self._slot())
            if seq.num_pend and start == seq.pend_start + seq.num_pend:
                seq.parts.append(part)  # joined when read: a copy per step would grow with the sequence
                seq.num_pend += count
            else:
                seq.pend_start, seq.parts, seq.num_pend = start, [part], count
            if seq.num_pend > MAX_PENDING:
                cut = seq.num_pend - MAX_PENDING
                seq.pend_start, seq.parts, seq.num_pend = seq.pend_start + cut, [seq.pending()[cut:]], MAX_PENDING

    def accept_path(self, req_id: str, root: int, path: list[int]) -> None:
        """A tree draft was verified: the step computed the root at position ``root`` and the
        tree's nodes after it (breadth-first); of their features the root's and the accepted
        nodes' (``path``, positions in the chunk) stay, at positions ``root``, ``root + 1``, ..."""
        seq = self.seqs.get(req_id)
        if seq is None or not seq.num_pend or root < seq.pend_start:
            return
        rows, local = seq.pending(), root - seq.pend_start
        keep = torch.tensor([local + j for j in [0, *path]], device=rows.device)
        if int(keep[-1]) >= rows.shape[0]:
            return
        seq.parts = [torch.cat([rows[:local], rows.index_select(0, keep)])]
        seq.num_pend = local + len(path) + 1

    def rollback(self, req_id: str, num_valid: int) -> None:
        """Only tokens ``0..num_valid-1`` are the sequence's: features past them were drafts'."""
        seq = self.seqs.get(req_id)
        if seq is None:
            return
        seq.keep(num_valid - seq.pend_start)
        seq.end = min(seq.end, max(seq.first, num_valid - 1))

    def drop(self, req_id: str, token_ids: list[int] | None = None, adapter: int = 0) -> None:
        seq = self.seqs.pop(req_id, None)
        if seq is not None:
            self.free_slots.append(seq.slot)

    def stats(self) -> dict:
        return {"eagle_head_requests": len(self.seqs), "eagle_proposals": self.num_proposals}

    def _slot(self) -> int:
        if self.free_slots:
            return self.free_slots.pop()
        return len(self.seqs) + len(self.free_slots)

    def _fit(self, num_slots: int, length: int) -> None:
        slots, cap = self.k_cache.shape[:2]
        if num_slots <= slots and length <= cap:
            return
        shape = (max(num_slots, 2 * slots, 4), max(length, min(2 * cap, self.max_len), 64), *self.k_cache.shape[2:])
        for name in ("k_cache", "v_cache"):
            old, new = getattr(self, name), torch.zeros(shape, dtype=self.k_cache.dtype, device=self.device)
            new[:slots, :cap] = old
            setattr(self, name, new)

    # ------------------------------------------------------------------ proposing
    @torch.inference_mode()
    def propose(self, states) -> list[Proposal]:
        out = [Proposal([]) for _ in states]
        live = self._live(states, self.k)
        if not live:
            return out
        self._fit(max(s.slot for _, s, _, _ in live) + 1, max(last for *_, last in live) + self.k + 1)
        h = self._catch_up(live)
        drafts = [[] for _ in live]
        for step in range(self.k):
            ids = self.head.draft_to_target[self.head.logits(h).argmax(dim=-1)]
            for j, t in enumerate(ids.tolist()):
                drafts[j].append(t)
            if step + 1 < self.k:
                h = self._draft_step(live, h, ids, step + 1)
        for (i, *_), d in zip(live, drafts):
            out[i] = Proposal(d)
        self.num_proposals += len(live)
        return out

    @torch.inference_mode()
    def propose_tree(self, states, tree: DraftTree) -> list[Proposal]:
        """A tree of drafts for each state, of ``tree``'s shape: a position's children are the
        head's top tokens there, in rank order. Each node's input is its parent's output and its
        own token's embedding at its depth's position; it attends to the head's cache of the
        sequence and to its own path's keys, which stay out of the cache (its siblings share
        the position)."""
        out = [Proposal([]) for _ in states]
        depth = tree.depths()
        live = [entry for entry in self._live(states, int(depth.max()))]
        if not live:
            return out
        self._fit(max(s.slot for _, s, _, _ in live) + 1, max(last for *_, last in live) + 1)
        h_root = self._catch_up(live)
        children = tree.children()
        n = len(tree.parents)
        tokens = [[0] * n for _ in live]
        hs: dict[int, torch.Tensor] = {0: h_root}  # position -> [len(live), hidden] output there
        kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # node position -> its k, v [len(live), kv_heads, hd]
        head = self.head
        for level in range(int(depth.max())):
            # the positions of this depth with children: their outputs name the children
            expand = [c for c in range(n + 1) if depth[c] == level and children[c]]
            for c in expand:
                if c not in hs:
                    hs[c] = self._tree_node(live, tree, c, tokens, hs, kv)
                top = head.logits(hs[c]).topk(len(children[c]), dim=-1).indices  # [len(live), m]
                ids = head.draft_to_target[top].tolist()
                for j, row in enumerate(ids):
                    for rank, child in enumerate(children[c]):
                        tokens[j][child - 1] = row[rank]
        for (i, *_), t in zip(live, tokens):
            out[i] = Proposal(t, tree=tree)
        self.num_proposals += len(live)
        return out

    def _tree_node(self, live, tree: DraftTree, c: int, tokens, hs, kv) -> torch.Tensor:
        """The head's output at tree position ``c`` (its parent's computed), for every live request."""
        head = self.head
        parent = tree.parents[c - 1] + 1
        path = [c]
        while tree.parents[path[-1] - 1] >= 0:
            path.append(tree.parents[path[-1] - 1] + 1)
        path.reverse()  # the nodes from depth 1 to c
        pos = torch.tensor([last + len(path) for *_, last in live], device=self.device)
        ids = torch.tensor([t[c - 1] for t in tokens], device=self.device)
        q, k, v = head.project(hs[parent], head.embed(ids), pos)
        kv[c] = (k, v)
        slots = torch.tensor([s.slot for _, s, _, _ in live], device=self.device)
        length = max(last for *_, last in live) + 1
        keys = torch.cat([self.k_cache[slots, :length], torch.stack([kv[a][0] for a in path], dim=1)], dim=1)
        values = torch.cat([self.v_cache[slots, :length], torch.stack([kv[a][1] for a in path], dim=1)], dim=1)
        first = torch.tensor([s.first for _, s, _, _ in live], device=self.device)
        lasts = torch.tensor([last for *_, last in live], device=self.device)
        j = torch.arange(length, device=self.device)
        mask = torch.cat([(j[None, :] >= first[:, None]) & (j[None, :] <= lasts[:, None]),
                          torch.ones(len(live), len(path), dtype=torch.bool, device=self.device)], dim=1)
        out = F.scaled_dot_product_attention(q.unsqueeze(2), keys.permute(0, 2, 1, 3), values.permute(0, 2, 1, 3),
                                             attn_mask=mask[:, None, None, :], scale=head.scale, enable_gqa=True)
        return head.finish(hs[parent], out.squeeze(2))

    def _live(self, states, depth: int) -> list:
        """(index, seq, tokens, position of the first draft's input) of each state the head has
        the target's features for, up to its last token, with room for ``depth`` drafts."""
        live = []
        for i, state in enumerate(states):
            seq = self.seqs.get(state.req_id)
            tokens = state.token_ids
            last = len(tokens) - 2  # the last position whose next token is known
            if seq is None or last < 0 or last + depth > self.max_len - 1:
                continue
            if not seq.num_pend:
                continue
            if seq.first < 0 or seq.pend_start != seq.end:  # nothing cached yet, or a gap: start over there
                seq.first = seq.end = seq.pend_start
            if seq.end > last or seq.pend_start + seq.num_pend < last + 1:
                continue  # the head has not the target's features up to here
            live.append((i, seq, tokens, last))
        return live

    def _catch_up(self, live) -> torch.Tensor:
        """Feed the head the pending positions of each live request (their keys and values into
        its cache); the output ``h`` at each one's last position ``[len(live), hidden]``."""
        head, outs = self.head, []
        for _, seq, tokens, last in live:
            start = seq.end - seq.pend_start
            feats = seq.pending()[start:start + last + 1 - seq.end]
            pos = torch.arange(seq.end, last + 1, device=self.device)
            ids = torch.as_tensor(tokens[seq.end + 1:last + 2], device=self.device)
            g = head.fuse(feats)
            q, k, v = head.project(g, head.embed(ids), pos)
            self.k_cache[seq.slot, seq.end:last + 1] = k
            self.v_cache[seq.slot, seq.end:last + 1] = v
            # only the last position's output drafts; the others were needed for their keys and values
            outs.append(head.finish(g[-1:], self._attend(q[-1:], seq.slot, seq.first, pos[-1:]))[0])
            seq.end = last + 1
            seq.pend_start, seq.parts, seq.num_pend = seq.end, [], 0
        return torch.stack(outs)

    def _attend(self, q: torch.Tensor, slot: int, first: int, pos: torch.Tensor) -> torch.Tensor:
        """Causal attention of queries at ``pos`` (ascending) over the slot's cache from ``first``."""
        end = int(pos[-1]) + 1
        k = self.k_cache[slot, first:end].transpose(0, 1)  # [kv_heads, L, hd]: GQA in the attention call
        v = self.v_cache[slot, first:end].transpose(0, 1)
        keys = torch.arange(first, end, device=self.device)
        mask = keys[None, :] <= pos[:, None]  # [n, L]
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, scale=self.head.scale,
                                             enable_gqa=True)
        return out.transpose(0, 1)  # [n, heads, hd]

    def _draft_step(self, live, h: torch.Tensor, ids: torch.Tensor, step: int) -> torch.Tensor:
        """The next link of every chain: input ``(h, embedding of the draft)`` at position
        ``last + step``, its key written past the cache's end (overwritten when real positions come)."""
        head = self.head
        pos = torch.tensor([last + step for *_, last in live], device=self.device)
        slots = torch.tensor([s.slot for _, s, _, _ in live], device=self.device)
        q, k, v = head.project(h, head.embed(ids), pos)  # q [B, heads, hd]
        self.k_cache[slots, pos] = k
        self.v_cache[slots, pos] = v
        length = int(pos.max()) + 1
        keys = self.k_cache[slots, :length].permute(0, 2, 1, 3)  # [B, kv_heads, L, hd]
        values = self.v_cache[slots, :length].permute(0, 2, 1, 3)
        first = torch.tensor([s.first for _, s, _, _ in live], device=self.device)
        j = torch.arange(length, device=self.device)
        mask = (j[None, :] >= first[:, None]) & (j[None, :] <= pos[:, None])  # [B, L]
        out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=mask[:, None, None, :],
                                             scale=head.scale, enable_gqa=True)  # [B, heads, 1, hd]
        return head.finish(h, out.squeeze(2))
