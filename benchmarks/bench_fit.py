"""Will it fit? nbmem's prediction against the real out-of-memory boundary, on the GPU (issue 23).

    PYTHONPATH=. python3 benchmarks/bench_fit.py                 # needs CUDA; about 3-4 minutes on an H100
    PYTHONPATH=. python3 benchmarks/bench_fit.py --only mlp --states fresh
    PYTHONPATH=. python3 benchmarks/bench_fit.py --only training     # issue 27's training setups
    PYTHONPATH=. python3 benchmarks/bench_fit.py --only remedies     # issue 27's remedies, each checked
    PYTHONPATH=. python3 benchmarks/bench_fit.py --only stack        # issue 36: HF checkpointing + bf16, compiled
    PYTHONPATH=. python3 benchmarks/bench_fit.py --only offload      # issue 36: save_on_cpu, host memory's limit
    PYTHONPATH=. python3 benchmarks/bench_fit.py --out DIR       # also writes results.json, traces, a plot
    PYTHONPATH=. python3 benchmarks/bench_fit.py --replay DIR/traces.json.gz   # no GPU: the analysis again

Each row is one model family in one state of the notebook: ``fresh`` (model and optimizer made, no step
run yet), ``stepped`` (one training step already run, so optimizer state and workspaces exist), ``half``
(stepped, and the process already holds half the GPU, partly fragmented). A body is a notebook cell: it
binds ``x``, ``out``, ``loss`` in a namespace that outlives it, and runs one training step.

- real: the largest value for which the body runs 3 times in a row without CUDA out of memory, found by
  bisection with real OOMs in this process, from the state of the row (restored between tries and freed,
  ``empty_cache``), to 1 %;
- nbmem: ``nbmem.fitting.runs.runner.fit`` at three small values (warm-up included), state restored afterwards;
- line: the straight-line baseline of issue 23, a line through ``max_memory_allocated()`` at the same
  three values, solved for free + reserved;
- batch-probe (PyPI, 0.4.0) and torch-kitsune (0.7.0), where installed: optional comparisons only.

The target: nbmem never above the real boundary and within 10 % below it, on every row.

``--only remedies`` (issue 27): fp32 models with repeated blocks (the LM, torch's ``TransformerEncoder``, a
residual CNN with BatchNorm, Hugging Face's GPT-2 where transformers is installed) fitted with ``want`` far
beyond what fits, so the fit measures each remedy it can apply by runs of its own; then for the plain body and
under each remedy (applied as the fit applies it) the real boundary by bisection, as above. ``--room-gib``
leaves that much of the GPU free for each family (the rest held by one tensor), so the bisections run at
smaller sizes; the margin is then the fit's rule applied to that room.

``--only offload`` (issue 36): an MLP whose step offloads what autograd saves to pinned host memory
(``torch.autograd.graph.save_on_cpu(pin_memory=True)``), fitted with host memory as a limit
(``host_limit``: this process's RSS plus ``--host-gib``; 0: the container's limit or the machine's memory, as a
fit without it). The real boundary by bisection over tries of three steps, each from the same state: a try fails
on a real out-of-memory (the GPU's, or pinned host memory's: ``cudaHostAlloc`` in ``pack_to_cpu``) or, under
``--host-gib``, where the pinned pool it grew passes the limit (the RSS at the start taken off). The row says
which limit the fit's answer hit, and whether any of the fit's own runs failed (none may).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import gzip
import json
import math
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

GiB, MiB = 2**30, 2**20


@dataclass
class Family:
    """A model, its optimizer, and the cell body that trains it one step at a value."""

    name: str
    var: str
    values: tuple[int, ...]
    make: Callable[[Any], Any]  # device -> model
    body: Callable[[Any, Any, dict[str, Any], int], None]  # (model, opt, ns, value)
    optimizer: Callable[[Any], Any]
    kitsune_shape: tuple[int, ...] | None = None  # the input without its batch dimension, for torch-kitsune
    kitsune_optimizer: str = "adamw"
    #: (model, optimizer) -> the other training state the body changes (LR schedulers, gradient scalers)
    others: Callable[[Any, Any], list[Any]] = lambda model, opt: []


def families(torch: Any, dev: str = "cuda") -> dict[str, Family]:
    nn, F = torch.nn, torch.nn.functional

    def adamw(m: Any) -> Any:
        return torch.optim.AdamW(m.parameters(), lr=1e-4)

    def sgd(m: Any) -> Any:
        return torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9)

    # -- an MLP -------------------------------------------------------------------------------------------------
    def mlp(device: Any) -> Any:
        layers: list[Any] = [nn.Linear(512, 1024), nn.GELU()]
        for _ in range(3):
            layers += [nn.Linear(1024, 1024), nn.GELU()]
        return nn.Sequential(*layers, nn.Linear(1024, 10)).to(device)


    def learn(opt: Any, ns: dict[str, Any]) -> None:
        """A step's end as a notebook writes it: backward from ns["loss"], the optimizer's step, grads set to None."""
        ns["loss"].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def classify(model: Any, opt: Any, ns: dict[str, Any]) -> None:
        """One training step of a classifier on ns["x"], ns["y"], its tensors kept in ns as a notebook keeps them."""
        ns["out"] = model(ns["x"])
        ns["loss"] = F.cross_entropy(ns["out"], ns["y"])
        learn(opt, ns)

    def mlp_body(model: Any, opt: Any, ns: dict[str, Any], b: int) -> None:
        ns["x"] = torch.randn(b, 512, device=dev)
        ns["y"] = torch.randint(0, 10, (b,), device=dev)
        classify(model, opt, ns)

    def wide_mlp(device: Any) -> Any:
        """bench_multi's ``mlp-cuda1`` on one GPU: eight 4096-wide layers, so a value's activations come in
        blocks of several GiB near a large card's limit."""
        layers: list[Any] = []
        for _ in range(8):
            layers += [nn.Linear(4096, 4096), nn.GELU()]
        return nn.Sequential(*layers, nn.Linear(4096, 10)).to(device)

    def wide_body(model: Any, opt: Any, ns: dict[str, Any], b: int) -> None:
        ns["x"] = torch.randn(b, 4096, device=dev)
        ns["y"] = torch.randint(0, 10, (b,), device=dev)
        classify(model, opt, ns)

    # -- a small transformer LM, bf16 autocast (causal SDPA: flash attention) -------------------------------------
    V, D, T = 8192, 256, 128
    LM_VOCAB = 1024

    class Block(nn.Module):
        """A pre-norm transformer block; ``flash``: causal SDPA (memory linear in the sequence), else the
        scores written out (quadratic: what the sequence-length fit is about)."""

        def __init__(self, d: int, h: int, flash: bool = True) -> None:
            super().__init__()
            self.h, self.flash = h, flash
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

        def forward(self, x: Any) -> Any:
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
            if self.flash:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                s = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.h)
                s = s.masked_fill(torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
                y = s.softmax(-1) @ v
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
            return x + self.ff(self.ln2(x))

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(LM_VOCAB, D)
            self.pos = nn.Embedding(1024, D)
            self.blocks = nn.Sequential(*[Block(D, 4) for _ in range(4)])
            self.head = nn.Linear(D, LM_VOCAB)

        def forward(self, idx: Any) -> Any:
            return self.head(self.blocks(self.emb(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))))

    def lm_body(model: Any, opt: Any, ns: dict[str, Any], b: int) -> None:
        ns["x"] = torch.randint(0, LM_VOCAB, (b, T + 1), device=dev)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            ns["out"] = model(ns["x"][:, :-1])
        ns["loss"] = F.cross_entropy(ns["out"].float().reshape(-1, LM_VOCAB), ns["x"][:, 1:].reshape(-1))
        learn(opt, ns)

    # -- a CNN with BatchNorm ----------------------------------------------------------------------------------
    def cnn(device: Any) -> Any:
        def block(i: int, o: int) -> list[Any]:
            return [nn.Conv2d(i, o, 3, padding=1, bias=False), nn.BatchNorm2d(o), nn.ReLU()]

        return nn.Sequential(*block(3, 32), *block(32, 32), nn.MaxPool2d(2), *block(32, 64), *block(64, 64),
                             nn.MaxPool2d(2), *block(64, 128), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                             nn.Linear(128, 10)).to(device)

    def cnn_body(model: Any, opt: Any, ns: dict[str, Any], b: int) -> None:
        ns["x"] = torch.randn(b, 3, 64, 64, device=dev)
        ns["y"] = torch.randint(0, 10, (b,), device=dev)
        classify(model, opt, ns)

    # -- a recurrent net (cuDNN LSTM) ----------------------------------------------------------------------------
    class RNN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm = nn.LSTM(256, 512, num_layers=2, batch_first=True)
            self.head = nn.Linear(512, 10)

        def forward(self, x: Any) -> Any:
            h, _ = self.lstm(x)
            return self.head(h[:, -1])

    def rnn_body(model: Any, opt: Any, ns: dict[str, Any], b: int) -> None:
        ns["x"] = torch.randn(b, 64, 256, device=dev)
        ns["y"] = torch.randint(0, 10, (b,), device=dev)
        classify(model, opt, ns)

    # -- the peak moves: a 1 GiB table of per-item biases (its Adam step dominates small batches) ----------------
    class Moving(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = nn.Parameter(torch.zeros(2**28))
            self.mlp = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10))

        def forward(self, x: Any, item: Any) -> Any:
            return self.mlp(x) + self.table[item].unsqueeze(1)

    def moving_body(model: Any, opt: Any, ns: dict[str, Any], b: int) -> None:
        ns["x"] = torch.randn(b, 256, device=dev)
        ns["item"] = torch.randint(0, 2**28, (b,), device=dev)
        ns["y"] = torch.randint(0, 10, (b,), device=dev)
        ns["out"] = model(ns["x"], ns["item"])
        ns["loss"] = F.cross_entropy(ns["out"], ns["y"])
        learn(opt, ns)

    # -- an embedding bag over 2^20 rows: its backward's buffers follow the distinct rows a batch touches ---------
    class Bag(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(2**20, 256)
            self.mlp = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10))

        def forward(self, idx: Any) -> Any:
            return self.mlp(self.emb(idx).mean(1))

    def bag_body(model: Any, opt: Any, ns: dict[str, Any], b: int) -> None:
        ns["x"] = torch.randint(0, 2**20, (b, 16), device=dev)
        ns["y"] = torch.randint(0, 10, (b,), device=dev)
        classify(model, opt, ns)

    # -- the sequence length: attention scores written out (quadratic), bf16 autocast ------------------------
    class SeqLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(V, D)
            self.pos = nn.Embedding(32768, D)
            self.blocks = nn.Sequential(*[Block(D, 4, flash=False) for _ in range(4)])
            self.head = nn.Linear(D, V)

        def forward(self, idx: Any) -> Any:
            h = self.emb(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
            return self.head(self.blocks(h))

    def seq_body(model: Any, opt: Any, ns: dict[str, Any], t: int) -> None:
        ns["x"] = torch.randint(0, V, (4, t + 1), device=dev)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            ns["out"] = model(ns["x"][:, :-1])
        ns["loss"] = F.cross_entropy(ns["out"].float().reshape(-1, V), ns["x"][:, 1:].reshape(-1))
        learn(opt, ns)

    # -- issue 27: the training setups a fit must leave as it found them -----------------------------------------
    # The scheduler and scaler of an optimizer, made with it and found by it (the body gets the optimizer).
    aux: dict[int, dict[str, Any]] = {}

    def with_aux(make_opt: Callable[[Any], Any], **parts: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def optimizer(m: Any) -> Any:
            opt = make_opt(m)
            aux[id(opt)] = {k: f(opt) for k, f in parts.items()}
            return opt
        return optimizer

    def aux_of(model: Any, opt: Any) -> list[Any]:
        return list(aux.get(id(opt), {}).values())

    def one_cycle(opt: Any) -> Any:
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=1_000_000)

    def fp16_scaler(opt: Any) -> Any:
        return torch.amp.GradScaler("cuda")

    def sched_body(model: Any, opt: Any, ns: dict[str, Any], b: int) -> None:
        mlp_body(model, opt, ns, b)
        aux[id(opt)]["sched"].step()

    def accum_body(model: Any, opt: Any, ns: dict[str, Any], b: int) -> None:
        """fp16 autocast with a GradScaler, two accumulated micro-batches of ``b`` per optimizer step."""
        scaler = aux[id(opt)]["scaler"]
        for _ in range(2):
            ns["x"] = torch.randn(b, 512, device=dev)
            ns["y"] = torch.randint(0, 10, (b,), device=dev)
            with torch.autocast("cuda", dtype=torch.float16):
                ns["out"] = model(ns["x"])
            ns["loss"] = F.cross_entropy(ns["out"].float(), ns["y"]) / 2
            scaler.scale(ns["loss"]).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    class CheckpointedLM(LM):
        """The LM with each block under ``torch.utils.checkpoint``, called from the notebook's own code."""

        def __init__(self, reentrant: bool) -> None:
            super().__init__()
            self.reentrant = reentrant

        def forward(self, idx: Any) -> Any:
            h = self.emb(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
            for blk in self.blocks:
                h = torch.utils.checkpoint.checkpoint(blk, h, use_reentrant=self.reentrant)
            return self.head(h)

    def lora(device: Any) -> Any:
        """The LM in bf16 with LoRA adapters on its attention (peft): only the adapters train."""
        from peft import LoraConfig, inject_adapter_in_model

        model = inject_adapter_in_model(LoraConfig(r=16, target_modules=["qkv", "proj"]), LM())
        for n, prm in model.named_parameters():
            prm.requires_grad_("lora_" in n)
        return model.to(device=device, dtype=torch.bfloat16)

    def adamw_trainable(m: Any) -> Any:
        return torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4)

    # -- issue 27's remedies: fp32 bodies with repeated blocks ------------------------------------------------------
    def lm_fp32_body(model: Any, opt: Any, ns: dict[str, Any], b: int) -> None:
        ns["x"] = torch.randint(0, LM_VOCAB, (b, T + 1), device=dev)
        ns["out"] = model(ns["x"][:, :-1])
        ns["loss"] = F.cross_entropy(ns["out"].reshape(-1, LM_VOCAB), ns["x"][:, 1:].reshape(-1))
        learn(opt, ns)

    class FFBlock(nn.Module):
        """A pre-norm feed-forward block with a residual, as GPT-style notebooks write their ``Block``."""

        def __init__(self) -> None:
            super().__init__()
            self.ln = nn.LayerNorm(D)
            self.ff = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

        def forward(self, x: Any) -> Any:
            return x + self.ff(self.ln(x))

    def gpt_sequential(device: Any) -> Any:
        """The GPT shape many notebooks write: one Sequential of an embedding, six blocks, a norm and a head."""
        return nn.Sequential(nn.Embedding(LM_VOCAB, D), *[FFBlock() for _ in range(6)], nn.LayerNorm(D),
                             nn.Linear(D, LM_VOCAB)).to(device)

    class Encoder(nn.Module):
        """torch's own TransformerEncoder (a ModuleList of TransformerEncoderLayer) and a classifier head."""

        def __init__(self) -> None:
            super().__init__()
            layer = nn.TransformerEncoderLayer(D, 4, 4 * D, dropout=0.1, batch_first=True)
            self.enc = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
            self.head = nn.Linear(D, 10)

        def forward(self, x: Any) -> Any:
            return self.head(self.enc(x).mean(1))

    def encoder_body(model: Any, opt: Any, ns: dict[str, Any], b: int) -> None:
        ns["x"] = torch.randn(b, T, D, device=dev)
        ns["y"] = torch.randint(0, 10, (b,), device=dev)
        classify(model, opt, ns)

    class ResBlock(nn.Module):
        def __init__(self, c: int) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU(),
                                      nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c))

        def forward(self, x: Any) -> Any:
            return F.relu(x + self.body(x))

    def resnet(device: Any) -> Any:
        return nn.Sequential(nn.Conv2d(3, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                             nn.Sequential(*[ResBlock(64) for _ in range(4)]), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                             nn.Linear(64, 10)).to(device)

    def gpt2(device: Any, embd: int = D, layers: int = 4, positions: int = 256, checkpointed: bool = False) -> Any:
        """Hugging Face's GPT-2, randomly initialised (no download); ``checkpointed``: its own gradient
        checkpointing switched on, as a fine-tuning notebook does."""
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(vocab_size=LM_VOCAB, n_positions=positions, n_embd=embd, n_layer=layers,
                         n_head=embd // 64, bos_token_id=0, eos_token_id=0)
        model = GPT2LMHeadModel(cfg).to(device)
        if checkpointed:
            model.gradient_checkpointing_enable()
        return model

    def hf(seq: int = T, bf16: bool = False) -> Callable[[Any, Any, dict[str, Any], int], None]:
        """A causal LM's training step on sequences of ``seq``, its forward under bf16 autocast where asked."""
        def body(model: Any, opt: Any, ns: dict[str, Any], b: int) -> None:
            ns["x"] = torch.randint(0, LM_VOCAB, (b, seq), device=dev)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
                got = model(input_ids=ns["x"], labels=ns["x"], use_cache=False)
            ns["out"], ns["loss"] = got.logits, got.loss
            del got
            learn(opt, ns)
        return body

    def llama(device: Any) -> Any:
        """A Llama-shaped decoder (6 layers of 768, Hugging Face's LlamaForCausalLM, random init, no download) with
        its own gradient checkpointing switched on, as issue 47's 141 GB row has it."""
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=6,
                          num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=1024)
        model = LlamaForCausalLM(cfg).to(device)
        model.gradient_checkpointing_enable()
        return model

    class UNet(nn.Module):
        """A denoising UNet as a diffusion notebook trains one: 128 × 128 RGB, three levels (64, 128, 256 channels)
        with GroupNorm and SiLU, skips joined by concatenation."""

        def __init__(self) -> None:
            super().__init__()

            def conv(i: int, o: int) -> Any:
                return nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.GroupNorm(8, o), nn.SiLU(),
                                     nn.Conv2d(o, o, 3, padding=1), nn.GroupNorm(8, o), nn.SiLU())

            self.down1, self.down2, self.mid = conv(3, 64), conv(64, 128), conv(128, 256)
            self.up2, self.up1 = conv(256 + 128, 128), conv(128 + 64, 64)
            self.out = nn.Conv2d(64, 3, 1)

        def forward(self, x: Any) -> Any:
            d1 = self.down1(x)
            d2 = self.down2(F.max_pool2d(d1, 2))
            m = self.mid(F.max_pool2d(d2, 2))
            u2 = self.up2(torch.cat([F.interpolate(m, scale_factor=2.0), d2], 1))
            return self.out(self.up1(torch.cat([F.interpolate(u2, scale_factor=2.0), d1], 1)))

    def unet_body(model: Any, opt: Any, ns: dict[str, Any], b: int) -> None:
        ns["x"] = torch.randn(b, 3, 128, 128, device=dev)
        ns["noise"] = torch.randn_like(ns["x"])
        ns["loss"] = F.mse_loss(model(ns["x"] + ns["noise"]), ns["noise"])
        learn(opt, ns)

    def compiled_lm(device: Any) -> Any:
        """The bf16 LM under ``torch.compile`` (default mode), as a notebook compiles it."""
        return torch.compile(LM().to(device))

    return {
        "mlp": Family("mlp", "batch", (256, 512, 1024), mlp, mlp_body, adamw, (512,)),
        "mlp-wide": Family("mlp-wide", "batch", (512, 1024, 2048), wide_mlp, wide_body, adamw, (4096,)),
        "lm-bf16": Family("lm-bf16", "batch", (8, 16, 32), lambda d: LM().to(d), lm_body, adamw),
        "cnn-bn": Family("cnn-bn", "batch", (32, 64, 128), cnn, cnn_body, sgd, (3, 64, 64), "sgd_momentum"),
        "lstm": Family("lstm", "batch", (64, 128, 256), lambda d: RNN().to(d), rnn_body, adamw, (64, 256)),
        "moving-peak": Family("moving-peak", "batch", (1024, 2048, 4096), lambda d: Moving().to(d), moving_body,
                              adamw),
        "lm-seq": Family("lm-seq", "seq", (128, 256, 512), lambda d: SeqLM().to(d), seq_body, adamw),
        "embedding": Family("embedding", "batch", (1024, 2048, 4096), lambda d: Bag().to(d), bag_body, adamw),
        "ckpt": Family("ckpt", "batch", (8, 16, 32), lambda d: CheckpointedLM(False).to(d), lm_body, adamw),
        "ckpt-reentrant": Family("ckpt-reentrant", "batch", (8, 16, 32), lambda d: CheckpointedLM(True).to(d),
                                 lm_body, adamw),
        "scaler-accum": Family("scaler-accum", "batch", (256, 512, 1024), mlp, accum_body,
                               with_aux(adamw, scaler=fp16_scaler), others=aux_of),
        "sched": Family("sched", "batch", (256, 512, 1024), mlp, sched_body, with_aux(adamw, sched=one_cycle),
                        others=aux_of),
        "lora-bf16": Family("lora-bf16", "batch", (8, 16, 32), lora, lm_body, adamw_trainable),
        "lm-fp32": Family("lm-fp32", "batch", (8, 16, 32), lambda d: LM().to(d), lm_fp32_body, adamw),
        "encoder": Family("encoder", "batch", (8, 16, 32), lambda d: Encoder().to(d), encoder_body, adamw),
        "resnet": Family("resnet", "batch", (8, 16, 32), resnet, cnn_body, sgd),
        "gpt2-hf": Family("gpt2-hf", "batch", (8, 16, 32), gpt2, hf(), adamw),
        "gpt-seq": Family("gpt-seq", "batch", (8, 16, 32), gpt_sequential, lm_fp32_body, adamw),
        "gpt2-hf-gc-bf16": Family("gpt2-hf-gc-bf16", "batch", (8, 16, 32), lambda d: gpt2(d, checkpointed=True),
                                  hf(bf16=True), adamw),
        # GPT-2 small's shape (12 layers of 768, 1,024 positions), sequences of 512
        "gpt2s-gc-bf16": Family("gpt2s-gc-bf16", "batch", (2, 4, 8),
                                lambda d: gpt2(d, 768, 12, 1024, checkpointed=True), hf(4 * T, bf16=True), adamw),
        "lm-compiled": Family("lm-compiled", "batch", (8, 16, 32), compiled_lm, lm_body, adamw),
        # issue 47's row: sequences of 512 under bf16 autocast
        "llama-gc-bf16": Family("llama-gc-bf16", "batch", (2, 4, 8), llama, hf(4 * T, bf16=True), adamw),
        # issue 47's UNet row
        "unet": Family("unet", "batch", (4, 8, 16), lambda d: UNet().to(d), unet_body, adamw, (3, 128, 128)),
    }

