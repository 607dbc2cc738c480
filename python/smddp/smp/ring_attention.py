"""Ring attention: causal attention of a context-parallel group's sequence parts without
gathering every key and value (SMP's cp_comm_type "p2p").

Rank r of a group of n holds queries, keys and values of tokens r*L .. (r+1)*L - 1 of each
sequence, or with load balancing two chunks of L/2 (chunks r and 2n-1-r of 2n; see chunks()).
Its keys and values travel round the ring (r sends to r+1 and receives from r-1), so at step s
rank r holds those of rank (r - s) mod n; it attends each of its query chunks to the key chunks
the causal mask (and a sliding window) lets them see, and skips the others: a chunk after the
queries' own, or wholly outside the window, costs no arithmetic. Without load balancing the
last rank attends to every part and the first to its own only; with it every rank attends to
as many keys (one early chunk sees few, the late one many). The next part is already on its way
while a rank computes (send and receive posted before the step's arithmetic).

Partial results combine exactly: each step gives the block's output normalised over the block
and its log-sum-exp per query, and two of those merge into the output over both blocks (the
running softmax of blockwise attention). Backward goes round the ring again with the saved
log-sum-exp: each part's keys and values travel with the gradient accumulated for them, which
ends up with the part's owner after a last step. Arithmetic runs in float32 at least (float64
stays float64); on the CPU a block runs in torch's fused flash-attention kernel, which returns
the log-sum-exp too, unless some of its queries see none of its keys. A rank holds the keys and
values of one part at a time (and the next one arriving), not the whole sequence.
"""

import torch
import torch.distributed as dist

_KV_TAG, _GRAD_TAG = 1, 2  # a part's keys and values, and their gradient, in separate streams


def chunks(rank, n, balanced):
    """The chunks of the sequence rank `rank` of n holds, in order: its n-th part, or, balanced,
    chunks rank and 2n-1-rank of 2n (one early, one late: under the causal mask every rank then
    attends to as many keys, where the last of n contiguous parts attends to n times the first's)."""
    return (rank, 2 * n - 1 - rank) if balanced else (rank,)


def positions(rank, n, length, balanced, device=None):
    """The positions in the whole sequence of the `length` tokens rank `rank` of n holds."""
    mine = chunks(rank, n, balanced)
    size = length // len(mine)
    return torch.cat([torch.arange(c * size, (c + 1) * size, device=device) for c in mine])


def _visible(q_part, k_part, length, window):
    """Whether any query of part q_part may attend a key of part k_part: not a later part, and
    (with a sliding window) not one whose nearest key is window or more tokens back."""
    if k_part > q_part:
        return False
    return window is None or (q_part - k_part - 1) * length + 1 < window


def _mask(q_part, k_part, length, window, device):
    q = q_part * length + torch.arange(length, device=device)[:, None]
    k = k_part * length + torch.arange(length, device=device)[None, :]
    allowed = k <= q
    if window is not None:
        allowed &= q - k < window
    return allowed


def _scores(q, k, mask, scale):
    return torch.matmul(q, k.transpose(-1, -2)).mul_(scale).masked_fill_(~mask, float("-inf"))


def _fused(q, q_part, k_part, length, window):
    """How torch's fused CPU attention kernel (flash attention, which also returns the log-sum-exp)
    can take the block: (is_causal, additive mask or None), or None where it cannot: off the CPU,
    or where some query sees no key of the part (a sliding window), whose row the kernel would
    not leave at exactly zero weight."""
    if q.device.type != "cpu" or (window is not None and (q_part - k_part) * length >= window):
        return None
    if window is None:
        return q_part == k_part, None
    allowed = _mask(q_part, k_part, length, window, q.device)
    return False, torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(~allowed, float("-inf"))


def _block_forward(q, k, v, q_part, k_part, length, window, scale):
    """This rank's queries against one part's keys and values: (output normalised over the part,
    log-sum-exp per query, -inf where a query sees none of its keys)."""
    fused = _fused(q, q_part, k_part, length, window)
    if fused is not None:
        causal, mask = fused
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=mask, scale=scale)[:2]
        return out, lse.to(q.dtype)
    s = _scores(q, k, _mask(q_part, k_part, length, window, q.device), scale)
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - _finite(lse).unsqueeze(-1)), v), lse


def _block_backward(g, q, k, v, out, lse, delta, q_part, k_part, length, window, scale):
    """Gradients (dq, dk, dv) of one part's contribution, from the whole output `out`, its
    log-sum-exp and delta = rowsum(g * out): the part's slice of the softmax is exp(scores - lse)."""
    fused = _fused(q, q_part, k_part, length, window)
    if fused is not None:
        causal, mask = fused
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            g, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale)
    p = torch.exp(_scores(q, k, _mask(q_part, k_part, length, window, q.device), scale) - lse.unsqueeze(-1))
    ds = p * (torch.matmul(g, v.transpose(-1, -2)) - delta)
    return torch.matmul(ds, k) * scale, torch.matmul(ds.transpose(-1, -2), q) * scale, torch.matmul(p.transpose(-1, -2), g)


