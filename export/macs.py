"""Multiply-accumulates counted on the ONNX graph itself, as a cross-check of torch's FLOP counter.

onnx-tool was tried first: it counts the ResNet prefixes but its static shape inference fails
on the ViT prefixes (a Reshape whose target shape is computed in the graph). So the shapes come
from onnxruntime instead: every intermediate value is made a graph output and the graph runs
once on a batch of 1, which gives exact shapes for any graph the runtime can execute. MACs are
then counted for the ops that carry the arithmetic (Conv, ConvTranspose, MatMul, Gemm); the
element-wise rest is ignored, as torch.utils.flop_counter ignores it, so ``2 * macs`` should
equal the torch forward FLOPs.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

__all__ = ["MACS_METHOD", "count_macs"]

MACS_METHOD = "fedsga_edge.export.macs: Conv/ConvTranspose/MatMul/Gemm MACs on onnxruntime-observed shapes, batch 1"


def _prod(shape) -> int:
    return int(math.prod(int(s) for s in shape))


def count_macs(path: str | Path, feeds: dict[str, np.ndarray]) -> int:
    """MACs of one run of the ONNX model at ``path`` on ``feeds`` (give a batch of 1 for per-sample)."""
    import onnx
    import onnxruntime as ort

    model = onnx.load(str(path))
    graph = model.graph
    known = {v.name for v in graph.output}
    for node in graph.node:
        for name in node.output:
            if name and name not in known:
                graph.output.append(onnx.ValueInfoProto(name=name))
                known.add(name)
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # keep the nodes we count
    opts.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    shapes = {n: v.shape for n, v in zip(names, sess.run(names, feeds))}
    shapes.update({k: v.shape for k, v in feeds.items()})
    shapes.update({t.name: tuple(t.dims) for t in graph.initializer})
    for node in graph.node:  # Constant nodes hold weights in some exports
        if node.op_type == "Constant" and node.output[0] not in shapes:
            shapes[node.output[0]] = tuple(onnx.numpy_helper.to_array(node.attribute[0].t).shape)

    total = 0
    for node in graph.node:
        op, ins, out = node.op_type, node.input, node.output[0]
        if op == "Conv":
            w = shapes[ins[1]]  # (Cout, Cin/groups, k...)
            total += _prod(shapes[out]) * _prod(w[1:])
        elif op == "ConvTranspose":
            w = shapes[ins[1]]  # (Cin, Cout/groups, k...)
            total += _prod(shapes[ins[0]]) * _prod(w[1:])
        elif op == "MatMul":
            total += _prod(shapes[out]) * int(shapes[ins[0]][-1])
        elif op == "Gemm":
            trans_a = next((a.i for a in node.attribute if a.name == "transA"), 0)
            a = shapes[ins[0]]
            total += _prod(shapes[out]) * int(a[0] if trans_a else a[1])
    return total
