"""Let vLLM 0.19-0.31 compile a model with LoRA enabled, for a benchmark that asks whether compiling pays.

Before vLLM splits a compiled graph it rewrites every `x.size(...)` node (`_decompose_size_nodes` in
`vllm/compilation/backends.py`), and replaces the node only where it is a direct argument of a user. Its
own LoRA kernels allocate `torch.empty((n, x.size(0), r))`: the size sits inside a tuple, stays in use,
and start-up fails with "Tried to erase Node size_2 but it still had 1 users". A size taken along one
dimension is a plain integer, which may cross a split as it is; here each such node becomes
`aten.sym_size.int(x, dim)` first (a function node, which vLLM's pass leaves alone, and what Dynamo
writes for a dynamic dimension anyway), and vLLM's pass then sees only whole-shape sizes.

Not used by art_nb itself: where vLLM cannot compile a LoRA model, art_nb starts "fast" (engines/vllm/
startup.py). This is for `gpu_t4_vs_unsloth.py --parts art_compiled` (Unsloth repairs the same pass for
its own compiled engine), to measure what compiling changes before art_nb relies on it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["install", "sizes_by_dim_to_sym_size"]


def sizes_by_dim_to_sym_size(graph_module: Any) -> int:
    """Turn each `x.size(dim)` node of `graph_module` into `aten.sym_size.int(x, dim)`; the number turned."""
    import torch

    graph = graph_module.graph
    turned = 0
    for node in list(graph.find_nodes(op="call_method", target="size")):
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        if dim is None:
            continue  # the whole shape: vLLM's pass handles it
        with graph.inserting_after(node):
            scalar = graph.call_function(torch.ops.aten.sym_size.int, args=(node.args[0], dim))
        scalar.meta = dict(node.meta)
        node.replace_all_uses_with(scalar)
        graph.erase_node(node)
        turned += 1
    graph_module.recompile()
    return turned


def install() -> bool:
    """Run `sizes_by_dim_to_sym_size` before vLLM's own size pass, in this process; False when this
    vLLM has no such pass (nothing to repair)."""
    from vllm.compilation import backends

    original = getattr(backends, "_decompose_size_nodes", None)
    if original is None or getattr(original, "_art_nb_repaired", False):
        return original is not None

    def decompose(graph_module: Any) -> None:
        sizes_by_dim_to_sym_size(graph_module)
        original(graph_module)

    decompose._art_nb_repaired = True  # type: ignore[attr-defined]
    backends._decompose_size_nodes = decompose
    return True
