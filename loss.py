"""
loss.py: DeCLUTR's contrastive objective, NT-Xent over anchors and positives, on one process or
many.

Paper §3.2 (after SimCLR's NT-Xent): for a batch of N documents with A anchors each, every anchor i
has one positive, the mean of its P positive span embeddings, and every other embedding of the batch
is a negative (those from the same document are the hardest). With cosine similarity sim and
temperature tau,

    l(i, j) = -log( exp(sim(z_i, z_j) / tau) / sum_{k != i} exp(sim(z_i, z_k) / tau) )

over the 2AN embeddings z = [anchors; mean positives], taken both ways (anchor -> positive and
positive -> anchor) and averaged over the 2AN terms.

Across GPUs, the embeddings of every rank are gathered so that all of them serve as negatives
(`gather`, below).

    from loss import nt_xent
    loss = nt_xent(anchors, positives)        # anchors (n, d), positives (n, P, d) or (n, d)
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F


def nt_xent(anchors: torch.Tensor, positives: torch.Tensor, temperature: float = 0.05
            ) -> torch.Tensor:
    """The scalar NT-Xent loss of §3.2 over this rank's n anchors (n, d) and their positives
    (n, P, d) or (n, d)."""
    # §3.2: "we average the positive embeddings": one positive per anchor, robust to an unlucky
    # short span
    if positives.dim() == 3:
        positives = positives.mean(dim=1)  # (n, d)
    # Many processes: every rank's embeddings join the batch, so every one of them is a negative
    # everywhere
    anchors, positives = gather(anchors), gather(positives)  # (M, d) each: every rank's M = A·N
    M = anchors.shape[0]
    # Cosine similarity of every pair of the 2M embeddings, divided by tau. In fp32 even under bf16
    # autocast: cosines divided by 0.05 need more than bf16's 8 significant bits (2 decimal digits).
    # On an Ampere or later GPU the product runs in TF32, as train.py's setup allows for every fp32
    # product: inputs of 11 significant bits, sums in fp32.
    with torch.autocast(anchors.device.type, enabled=False):
        z = torch.cat([anchors, positives])
        z = F.normalize(z.to(torch.promote_types(z.dtype, torch.float32)), dim=-1)  # (2M, d), unit
        # A small tau sharpens the softmax, so that the hard negatives dominate
        sim = z @ z.T / temperature  # (2M, 2M)
    # An embedding is never its own negative: leave the diagonal out of every denominator
    sim = sim.masked_fill(torch.eye(2 * M, dtype=torch.bool, device=sim.device), float("-inf"))
    # Row i's target is its partner: anchor i -> positive i (column M + i), and positive i -> anchor
    # i. Made on the device itself: a copy from the host would make the host wait for the GPU.
    targets = torch.arange(2 * M, device=sim.device).roll(M)  # M, ..., 2M - 1, 0, ..., M - 1
    # Cross-entropy over each row is l(i, j) above; its mean runs over the 2M terms, both directions
    return F.cross_entropy(sim, targets)


# -----------------------------------------------------------------------------------------------
# The gather across ranks, with the gradient of one process holding the whole batch


def gather(x: torch.Tensor) -> torch.Tensor:
    """(n, d) on each rank -> (world * n, d), rank order; identity on a single process."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return x
    return _Gather.apply(x)


class _Gather(torch.autograd.Function):
    """all_gather whose backward hands each rank the gradient of its own slice, summed over every
    rank's loss."""

    @staticmethod
    def forward(ctx, x):
        ctx.rank, ctx.n = dist.get_rank(), x.shape[0]
        out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(out, x.contiguous())
        return torch.cat(out)

    @staticmethod
    def backward(ctx, grad):
        # Every rank computes the same global loss from the same gathered embeddings, but only this
        # rank can carry the gradient of its own slice back into its encoder. Each rank's loss holds
        # a gradient for this slice (through its negatives too), so the all-reduce sums the world's
        # copies of it here. Averaging the weight gradients over ranks (DistributedDataParallel
        # does) then divides that sum by world size again: exactly the gradient of one process
        # holding the whole batch. With a plain all_gather each rank would keep only its own copy,
        # averaging would leave 1/world of that gradient, and a separate x world_size fix (the
        # original's) would have to make it up.
        grad = grad.contiguous()
        dist.all_reduce(grad)
        return grad[ctx.rank * ctx.n:(ctx.rank + 1) * ctx.n]
