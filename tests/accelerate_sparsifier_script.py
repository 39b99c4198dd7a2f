"""Run by tests/test_integrations.py under ``accelerate launch --multi_gpu --num_processes 2``
(with ``Accelerator(cpu=True)``: two CPU processes over gloo; in accelerate 1.15 ``--cpu
--num_processes 2`` starts a single process).

Trains a small MLP on scikit-learn digits with a target schedule in a loop prepared by
``accelerator.prepare``, checkpoints the Sparsifier with ``register_for_checkpointing``, and
writes (on the main process) whether the slopes are identical on every rank to ``argv[1]``.
"""

from __future__ import annotations

import json
import sys

import torch
from accelerate import Accelerator
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import linearize
from linearize import LinearizableActivation


def main(out_path: str, ckpt_dir: str) -> None:
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    d = load_digits()
    data = TensorDataset(torch.tensor(d.data, dtype=torch.float32) / 16.0, torch.tensor(d.target))
    loader = DataLoader(data, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(0))
    model = nn.Sequential(
        nn.Linear(64, 64), LinearizableActivation("relu", 64, -1), nn.Linear(64, 10)
    )
    optimizer = torch.optim.SGD(linearize.param_groups(model, weight_decay=5e-4), lr=0.05, momentum=0.9)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    total = 30
    sparsifier = linearize.Sparsifier(model, linearize.schedules.target(0.25, end=20), total, lam=0.01)
    sparsifier.attach(optimizer)
    accelerator.register_for_checkpointing(sparsifier)
    step = 0
    while step < total:
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            accelerator.backward(loss)
            optimizer.step()
            step += 1
            if step == total:
                break
    slopes = torch.cat([u.slope.detach() for _, u in linearize.units(model)])
    gathered = accelerator.gather(slopes.unsqueeze(0))  # [processes, C]
    accelerator.save_state(ckpt_dir)
    accelerator.wait_for_everyone()  # rank 0 writes the files the other ranks load next
    saved_state = sparsifier.state_dict()
    sparsifier.load_state_dict({**saved_state, "step_count": 0, "history": []})  # forget, then restore
    accelerator.load_state(ckpt_dir)
    if accelerator.is_main_process:
        result = {
            "processes": accelerator.num_processes,
            "identical": bool(all(torch.equal(gathered[0], row) for row in gathered)),
            "fraction": sparsifier.nonlinear_fraction(),
            "steps": total,
            "restored": sparsifier.state_dict() == saved_state,
        }
        with open(out_path, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