#: Issue 27's training setups, run with ``--only`` (``--only training`` runs them all).
TRAINING = ("ckpt", "ckpt-reentrant", "scaler-accum", "sched", "lora-bf16")
#: Issue 36's stack, run with ``--only stack``: Hugging Face's own checkpointing under bf16, a compiled model.
STACK = ("gpt2-hf-gc-bf16", "gpt2s-gc-bf16", "lm-compiled")
#: Issue 27's remedies, run with ``--only remedies``: each family's plain fit and every remedy it measures.
REMEDIES = ("lm-fp32", "encoder", "resnet", "gpt2-hf", "gpt-seq")


@dataclass
class Row:
    family: str
    state: str
    var: str
    values: tuple[int, ...]
    real: int | None = None
    real_hi: int | None = None
    nbmem: int | None = None
    nbmem_pow2: int | None = None
    method: str = ""
    line: int | None = None
    probe: int | None = None
    probe_max: int | None = None
    kitsune: int | None = None
    t_nbmem: float | None = None
    t_real: float | None = None
    t_line: float | None = None
    t_probe: float | None = None
    t_kitsune: float | None = None
    alloc_before: int | None = None
    alloc_after: int | None = None
    restored_bytes: int | None = None
    capacity: int | None = None
    peak_where: tuple[str, str] = ("", "")
    notes: list[str] = field(default_factory=list)
    error: str = ""


