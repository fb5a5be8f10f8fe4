"""``DIR/manifest.json``: what an export wrote, for the device runtime and the profiler to read.

The manifest is plain JSON (the device side reads it with ``json`` alone; see
``fedsga_edge.device.runtime.load_manifest``). Layout, format_version 1::

    {"format": "fedsga-edge-prefixes", "format_version": 1, "fedsga_edge_version": str,
     "model": {arch, family, width, img_size, num_classes, num_blocks, splits, prompts_m,
               prompt_dim, prompt_std, checkpoint, weights_sha256,
               units: {state-dict key: unit}, interface_pool_axes: [int], prompts_as_tokens: bool},
     "input": {name: "x", shape: [null, 3, H, W], layout: "NCHW", dtype: "float32",
               normalization: {mean, std, source} | null},
     "opset": int, "exporter": str, "torch_version": str, "onnx_version": str,
     "onnxruntime_version": str, "macs_method": str,
     "prefixes": [{split, depth, file, sha256, bytes, weights_sha256, params,
                   flops_per_sample, flops_train_per_sample, macs_onnx, macs_vs_flops,
                   inputs: {x: shape, prompts: shape}, output: {name, shape},
                   activation: {shape, elems, bytes_per_sample: {fp32, fp16, int8}},
                   validation: {batch, atol, max_abs_diff, checks}, valid, export_seconds,
                   fp16?: {file, sha256, bytes, max_abs_dev},
                   int8?: {file, sha256, bytes, max_abs_dev, mean_abs_dev, speedup, ...},
                   train?: {forward_file, backward_file, state_file, params, buffers, ...}}]}

``units``, ``interface_pool_axes`` and ``prompts_as_tokens`` are the model's contract
(``SplitModel.unit_of``, ``interface_pool_axes``, ``prompt_positions``) for the torch-free device,
which cannot ask the model; ``family`` is a label only. Shapes use ``null`` for the dynamic batch
dimension. ``split`` is the 1-based split index k,
``depth`` the number of blocks on the client (``SplitModel.depth_of(k)``).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "ManifestError",
    "read_manifest",
    "sha256_file",
    "write_manifest",
]

FORMAT = "fedsga-edge-prefixes"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"


class ManifestError(ValueError):
    """The folder holds no manifest we can read (missing, another format, a newer version)."""


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def write_manifest(out_dir: str | Path, manifest: dict[str, Any]) -> Path:
    path = Path(out_dir) / MANIFEST_NAME
    body = {"format": FORMAT, "format_version": FORMAT_VERSION, **manifest}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(body, indent=2, sort_keys=False) + "\n")
    tmp.replace(path)  # readers never see half a manifest
    return path


def read_manifest(out_dir: str | Path, *, verify: bool = False) -> dict[str, Any]:
    """Reads and checks ``out_dir/manifest.json``; ``verify`` re-hashes every listed file."""
    path = Path(out_dir) / MANIFEST_NAME
    if not path.is_file():
        raise ManifestError(f"no {MANIFEST_NAME} in {out_dir}: run `fedsga-edge export --out {out_dir}` first")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ManifestError(f"{path} is not valid JSON: {exc}") from exc
    if manifest.get("format") != FORMAT:
        raise ManifestError(f"{path} is not a fedsga-edge prefix manifest (format={manifest.get('format')!r})")
    if manifest.get("format_version", 0) > FORMAT_VERSION:
        raise ManifestError(
            f"{path} has format_version {manifest['format_version']}; this reader knows {FORMAT_VERSION}"
        )
    if verify:
        for p in manifest["prefixes"]:
            for name, digest in _listed_files(p):
                actual = sha256_file(Path(out_dir) / name)
                if actual != digest:
                    raise ManifestError(
                        f"{name}: sha256 {actual[:12]}... does not match the manifest's {digest[:12]}..."
                    )
    return manifest


def _listed_files(prefix: dict[str, Any]) -> list[tuple[str, str]]:
    files = [(prefix["file"], prefix["sha256"])]
    for key in ("fp16", "int8"):
        if prefix.get(key):
            files.append((prefix[key]["file"], prefix[key]["sha256"]))
    if prefix.get("train"):
        t = prefix["train"]
        files += [(t[k], t["sha256"][k]) for k in ("forward_file", "backward_file", "state_file", "eval_file")
                  if t.get(k)]
    return files
