"""The forward of a multi-step graph: N uniform decode steps traced as one graph
(docs/design.md §3, "Multi-step graphs")."""

from __future__ import annotations

from collections.abc import Callable

import torch

from decodegraph.attention.backends.base import AttentionMetadata


def multi_step_forward(
    model: torch.nn.Module, params: list[AttentionMetadata], block_size: int, num_steps: int
) -> Callable[..., torch.Tensor]:
    """`num_steps` uniform decode steps in one function to trace, each step's argmax the
    next one's tokens; it returns the ids [num_steps, rows].

    `params` are the graph's attention params, one per attention group. The first step
    reads what the runner wrote. Each later one moves every request's row (those below
    the params' request count) on by one position, its slot found in the request's
    block-table row (the scheduler allocated every step's slots up front) and its length
    one longer; padded rows get slot -1 and length 0. Those are the only attention inputs
    that change, and the params hold tensors for them: while a later step is traced they
    hold the values computed in the graph, so the attention operator's call in that step
    takes those. They are restored once the trace is done."""
    bs = block_size

    def forward_steps(
        input_ids: torch.Tensor, positions: torch.Tensor, *_: torch.Tensor
    ) -> torch.Tensor:
        first = [(md.slot_mapping, md.seq_lens_host) for md in params]
        ids, pos, steps = input_ids, positions, []
        try:
            for step in range(num_steps):
                if step:
                    pos = positions + step
                    for md, (_, lens) in zip(params, first, strict=True):
                        live = torch.arange(lens.shape[0], device=lens.device) < md.num_reqs_host
                        row_blocks = md.block_tables.gather(1, (pos // bs).unsqueeze(1))
                        slots = row_blocks.squeeze(1).to(torch.int64) * bs + pos % bs
                        md.slot_mapping = torch.where(live, slots, -1)
                        md.seq_lens_host = torch.where(live, lens + step, 0)
                ids = model.compute_logits(model(ids, pos)).argmax(dim=-1)
                steps.append(ids)
        finally:
            for md, (slots, lens) in zip(params, first, strict=True):
                md.slot_mapping, md.seq_lens_host = slots, lens
        return torch.stack(steps)

    return forward_steps
