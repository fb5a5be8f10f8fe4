"""``fedsga-edge partition``: a dataset's partition written as one folder per device.

To rehearse a deployment on public data: the same run flags as ``simulate`` give exactly the partition
``simulate`` uses for that seed (``runbuild.plan_run``), and each device's share goes to ``OUT/client-NNN/``
in the image-folder layout ``device --data`` reads (``<class>/<position>.png``, lossless PNG, so the share's
pixels and sample order come back unchanged) or to ``OUT/client-NNN.npz``. ``OUT/dataset.json`` is what the
coordinator needs instead of the data (``coordinator --classes``): the class names in class-id order, the
input size and the normalisation, plus where the partition came from; ``--test`` also writes the test split
(``OUT/test``) for ``coordinator --test-data``. Copy each ``client-NNN`` to its device.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import typer

from .runflags import run_config, with_run_options

__all__ = ["register", "partition"]


def register(app: typer.Typer) -> None:
    app.command("partition")(with_run_options(partition))


@with_run_options
def partition(
    out: Path = typer.Option(..., help="Folder to write: client-NNN per device, dataset.json (and test)."),
    format: str = typer.Option("folder", "--format", help="folder (one PNG per image, in class folders) | npz."),
    test: bool = typer.Option(False, "--test/--no-test", help="Also write the test split (OUT/test), for "
                              "`coordinator --test-data`."),
    **flags: Any,
) -> None:
    """Write the partition `simulate` uses (same dataset, --partition, --alpha, --clients, --seed, --train-subset)
    as one folder per device, for `device --data` and `trial --device-data`."""
    if format not in ("folder", "npz"):
        raise typer.BadParameter(f"--format must be folder or npz (got {format!r})")
    cfg = run_config(**flags)
    from fedsga_edge.data import DatasetError
    from fedsga_edge.data.local import DESCRIPTION_FILE, write_image_folder, write_npz
    from fedsga_edge.runbuild import plan_run, run_data_of

    if out.exists() and any(out.iterdir()):
        raise typer.BadParameter(f"--out {out} exists and is not empty: give a new folder")
    try:  # whole shares: each device holds its --eval-holdout slice out of its own data
        plan = plan_run(dataclasses.replace(cfg, eval_holdout=0.0), seed_globals=False, torch_free=True)
    except DatasetError as exc:
        typer.secho(f"error: {exc}", fg="red", err=True)
        raise typer.Exit(2) from None
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    b = plan.bundle
    out.mkdir(parents=True, exist_ok=True)
    write = write_image_folder if format == "folder" else write_npz
    sizes = {}
    for cid, share in zip(plan.client_ids, plan.parts):
        dest = out / (cid if format == "folder" else f"{cid}.npz")
        sizes[cid] = write(dest, b.train.get_batch(share), b.train.labels[share], b.classes)
    if test:
        dest = out / ("test" if format == "folder" else "test.npz")
        write(dest, b.test.get_batch(list(range(len(b.test)))), b.test.labels, b.classes)
    keys = ("dataset", "partition", "alpha", "clients", "seed", "train_subset", "img_size")
    source = {k: getattr(cfg, k) for k in keys}
    description = run_data_of(b).to_wire() | {"source": source, "format": format, "devices": sizes,
                                               "test_samples": len(b.test) if test else 0}
    (out / DESCRIPTION_FILE).write_text(json.dumps(description, indent=2))
    typer.echo(f"wrote {len(sizes)} device folders ({', '.join(f'{c}: {n}' for c, n in sizes.items())})"
               + (f" and {len(b.test)} test images" if test else "") + f" -> {out}")
