"""One of two DDP ranks of GRPOTrainer in server mode against a llamarl_ddma
vLLM server (test_trl_server.py starts them with torchrun): 2 steps, one more
sync; rank 0 (which holds the transfer) writes the trained weights and the
transfer's version to OUT, every rank its weights' checksum.

    python -m torch.distributed.run --nproc-per-node 2 trl_server_worker.py URL MODEL_DIR OUT
"""

import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from test_trl import config, length_reward, prompts, tokenizer

from llamarl_core.integrations.trl import GRPOTrainer


def main(url: str, model_dir: str, out: str) -> None:
    args = config("dapo", use_vllm=True, vllm_mode="server", vllm_server_base_url=url, max_steps=2,
                  learning_rate=1e-2)
    trainer = GRPOTrainer(model=model_dir, reward_funcs=length_reward, args=args, train_dataset=prompts(),
                          processing_class=tokenizer())
    generation, rank = trainer.vllm_generation, int(os.environ["RANK"])
    result = {"transfer": generation.transfer is not None}
    try:
        trainer.train()
        generation.sync_weights()  # every rank walks the parameters; rank 0 sends
        model = trainer.accelerator.unwrap_model(trainer.model)
        result["checksum"] = sum(float(p.detach().double().sum()) for p in model.parameters())
        if generation.transfer is not None:
            result["version"] = generation.transfer.version
            save_file({n: p.detach().contiguous() for n, p in model.state_dict().items()},
                      str(Path(out) / "trained.safetensors"))
    finally:
        if generation.transfer is not None:
            generation.transfer.destroy()
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(*sys.argv[1:])
