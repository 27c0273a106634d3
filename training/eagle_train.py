"""``specserve train-eagle``: trains an EAGLE-3 head for a target on the CPU.

Data: self-distillation (``training.eagle_data``). The target answers ``prompts`` chat
prompts, by default a random half of the 2,506 of ``training.eagle_prompts`` (explanations,
writing, role play, reasoning, extraction and code), greedily, ``answer_tokens`` each, once
(kept for resumed runs), and gives at every token, while it writes, the three
features the head reads and its next-token distribution; training restricts that to
the draft vocabulary (the ``draft_vocab`` most frequent tokens of the chats) and
renormalizes. The head so
learns the text it will draft: the target's own. The chats, end to end, are cut into
sequences of ``seq_len`` tokens (``Windows``). Every twentieth chat is held out: the
head's top-1 agreement with the target on those is logged every ``eval_every`` steps,
the measure of how it drafts text it has not seen (with a few hundred thousand
tokens, agreement on the training text runs far ahead of it).

Loss: EAGLE-3's training-time test over ``ttt_steps`` steps. Step 0 is the head over
the target's pairs ``(f_b, t_{b+1})``, predicting ``t_{b+2}``; step j feeds the head's
own output of step j - 1 with token ``t_{b+1+j}`` at position ``b + j``, attending to the
step-0 keys up to b and to its own chain's keys of steps 1 .. j, as drafting does.
Each step's soft cross-entropy against the target's distribution, weighted 0.8^j.
The learning rate warms up over ``warmup`` steps, then follows a cosine from ``lr`` down
to a tenth of it over the run's time budget (a resumed run starts the cosine afresh).

Steps over chats: within a fixed time budget, more training steps on fewer chats beat
fewer steps on more chats (answering a chat costs about as much as a training step), so
the command answers a random half of the prompts by default.

Steps over depth: the training-time test runs 2 steps, not EAGLE-3's 3 or more. The
policy on a CPU drafts one or two tokens a round, and a third step makes each training
step a third slower: that time buys more steps at the depths that are drafted.

Every ``save_every`` steps the head is written in the published EAGLE-3 format (the
loader reads it), with ``train/state.safetensors`` (weights, Adam moments, step) and
``train_log.json``; a rerun with the same ``--out`` resumes from there. The loss curve
is ``loss.png``. No pickle is written or read.
"""

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from training.eagle_data import Distilled, distill
from drafters.eagle_head import EagleHead, save_eagle_head
from training.eagle_prompts import distillation_prompts


@dataclass(frozen=True)
class TrainConfig:
    out: str
    model: str | None = None  # the target; None: the default model
    minutes: float = 28.0  # wall-time budget of this run (resumed runs get it afresh)
    max_steps: int = 20000  # the time budget ends a run long before
    batch_size: int = 4
    seq_len: int = 256
    draft_vocab: int = 8192
    answer_tokens: int = 192  # the target's answer per distillation prompt, at most
    prompts: int = 1253  # distillation prompts: a seeded random half of the 2,506 (``random_subset``); see above
    ttt_steps: int = 2  # see "Steps over depth" above
    lr: float = 1e-3
    warmup: int = 10
    save_every: int = 100  # a save costs one or two steps' time
    eval_every: int = 100
    eval_sequences: int = 32  # held-out sequences the agreement is measured on
    seed: int = 0
    bf16: bool = True  # matmuls in bfloat16 (autocast) where the CPU has them natively; weights, Adam float32


def distilled(target, path, cfg: TrainConfig, out: Path) -> Distilled:
    """The chats of ``training.eagle_data`` (the distillation prompts in the chat template and
    the target's answers, with features and labels), made once and kept in
    ``out/train/distilled.safetensors`` for resumed runs."""
    from tqdm import tqdm

    from engine.llm_engine import eos_token_ids_of
    from engine.worker.loader import load_tokenizer

    file = out / "train" / "distilled.safetensors"
    if file.is_file():
        return Distilled.load(file)
    tok = load_tokenizer(path)
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
               for p in random_subset(distillation_prompts(), cfg.prompts, cfg.seed)]
    prompts = [p["input_ids"] if hasattr(p, "keys") else p for p in prompts]  # transformers 5 returns an encoding
    bar = tqdm(total=len(prompts), desc="distill (the target answers)", unit="prompt")
    data = distill(target, prompts, cfg.answer_tokens, feature_layers(target), eos_token_ids_of(target.config, tok),
                   progress=bar.update)
    bar.close()
    file.parent.mkdir(parents=True, exist_ok=True)
    data.save(file)
    return data


