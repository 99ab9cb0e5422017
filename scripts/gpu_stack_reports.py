"""What nbmem says on the stack people fine-tune with, read as its author would (issues 18 and 19).

    python3 scripts/gpu_stack_reports.py [--layers 8] [--out DIR]

A real IPython shell with `%cudamem on` runs a notebook's cells: a random-init Llama from `LlamaConfig` (no
download), a peft LoRA adapter, transformers' `Trainer` on synthetic tokens, then `del model` while the
trainer still holds it, and a compiled module. Each cell's report is printed as the notebook shows it
(text), with the number of owner rows, so a person can read whether the first screen says who holds what.
Needs CUDA, transformers and peft (carried as wheels: scripts/gpu_wheels.sh).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import textwrap
import time
from pathlib import Path

CELLS = [(name, textwrap.dedent(src).strip()) for name, src in [
    ("load", """
        %load_ext nbmem
        %cudamem on"""),
    ("imports", """
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
        from peft import LoraConfig, get_peft_model
        torch.cuda.init()"""),
    ("model", """
        cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers={layers},
                          num_attention_heads=16, num_key_value_heads=16)
        model = LlamaForCausalLM(cfg).to('cuda')"""),
    ("lora", """
        model = get_peft_model(model, LoraConfig(r=16, target_modules=['q_proj', 'v_proj'], task_type='CAUSAL_LM'))"""),
    ("data", """
        class Tokens(torch.utils.data.Dataset):
            def __len__(self):
                return 64
            def __getitem__(self, i):
                ids = torch.randint(0, 32000, (256,))
                return {'input_ids': ids, 'labels': ids}
        args = TrainingArguments(output_dir='{out}', per_device_train_batch_size=8, max_steps=6,
                                 logging_steps=100, report_to=[], save_strategy='no', bf16=True)
        trainer = Trainer(model=model, args=args, train_dataset=Tokens())"""),
    ("train", "result = trainer.train()"),
    ("del model", "del model"),
    ("leaks", """
        import nbmem
        owners = nbmem.leaks()
        print(owners[['name', 'bytes', 'tensors', 'what', 'also_held_by']].to_string())
        print(len(nbmem.leaks(detail=True)), 'rows with detail=True')"""),
    ("fit setup", """
        lm = LlamaForCausalLM(cfg).to('cuda')
        opt = torch.optim.AdamW(lm.parameters(), lr=1e-4)"""),
    ("fit", """
        %%cudamem --fit batch=2,4,8
        ids = torch.randint(0, 32000, (batch, 512), device='cuda')
        with torch.autocast('cuda', dtype=torch.bfloat16):
            loss = lm(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)"""),
    ("compiled", """
        mlp = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048)).cuda()
        cmlp = torch.compile(mlp, mode='reduce-overhead')
        for _ in range(3):
            y = cmlp(torch.randn(256, 2048, device='cuda'))"""),
]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    os.environ.setdefault("IPYTHONDIR", tempfile.mkdtemp(prefix="nbmem-ipython-"))
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    cfg = Config()
    cfg.HistoryManager.hist_file = ":memory:"
    cfg.Nbmem.gauge = "none"
    cfg.InteractiveShell.colors = "nocolor"
    sh = InteractiveShell.instance(config=cfg)
    from nbmem.ipython.root import session_of

    lines: list[str] = []
    work = tempfile.mkdtemp(prefix="nbmem-trainer-")
    for name, src in CELLS:
        src = src.replace("{layers}", str(a.layers)).replace("{out}", work)
        t0 = time.perf_counter()
        r = sh.run_cell(src, store_history=True)
        took = time.perf_counter() - t0
        head = f"==== [{name}] {'ok' if r.success else 'FAILED'} in {took:.1f} s"
        print(head, flush=True)
        lines.append(head)
        if not r.success:
            lines.append(repr(r.error_before_exec or r.error_in_exec))
        if name == "fit":
            fit = session_of(sh).last_fit
            lines.append(str(fit) if fit is not None else "no fit result")
        elif name not in ("load", "leaks"):
            rep = session_of(sh).last_report
            if rep is not None and rep.cell == sh.execution_count - 1:
                lines.append(f"owner rows: {len(rep.findings)}; shown: {len(rep.holders.shown)}")
                lines.append(str(rep))
    text = "\n".join(lines)
    print(text)
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "stack_reports.txt").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
