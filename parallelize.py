"""
Parallel strategies for model.GPT with torch.distributed (issue #12), in place, before the
optimizer is made:

    parallelize(model, strategy, device_type, world_size, tp_size)

ddp wraps the model later (train.py); fsdp shards each block, then the root, with FSDP2's
fully_shard; tp and tp-sp are Megatron-style tensor parallelism (below); fsdp+tp and fsdp+tp-sp
lay the ranks out as a 2-D mesh (dp, tp): tensor parallelism within each group of tp_size
consecutive ranks, FSDP2 across the groups.

In each block, c_attn and c_fc are column-parallel (each rank computes n_head/t heads and 4C/t
hidden units), attn.c_proj and mlp.c_proj row-parallel (their outputs are summed over the ranks).
With sequence_parallel the LayerNorms and the residual stream between blocks hold T/t positions
per rank: the column-parallel linears all-gather their input and the row-parallel ones
reduce-scatter their output. Embeddings, ln_f and the tied lm_head stay whole on every rank
(replicated DTensors): the logits and the loss are computed in full on each rank.

The fused qkv weight is reordered so that rank r's row shard holds [q_r, k_r, v_r]; attention
reads its head count from the width it receives. The parallel model computes the same function
as the unsharded one, with c_attn's rows permuted (tests compare the losses).
"""

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleOutput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

from memory_audit.prediction.ledger.tensor_parallel import check  # the rule train.py and the predictor use


def _as_replicated(module, inputs, mesh):
    """Forward pre-hook: plain tensors enter as replicated DTensors, sharded ones are gathered."""
    def one(x):
        if isinstance(x, DTensor):
            return x.redistribute(mesh, [Replicate()])
        if isinstance(x, torch.Tensor):
            return DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        return x
    return tuple(one(x) for x in inputs)


def _local(module, output, mesh):
    return output.to_local() if isinstance(output, DTensor) else output


def qkv_order(n_embd, t):
    """Row permutation of c_attn's (3C, C) weight that puts [q_r, k_r, v_r] in rank r's shard."""
    return torch.arange(3 * n_embd).view(3, t, n_embd // t).transpose(0, 1).reshape(-1)


def block_plan(sequence_parallel):
    """parallelize_module's plan for one Block."""
    if not sequence_parallel:
        return {"attn.c_attn": ColwiseParallel(), "attn.c_proj": RowwiseParallel(),
                "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel()}
    return {"ln_1": SequenceParallel(), "ln_2": SequenceParallel(),
            "attn.c_attn": ColwiseParallel(input_layouts=Shard(1)),
            "attn.c_proj": RowwiseParallel(output_layouts=Shard(1)),
            "mlp.c_fc": ColwiseParallel(input_layouts=Shard(1)),
            "mlp.c_proj": RowwiseParallel(output_layouts=Shard(1))}


def parallelize(model, strategy, device_type, world_size, tp_size):
    """Shard model in place for `strategy` over world_size ranks; returns the model."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    if strategy == "ddp":  # train.py wraps the model in DistributedDataParallel instead
        return model
    t = tp_size if "tp" in strategy else 1
    mesh = init_device_mesh(device_type, (world_size // t, t), mesh_dim_names=("dp", "tp"))
    if "tp" in strategy:
        tensor_parallel(model, mesh["tp"], sequence_parallel=strategy.endswith("-sp"))
    if strategy.startswith("fsdp"):  # each block a unit, then the root (embeddings, ln_f, the tied lm_head)
        for block in model.transformer.h:  # one mesh for every unit (fully_shard alone makes one per call)
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    return model


def tensor_parallel(model, mesh, sequence_parallel=False):
    """Shard model's blocks over the 1-D mesh in place; returns the model."""
    t = mesh.size()
    cfg = model.config
    check({"parallel": "tp-sp" if sequence_parallel else "tp", "world_size": t, "tp_size": t,
           "n_head": cfg.n_head, "dropout": cfg.dropout})
    order = qkv_order(cfg.n_embd, t)
    for block in model.transformer.h:
        with torch.no_grad():
            for p in block.attn.c_attn.parameters():
                p.copy_(p[order])
        if not sequence_parallel:  # LayerNorms replicated: their inputs and outputs are whole
            for ln in (block.ln_1, block.ln_2):
                distribute_module(ln, mesh, input_fn=_as_replicated, output_fn=_local)
        parallelize_module(block, mesh, block_plan(sequence_parallel))
    tr = model.transformer
    # the tied embedding: one replicated parameter serves wte and lm_head
    distribute_module(model.lm_head, mesh, input_fn=_as_replicated, output_fn=_local)
    tr.wte.weight = model.lm_head.weight
    for name in ("wte", "wpe") + (() if sequence_parallel else ("ln_f",)):
        distribute_module(tr[name], mesh, input_fn=_as_replicated, output_fn=_local)
    if sequence_parallel:  # the residual stream holds this rank's T/t positions from block 0 to ln_f
        parallelize_module(tr, mesh, {"drop": PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=True),
            "ln_f": SequenceParallel()})  # lm_head's pre-hook all-gathers ln_f's sharded output
    return model
