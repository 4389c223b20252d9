"""Kimi Delta Attention (KDA), the linear-attention layers of GLM-5-Next (REFERENCE section 5).

A KDA layer keeps, per sequence, a fixed-size state: the recurrent matrix S [H, d, d] (fp32; rows =
key channel, columns = value channel) and the short-conv window (the last K-1 pre-conv q|k|v rows).
Everything here is a pure function of (inputs, state) -> (outputs, new state) so the engine can
back the storage with its own pools; `KdaLayer.forward` returns a `KdaPending` that is committed to
any accepted prefix afterwards (speculative verify, section 8):

- mode "final":  chunked form, only the state after the last token (prefill / decode);
- mode "states": recurrent form, the state after EVERY position kept (rollback = pick one);
- mode "replay": outputs from the chunked form, the per-position kernel inputs kept, committed S
  untouched (rollback = re-run a+1 recurrent steps from it, no GEMMs).

The engine's batched forwards (`KdaLayer.forward_batch`) keep a verify's raw rows instead (`KdaRows`:
q, k, v after the conv, the gate's and beta's projections), and on the kernel path run the decode or
verify and the commit's replay as one kernels/kda.py `kda_slots` launch each, on the slot pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from glm5mtp_cli.core.cached import CachedSlots
from glm5mtp_cli.models.fp8 import joined_output, joined_weight
from glm5mtp_cli.models.glm5_next.config import NextConfig
from kernels._triton import use_kernels
from kernels.kda import gated_inputs, kda_rows, kda_slots, normalised_qk
from kernels.rmsnorm import gated_rmsnorm
from kernels.short_conv import short_conv

CHUNK = 64  # chunk length of the prefill form (transformers' and FLA's)
# Up to this many rows, a kernel-path forward runs the recurrence (kernels/kda.py: one launch over
# every row) instead of the chunked form's ~30 launches per chunk: a decode or a verify. A batched
# prefill forward ("final") takes the recurrence's kernel at any length (kernels/kda.py's docstring).
KERNEL_ROWS = 16


# ---- short causal conv -----------------------------------------------------------------------

def conv_apply(z: torch.Tensor, window: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU over new rows (kernels/short_conv.py; one kernel on CUDA).

    z [..., T, C] (pre-conv), window [..., K-1, C] (the K-1 rows before z; zeros at the sequence
    start), weight [C, K]. Returns (silu(conv) [..., T, C] in z's dtype, the extended window
    [..., K-1+T, C]). The new window after accepting the first m rows is extended[m : m+K-1].
    """
    return short_conv(z, window, weight)


# ---- the recurrence -----------------------------------------------------------------------------

@dataclass
class KdaInputs:
    """Per-position kernel inputs (fp32): q (normalised and scaled), k (normalised), v, g (log-decay
    per channel, <= 0), beta. q/k/v/g [T, H, d], beta [T, H]."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor

    def take(self, n: int) -> "KdaInputs":
        return KdaInputs(self.q[:n], self.k[:n], self.v[:n], self.g[:n], self.beta[:n])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.k, self.v, self.g, self.beta))

    def folded(self) -> "KdaInputs":
        """Batched inputs [B, T, H, d] as one sequence of B*H heads [T, B*H, d]: heads are
        independent, so the recurrences run every sequence at once."""
        def fold(t):
            return t.transpose(0, 1).reshape(t.shape[1], t.shape[0] * t.shape[2], *t.shape[3:])
        return KdaInputs(*(fold(t) for t in (self.q, self.k, self.v, self.g, self.beta)))


@dataclass
class KdaRows:
    """A KDA layer's raw rows, what kernels/kda.py's kda_slots takes: q, k, v after the conv, f the
    forget gate's projection (before dt_bias) [..., H, d], b beta's logit [..., H]; and the layer's
    gate parameters dt_bias [H * d], a_log [H]."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    f: torch.Tensor
    b: torch.Tensor
    dt_bias: torch.Tensor
    a_log: torch.Tensor

    def prepared(self, lower: float) -> KdaInputs:
        return KdaInputs(*gated_inputs(self.q, self.k, self.v, self.f, self.dt_bias, self.a_log, self.b, lower))


def prepare_inputs(q, k, v, g, beta) -> KdaInputs:
    """L2-normalise q and k (eps 1e-6), scale q by d^-1/2; everything fp32."""
    return KdaInputs(*normalised_qk(q, k), v.float(), g.float(), beta.float())