def ratio(a: int | None, b: int | None) -> str:
    return "NA" if a is None or not b else f"{a / b:.3f}"


def fmt(n: int | None) -> str:
    return "NA" if n is None else f"{n:,}"


def cuda_or_say(torch: Any, fitting: Any, name: str) -> bool:
    """Whether CUDA is here (TF32 on for the bench, as training runs it); without it, the fit's own one-line
    refusal and a summary that says nothing was measured."""
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        return True
    try:
        fitting.fit(lambda v: None, [1, 2])
    except fitting.FitRefused as e:
        print(f"{name}: {e}")
    print(f"\n=== summary ===\n{name}: needs CUDA (nothing measured)")
    return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="", help="comma-separated families (default: all)")
    ap.add_argument("--states", default="fresh,stepped", help="states for every family (half is extra)")
    ap.add_argument("--half", default="mlp", help="the family also run with half the GPU held ('' for none)")
    ap.add_argument("--seq", action=argparse.BooleanOptionalAction, default=True, help="the sequence-length row")
    ap.add_argument("--extra", default="embedding", help="families run last, fresh only, if time is left")
    ap.add_argument("--batch-probe", action=argparse.BooleanOptionalAction, default=True,
                    help="batch-probe (PyPI) on the fresh rows, where installed")
    ap.add_argument("--kitsune", action=argparse.BooleanOptionalAction, default=True,
                    help="torch-kitsune on the fresh rows (in a CPU child process), where installed")
    ap.add_argument("--budget-s", type=float, default=240.0, help="stop starting rows after this long")
    ap.add_argument("--remedy-families", default=",".join(REMEDIES),
                    help="--only remedies: comma-separated families (default: all of them)")
    ap.add_argument("--room-gib", type=float, default=0.0,
                    help="--only remedies: leave this much of the GPU free for each family (0: all of it)")
    ap.add_argument("--host-gib", type=float, default=16.0,
                    help="--only offload: the host memory the runs may add (0: the machine's or container's)")
    ap.add_argument("--out", default="", help="a folder for results.json and the fits' traces")
    ap.add_argument("--replay", nargs="+", default=[], metavar="TRACES",
                    help="no GPU: nbmem's prediction again, by the analysis as it is now, from the traces.json.gz "
                         "of earlier runs (--out), beside the real boundaries they measured")
    ap.add_argument("--kitsune-only", default="", help=argparse.SUPPRESS)  # the child that asks torch-kitsune
    a = ap.parse_args()
    if a.replay:
        return replay(a.replay)
    import torch

    if a.kitsune_only:
        return kitsune_child(torch, a.kitsune_only.split(","))

    from nbmem.fitting.runs import runner as fitting
    from nbmem.formatting import fmt_bytes
    from nbmem.ui.plotting import plot_fit

    if not cuda_or_say(torch, fitting, "bench_fit"):
        return 0
    started = time.perf_counter()
    fams = families(torch)
    if a.only == "offload":
        return offload_main(torch, fitting, a.host_gib, started)
    if a.only == "remedies":
        return remedies_main(torch, fitting, fams, [f for f in a.remedy_families.split(",") if f], a.budget_s,
                             a.room_gib, started, a.out)
    groups = {"training": TRAINING, "stack": STACK}
    only = [g for f in a.only.split(",") if f for g in groups.get(f, (f,))] or [
        f for f in fams if f not in ("lm-seq", "embedding", *TRAINING, *STACK)]
    # Every family fresh first, then the sequence length and half the GPU held, then the other states: what a
    # spent time budget leaves out is the least new.
    states = [s for s in a.states.split(",") if s]
    plan = [(f, states[0]) for f in only] if states else []
    if a.seq:
        plan.append(("lm-seq", "fresh"))
    if a.half:
        plan += [(f, "half") for f in a.half.split(",")]
    plan += [(f, s) for s in states[1:] for f in only]
    plan += [(f, states[0]) for f in a.extra.split(",") if f and states]
    competitors = load_competitors()
    if not a.batch_probe:
        competitors["batch-probe"] = "not asked for (--no-batch-probe)"
    if not a.kitsune:
        competitors["torch-kitsune"] = "not asked for (--no-kitsune)"
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, "
          f"{fmt_bytes(torch.cuda.mem_get_info()[1])}; comparisons: " +
          "; ".join(f"{k}: {v if isinstance(v, str) else 'installed'}" for k, v in competitors.items()), flush=True)
    # torch-kitsune predicts from formulas on the CPU (its input shapes run through the model there): it runs
    # in a child process beside the GPU rows, and its answers are collected at the end.
    kit = None
    if not isinstance(competitors.get("torch-kitsune", ""), str):
        asked = [f for f in dict.fromkeys(f for f, s in plan if s == "fresh") if fams[f].kitsune_shape]
        kit = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--kitsune-only", ",".join(asked)],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    rows: list[Row] = []
    saved: list[dict[str, Any]] = []
    print(malloc_probe(torch), flush=True)
    for fam_name, state in plan:
        fam = fams[fam_name]
        if time.perf_counter() - started > a.budget_s:
            rows.append(Row(fam_name, state, fam.var, fam.values, error="not run: time budget spent"))
            continue
        row = Row(fam_name, state, fam.var, fam.values)
        rows.append(row)
        try:
            compare = competitors if state == "fresh" and fam.var == "batch" else {}
            measure(torch, fitting, fam, state, row, compare, saved, bool(a.out))
        except Exception as e:  # a row that breaks is reported; the others go on
            row.error = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            traceback.print_exc()
        finally:
            gc.collect()
            torch.cuda.empty_cache()
        print(f"  {fam_name}/{state}: real {fmt(row.real)}, nbmem {fmt(row.nbmem)} ({ratio(row.nbmem, row.real)}), "
              f"line {fmt(row.line)} ({ratio(row.line, row.real)}), {row.error}", flush=True)
    if kit is not None:
        try:
            out, _ = kit.communicate(timeout=max(5.0, a.budget_s + 20 - (time.perf_counter() - started)))
            answers = json.loads(out.strip().splitlines()[-1]) if out.strip() else {}
        except subprocess.TimeoutExpired:  # what it answered so far still counts
            kit.kill()
            out, _ = kit.communicate()
            answers = json.loads(out.strip().splitlines()[-1]) if out.strip() else {}
        for r in rows:
            got = answers.get(r.family)
            if r.state != "fresh":
                continue
            if isinstance(got, list):
                r.kitsune, r.t_kitsune = got
            elif isinstance(got, str):
                r.notes.append(f"torch-kitsune: {got}")
            elif fams[r.family].kitsune_shape is None:
                r.notes.append("torch-kitsune: takes a float input of one shape (this model takes token ids)")
            else:
                r.notes.append("torch-kitsune: no answer within the benchmark's time (its shape propagation runs "
                               "the model on the CPU at batches up to 4,096)")
    print_table(rows, competitors)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "results.json"), "w") as f:
            json.dump([r.__dict__ for r in rows], f, indent=1, default=str)
        shown = next((s for s in saved if s["family"] == "moving-peak"), saved[0] if saved else None)
        if shown is not None:
            plot_fit(shown["result"]).savefig(os.path.join(a.out, "fit.png"), dpi=90)
        for s in saved:
            s.pop("result", None)
        with gzip.open(os.path.join(a.out, "traces.json.gz"), "wt") as f:
            json.dump(saved, f)
    print(f"\n=== summary ===\nbench_fit: {len(rows)} rows in {time.perf_counter() - started:.0f} s")
    return 0


