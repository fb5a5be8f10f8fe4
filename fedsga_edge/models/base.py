"""The one interface every split-ready backbone exposes.

A backbone is a sequence of L *blocks* followed by a final pooling and a linear head.
``blocks[0]`` consumes the image and the client's private prompts; every later block maps an
activation to an activation. A *split depth* ``d`` means the client runs ``blocks[:d]`` and the
server ``blocks[d:]``; the candidate depths (``splits``) sit at block boundaries, and the 1-based
*split index* ``k`` names ``splits[k - 1]``.

Blocks and head are the *units* of depth-wise aggregation (docs/method.md "Aggregation"): unit j
is block j, unit L the head. :meth:`SplitModel.unit_of` is the one place that maps a state-dict key
to its unit, and what differs between backbones (pooling axes, prompts as tokens or as a bias, the
width phi_s takes) is asked of the model, never inferred from its family or parameter names.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["SplitModel"]


class SplitModel(nn.Module):
    """Backbone + head with exact prefix / suffix execution at any block boundary."""

    arch: str = ""
    family: str = ""  # "cnn" or "vit": a label for reports and manifests only; behaviour asks the model
    prompt_std: float = 1.0  # scale of a fresh prompt token (init_prompts); in the export manifest too
    head_name: str = "head"  # attribute (and state-dict prefix) the head is registered under
    interface_pool_axes: tuple[int, ...] = ()  # activation axes interface_pool averages (batch is axis 0)
    prompts_as_tokens: bool = False  # True: each prompt adds one sequence position (ViT); False: a bias (CNN)
    int8_op_types: tuple[str, ...] | None = None  # ONNX ops int8 export may quantize (None: all it can)

    def __init__(
        self,
        blocks: list[nn.Module],
        head: nn.Linear,
        splits: tuple[int, ...],
        feature_dim: int,
        prompt_dim: int,
        input_size: int,
    ) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        setattr(self, self.head_name, head)  # nn.Module.__setattr__ registers it; ``head`` reads it back
        if not splits or list(splits) != sorted(set(splits)) or splits[0] < 1 or splits[-1] >= len(blocks):
            raise ValueError(f"candidate splits {splits} must be increasing block boundaries in 1..{len(blocks) - 1}")
        self.splits = tuple(splits)
        self.feature_dim = feature_dim
        self.prompt_dim = prompt_dim
        self.input_size = input_size

    @property
    def head(self) -> nn.Linear:
        """The classifier, whatever attribute name the backbone registers it under (``head_name``)."""
        module = self._modules.get(self.head_name)
        if module is None:
            raise AttributeError(f"{type(self).__name__} has no head registered as {self.head_name!r}")
        return module  # type: ignore[return-value]

    # -- units (the aggregation contract) ------------------------------------------------------
    def unit_of(self, name: str) -> int:
        """Aggregation unit of state-dict key ``name``: j for block j, ``num_blocks`` for the head.

        Derived from which module owns the key, not from its spelling, so a backbone may name its
        modules as it likes; a key outside every unit raises rather than silently dropping out.
        """
        unit = self._unit_table().get(name)
        if unit is None:
            raise ValueError(f"{name!r} is not a parameter or buffer of any unit of {self.arch or type(self).__name__}")
        return unit

    def _unit_table(self) -> dict[str, int]:
        """State-dict key -> unit, built once from the module tree (cached like the shapes)."""
        table: dict[str, int] | None = self.__dict__.get("_unit_cache")
        if table is None:
            owner = {id(m): j for j, m in enumerate([*self.blocks, self.head])}
            table = {}
            for prefix, module in self.named_modules(remove_duplicate=False):
                j = owner.get(id(module))
                if j is not None:
                    table.update((f"{prefix}.{key}", j) for key in module.state_dict(keep_vars=True))
            self.__dict__["_unit_cache"] = table
        return table

    # -- geometry -------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_splits(self) -> int:
        return len(self.splits)

    def depth_of(self, k: int) -> int:
        """Block count on the client for 1-based split index ``k``."""
        if not 1 <= k <= len(self.splits):
            raise ValueError(f"split index {k} out of range 1..{len(self.splits)} for {self.arch}")
        return self.splits[k - 1]

    # -- execution ------------------------------------------------------------------------------
    def run_blocks(self, h: Tensor, start: int, end: int, prompts: Tensor | None = None) -> Tensor:
        """Run ``blocks[start:end]``; ``prompts`` only matter when ``start == 0``."""
        for j in range(start, end):
            h = self.blocks[j](h, prompts) if j == 0 else self.blocks[j](h)
        return h

    def prefix(self, x: Tensor, depth: int, prompts: Tensor | None = None) -> Tensor:
        """Client side: the activation ``z = h^(depth)`` that crosses the wire."""
        return self.run_blocks(x, 0, depth, prompts)

    def suffix(self, z: Tensor, depth: int) -> Tensor:
        """Server side: the remaining blocks and the final pooling -> features (B, feature_dim)."""
        return self.pool(self.run_blocks(z, depth, self.num_blocks))

    def features(self, x: Tensor, prompts: Tensor | None = None) -> Tensor:
        return self.suffix(self.prefix(x, self.num_blocks, prompts), self.num_blocks)

    def forward(self, x: Tensor, prompts: Tensor | None = None) -> Tensor:
        return self.head(self.features(x, prompts))

    def pool(self, h: Tensor) -> Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def interface_pool(self, h: Tensor) -> Tensor:
        """Pooled intermediate activation (``hbar`` in Eqs. 3 and 5): the mean over ``interface_pool_axes``.

        Declared as axes rather than code so the torch-free ONNX device pools the same way from
        the export manifest.
        """
        if not self.interface_pool_axes:
            raise NotImplementedError(f"{type(self).__name__} declares no interface_pool_axes")
        return h.mean(dim=self.interface_pool_axes)

    @property
    def phi_input_dim(self) -> int:
        """Width of the pooled p_1 features (interface_pool at split 1) that FedSGA's shallow head phi_s takes."""
        ref = next(self.parameters())
        h = torch.zeros(1, *self.interface_shape(self.depth_of(1)), device=ref.device, dtype=ref.dtype)
        return int(self.interface_pool(h).shape[-1])

    # -- prompts --------------------------------------------------------------------------------
    def prompt_positions(self, m: int) -> int:
        """Extra sequence positions ``m`` prompts add to an activation: m as tokens, 0 as a bias."""
        return m if self.prompts_as_tokens else 0

    def init_prompts(self, m: int, generator: torch.Generator | None = None) -> Tensor:
        """A fresh private prompt set (m, prompt_dim) at scale ``prompt_std``; never aggregated."""
        return self.prompt_std * torch.randn(m, self.prompt_dim, generator=generator)

    # -- shapes ---------------------------------------------------------------------------------
    @torch.no_grad()
    def interface_shape(self, depth: int, prompts_m: int = 0) -> tuple[int, ...]:
        """Per-sample activation shape at ``depth`` (one batch-1 forward, cached)."""
        key = (depth, prompts_m)
        cache = self.__dict__.setdefault("_shape_cache", {})
        if key not in cache:
            ref = next(self.parameters())
            x = torch.zeros(1, 3, self.input_size, self.input_size, device=ref.device, dtype=ref.dtype)
            p = torch.zeros(prompts_m, self.prompt_dim, device=ref.device, dtype=ref.dtype) if prompts_m else None
            was_training = self.training
            self.eval()
            cache[key] = tuple(self.prefix(x, depth, p).shape[1:])
            self.train(was_training)
        return cache[key]

    def block_param_count(self, start: int, end: int) -> int:
        return sum(p.numel() for j in range(start, end) for p in self.blocks[j].parameters())

