"""A Weights & Biases sweep whose agents decode the images once, not once per agent.

Every ``wandb agent`` process is a fresh interpreter, so a plain training script decodes and
resizes every image again in every agent. Here ``train()`` asks cachekit for the image
column instead: the first agent decodes into the cache, agents that start meanwhile wait for
it and then map the same file, and every later agent maps it in milliseconds. cachekit puts
the entry key, hit or miss, build and wait seconds, rows and bytes in each run's summary
under ``cachekit/``.

    pip install "cachekit[wandb]"
    python examples/wandb_sweep.py --make-data /tmp/covers     # images + /tmp/covers/labels.csv
    cachekit build /tmp/covers/labels.csv --column img_path --size 32x32   # optional prebuild

    # one run, no account needed:
    WANDB_MODE=offline python examples/wandb_sweep.py --csv /tmp/covers/labels.csv

    # a real sweep (after `wandb login`): create it, then start agents anywhere that sees the
    # same cache directory ($CACHEKIT_DIR, default ~/.cache/cachekit):
    python examples/wandb_sweep.py --sweep --csv /tmp/covers/labels.csv
    wandb agent ENTITY/cachekit-sweep/SWEEP_ID     # in several terminals
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pandas as pd
import torch
import wandb
from torch import nn
from torch.utils.data import DataLoader

import cachekit

PROJECT = "cachekit-sweep"
CLASSES = ("red", "green", "blue")  # the generated images' dominant colour
DEFAULTS: dict[str, Any] = {
    "csv": None,  # the labelled CSV: img_path,label
    "size": 32,
    "lr": 0.01,
    "batch_size": 32,
    "channels": 16,
    "steps": 40,
    "num_workers": 0,
}


def sweep_config(csv: str) -> dict[str, Any]:
    """A random search over the learning rate, batch size and width, on one fixed data set.

    ``csv`` and ``size`` are fixed values, so every agent asks for the same cache entry. The
    default command passes the parameters as ``--name=value`` after the program; ``main``
    ignores them because ``wandb.init`` reads them from the sweep.
    """
    return {
        "program": os.path.relpath(__file__),  # start `wandb agent` from this same directory
        "method": "random",
        "metric": {"name": "loss", "goal": "minimize"},
        "parameters": {
            "csv": {"value": str(Path(csv).resolve())},
            "size": {"value": DEFAULTS["size"]},
            "lr": {"distribution": "log_uniform_values", "min": 1e-3, "max": 1e-1},
            "batch_size": {"values": [16, 32, 64]},
            "channels": {"values": [8, 16, 32]},
            "steps": {"value": DEFAULTS["steps"]},
        },
    }


def train(csv: Optional[str] = None) -> dict[str, Any]:
    """One sweep run: map the cached images, train a small CNN for a few steps, log the loss.

    Uses the active wandb run if the caller started one, else starts its own (as under
    ``wandb agent``) and finishes it. The cache is ``cachekit.Cache()``: $CACHEKIT_DIR, else
    ~/.cache/cachekit. Returns the summary fields it logged.
    """
    own_run = wandb.run is None
    run = wandb.init(project=PROJECT, config=DEFAULTS) if own_run else wandb.run
    try:
        config = {**DEFAULTS, **{k: v for k, v in dict(run.config).items() if v is not None}}
        if csv is not None:
            config["csv"] = csv
        if not config["csv"]:
            raise SystemExit("no data: pass --csv FILE (make one with --make-data DIR)")
        run.config.update({"csv": config["csv"]}, allow_val_change=True)

        df = pd.read_csv(config["csv"])
        # The only cachekit lines a train function needs: decoded once, then mapped.
        entry = cachekit.Cache().images(df["img_path"], size=config["size"])
        dataset = entry.dataset(targets=df["label"].to_numpy())

        # Proof that every agent trains on the same bytes: compare this across runs.
        data_hash = hashlib.blake2b(np.ascontiguousarray(entry.array), digest_size=16)
        data_hash.update(df["label"].to_numpy(dtype=np.int64).tobytes())
        run.summary["data_blake2b"] = data_hash.hexdigest()

        loss = _fit(dataset, config, run)
        run.summary["loss"] = loss
        return {name: run.summary[name] for name in run.summary.keys()
                if name.startswith("cachekit/") or name in ("loss", "data_blake2b")}
    finally:
        if own_run:
            run.finish()


def _fit(dataset: Any, config: dict[str, Any], run: Any) -> float:
    torch.manual_seed(0)
    loader = DataLoader(dataset, batch_size=int(config["batch_size"]), shuffle=True,
                        num_workers=int(config["num_workers"]), drop_last=False)
    model = small_cnn(int(config["channels"]), len(CLASSES))
    optimizer = torch.optim.Adam(model.parameters(), lr=float(config["lr"]))
    step, loss = 0, float("nan")
    while step < int(config["steps"]):
        for images, labels in loader:
            x = images.float().div_(255.0)  # uint8 CHW batches straight from the cache
            batch_loss = nn.functional.cross_entropy(model(x), labels)
            optimizer.zero_grad()
            batch_loss.backward()
            optimizer.step()
            loss = batch_loss.item()
            run.log({"loss": loss}, step=step)
            step += 1
            if step >= int(config["steps"]):
                break
    return loss


def small_cnn(channels: int, classes: int) -> nn.Module:
    """Two conv blocks and a linear head: enough to learn the dominant colour."""
    return nn.Sequential(
        nn.Conv2d(3, channels, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * channels, classes),
    )


def make_data(directory: str, count: int = 256, seed: int = 0) -> Path:
    """Write ``count`` generated cover-like JPEGs and ``labels.csv`` (img_path,label) there.

    The label is the index of the image's dominant colour channel, so a tiny CNN can learn it.
    """
    from PIL import Image

    from cachekit.samples import write_sample_images

    directory_path = Path(directory).resolve()
    paths = write_sample_images(directory_path / "images", count, seed=seed)
    labels = []
    for path in paths:
        with Image.open(path) as im:
            im.draft("RGB", (64, 64))  # the label needs the mean colour only
            labels.append(int(np.asarray(im.convert("RGB")).reshape(-1, 3).mean(0).argmax()))
    csv = directory_path / "labels.csv"
    pd.DataFrame({"img_path": paths, "label": labels}).to_csv(csv, index=False)
    return csv


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", help="labelled CSV with img_path and label columns")
    parser.add_argument("--make-data", metavar="DIR", help="write sample images and a CSV")
    parser.add_argument("--count", type=int, default=256, help="images for --make-data")
    parser.add_argument("--sweep", action="store_true", help="create the sweep and exit")
    # `wandb agent` appends the sweep's parameters as --name=value; wandb.init reads them.
    args, _ = parser.parse_known_args(argv)
    if args.make_data:
        csv = make_data(args.make_data, args.count)
        print(f"wrote {args.count} images and {csv}\nnext: python {sys.argv[0]} --csv {csv}")
    elif args.sweep:
        if not args.csv:
            parser.error("--sweep needs --csv")
        sweep_id = wandb.sweep(sweep_config(args.csv), project=PROJECT)
        print(f"start agents with: wandb agent {PROJECT}/{sweep_id}")
    else:
        print(train(args.csv))


if __name__ == "__main__":
    main()
