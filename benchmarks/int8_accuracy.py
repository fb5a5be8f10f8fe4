"""int8 prefixes on a trained model: size, output deviation, speed and test accuracy change.

Trains the model centrally for a few epochs (plain SGD + cross-entropy through the full model with
one fixed prompt set, saved in the checkpoint), then runs the export with ``--int8`` on that
checkpoint: every prefix is quantized with calibration images from the training split, and the
full model's test accuracy is measured with the fp32 prefix and with the int8 prefix feeding the
same torch suffix and head.

    python benchmarks/int8_accuracy.py --data digits --out runs/int8 [--model resnet18_cifar]
        [--width 0.25] [--epochs 8] [--results benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

SECTION = "### int8 prefixes: size, deviation, speed, accuracy"


def train(args: argparse.Namespace) -> tuple[Path, float]:
    import torch
    import torch.nn.functional as F
    from fedsga_edge.export.quantize import normalize

    from fedsga_edge.data import load_dataset
    from fedsga_edge.models import create_model

    torch.manual_seed(args.seed)
    bundle = load_dataset(args.data, args.data_root)
    model = create_model(args.model, width=args.width, num_classes=bundle.num_classes, img_size=bundle.image_size)
    prompts = model.init_prompts(args.prompts, generator=torch.Generator().manual_seed(args.seed))
    x_all = torch.from_numpy(normalize(bundle.train.get_batch(np.arange(len(bundle.train))), bundle.mean, bundle.std))
    y_all = torch.from_numpy(np.asarray(bundle.train.labels))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    rng = np.random.default_rng(args.seed)
    model.train()
    for _ in range(args.epochs):
        order = torch.from_numpy(rng.permutation(len(y_all)))
        for i in range(0, len(order), 64):
            idx = order[i : i + 64]
            loss = F.cross_entropy(model(x_all[idx], prompts), y_all[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    model.eval()
    x_te = torch.from_numpy(normalize(bundle.test.get_batch(np.arange(len(bundle.test))), bundle.mean, bundle.std))
    with torch.no_grad():
        acc = float((model(x_te, prompts).argmax(1).numpy() == np.asarray(bundle.test.labels)).mean())
    path = args.out / "checkpoint.pt"
    torch.save({"model": model.state_dict(), "prompts": prompts}, path)
    return path, acc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="resnet18_cifar")
    ap.add_argument("--width", type=float, default=0.25)
    ap.add_argument("--data", default="digits")
    ap.add_argument("--data-root", default=None)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("runs/int8"))
    ap.add_argument("--results", type=Path, default=None)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/int8_accuracy.py " + " ".join(sys.argv[1:])

    t = time.perf_counter()
    ckpt, torch_acc = train(args)
    train_s = time.perf_counter() - t
    from fedsga_edge.export.pipeline import ExportConfig, export_prefixes

    manifest = export_prefixes(
        ExportConfig(
            model=args.model,
            width=args.width,
            out=args.out / "artifacts",
            checkpoint=ckpt,
            int8=True,
            calib_data=args.data,
            data_root=args.data_root,
            eval_samples=0,
            prompts=args.prompts,
        ),
        log=lambda text: print(text, flush=True),
    )
    m = manifest["model"]
    lines = [
        SECTION,
        "",
        f"Command: `{command}`",
        "",
        (
            f"{m['arch']} width {m['width']}, trained centrally for {args.epochs} epochs on {args.data} "
            f"({train_s:.0f} s; torch full-model test accuracy {100 * torch_acc:.2f}%), then `fedsga-edge export --int8 "
            f"--calib-data {args.data} --checkpoint ...`: QDQ, uint8 activations, int8 per-channel weights, MinMax "
            f"calibration on {manifest['prefixes'][0]['int8']['calibration']['samples']} training images. Accuracy: "
            f"the whole test split through the fp32 / int8 ONNX prefix and the torch suffix and head. Deviation: "
            f"mean |z_int8 - z_fp32| / mean |z_fp32| on the same images. Speed: onnxruntime p50 at batch "
            f"{manifest['prefixes'][0]['int8']['latency_batch']}, default threads, on this shared 2-core machine."
        ),
        "",
        (
            "| k | depth | fp32 file | int8 file | rel. deviation | max abs dev | fp32 acc | int8 acc | change | "
            "top-1 agreement | fp32 ms | int8 ms | speed-up |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in manifest["prefixes"]:
        q = p["int8"]
        lines.append(
            f"| {p['split']} | {p['depth']} | {p['bytes'] / 1024:.0f} KiB | {q['bytes'] / 1024:.0f} KiB | "
            f"{100 * q['rel_mean_dev']:.2f}% | {q['max_abs_dev']:.3f} | {100 * q['accuracy_fp32']:.2f}% | "
            f"{100 * q['accuracy_int8']:.2f}% | {100 * q['accuracy_delta']:+.2f} pt | {100 * q['agreement']:.1f}% | "
            f"{q['latency_ms_fp32']:.2f} | {q['latency_ms_int8']:.2f} | {q['speedup']:.2f}x |"
        )
    text = "\n".join(lines) + "\n"
    (args.out / "int8.md").write_text(text)
    (args.out / "int8.json").write_text(json.dumps(manifest, indent=1))
    print(text)
    if args.results:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from latency import write_section

        write_section(args.results, text, SECTION)


if __name__ == "__main__":
    main()