def replay(paths: list[str]) -> int:
    """The fit's analysis over recorded runs (pure: the same traces give the same prediction), against the real
    boundary and the straight line those runs measured."""
    from nbmem.fitting.analysis import allocator as allocmodel
    from nbmem.fitting.analysis import model as fitmodel
    from nbmem.fitting.analysis import prediction as fit

    head = ("family", "state", "var", "real (to)", "nbmem then", "nbmem now", "now/real", "line", "line/real",
            "method", "t analysis")
    table = []
    ok = good = above = 0
    for path in paths:
        with gzip.open(path, "rt") as f:
            for s in json.load(f):
                segs = tuple(allocmodel.SegmentState(x["address"], x["total_bytes"], x["stream"], x["small"],
                                              tuple(tuple(b) for b in x["blocks"]), x["usable"]) for x in s["segments"])
                runs = [fitmodel.RunTrace(r["value"], r["entries"], r["counted"], r["allocated_before_bytes"],
                                     r["reserved_before_bytes"], r["oom"]) for r in s["runs"]]
                t = time.perf_counter()
                res = fit.analyse(runs, fitmodel.Room(**s["room"]), name=s["family"], segments=segs)
                dt = time.perf_counter() - t
                # The remedy and training rows measure no straight line (older remedy files carry a placeholder
                # room of 1 byte): NA, not a made-up number.
                measured = s.get("line_peaks") and (s.get("line_room") or 0) > 1
                line = straight_line(tuple(s["values"]), s["line_peaks"], s["line_room"]) if measured else None
                real, now = s["real"], res.largest_value
                if real and now:
                    ok += 1
                    good += 0.9 * real <= now <= real
                    above += now > real
                table.append((s["family"], s["state"], "seq" if s["family"] == "lm-seq" else "batch",
                              f"{fmt(real)} ({fmt(s['real_hi'])})", fmt(s["nbmem"]), fmt(now), ratio(now, real),
                              fmt(line), ratio(line, real), res.method, f"{dt:.2f}s"))
    widths = [max(len(str(x)) for x in col) for col in zip(head, *table)]
    print("  ".join(h.ljust(w) for h, w in zip(head, widths)))
    for row in table:
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip())
    print(f"\nnbmem now within 10 % below the real boundary and never above it: {good} of {ok} rows; above: {above}")
    print(f"\n=== summary ===\nbench_fit: replayed {len(table)} rows from {len(paths)} files ({ok} with both a real "
          f"boundary and a prediction)")
    return 0