def random_subset(items: list, n: int, seed: int = 0) -> list:
    """``n`` of ``items`` drawn at random (seeded), in their order; all of them if ``n`` is
    as many or more. Not a stride: the prompts are products (subject x form, task x
    language), and every other one of those would drop half the forms or languages."""
    if n >= len(items):
        return list(items)
    keep = torch.randperm(len(items), generator=torch.Generator().manual_seed(seed))[:n].sort().values
    return [items[i] for i in keep.tolist()]


class Windows:
    """Training sequences: windows of ``seq_len`` tokens over some chats laid end to end,
    with their features and the target's distributions over the draft vocabulary."""

    def __init__(self, data: Distilled, chats: list[int], seq_len: int, draft_ids: torch.Tensor, vocab: int):
        pos = data.positions(chats)
        n = len(pos) // seq_len
        self.data, self.index = data, pos[: n * seq_len].view(n, seq_len)  # [n, seq_len] token positions
        self.to_draft = torch.full((vocab,), -1, dtype=torch.long)  # target id -> draft id, -1: none
        self.to_draft[draft_ids] = torch.arange(len(draft_ids))
        self.num_draft = len(draft_ids)

    def __len__(self) -> int:
        return len(self.index)

    def tokens(self, idx: list[int]) -> torch.Tensor:
        """[B, seq_len] token ids of sequences ``idx``."""
        return self.data.tokens[self.index[idx]]

    def batch(self, idx: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> tokens [B, N], features [B, N, F] and the target's next-token distributions
        over the draft vocabulary [B, N, D] (its kept likeliest tokens that are in it,
        renormalized) of sequences ``idx``."""
        pos = self.index[idx]
        ids = self.to_draft[self.data.top_ids[pos].long()]  # [B, N, TOP]; -1: not in the draft vocabulary
        p = self.data.top_p[pos].float() * (ids >= 0)
        p = p / p.sum(-1, keepdim=True).clamp_min(1e-12)
        dense = torch.zeros(*pos.shape, self.num_draft).scatter_add_(2, ids.clamp_min(0), p)
        return self.data.tokens[pos], self.data.feats[pos].float(), dense


def draft_vocabulary(tokens: torch.Tensor, vocab: int, size: int) -> torch.Tensor:
    """The ``size`` most frequent of ``tokens`` (ties: lower ids first), sorted [size]."""
    counts = torch.bincount(tokens, minlength=vocab).double()
    score = counts - torch.arange(vocab, dtype=torch.float64) / vocab  # ties: low ids, the frequent merges
    return score.topk(min(size, vocab)).indices.sort().values


def feature_layers(target) -> tuple[int, int, int]:
    """EAGLE-3's low, middle and high layers of the target (the loader's default)."""
    L = target.config.num_hidden_layers
    return 2, L // 2, L - 3


def new_head(target, draft_ids: torch.Tensor) -> EagleHead:
    """An EAGLE-3 head shaped like one target layer; its norm and lm_head start as the
    target's (restricted to the draft vocabulary), its fc as "take the high layer", its
    decoder layer as the target's last one reading that feature (the embedding's half of
    q, k and v small and random): that start agrees with the target more often, after
    the same steps, than a randomly initialized layer."""
    from transformers import LlamaConfig

    cfg = target.config
    L = cfg.num_hidden_layers
    head_cfg = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=1, num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"],
        draft_vocab_size=len(draft_ids), tie_word_embeddings=False,
    )
    head = EagleHead(head_cfg, "eagle3", target, cfg.max_position_embeddings, feature_layers(target))
    H = cfg.hidden_size
    with torch.no_grad():
        head.draft_to_target.copy_(draft_ids)
        head.lm_head.weight.copy_(float_weight(target.lm_head)[draft_ids])
        head.norm.weight.copy_(target.norm.weight)
        head.fc.weight.zero_()
        head.fc.weight[:, 2 * H :] = torch.eye(H)
        _start_as_layer(head, target.layers[L - 1])
    for p in head.parameters():
        p.requires_grad_(True)
    return head


def float_weight(linear) -> torch.Tensor:
    """A target layer's weight [out, in] in float32: a weight kept in GGUF blocks (on meta; a
    tied head's are the embedding's) dequantized from them."""
    if not linear.weight.is_meta:
        return linear.weight
    return linear.quant_rows.pack(linear.weight.shape[0]).dequantize()


def _start_as_layer(head: EagleHead, layer) -> None:
    """The head's decoder layer as ``layer`` where its hidden input stands for the layer's
    input; the embedding's half of q, k and v scaled down to a tenth of its random start."""
    H = head.config.hidden_size
    qkv = layer.self_attn.qkv_proj
    for proj, w in zip((head.q_proj, head.k_proj, head.v_proj), float_weight(qkv).split(qkv.out_sizes)):
        proj.weight[:, :H] *= 0.1
        proj.weight[:, H:] = w
    head.hidden_norm.weight.copy_(layer.input_layernorm.weight)
    head.o_proj.weight.copy_(float_weight(layer.self_attn.o_proj))
    gate_up = layer.mlp.gate_up_proj
    gate, up = float_weight(gate_up).split(gate_up.out_sizes)
    head.gate_proj.weight.copy_(gate)
    head.up_proj.weight.copy_(up)
    head.down_proj.weight.copy_(float_weight(layer.mlp.down_proj))
    head.post_attention_layernorm.weight.copy_(layer.post_attention_layernorm.weight)


def ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """q [B, n, Hq, D]; keys/values of steps 0 .. j, step i [B, N - 1 - i, KVH, D] -> [B, n, Hq * D].

    Query b attends to step-0 keys 0 .. b and to key b of each later step (its own chain)."""
    B, n, Hq, D = q.shape
    rep = Hq // keys[0].shape[2]
    k0, v0 = (t.repeat_interleave(rep, dim=2).transpose(1, 2) for t in (keys[0], values[0]))  # [B, Hq, N-1, D]
    qt = q.transpose(1, 2)  # [B, Hq, n, D]
    causal = torch.arange(k0.shape[2])[None, :] <= torch.arange(n)[:, None]  # [n, N-1]
    scores = [(qt @ k0.transpose(-1, -2)).masked_fill(~causal, float("-inf"))]
    own = [(k[:, :n].repeat_interleave(rep, dim=2).transpose(1, 2), v[:, :n].repeat_interleave(rep, dim=2).transpose(1, 2))
           for k, v in zip(keys[1:], values[1:])]
    scores += [(qt * k).sum(-1, keepdim=True) for k, _ in own]  # [B, Hq, n, 1] each
    probs = torch.softmax(torch.cat(scores, dim=-1) / math.sqrt(D), dim=-1)
    out = probs[..., : k0.shape[2]] @ v0
    for i, (_, v) in enumerate(own):
        out = out + probs[..., k0.shape[2] + i : k0.shape[2] + i + 1] * v
    return out.transpose(1, 2).reshape(B, n, Hq * D)


def ttt_loss(head: EagleHead, feats, tokens, target_p, steps: int):
    """feats [B, N, 3H], tokens [B, N], target_p [B, N, D] -> (loss, top-1 agreement per step)."""
    B, N = tokens.shape
    hidden = head.fc(feats[:, :-1])  # [B, N-1, H]: pairs b = 0 .. N-2
    keys, values, total, accs = [], [], 0.0, []
    for j in range(steps):
        n = N - 1 - j
        ids = tokens[:, 1 + j : 1 + j + n]
        residual, x = head.layer_inputs(ids.reshape(-1), hidden[:, :n].reshape(B * n, -1))
        q, k, v = head.qkv(x, (torch.arange(n) + j).repeat(B))
        keys.append(k.view(B, n, *k.shape[1:]))
        values.append(v.view(B, n, *v.shape[1:]))
        attn = ttt_attention(q.view(B, n, *q.shape[1:]), keys, values)
        out = head.finish(residual, attn.reshape(B * n, -1)).view(B, n, -1)
        logp = F.log_softmax(head.lm_head(head.norm(out)).float(), dim=-1)  # [B, n, D]
        tp = target_p[:, 1 + j : 1 + j + n]
        total = total + 0.8**j * -(tp * logp).sum(-1).mean()
        accs.append((logp.argmax(-1) == tp.argmax(-1)).float().mean().item())
        hidden = out
    return total, accs


