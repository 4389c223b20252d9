"""KDA's gated delta rule over a few rows (decode, verify, and the commit's replay) as one kernel.

Per head h and row t (models/glm5_next/kda.py; REFERENCE-glm5next section 5), with the state
S [d_k, d_v] fp32:

    S <- Diag(exp g_t) S;   S <- S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t

PyTorch runs this as ~8 launches per row (and the chunked form a verify uses as ~30 per chunk);
here one program per (head, block of value columns) keeps its columns of S in registers over all T
rows: S is read once and written once. `lengths` [N] (device, optional) stops head n after its
first lengths[n] rows (the rows after leave S as it is and their outputs are not written), so one
launch replays every sequence's accepted prefix at once.

`kda_rows_ref` is the reference (the model's CPU path); the kernel matches it to fp32 rounding.
It has no backward: where autograd tracks an input (training), the reference runs.
"""

import torch

from ._triton import alloc, as_op, jit, tracks_grad, tl, use_triton


def kda_rows_ref(q, k, v, g, beta, state, lengths=None):
    """q, k, v, g [T, N, d] fp32 (q normalised and scaled, k normalised, g the log-decay <= 0),
    beta [T, N], state [N, d, d] fp32 (not modified); lengths [N] or None (all T rows).
    Returns (o [T, N, d] fp32, final state [N, d, d]); o past a head's length is zero."""
    s = state.float().clone()
    outs = []
    for t in range(q.shape[0]):
        live = None if lengths is None else (lengths > t).float()      # [N]
        gt, bt = g[t], beta[t]
        if live is not None:
            gt, bt = gt * live[:, None], bt * live
        s.mul_(gt.exp().unsqueeze(-1))                                   # Diag(exp g) S
        kv = torch.bmm(k[t].unsqueeze(1), s).squeeze(1)                  # S^T k
        s.baddbmm_(k[t].unsqueeze(-1), (bt.unsqueeze(-1) * (v[t] - kv)).unsqueeze(1))
        o = torch.bmm(q[t].unsqueeze(1), s).squeeze(1)                   # S^T q
        outs.append(o if live is None else o * live[:, None])
    o = torch.stack(outs) if outs else v.new_zeros(v.shape)
    return o, s


@jit
def _kda_rows_kernel(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, s_ptr, len_ptr, o_ptr, out_s_ptr, T, N,
                     D: tl.constexpr, BV: tl.constexpr, HAS_LEN: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BV + tl.arange(0, BV)
    rows = tl.arange(0, D)
    s_off = n * D * D + rows[:, None] * D + cols[None, :]
    s = tl.load(s_ptr + s_off)                                           # [D, BV] fp32
    steps = T
    if HAS_LEN:
        steps = tl.minimum(tl.load(len_ptr + n), T)
    for t in range(steps):
        row = (t * N + n) * D
        gk = tl.exp(tl.load(g_ptr + row + rows))
        kk = tl.load(k_ptr + row + rows)
        s = s * gk[:, None]
        kv = tl.sum(kk[:, None] * s, axis=0)                             # S^T k   [BV]
        delta = tl.load(b_ptr + t * N + n) * (tl.load(v_ptr + row + cols) - kv)
        s = s + kk[:, None] * delta[None, :]
        qq = tl.load(q_ptr + row + rows)
        tl.store(o_ptr + row + cols, tl.sum(qq[:, None] * s, axis=0))
    tl.store(out_s_ptr + s_off, s)


def kda_rows_triton(q, k, v, g, beta, state, lengths=None):
    t, n, d = q.shape
    q, k, v, g, beta = (x.float().contiguous() for x in (q, k, v, g, beta))
    s0 = state.float().contiguous()
    # rows past a head's length are zeros, as the reference's (an unwritten element stays so)
    o = torch.zeros((t, n, d), dtype=torch.float32, device=q.device) if lengths is not None else \
        alloc((t, n, d), torch.float32, q.device)
    final = alloc((n, d, d), torch.float32, q.device)
    bv = min(d, 32)
    lens = lengths.to(torch.int32).contiguous() if lengths is not None else s0
    _kda_rows_kernel[(n, d // bv)](q, k, v, g, beta, s0, lens, o, final, t, n, D=d, BV=bv,
                                   HAS_LEN=lengths is not None)
    return o, final


def kda_rows(q, k, v, g, beta, state, lengths=None, force_triton: bool = False):
    """kda_rows_ref's results; the Triton kernel for CUDA tensors with a power-of-two head size of
    at least 16 (or `force_triton` in the interpreter)."""
    if as_op() and not tracks_grad(q, k, v, g, beta, state):
        return kda_rows_op(q, k, v, g, beta, state, lengths)
    if _kernel_fits(q, k, v, g, beta, state, force=force_triton):
        return kda_rows_triton(q, k, v, g, beta, state, lengths)
    return kda_rows_ref(q, k, v, g, beta, state, lengths)


def _kernel_fits(q, *tensors, force: bool = False) -> bool:
    d = q.shape[-1]
    return (use_triton(q, *tensors, force=force) and d >= 16 and d & (d - 1) == 0
            and not tracks_grad(q, *tensors))


# As a custom op for compiled forwards (_triton's docstring).
@torch.library.custom_op("glm5mtp::kda_rows", mutates_args=())
def kda_rows_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor, lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    if _kernel_fits(q, k, v, g, beta, state):
        return kda_rows_triton(q, k, v, g, beta, state, lengths)
    o, s = kda_rows_ref(q, k, v, g, beta, state, lengths)
    return o.contiguous(), s.contiguous()


@kda_rows_op.register_fake
def _(q, k, v, g, beta, state, lengths=None):
    return q.new_empty(q.shape, dtype=torch.float32), q.new_empty(state.shape, dtype=torch.float32)