def malloc_probe(torch: Any) -> str:
    """How much of cudaMemGetInfo's free memory one cudaMalloc can take (it sets how tight the margin may be)."""
    gc.collect()
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    lo, hi = 0, 2048  # MiB short of free: lo fails, hi fits (found below)
    while True:
        try:
            x = torch.empty(free - hi * MiB, dtype=torch.uint8, device="cuda")
            del x
            break
        except torch.cuda.OutOfMemoryError:
            lo, hi = hi, hi * 2
    while hi - lo > 2:
        mid = (lo + hi) // 2
        try:
            x = torch.empty(free - mid * MiB, dtype=torch.uint8, device="cuda")
            del x
            hi = mid
        except torch.cuda.OutOfMemoryError:
            lo = mid
        torch.cuda.empty_cache()
    torch.cuda.empty_cache()
    return f"one cudaMalloc takes at most free − {hi} MiB (free {free / GiB:.2f} GiB)"


def kitsune_child(torch: Any, names: list[str]) -> int:
    """torch-kitsune's largest batch for each family (CPU only), printed as one JSON line."""
    from kitsune.predict import predict_memory

    torch.set_num_threads(4)
    fams = families(torch, "cpu")
    out: dict[str, Any] = {}
    for name in names:
        fam = fams[name]
        t = time.perf_counter()
        try:
            got = predict_memory(fam.make("cpu"), input_shape=fam.kitsune_shape, batch_size=1,
                                 optimizer=fam.kitsune_optimizer, training=True, gpu="h100", find_max_batch_size=True)
            out[name] = [got.max_batch_size, time.perf_counter() - t]
        except Exception as e:
            out[name] = f"failed ({type(e).__name__}: {str(e)[:60]})"
        print(json.dumps(out), flush=True)
    return 0


def load_competitors() -> dict[str, Any]:
    out: dict[str, Any] = {}
    try:
        import batch_probe

        out["batch-probe"] = batch_probe
    except Exception as e:
        out["batch-probe"] = f"not installed ({type(e).__name__})"
    try:
        from kitsune.predict import predict_memory

        out["torch-kitsune"] = predict_memory
    except Exception as e:
        out["torch-kitsune"] = f"not installed ({type(e).__name__})"
    return out


