"""DeepSpeed ZeRO (stage 1, 2 or 3) with a torch optimizer on CPU (optional: needs deepspeed).

    pip install -r requirements-examples.txt      # DS_BUILD_OPS=0: no native ops are built
    torchrun --nproc-per-node 2 examples/deepspeed_zero.py --backend smddp --stage 3 [--steps 3]

DeepSpeed runs on its CPU accelerator (DS_ACCELERATOR=cpu, set below unless already
set) and initializes torch.distributed itself with ``deepspeed.init_distributed(
dist_backend=...)``. ZeRO-1/2 partition the optimizer state (and gradients); ZeRO-3
also the parameters. The optimizer is torch's AdamW (DeepSpeed's fused optimizers
need compiled ops).

Every rank builds the same model (same seed), trains on its own synthetic batch
(seeded by its rank), and rank 0 prints the loss averaged over the ranks,
one line per step: ``step <i> loss <repr(float)>``.
"""
import os
import warnings

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from _common import BATCH, make_batch, make_model, parser, report, require  # noqa: E402  (examples/ is on sys.path)


def main():
    p = parser(__doc__)
    p.add_argument("--stage", type=int, default=2, choices=[1, 2, 3], help="ZeRO stage")
    args = p.parse_args()
    deepspeed = require("deepspeed")
    if args.backend == "smddp":
        import smddp  # noqa: F401  registers the "smddp" backend
    # DeepSpeed 0.19 calls the names torch 2.13 deprecated (all_gather_into_tensor, ...)
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated",
                            category=FutureWarning)

    deepspeed.init_distributed(dist_backend=args.backend)  # env:// (set by torchrun)
    rank = dist.get_rank()

    model = make_model()
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": args.stage},
        "zero_allow_untested_optimizer": True,  # a torch optimizer under ZeRO
        "steps_per_print": 1 << 30,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, config=config,
                                           optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))

    x, y = make_batch(rank)
    for step in range(args.steps):
        loss = F.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        report(step, loss)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