def train(cfg: TrainConfig) -> Path:
    """Trains (or resumes) the head in ``cfg.out``; returns that directory."""
    from tqdm import tqdm

    from engine.worker.loader import load_model
    from engine.worker.model_store import resolve_model

    start = time.monotonic()  # the budget covers the distillation too
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    path = resolve_model(cfg.model)
    target = load_model(path, torch.float32, torch.device("cpu"))
    for p in target.parameters():
        p.requires_grad_(False)
    data = distilled(target, path, cfg, out)
    chats = range(len(data.starts) - 1)
    train_chats, held_chats = [c for c in chats if c % 20 != 19], [c for c in chats if c % 20 == 19]
    state = _load_state(out)
    vocab = target.config.vocab_size
    draft_ids = state["draft_ids"] if state else draft_vocabulary(data.tokens[data.positions(train_chats)], vocab,
                                                                  cfg.draft_vocab)
    sequences = Windows(data, train_chats, cfg.seq_len, draft_ids, vocab)
    held_out = Windows(data, held_chats, cfg.seq_len, draft_ids, vocab)
    held_out.index = held_out.index[: cfg.eval_sequences]
    order = torch.randperm(len(sequences), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    head = new_head(target, draft_ids)
    opt = torch.optim.AdamW([p for p in head.parameters()], lr=cfg.lr, weight_decay=0.0)
    log = {"config": asdict(cfg), "steps": [], "loss": [], "acc": [], "held_out": [], "elapsed_s": 0.0}
    if state:
        _restore(head, opt, state)
        log = json.loads((out / "train_log.json").read_text())
        log.setdefault("held_out", [])  # logs written before held-out chats were
    fast_bf16 = cfg.bf16 and has_native_bf16()
    step = log["steps"][-1] + 1 if log["steps"] else 0
    spent = log["elapsed_s"]
    budget = round(cfg.minutes * 60)  # the bar runs over the time budget, which ends the run
    bar = tqdm(total=budget, initial=min(budget, round(time.monotonic() - start)), desc="train-eagle", unit="s")
    while step < cfg.max_steps and time.monotonic() - start < cfg.minutes * 60:
        idx = [order[(step * cfg.batch_size + i) % len(order)] for i in range(cfg.batch_size)]
        batch, feats, target_p = sequences.batch(idx)  # [B, N], [B, N, F], [B, N, D]
        for group in opt.param_groups:
            group["lr"] = learning_rate(cfg, step, (time.monotonic() - start) / (cfg.minutes * 60))
        loss, accs = training_step(head, opt, feats, batch, target_p, cfg.ttt_steps, fast_bf16)
        log["steps"].append(step)
        log["loss"].append(loss.item())
        log["acc"].append(accs)
        bar.n = min(budget, round(time.monotonic() - start))
        bar.set_postfix(step=step, loss=f"{loss.item():.3f}", acc=" ".join(f"{a:.2f}" for a in accs))
        step += 1
        if step % cfg.eval_every == 0:
            log["held_out"].append([step, agreement(head, held_out, cfg.ttt_steps)])
        if step % cfg.save_every == 0:
            log["elapsed_s"] = spent + time.monotonic() - start
            _save(out, head, opt, draft_ids, log)
    bar.close()
    log["held_out"].append([step, agreement(head, held_out, cfg.ttt_steps)])
    print("held-out top-1 agreement by drafting depth:", " ".join(f"{a:.3f}" for a in log["held_out"][-1][1]))
    log["elapsed_s"] = spent + time.monotonic() - start
    _save(out, head, opt, draft_ids, log)
    return out


def training_step(head: EagleHead, opt, feats, tokens, target_p, steps: int, bf16: bool):
    """One optimizer step on ``ttt_loss`` (its matmuls in bfloat16 if ``bf16``; gradients
    clipped to norm 1); returns the loss and the agreements."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss, accs = ttt_loss(head, feats, tokens, target_p, steps)
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
    opt.step()
    return loss, accs


def has_native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX), where oneDNN's
    bfloat16 matmuls make a training step several times faster than float32. Elsewhere
    autocast would emulate them, slower than float32."""
    from engine.utils.devices import cpu_flags

    flags = cpu_flags().split()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def learning_rate(cfg: TrainConfig, step: int, spent: float) -> float:
    """Linear warm-up over ``cfg.warmup`` steps, then a cosine from ``cfg.lr`` to a tenth of
    it as ``spent`` (the share of the time budget used) goes from 0 to 1."""
    cosine = 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, spent)))
    return cfg.lr * min(1.0, (step + 1) / cfg.warmup) * cosine


