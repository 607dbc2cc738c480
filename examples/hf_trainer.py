"""Hugging Face Trainer on smddp (optional: needs transformers and accelerate).

    pip install -r requirements-examples.txt
    torchrun --nproc-per-node 2 examples/hf_trainer.py --backend smddp [--steps 3]

The Trainer (through accelerate) takes the process group that is already initialized, so the
only change to a Trainer script is to start it on smddp before building TrainingArguments and
leave ``ddp_backend`` unset (transformers' parser refuses "smddp" as a choice, and accelerate
refuses it on CPU). On a CPU-only machine ``use_cpu=True`` is needed too, on any backend: without
it the Trainer does not wrap the model and each rank trains alone. The Trainer then wraps the model
in DistributedDataParallel over that group, gives each rank its shard of the dataset and gathers
the logged loss across the ranks. A tiny Llama built from its config (nothing downloaded) trains
on random token ids; rank 0 prints each step's logged loss: ``step <i> loss <repr(float)>``.
"""
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import init, parser, require  # noqa: E402  (examples/ is on sys.path)

VOCAB, SEQ, SAMPLES = 128, 16, 64


def main():
    p = parser(__doc__)
    args = p.parse_args()
    require("transformers", "accelerate")
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments
    init(args.backend)  # before TrainingArguments: the Trainer uses the group it finds

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                         attn_implementation="eager")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=torch.Generator().manual_seed(1))
    dataset = [{"input_ids": row, "labels": row} for row in ids]

    class PrintLoss(TrainerCallback):
        def on_log(self, targs, state, control, logs=None, **kwargs):
            if logs and "loss" in logs and dist.get_rank() == 0:
                print(f"step {state.global_step - 1} loss {float(logs['loss'])!r}", flush=True)

    with tempfile.TemporaryDirectory() as out:
        targs = TrainingArguments(output_dir=out, per_device_train_batch_size=4, max_steps=args.steps,
                                  learning_rate=1e-3, logging_steps=1, report_to=[], use_cpu=True,
                                  save_strategy="no", seed=0, data_seed=0, dataloader_num_workers=0,
                                  disable_tqdm=True)
        trainer = Trainer(model=model, args=targs, train_dataset=dataset, callbacks=[PrintLoss()])
        trainer.train()
    wrapped = trainer.model_wrapped  # what trained: DDP over the group initialized above
    assert type(wrapped).__name__ == "DistributedDataParallel", type(wrapped)
    assert dist.get_backend(wrapped.process_group) == args.backend, dist.get_backend(wrapped.process_group)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
