"""
loss.py: DeCLUTR's contrastive objective, NT-Xent over anchors and positives, on one process or many.

Paper §3.2 (after SimCLR's NT-Xent): for a batch of N documents with A anchors each, every anchor i has one
positive, the mean of its P positive span embeddings, and every other embedding of the batch is a negative
(those from the same document are the hardest). With cosine similarity sim and temperature tau,

    l(i, j) = -log( exp(sim(z_i, z_j) / tau) / sum_{k != i} exp(sim(z_i, z_k) / tau) )

over the 2AN embeddings z = [anchors; mean positives], taken both ways (anchor -> positive and
positive -> anchor) and averaged over the 2AN terms.

Across GPUs, the embeddings of every rank are gathered so that all of them serve as negatives. The gather
passes gradients back to the rank that computed each slice, summed over the ranks that used it, so that under
gradient averaging (DDP's, or train.py's) the gradient equals that of one process holding the whole batch:
the original needed a separate x world_size fix for exactly this.

    from loss import nt_xent
    loss = nt_xent(anchors, positives)        # anchors (M, d), positives (M, P, d) or (M, d)
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F


class _Gather(torch.autograd.Function):
    """all_gather whose backward hands each rank the gradient of its own slice, summed over every rank's loss."""

    @staticmethod
    def forward(ctx, x):
        ctx.rank, ctx.n = dist.get_rank(), x.shape[0]
        out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(out, x.contiguous())
        return torch.cat(out)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        # Every rank computed the same global loss; each one's gradient for this rank's slice is summed here.
        # Gradients are then averaged over ranks (DDP or train.py), which turns this sum back into exactly
        # one copy of the global gradient.
        dist.all_reduce(grad)
        return grad[ctx.rank * ctx.n:(ctx.rank + 1) * ctx.n]


def gather(x: torch.Tensor) -> torch.Tensor:
    """(n, d) on each rank -> (world * n, d), rank order; identity on a single process."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return x
    return _Gather.apply(x)


def nt_xent(anchors: torch.Tensor, positives: torch.Tensor, temperature: float = 0.05,
            across_ranks: bool = True) -> torch.Tensor:
    """The scalar NT-Xent loss of §3.2: anchors (M, d), positives (M, P, d) or (M, d), local to this rank."""
    if positives.dim() == 3:
        # §3.2: "we average the positive embeddings" - one positive per anchor, robust to an unlucky short span
        positives = positives.mean(dim=1)  # (M, d)
    if across_ranks:
        anchors, positives = gather(anchors), gather(positives)
    m = anchors.shape[0]
    with torch.autocast(anchors.device.type, enabled=False):  # cosines / 0.05 need fp32, not bf16's 3 digits
        z = torch.cat([anchors, positives])
        z = F.normalize(z.to(torch.promote_types(z.dtype, torch.float32)), dim=-1)  # (2M, d) unit rows: dot = cosine
        sim = z @ z.T / temperature  # (2M, 2M)
    # A small tau sharpens the softmax so that hard negatives dominate (SimCLR; DeCLUTR uses 0.05).
    sim = sim.masked_fill(torch.eye(2 * m, dtype=torch.bool, device=sim.device), float("-inf"))  # never itself
    targets = torch.cat([torch.arange(m, 2 * m), torch.arange(0, m)]).to(sim.device)  # anchor <-> its positive
    return F.cross_entropy(sim, targets)  # mean over the 2M terms, both directions