def kda_recurrent(x: KdaInputs, state: torch.Tensor, keep_states: bool = False,
                  states_out: torch.Tensor | None = None):
    """Token-by-token recurrence (decode / verify form). state [H, d, d] fp32, not modified.

    Returns (o [T, H, d] fp32, final state, states [T, H, d, d] or None): states[t] is S after
    position t. states_out: a preallocated [>=T, H, d, d] fp32 buffer for those states (an engine's
    per-position slots); the update runs in place in it, with no 4 MiB allocation per row.
    Without keep_states: kernels/kda.py's kda_rows (one kernel on CUDA).
    """
    if not keep_states:
        o, final = kda_rows(x.q, x.k, x.v, x.g, x.beta, state)
        return o, final, None
    T = x.q.shape[0]
    if states_out is None:
        states_out = torch.empty(T, *state.shape, dtype=torch.float32, device=state.device)
    prev = state.float()
    outs = []
    for t in range(T):
        s = torch.mul(prev, x.g[t].exp().unsqueeze(-1), out=states_out[t])  # Diag(exp g) S
        kv = torch.bmm(x.k[t].unsqueeze(1), s).squeeze(1)                   # S^T k       [H, d]
        delta = x.beta[t].unsqueeze(-1) * (x.v[t] - kv)                      # beta (v - S^T k)
        s.baddbmm_(x.k[t].unsqueeze(-1), delta.unsqueeze(1))                 # S + k delta^T
        outs.append(torch.bmm(x.q[t].unsqueeze(1), s).squeeze(1))            # S^T q
        prev = s
    o = torch.stack(outs) if outs else x.v.new_zeros(x.v.shape)
    return o, (prev if T else state.float().clone()), states_out[:T]


def kda_rows_form(x: KdaInputs, state: torch.Tensor, chunk: int = CHUNK):
    """(o, final state) of rows x from state, in the form that suits them: the recurrence for one
    row, or for up to KERNEL_ROWS on the kernel path; the chunked form otherwise."""
    t = x.q.shape[0]
    if t == 1 or (t <= KERNEL_ROWS and use_kernels(x.q)):
        return kda_recurrent(x, state)[:2]
    return kda_chunked(x, state, chunk)


def kda_chunked(x: KdaInputs, state: torch.Tensor, chunk: int = CHUNK):
    """Chunked (WY) form, equal to kda_recurrent up to rounding. Returns (o [T, H, d], final state).

    Within a chunk, with G the cumulative log-decay: solve (I + L) for the delta-rule corrections
    (L strictly lower triangular), then one matmul pass for outputs and the state. Decay ratios are
    taken as exp(G_r - G_s) with r >= s only, so nothing overflows however long the chunk.
    """
    T, H, d = x.q.shape
    s = state.float().clone()
    outs = []
    for c0 in range(0, T, chunk):
        q, k, v, g, beta = (t[c0:c0 + chunk] for t in (x.q, x.k, x.v, x.g, x.beta))
        L = q.shape[0]
        G = g.cumsum(0)                                                        # [L, H, d]
        tri = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()      # s <= r
        diff = (G.unsqueeze(1) - G.unsqueeze(0)).masked_fill(~tri[:, :, None, None], float("-inf")).exp()  # [r, s, H, d]
        kk = torch.einsum("rhc,shc,rshc->hrs", k, k, diff)                     # sum_c k_r k_s e^{G_r-G_s}
        lmat = (beta.t().unsqueeze(-1) * kk).tril(-1)                          # [H, r, s], s < r
        eye = torch.eye(L, dtype=q.dtype, device=q.device).expand(H, L, L)
        bv = (beta.unsqueeze(-1) * v).transpose(0, 1)                          # [H, L, d]
        bk = (beta.unsqueeze(-1) * k * G.exp()).transpose(0, 1)
        u = torch.linalg.solve_triangular(eye + lmat, bv, upper=False, unitriangular=True)
        w = torch.linalg.solve_triangular(eye + lmat, bk, upper=False, unitriangular=True)
        vp = u - torch.matmul(w, s)                                            # V' = U - W S
        aqk = torch.einsum("rhc,shc,rshc->hrs", q, k, diff)                    # s <= r (diff is 0 above)
        qg = (q * G.exp()).transpose(0, 1)
        o = torch.matmul(qg, s) + torch.matmul(aqk, vp)                        # [H, L, d]
        last = G[-1]                                                           # [H, d]
        kdec = (k * (last.unsqueeze(0) - G).exp()).transpose(0, 1)            # K * e^{G_last - G}
        s = last.exp().unsqueeze(-1) * s + torch.matmul(kdec.transpose(-1, -2), vp)
        outs.append(o.transpose(0, 1))
    o = torch.cat(outs) if outs else x.v.new_zeros(x.v.shape)
    return o, s