def _slim(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Trace entries without their stacks (the innermost user frame is kept), for the saved traces."""
    from nbmem.trace.linetrace import deepest_user_frame

    out = []
    for e in entries:
        d = {k: e[k] for k in ("action", "addr", "size", "stream") if k in e}
        where = deepest_user_frame(e.get("frames") or [])
        if where:
            file, _, rest = where.partition(":")
            d["frames"] = [{"filename": os.path.basename(file), "line": int(rest.split(" ")[0]), "name": "body"}]
        out.append(d)
    return out


def measure(torch: Any, fitting: Any, fam: Family, state: str, row: Row, competitors: dict[str, Any],
            saved: list[dict[str, Any]], keep_traces: bool) -> None:
    """One row: the state, nbmem's fit, the straight line, the real boundary, and the comparisons."""
    from nbmem.clean.release import TorchRelease
    from nbmem.fitting.analysis import prediction as fitmod
    from nbmem.fitting.runs import multigpu
    from nbmem.fitting.runs.state import restore_state, snapshot_state

    model = fam.make("cuda")
    opt = fam.optimizer(model)
    ns: dict[str, Any] = {}
    hold: list[Any] = []
    if state in ("stepped", "half"):
        fam.body(model, opt, ns, fam.values[0])
        ns.clear()
    if state == "half":
        free, total = torch.cuda.mem_get_info()
        hold.append(torch.empty(int(total * 0.5) - 4 * GiB, dtype=torch.uint8, device="cuda"))
        # and 4 GiB of 20 MiB segments, each left split by one 6 MiB tensor of three (two in three freed)
        small = [torch.empty(6 * MiB, dtype=torch.uint8, device="cuda") for _ in range(600)]
        hold += small[::3]
        del small
    gc.collect()
    torch.cuda.empty_cache()
    others = fam.others(model, opt)
    start = snapshot_state([model], [opt], others)

    def run(v: int) -> None:
        fam.body(model, opt, ns, v)

    def clean() -> None:
        ns.clear()

    # nbmem, capturing what it analysed (for --out)
    captured: dict[str, Any] = {}
    real_analyse = multigpu.analyse  # what the fit analyses each device's runs with

    def capture(runs: Any, room: Any, **kw: Any) -> Any:
        captured.update(runs=runs, room=room, segments=kw.get("segments", ()))
        return real_analyse(runs, room, **kw)

    multigpu.analyse = capture
    try:
        row.alloc_before = before = torch.cuda.memory_allocated()
        t = time.perf_counter()
        res = fitting.fit(run, fam.values, name=fam.var, clean=clean, modules=[model], optimizers=[opt],
                          others=others, stacks=True)
        row.t_nbmem = time.perf_counter() - t
        row.alloc_after = torch.cuda.memory_allocated()
    finally:
        multigpu.analyse = real_analyse
    row.nbmem, row.nbmem_pow2, row.method = res.largest_value, res.power_of_two, res.method
    row.restored_bytes, row.capacity, row.peak_where = res.restored_bytes, res.room.capacity_bytes, res.peak_where
    row.notes = [n for n in res.notes if n not in fitmod.ASSUMPTIONS]
    if res.largest_value is None:
        row.notes.append(f"no prediction: {res.reason}")
    print(str(res), flush=True)

    # the straight line through max_memory_allocated() at the same values
    t = time.perf_counter()
    gc.collect()
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    room = free + torch.cuda.memory_reserved()
    peaks = []
    for v in fam.values:
        torch.cuda.reset_peak_memory_stats()
        run(v)
        peaks.append(torch.cuda.max_memory_allocated())
        clean()
    restore_state(start)
    row.line = straight_line(fam.values, peaks, room)
    row.t_line = time.perf_counter() - t

    # the real boundary (with --out, the trace of the largest run that fitted and of the smallest that did not)
    trials: list[dict[str, Any]] = []
    edges: dict[str, Any] = {}
    source = TorchRelease()

    def three_in_a_row(v: int) -> bool:
        ok = True
        gc.collect()
        torch.cuda.empty_cache()
        # Each try starts as a fit leaves the user, as in the remedies' tries: a workspace the last try made would
        # pin the segment it was made in (6.8 GiB of ckpt's, seen after a try that ran out of memory).
        fitting.give_back_workspaces(source, {torch.cuda.current_device(): before})
        free, _ = torch.cuda.mem_get_info()
        reserved = torch.cuda.memory_reserved()
        trace = source.start_trace(stacks=False, max_entries=1_000_000) if keep_traces else None
        try:
            for _ in range(3):
                run(v)
            torch.cuda.synchronize()
        except Exception as e:
            if not fitting.is_out_of_memory(e):
                raise
            ok = False
        finally:
            entries = (source.finish_trace(trace, read=True) or [[]])[0] if trace is not None else []
            ns.clear()
            restore_state(start)
            gc.collect()
            torch.cuda.empty_cache()
        trials.append({"value": v, "ok": ok, "free": free, "reserved": reserved})
        key = "ok" if ok else "fail"
        if keep_traces and (key not in edges or (v > edges[key]["value"]) == ok):
            edges[key] = {"value": v, "free": free, "reserved": reserved, "entries": _slim(entries)}
        return ok

    t = time.perf_counter()
    row.real, row.real_hi = boundary(three_in_a_row, row.nbmem or row.line or fam.values[-1])
    row.t_real = time.perf_counter() - t
    # The last try's workspaces go too: left, one pinned a 6.2 GiB segment of ckpt's for every later row.
    fitting.give_back_workspaces(source, {torch.cuda.current_device(): before})

    if "batch-probe" in competitors and not isinstance(competitors["batch-probe"], str):
        t = time.perf_counter()
        try:
            def work(n: int) -> None:
                try:
                    run(n)
                    torch.cuda.synchronize()
                finally:
                    ns.clear()

            got = competitors["batch-probe"].probe(work, low=1, high=max(2 * (row.real_hi or row.real or 1), 64),
                                                   headroom=0.2, backend="torch", verbose=False)
            row.probe, row.probe_max = got, round(got / 0.8)
        except Exception as e:
            row.notes.append(f"batch-probe failed: {type(e).__name__}: {str(e)[:80]}")
        finally:
            ns.clear()
            restore_state(start)
            gc.collect()
            torch.cuda.empty_cache()
        row.t_probe = time.perf_counter() - t
    if keep_traces and captured:
        saved.append({"family": fam.name, "state": state, "values": list(fam.values), "real": row.real,
                      "real_hi": row.real_hi, "trials": trials, "room": dataclasses.asdict(captured["room"]),
                      "segments": [dataclasses.asdict(s) for s in captured["segments"]],
                      "runs": [{"value": r.value, "counted": r.counted, "oom": r.oom,
                                "allocated_before_bytes": r.allocated_before_bytes,
                                "reserved_before_bytes": r.reserved_before_bytes, "entries": _slim(list(r.entries))}
                               for r in captured["runs"]],
                      "line_peaks": peaks, "line_room": room, "nbmem": row.nbmem, "edges": edges, "result": res})
    ns.clear()
    hold.clear()


# -- issue 36: host memory as the limit ---------------------------------------------------------------------------
def offload_main(torch: Any, fitting: Any, host_gib: float, started: float) -> int:
    """The save_on_cpu row: the fit under a host limit, and the real boundary with real failures on both sides."""
    from nbmem.fitting.runs.hostwatch import empty_pinned_cache
    from nbmem.fitting.runs.state import restore_state, snapshot_state
    from nbmem.formatting import fmt_bytes
    from nbmem.measure.host import HostSource

    nn = torch.nn
    width, values = 4096, (1024, 2048, 4096)
    model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(width, width), nn.GELU())],
                          nn.Linear(width, 10)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    ns: dict[str, Any] = {}

    def run(b: int) -> None:
        ns["x"] = torch.randn(b, width, device="cuda")
        ns["y"] = torch.randint(0, 10, (b,), device="cuda")
        with torch.autograd.graph.save_on_cpu(pin_memory=True):
            ns["loss"] = nn.functional.cross_entropy(model(ns["x"]), ns["y"])
        ns["loss"].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    run(values[0])  # stepped: momentum buffers exist
    ns.clear()
    gc.collect()
    torch.cuda.empty_cache()
    start = snapshot_state([model], [opt])
    rss = HostSource().rss_bytes() or 0
    limit = int(rss + host_gib * GiB) if host_gib else None
    said = f"host_limit {fmt_bytes(limit)} (RSS {fmt_bytes(rss)} + {host_gib:g} GiB)" if limit else "the machine's"
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, {fmt_bytes(torch.cuda.mem_get_info()[1])}; "
          f"host: {said}", flush=True)
    t = time.perf_counter()
    res = fitting.fit(run, values, name="batch", clean=ns.clear, modules=[model], optimizers=[opt], host_limit=limit)
    t_fit = time.perf_counter() - t
    print(str(res), flush=True)
    fit_failures = [p.value for p in res.points if p.oom]

    def pool() -> int:
        return int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))

    how: dict[int, str] = {}

    def three_in_a_row(v: int) -> bool:
        gc.collect()
        torch.cuda.empty_cache()
        empty_pinned_cache()
        before, why = pool(), ""
        try:
            for _ in range(3):
                run(v)
            torch.cuda.synchronize()
        except Exception as e:
            if not fitting.is_out_of_memory(e):
                raise
            why = str(e).splitlines()[0][:80]
        finally:
            grown = pool() - before
            ns.clear()
            restore_state(start)
            gc.collect()
            torch.cuda.empty_cache()
            empty_pinned_cache()
        if not why and limit is not None and grown > limit - rss:
            why = f"pinned pool {fmt_bytes(grown)} over the {fmt_bytes(limit - rss)} the limit leaves"
        how[v] = why
        return not why

    t = time.perf_counter()
    # to the sample: where the host limits it, the boundary is a step (each pinned block doubles at a power of two),
    # and one percent short of it is not where it is
    real, real_hi = boundary(three_in_a_row, res.largest_value or values[-1], rel=0.0)
    t_real = time.perf_counter() - t
    hit = ("host memory" if res.host is not None and res.host.limits else "the GPU") if res.largest_value else "none"
    failed_at = how.get(real_hi or -1, "")
    print(f"\nsave_on_cpu (pinned): predicted {fmt(res.largest_value)}, real {fmt(real)} (fails at {fmt(real_hi)}: "
          f"{failed_at or 'NA'}), {ratio(res.largest_value, real)}; the answer is limited by {hit}; "
          f"the fit's own runs that failed: {fit_failures or 'none'}; fit {t_fit:.1f} s, real {t_real:.1f} s")
    ok = res.largest_value is not None and real is not None and 0.9 * real <= res.largest_value <= real
    print(f"\n=== summary ===\nbench_fit offload: save_on_cpu under {said} host memory, limited by {hit}: "
          f"{ratio(res.largest_value, real)} of the real boundary ({'within 10 % below' if ok else 'NOT within 10 %'}"
          f"{', ABOVE' if res.largest_value and real and res.largest_value > real else ''}); runs of the fit that "
          f"failed: {len(fit_failures)}; {time.perf_counter() - started:.0f} s")
    return 0