@torch.no_grad()
def agreement(head: EagleHead, windows: "Windows", steps: int, batch: int = 4) -> list[float]:
    """The head's top-1 agreement with the target per training-time-test step over all
    of ``windows``' sequences (sequences of ``batch`` at a time)."""
    n = len(windows)
    totals = [0.0] * steps
    for start in range(0, n, batch):
        idx = list(range(start, min(n, start + batch)))
        tokens, feats, target_p = windows.batch(idx)
        accs = ttt_loss(head, feats, tokens, target_p, steps)[1]
        totals = [t + a * len(idx) for t, a in zip(totals, accs)]
    return [t / max(1, n) for t in totals]


def _save(out: Path, head: EagleHead, opt, draft_ids: torch.Tensor, log: dict) -> None:
    """The head in its published format, the resumable state, the log and the loss curve."""
    from safetensors.torch import save_file

    save_eagle_head(head, out)
    tensors = {"draft_ids": draft_ids.clone()}
    for name, p in head.named_parameters():
        tensors[f"param.{name}"] = p.detach().clone()
        st = opt.state.get(p)
        if st:
            tensors[f"exp_avg.{name}"], tensors[f"exp_avg_sq.{name}"] = st["exp_avg"], st["exp_avg_sq"]
            tensors[f"step.{name}"] = torch.as_tensor(st["step"], dtype=torch.float32).reshape(1)
    (out / "train").mkdir(exist_ok=True)  # not a *.safetensors of the head's directory: the loader reads those
    save_file(tensors, str(out / "train" / "state.tmp"))
    (out / "train" / "state.tmp").replace(out / "train" / "state.safetensors")
    (out / "train_log.json").write_text(json.dumps(log))
    _plot(out / "loss.png", log)


def _load_state(out: Path) -> dict | None:
    from safetensors.torch import load_file

    file = out / "train" / "state.safetensors"
    return load_file(str(file)) if file.is_file() and (out / "train_log.json").is_file() else None


def _restore(head: EagleHead, opt, state: dict) -> None:
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_(state[f"param.{name}"])
            if f"exp_avg.{name}" in state:
                opt.state[p] = {"step": state[f"step.{name}"][0].clone(), "exp_avg": state[f"exp_avg.{name}"],
                                "exp_avg_sq": state[f"exp_avg_sq.{name}"]}


def _plot(file: Path, log: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, acc) = plt.subplots(1, 2, figsize=(10, 3.5))
    ax.plot(log["steps"], log["loss"], lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("training-time-test loss")
    ax.set_title("train-eagle: EAGLE-3 head")
    acc.plot(log["steps"], [a[0] for a in log["acc"]], lw=0.8, label="training batch")
    held = log.get("held_out", [])
    acc.plot([h[0] for h in held], [h[1][0] for h in held], "o-", label="held-out chats")
    acc.set_xlabel("step")
    acc.set_ylabel("top-1 agreement, first draft")
    acc.legend()
    fig.tight_layout()
    fig.savefig(file, dpi=100)
    plt.close(fig)
