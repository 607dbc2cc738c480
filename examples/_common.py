"""What the example scripts share: the small MLP, each rank's synthetic batch, and the loss report
that tests/test_examples.py parses (``step <i> loss <repr(float)>`` on rank 0)."""
import argparse
import importlib
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

DIN, DH, DOUT, BATCH = 16, 64, 4, 32


def parser(doc):
    """The options every example takes: --backend and --steps (add your own, then parse)."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--backend", default="smddp", help="smddp or gloo (default smddp)")
    p.add_argument("--steps", type=int, default=3)
    return p


def require(*modules):
    """Imports the optional packages an example needs (returns the first), or exits saying how to
    install them."""
    try:
        loaded = [importlib.import_module(m) for m in modules]
    except ImportError as e:
        sys.exit(f"this example needs {' and '.join(modules)} (pip install -r requirements-examples.txt): {e}")
    return loaded[0]


def init(backend):
    """Joins the job torchrun started (env://) on `backend`."""
    if backend == "smddp":
        import smddp  # noqa: F401  registers the "smddp" backend
    dist.init_process_group(backend=backend)


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIN, DH), nn.Tanh(), nn.Linear(DH, DH), nn.Tanh(), nn.Linear(DH, DOUT))


def make_batch(rank):
    """This rank's synthetic regression batch: different on every rank, same on every run."""
    teacher = torch.randn(DIN, DOUT, generator=torch.Generator().manual_seed(42))
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(BATCH, DIN, generator=g)
    return x, torch.sin(x @ teacher)


def report(step, loss):
    # mean over the ranks, summed in float64: exact whatever the reduction order
    t = loss.detach().double().reshape(1)
    dist.all_reduce(t)
    if dist.get_rank() == 0:
        print(f"step {step} loss {t.item() / dist.get_world_size()!r}", flush=True)