# -- issue 27: each remedy's prediction against its real boundary -------------------------------------------------
#: Far more than any family fits: every fit measures its remedies.
WANT = 10**8


@dataclass
class RemedyRow:
    family: str
    remedy: str  # "plain" for the fit's own prediction
    predicted: int | None = None
    real: int | None = None
    real_hi: int | None = None
    time_ratio: float | None = None
    t_fit: float | None = None  # the whole fit, plain runs and every remedy's (on the plain row)
    t_real: float | None = None
    step_s: float | None = None  # one step at the real boundary (the last of three in a row that ran there)
    alloc: str = ""  # memory_allocated() before → after the fit (on the plain row)
    note: str = ""


def remedies_main(torch: Any, fitting: Any, fams: dict[str, Family], names: list[str], budget_s: float,
                  room_gib: float, started: float, out: str = "") -> int:
    from nbmem.formatting import fmt_bytes

    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, {fmt_bytes(torch.cuda.mem_get_info()[1])}"
          + (f"; {room_gib:g} GiB left free for each family" if room_gib else ""), flush=True)
    rows: list[RemedyRow] = []
    saved: list[dict[str, Any]] = []
    for name in names:
        if time.perf_counter() - started > budget_s:
            rows.append(RemedyRow(name, "", note="not run: time budget spent"))
            continue
        try:
            measure_remedies(torch, fitting, fams[name], rows, room_gib, saved if out else None)
        except Exception as e:  # a family that breaks is reported; the others go on
            first = str(e).splitlines()[0][:160] if str(e) else ""
            rows.append(RemedyRow(name, "", note=f"{type(e).__name__}: {first}"))
            traceback.print_exc()
        finally:
            gc.collect()
            torch.cuda.empty_cache()
    head = ("family", "remedy", "predicted", "real (to)", "pred/real", "time/sample", "step at real", "t fit",
            "t real", "alloc before→after", "note")
    table = [(r.family, r.remedy, fmt(r.predicted), f"{fmt(r.real)} ({fmt(r.real_hi)})" if r.real else "",
              ratio(r.predicted, r.real), "" if r.time_ratio is None else f"{r.time_ratio:.2f}×",
              "" if r.step_s is None else f"{r.step_s:.3f}s",
              "" if r.t_fit is None else f"{r.t_fit:.1f}s", "" if r.t_real is None else f"{r.t_real:.1f}s",
              r.alloc, r.note) for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *table)]
    print()
    for t in (head, *table):
        print("  ".join(str(x).ljust(w) for x, w in zip(t, widths)).rstrip())
    ok = [r for r in rows if r.real is not None and r.predicted is not None]
    good = [r for r in ok if 0.9 * r.real <= r.predicted <= r.real]
    above = [f"{r.family}/{r.remedy}" for r in ok if r.predicted > r.real]
    fams_checked = {r.family for r in ok if r.remedy != "plain"}
    print(f"\n=== summary ===\nbench_fit remedies: within 10 % below the real boundary and never above it: {len(good)} "
          f"of {len(ok)} rows ({len(ok) - sum(r.remedy == 'plain' for r in ok)} remedy rows, "
          f"{len(fams_checked)} families); above: {', '.join(above) or 'none'}; "
          f"{time.perf_counter() - started:.0f} s")
    if out:
        os.makedirs(out, exist_ok=True)
        with gzip.open(os.path.join(out, "remedy_traces.json.gz"), "wt") as f:
            json.dump(saved, f)
    return 0