def _finite(lse):
    """lse with -inf (a query that saw no key yet) as 0, for subtracting it safely: exp(-inf - 0)
    is the 0 wanted there."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


class _Shift:
    """Sends `t` to the next rank of the ring and receives its equal from the previous one."""

    def __init__(self, t, group, tag):
        n, r = dist.get_world_size(group), dist.get_rank(group)
        self.received = torch.empty_like(t)
        ops = [dist.P2POp(dist.isend, t, dist.get_global_rank(group, (r + 1) % n), group, tag),
               dist.P2POp(dist.irecv, self.received, dist.get_global_rank(group, (r - 1) % n), group, tag)]
        self.works = dist.batch_isend_irecv(ops)

    def wait(self):
        for w in self.works:
            w.wait()
        return self.received


def _ring(kv, group, pairs, acc, repeat):
    """Round the ring from this rank's part: per step, (rank whose part it is, its keys, its
    values), the latter expanded to the query heads in dtype `acc`, or (rank, None, None) where
    pairs(rank) is empty (this rank's queries see none of it). The next part is on its way while
    the caller works on one."""
    n, r = dist.get_world_size(group), dist.get_rank(group)

    def heads(t):  # no copy where every query head has its own kv head (and the dtype is acc's)
        t = t.to(acc)
        return t.repeat_interleave(repeat, dim=1) if repeat > 1 else t

    for step in range(n):
        part = (r - step) % n
        shift = _Shift(kv, group, _KV_TAG) if step < n - 1 else None
        if pairs(part):
            yield part, heads(kv[0]), heads(kv[1])
        else:
            yield part, None, None
        if shift is not None:
            kv = shift.wait()


def _pairs(group, length, window, balanced):
    """pairs(rank): the blocks this rank computes against that rank's part, as (slice of this
    rank's tokens, its chunk, slice of the part's tokens, its chunk) for every query chunk and
    key chunk the mask lets meet; chunk indices count chunks of the returned size."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    mine = chunks(r, n, balanced)
    size = length // len(mine)

    def within(i):
        return slice(i * size, (i + 1) * size)

    def pairs(rank):
        return [(within(i), qc, within(j), kc) for i, qc in enumerate(mine)
                for j, kc in enumerate(chunks(rank, n, balanced)) if _visible(qc, kc, size, window)]

    return pairs, size


class RingAttention(torch.autograd.Function):
    """query [batch, heads, L, dim], key / value [batch, kv heads, L, dim] of this rank's tokens
    (chunks(rank, n, balanced)); returns the attention output [batch, heads, L, dim] over every
    earlier token of the sequence."""

    @staticmethod
    def forward(ctx, query, key, value, group, scale, window, balanced):
        acc = torch.promote_types(query.dtype, torch.float32)
        batch, heads, length, _ = query.shape
        repeat = heads // key.shape[1]  # grouped-query attention: each kv head serves `repeat` heads
        pairs, size = _pairs(group, length, window, balanced)
        q = query.to(acc)
        out = q.new_zeros(batch, heads, length, value.shape[-1])
        lse = q.new_full((batch, heads, length), float("-inf"))
        kv = torch.stack((key, value))  # one message per step; kept for backward's own round
        for part, k, v in _ring(kv, group, pairs, acc, repeat):
            if k is None:
                continue
            for qs, qc, ks, kc in pairs(part):
                block, block_lse = _block_forward(q[:, :, qs], k[:, :, ks], v[:, :, ks], qc, kc, size, window, scale)
                merged = torch.logaddexp(lse[:, :, qs], block_lse)
                base = _finite(merged).unsqueeze(-1)
                out[:, :, qs] = (out[:, :, qs] * torch.exp(lse[:, :, qs].unsqueeze(-1) - base)
                                 + block * torch.exp(block_lse.unsqueeze(-1) - base))
                lse[:, :, qs] = merged
        ctx.save_for_backward(query, kv, out, lse)
        ctx.group, ctx.scale, ctx.window, ctx.balanced = group, scale, window, balanced
        return out.to(query.dtype)

    @staticmethod
    def backward(ctx, grad):
        query, kv, out, lse = ctx.saved_tensors
        group, scale, window = ctx.group, ctx.scale, ctx.window
        n = dist.get_world_size(group)
        acc = out.dtype
        batch, heads, length, _ = query.shape
        kv_heads = kv.shape[2]
        repeat = heads // kv_heads
        pairs, size = _pairs(group, length, window, ctx.balanced)
        q, g = query.to(acc), grad.to(acc)
        delta = (g * out).sum(dim=-1, keepdim=True)  # softmax's backward term, per query
        dq = torch.zeros_like(q)
        # The gradient of the part held travels with it: it arrives from the previous rank while
        # this one computes the part's blocks, and leaves for the next rank once added to.
        dkv, arriving = torch.zeros(kv.shape, dtype=acc, device=kv.device), None
        for part, k, v in _ring(kv, group, pairs, acc, repeat):
            blocks = []
            for qs, qc, ks, kc in pairs(part) if k is not None else ():
                dq_block, dk, dv = _block_backward(g[:, :, qs], q[:, :, qs], k[:, :, ks], v[:, :, ks], out[:, :, qs],
                                                   lse[:, :, qs], delta[:, :, qs], qc, kc, size, window, scale)
                dq[:, :, qs] += dq_block
                blocks.append((ks, dk, dv))
            if arriving is not None:
                dkv = arriving.wait()
            for ks, dk, dv in blocks:
                dkv[0][:, :, ks] += dk.view(batch, kv_heads, repeat, size, -1).sum(dim=2)
                dkv[1][:, :, ks] += dv.view(batch, kv_heads, repeat, size, -1).sum(dim=2)
            arriving = _Shift(dkv, group, _GRAD_TAG) if n > 1 else None
        # One more step brings each part's gradient home (after the last step rank r held part
        # r + 1's, which rank r + 1 owns).
        if arriving is not None:
            dkv = arriving.wait()
        return dq.to(query.dtype), dkv[0].to(kv.dtype), dkv[1].to(kv.dtype), None, None, None, None
