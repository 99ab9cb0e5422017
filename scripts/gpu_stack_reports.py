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
import time
from pathlib import Path

CELLS = [
    ("load", "%load_ext nbmem\n%cudamem on"),
    ("imports", "import torch\nfrom transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments\n"
                "from peft import LoraConfig, get_peft_model\ntorch.cuda.init()"),
    ("model", "cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers={layers},\n"
              "                  num_attention_heads=16, num_key_value_heads=16)\n"
              "model = LlamaForCausalLM(cfg).to('cuda')"),
    ("lora", "model = get_peft_model(model, LoraConfig(r=16, target_modules=['q_proj', 'v_proj'], task_type='CAUSAL_LM'))"),
    ("data", "class Tokens(torch.utils.data.Dataset):\n"
             "    def __len__(self):\n        return 64\n"
             "    def __getitem__(self, i):\n"
             "        ids = torch.randint(0, 32000, (256,))\n"
             "        return {'input_ids': ids, 'labels': ids}\n"
             "args = TrainingArguments(output_dir='{out}', per_device_train_batch_size=8, max_steps=6, logging_steps=100,\n"
             "                         report_to=[], save_strategy='no', bf16=True)\n"
             "trainer = Trainer(model=model, args=args, train_dataset=Tokens())"),
    ("train", "result = trainer.train()"),
    ("del model", "del model"),
    ("leaks", "import nbmem\nowners = nbmem.leaks()\nprint(owners[['name', 'bytes', 'tensors', 'what', 'also_held_by']].to_string())\n"
              "print(len(nbmem.leaks(detail=True)), 'rows with detail=True')"),
    ("compiled", "mlp = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048)).cuda()\n"
                 "cmlp = torch.compile(mlp, mode='reduce-overhead')\n"
                 "for _ in range(3):\n    y = cmlp(torch.randn(256, 2048, device='cuda'))"),
]


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
    from nbmem.magics import session_of

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
        if name not in ("load", "leaks"):
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