def measure_remedies(torch: Any, fitting: Any, fam: Family, rows: list[RemedyRow], room_gib: float,
                     saved: list[dict[str, Any]] | None = None) -> None:
    """A family's fit with ``want`` far beyond what fits, then the real boundary plainly and under each remedy the
    fit measured (applied as the fit applies it), by bisection with real OOMs."""
    from contextlib import nullcontext

    from nbmem.clean.release import TorchRelease
    from nbmem.fitting.analysis.model import margin_bytes_for
    from nbmem.fitting.runs import multigpu, remedies
    from nbmem.fitting.runs.state import restore_state, snapshot_state
    from nbmem.formatting import fmt_bytes

    hold: list[Any] = []
    release = TorchRelease()
    margin = None
    if room_gib:
        free, _ = torch.cuda.mem_get_info()
        room = int(room_gib * GiB)
        hold.append(torch.empty(max(0, free - room), dtype=torch.uint8, device="cuda"))
        margin = margin_bytes_for(room, 0)
    model = fam.make("cuda")
    opt = fam.optimizer(model)
    ns: dict[str, Any] = {}
    others = fam.others(model, opt)
    gc.collect()
    torch.cuda.empty_cache()
    start = snapshot_state([model], [opt], others)

    def run(v: int) -> None:
        fam.body(model, opt, ns, v)

    def clean() -> None:
        ns.clear()

    # With ``saved``: what each analysis of the fit saw, by the list of runs it was handed (the plain runs', then
    # each remedy's); the last analysis of each list is its prediction.
    # Keyed by the first run's trace: every analysis gets a new list (their ids are reused once one is freed),
    # while one fit's runs keep their trace objects, which the kept lists hold alive.
    analysed: dict[int, tuple[list[Any], Any, Any]] = {}
    real_analyse = multigpu.analyse  # what the fit analyses each device's runs with

    def capture(runs: Any, room: Any, **kw: Any) -> Any:
        if runs:
            analysed[id(runs[0])] = (list(runs), room, kw.get("segments", ()))
        return real_analyse(runs, room, **kw)

    if saved is not None:
        multigpu.analyse = capture

    def outside() -> int:
        """Free plus reserved: it falls only when something outside the allocator takes device memory (the code
        of kernels CUDA loads on first use), which the fit cannot see coming; printed as it goes."""
        torch.cuda.synchronize()
        return int(torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved())

    drift = [("before the fit", outside())]
    before = torch.cuda.memory_allocated()
    t = time.perf_counter()
    try:
        res = fitting.fit(run, fam.values, name=fam.var, clean=clean, modules=[model], optimizers=[opt],
                          others=others, stacks=True, want=WANT, margin_bytes=margin)
    finally:
        multigpu.analyse = real_analyse
    t_fit = time.perf_counter() - t
    drift.append(("after the fit", outside()))
    fits = list(analysed.values())  # in the order their lists were first analysed: plain, then each remedy's
    after = torch.cuda.memory_allocated()
    print(str(res), flush=True)
    measured = {r.name: r for r in res.remedies if r.name in (remedies.CHECKPOINTING, remedies.BF16)}
    cands, _ = remedies.candidates(torch, [model], others)
    left = [n for n in res.notes if " left out" in n]
    plan: list[tuple[str, Any]] = [("plain", None)] + [(c.name, c) for c in cands if c.name in measured]
    # the plain runs' list first, then each candidate's in order (one that failed before its analysis shifts these)
    by_name = dict(zip(["plain", *(c.name for c in cands)], fits))
    for label, cand in plan:
        row = RemedyRow(fam.name, label)
        rows.append(row)
        if cand is None:
            row.predicted, row.t_fit, row.alloc = res.largest_value, t_fit, f"{fmt(before)}→{fmt(after)}"
            row.note = f"{res.steps_run} steps; " + "; ".join(left)
        else:
            row.predicted, row.time_ratio = measured[label].largest_value, measured[label].time_per_sample_ratio
        go = run if cand is None else cand.wrap(run)
        step_s: dict[int, float] = {}
        edges: dict[str, Any] = {}

        def three_in_a_row(v: int, cand: Any = cand, go: Any = go, step_s: dict[int, float] = step_s,
                           edges: dict[str, Any] = edges) -> bool:
            ok = True
            gc.collect()
            torch.cuda.empty_cache()
            # Each try starts as the fit left the user: the cuBLAS workspaces the last try made go (as the fit's
            # go), else one stays pinning the segment it was made in, whose free part the next try cannot use
            # for its large blocks (716 MiB of 748 MiB under bf16: 2,356 where the fit's state allows 2,546).
            fitting.give_back_workspaces(release, {torch.cuda.current_device(): before})
            free = torch.cuda.mem_get_info()[0]
            reserved = torch.cuda.memory_reserved()
            trace = release.start_trace(stacks=False, max_entries=1_000_000) if saved is not None else None
            try:
                with nullcontext() if cand is None else cand.applied():
                    for _ in range(3):
                        torch.cuda.synchronize()
                        t = time.perf_counter()
                        go(v)
                        torch.cuda.synchronize()
                        step_s[v] = time.perf_counter() - t
            except Exception as e:
                if not fitting.is_out_of_memory(e):
                    raise
                ok = False
            finally:
                entries = (release.finish_trace(trace, read=True) or [[]])[0] if trace is not None else []
                ns.clear()
                restore_state(start)
                gc.collect()
                torch.cuda.empty_cache()
            key = "ok" if ok else "fail"
            if trace is not None and (key not in edges or (v > edges[key]["value"]) == ok):
                edges[key] = {"value": v, "free": free, "reserved": reserved, "entries": _slim(entries)}
            return ok

        t = time.perf_counter()
        row.real, row.real_hi = boundary(three_in_a_row, row.predicted or fam.values[-1])
        drift.append((f"after the {label} bisection", outside()))
        fitting.give_back_workspaces(release, {torch.cuda.current_device(): before})  # as after the training rows
        if saved is not None and label in by_name:
            runs, room, segments = by_name[label]
            saved.append({"family": f"{fam.name}/{label}", "state": "fresh", "values": list(fam.values),
                          "real": row.real, "real_hi": row.real_hi, "nbmem": row.predicted,
                          "room": dataclasses.asdict(room), "segments": [dataclasses.asdict(x) for x in segments],
                          "runs": [{"value": r.value, "counted": r.counted, "oom": r.oom,
                                    "allocated_before_bytes": r.allocated_before_bytes,
                                    "reserved_before_bytes": r.reserved_before_bytes, "entries": _slim(list(r.entries))}
                                   for r in runs], "edges": edges})
        row.t_real = time.perf_counter() - t
        row.step_s = step_s.get(row.real) if row.real is not None else None
        print(f"  {fam.name}/{label}: predicted {fmt(row.predicted)}, real {fmt(row.real)} "
              f"({ratio(row.predicted, row.real)})", flush=True)
    print(f"  {fam.name}: free + reserved " + ", ".join(f"{fmt_bytes(b - drift[0][1], signed=True)} {at}"
                                                     for at, b in drift[1:]) + " (against before the fit)", flush=True)
    ns.clear()
    hold.clear()


def straight_line(values: tuple[int, ...], peaks: list[int], room: int) -> int | None:
    """Issue 23's baseline: least squares through (value, max_memory_allocated), solved for the room."""
    n = len(values)
    mx, my = sum(values) / n, sum(peaks) / n
    sxx = sum((v - mx) ** 2 for v in values)
    b = sum((v - mx) * (p - my) for v, p in zip(values, peaks)) / sxx
    a = my - b * mx
    return None if b <= 0 else int((room - a) / b)


def boundary(ok: Callable[[int], bool], start: int, rel: float = 0.01) -> tuple[int | None, int | None]:
    """The largest value that runs (and the smallest above it that did not), from ``start``, to ``rel``."""
    start = max(1, int(start))
    if ok(start):
        lo, step = start, 0.02
        while True:
            v = int(lo * (1 + step)) + 1
            if not ok(v):
                hi = v
                break
            lo, step = v, step * 2
    else:
        hi, step = start, 0.05
        while True:
            v = int(hi * (1 - step))
            if v < 1:
                return None, hi
            if ok(v):
                lo = v
                break
            hi, step = v, min(0.5, step * 2)
    while hi - lo > max(1, int(lo * rel)):
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo, hi


def print_table(rows: list[Row], competitors: dict[str, Any]) -> None:
    head = ("family", "state", "var", "real (to)", "nbmem", "nb/real", "line", "line/real", "b-probe", "kitsune",
            "t real", "t nbmem", "t line", "t probe", "alloc before→after")
    table = []
    for r in rows:
        if r.error and r.real is None and r.nbmem is None:
            table.append((r.family, r.state, r.var, r.error, *[""] * 11))
            continue
        table.append((r.family, r.state, r.var, f"{fmt(r.real)} ({fmt(r.real_hi)})", fmt(r.nbmem),
                      ratio(r.nbmem, r.real), fmt(r.line), ratio(r.line, r.real),
                      "" if r.probe is None else f"{r.probe:,} (max {r.probe_max:,})",
                      "" if r.kitsune is None else f"{r.kitsune:,}",
                      *("" if x is None else f"{x:.1f}s" for x in (r.t_real, r.t_nbmem, r.t_line, r.t_probe)),
                      f"{fmt(r.alloc_before)}→{fmt(r.alloc_after)}"))
    widths = [max(len(str(x)) for x in col) for col in zip(head, *table)]
    print()
    print("  ".join(h.ljust(w) for h, w in zip(head, widths)))
    for t in table:
        print("  ".join(str(x).ljust(w) for x, w in zip(t, widths)).rstrip())
    ok = [r for r in rows if r.real is not None and r.nbmem is not None]
    good = [r for r in ok if r.nbmem <= r.real and r.nbmem >= 0.9 * r.real]
    above = [r for r in ok if r.nbmem > r.real]
    print(f"\nnbmem within 10 % below the real boundary and never above it: {len(good)} of {len(ok)} rows"
          + (f"; ABOVE on {', '.join(f'{r.family}/{r.state}' for r in above)}" if above else ""))
    lines = [r for r in rows if r.real is not None and r.line is not None]
    print(f"straight line within ±10 %: {sum(1 for r in lines if abs(r.line / r.real - 1) <= 0.1)} of {len(lines)}; "
          f"above the real boundary: {sum(1 for r in lines if r.line > r.real)}")
    for k, v in competitors.items():
        if isinstance(v, str):
            print(f"{k}: {v}")
    print("batch-probe: its answer is 80 % of the largest batch its own binary search ran once (max in brackets); "
          "torch-kitsune: its formula against its table's H100 (80 GB), capped at 4,096")
    for r in rows:
        for n in r.notes:
            print(f"  {r.family}/{r.state}: {n}")
        if r.peak_where[0] or r.peak_where[1]:
            print(f"  {r.family}/{r.state}: peak at {r.values[0]}: {r.peak_where[0]}; at {fmt(r.nbmem)}: "
                  f"{r.peak_where[1]}")


if __name__ == "__main__":
    sys.exit(main())