# ---- the layer ------------------------------------------------------------------------------------

@dataclass
class KdaPending:
    """What a KDA forward over T rows leaves for commit(keep): keep the first `keep` rows."""

    extended: torch.Tensor                 # [K-1+T, 3C] pre-conv window + new rows
    final: torch.Tensor | None = None      # mode final: S after all T rows
    states: torch.Tensor | None = None     # mode states: [T, H, d, d]
    inputs: KdaInputs | None = None        # mode replay: kernel inputs of the T rows
    start: torch.Tensor | None = None      # the committed S before the rows (read only)

    def commit(self, keep: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(S, conv window) after keeping the first `keep` rows (0..T); k = conv kernel width."""
        window = self.extended[keep:keep + k - 1].clone()
        if keep == 0:
            return self.start.clone(), window
        if self.states is not None:
            return self.states[keep - 1].clone(), window
        if self.inputs is not None:
            _, s, _ = kda_recurrent(self.inputs.take(keep), self.start)
            return s, window
        if keep != self.extended.shape[0] - (k - 1):
            raise ValueError("a 'final' KDA forward can only commit all of its rows")
        return self.final, window


@dataclass
class KdaBatchPending:
    """What a KdaLayer.forward_batch over B sequences x T rows leaves for the commit after it (S is
    untouched by the forward: the engine's slot). `stack` puts every KDA layer's conv rows (and a
    prefill's states) behind one leading layer dim, so one gather and one write commit every layer's
    windows; a verify's raw rows stay per layer (a replay launch per layer in place of seven stacking
    copies a forward)."""

    extended: torch.Tensor                 # [(Lk,) B, K-1+T, 3C]
    lower: float                           # the forget gate's lower bound (the config's)
    final: torch.Tensor | None = None      # mode final: [(Lk,) B, H, d, d]
    rows: KdaRows | list[KdaRows] | None = None  # mode replay: the T raw rows [B, T, ...] (stacked: a list by layer)
    padded: bool = False                   # rows past each sequence's real ones were kept out of `final`
    slots: dict | None = None              # the target's: the CachedSlots (kda, conv) it read, where it commits

    @classmethod
    def stack(cls, layers: list["KdaBatchPending"], slots: dict) -> "KdaBatchPending":
        return cls(torch.stack([p.extended for p in layers]), layers[0].lower,
                   None if layers[0].final is None else torch.stack([p.final for p in layers]),
                   None if layers[0].rows is None else [p.rows for p in layers], layers[0].padded, slots)

    def commit(self, keep: torch.Tensor, k: int) -> None:
        """Stacked: every sequence keeps its first keep[b] rows (keep [B] on the device: no host
        value, so a captured forward can commit) in its KDA states and conv windows, written to the
        slots the forward read; k = conv kernel width. Replay: kernels/kda.py's kda_slots re-runs
        each sequence's kept rows from its committed S and writes S in place (rows past keep[b]
        neither decay nor write), so it leaves exactly the kept rows' state. 'final' keeps its
        state where keep > 0 (the caller keeps exactly the real rows of such a forward) and S where
        nothing is kept."""
        kda, conv = self.slots["kda"], self.slots["conv"]
        ext = self.extended
        at = keep[:, None] + torch.arange(k - 1, device=keep.device)  # [B, K-1]
        window = ext.gather(2, at[None, :, :, None].expand(ext.shape[0], -1, -1, ext.shape[-1]))
        conv.data.index_copy_(1, conv.index, window.to(conv.data.dtype))
        if self.rows is None:
            s = torch.where(keep.view(1, -1, 1, 1, 1) > 0, self.final, kda.data.index_select(1, kda.index))
            kda.data.index_copy_(1, kda.index, s)
            return
        for layer, r in enumerate(self.rows):
            kda_slots(*(x[None] for x in (r.q, r.k, r.v, r.f, r.dt_bias, r.a_log, r.b)), self.lower,
                      kda.data[layer:layer + 1], kda.index, keep, commit=True)


class _Weight(nn.Module):
    """A bare `.weight` holder so state_dict names match the checkpoint (`q_conv1d.weight`)."""

    def __init__(self, *shape: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape, dtype=torch.float32))


class KdaLayer(nn.Module):
    """Parameters named as the checkpoint's `layers.N.self_attn.*` of a KDA layer.

    Under --tp (glm5_next/sharding.py) the layer holds `heads` of the model's heads, its state and
    conv window only theirs, and o_proj's partial sum is added over ranks (`comm`)."""

    comm = None

    def __init__(self, cfg: NextConfig):
        super().__init__()
        d, c, hd, nh, k = cfg.hidden_size, cfg.linear_dim, cfg.linear_head_dim, cfg.linear_num_heads, cfg.linear_conv_kernel_dim
        self.heads, self.head_dim, self.kernel = nh, hd, k
        self.eps = cfg.rms_norm_eps
        self.lower_bound = cfg.linear_lower_bound
        self.q_proj = nn.Linear(d, c, bias=False)
        self.k_proj = nn.Linear(d, c, bias=False)
        self.v_proj = nn.Linear(d, c, bias=False)
        # depthwise conv weights, one per q/k/v (the checkpoint keeps them split; conv is per channel)
        self.q_conv1d, self.k_conv1d, self.v_conv1d = _Weight(c, 1, k), _Weight(c, 1, k), _Weight(c, 1, k)
        self.f_a_proj = nn.Linear(d, hd, bias=False)
        self.f_b_proj = nn.Linear(hd, c, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(c, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.empty(nh, dtype=torch.float32))
        self.b_proj = nn.Linear(d, nh, bias=False)
        self.g_a_proj = nn.Linear(d, hd, bias=False)
        self.g_b_proj = nn.Linear(hd, c, bias=False)
        self.o_norm = _Weight(hd)
        self.o_proj = nn.Linear(c, d, bias=False)

    def joined_groups(self) -> dict[str, list[nn.Module]]:
        """What one kernel reads as one tensor (models/fp8.join_loaded): the six projections of the
        input a, in the order `project` splits their GEMM; the three conv weights."""
        return {"a": [self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, self.g_a_proj, self.b_proj],
                "conv": [self.q_conv1d, self.k_conv1d, self.v_conv1d]}

    def conv_weight(self) -> torch.Tensor:
        w = joined_weight(self, "conv")
        return (w if w is not None else torch.cat([self.q_conv1d.weight, self.k_conv1d.weight,
                                                   self.v_conv1d.weight])).squeeze(1)

    def project(self, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The projections of a [..., D]: (pre-conv q|k|v [..., 3C], f_a [..., hd], g_a [..., hd],
        beta's logit [..., H]); one GEMM where the loader joined them."""
        out = joined_output(self, "a", a)
        if out is None:
            z = torch.cat([self.q_proj(a), self.k_proj(a), self.v_proj(a)], dim=-1)
            return z, self.f_a_proj(a), self.g_a_proj(a), self.b_proj(a)
        c, hd = self.q_proj.out_features, self.f_a_proj.out_features
        return out.split([3 * c, hd, hd, self.b_proj.out_features], dim=-1)

    def rows(self, a: torch.Tensor, window: torch.Tensor) -> tuple[KdaRows, torch.Tensor, torch.Tensor]:
        """The raw rows of a [T, D] or [B, T, D] after the window [(B,) K-1, 3C]; also the extended
        window and the output gate's first projection (g_a, for `output`)."""
        lead = a.shape[:-1]
        z, f_a, g_a, b = self.project(a)
        zc, extended = conv_apply(z, window, self.conv_weight())
        q, k, v = (t.view(*lead, self.heads, self.head_dim) for t in zc.chunk(3, dim=-1))
        # the forget gate reads the pre-conv input a: lb * sigmoid(exp(A_log) (f_b f_a a + dt_bias))
        f = self.f_b_proj(f_a).view(*lead, self.heads, self.head_dim)
        return KdaRows(q, k, v, f, b, self.dt_bias, self.A_log), extended, g_a

    def inputs(self, a: torch.Tensor, window: torch.Tensor) -> tuple[KdaInputs, torch.Tensor]:
        """Kernel inputs of rows a [T, D] after the window [K-1, 3C]; also the extended window."""
        rows, extended, _ = self.rows(a, window)
        return rows.prepared(self.lower_bound), extended

    def output(self, a: torch.Tensor, o: torch.Tensor, g_a: torch.Tensor) -> torch.Tensor:
        """o [..., H, d] (any dtype: rounded to a's first) through the gated per-head RMSNorm (fp32,
        weight included; kernels/rmsnorm.gated_rmsnorm) then o_proj."""
        gated = gated_rmsnorm(o, self.g_b_proj(g_a), self.o_norm.weight, self.eps, a.dtype)
        out = self.o_proj(gated)
        return out if self.comm is None else self.comm.all_reduce_sum(out)

    def forward(self, a: torch.Tensor, state: torch.Tensor, window: torch.Tensor, mode: str = "final",
                chunk: int = CHUNK, states_out: torch.Tensor | None = None) -> tuple[torch.Tensor, KdaPending]:
        """a [T, D] normed block input; state [H, d, d] fp32 and window [K-1, 3C] are read, not written.
        states_out (mode states): preallocated per-position state slots [>=T, H, d, d]."""
        rows, extended, g_a = self.rows(a, window)
        x = rows.prepared(self.lower_bound)
        if mode == "states":
            o, _, states = kda_recurrent(x, state, keep_states=True, states_out=states_out)
            pending = KdaPending(extended, states=states, start=state)
        elif mode == "replay":
            o, _ = kda_rows_form(x, state, chunk)
            pending = KdaPending(extended, inputs=x, start=state)
        elif mode == "final":
            o, s = kda_rows_form(x, state, chunk)
            pending = KdaPending(extended, final=s, start=state)
        else:
            raise ValueError(f"unknown KDA mode {mode!r}")
        return self.output(a, o, g_a), pending

    def forward_batch(self, a: torch.Tensor, kda: CachedSlots, layer: int, window: torch.Tensor, mode: str = "replay",
                      chunk: int = CHUNK, real: torch.Tensor | None = None) -> tuple[torch.Tensor, KdaBatchPending]:
        """B sequences at once, T rows each: a [B, T, D]; the sequences' states are kda's pool slots
        of KDA layer `layer`, window [B, K-1, 3C]; both are read, not written. mode "replay" (a
        verify's rows: keep the raw rows) or "final" (prefill: keep the state after all rows).
        Fixed shapes for a given (B, T).

        real [B] (device; None: all T): sequence b's rows from real[b] on are padding (a shared
        prefill forward). They get g = 0 and beta = 0, no decay and no write, so `final` is the
        state after the real rows, exact; their outputs are garbage nobody reads, and the conv
        window of the kept rows comes from `extended` at commit as for any prefix."""
        if mode not in ("replay", "final"):
            raise ValueError(f"batched KDA forwards keep 'replay' or 'final', got {mode!r}")
        b, t = a.shape[:2]
        rows, extended, g_a = self.rows(a, window)
        pending = KdaBatchPending(extended, self.lower_bound, rows=rows if mode == "replay" else None,
                                  padded=real is not None)
        if use_kernels(a) and (mode == "final" or t <= KERNEL_ROWS):  # one kernel from the raw rows, S read in place
            pool = kda.data[layer:layer + 1]
            out = kda_slots(*(x[None] for x in (rows.q, rows.k, rows.v, rows.f)), rows.dt_bias[None],
                            rows.a_log[None], rows.b[None], self.lower_bound, pool, kda.index, real,
                            final=mode == "final")
            o = out[0] if mode == "final" else out  # [1, B, T, H, d]: the one layer's
            if mode == "final":
                pending.final = out[1][0]
            return self.output(a, o[0], g_a), pending
        x = rows.prepared(self.lower_bound)
        if real is not None:
            live = torch.arange(t, device=a.device)[None, :] < real[:, None]          # [B, T]
            x = KdaInputs(x.q, x.k, x.v, x.g * live[..., None, None], x.beta * live[..., None])
        state = kda.read(layer)
        run = kda_rows_form(x.folded(), state.reshape(b * self.heads, *state.shape[2:]), chunk)
        o = run[0].view(t, b, self.heads, self.head_dim).transpose(0, 1)
        if mode == "final":
            pending.final = run[1].view(state.shape)
        return self.output(a, o, g_a), pending
