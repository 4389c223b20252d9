"""KDA math: chunked == recurrent == a token-by-token reference written here from the equations,
the short conv in pieces == whole, and both rollback records commit the same state."""

import torch

from glm5mtp_cli.models.glm5_next.kda import KdaInputs, KdaPending, conv_apply, kda_chunked, kda_recurrent, prepare_inputs


def naive(q, k, v, g, beta, s0):
    """Per head, per token: S <- diag(e^g) S; S <- S + k (beta (v - S^T k))^T; o = S^T q (q, k L2-normed)."""
    T, H, d = q.shape
    s = s0.clone().double()
    out = torch.zeros(T, H, d, dtype=torch.float64)
    for t in range(T):
        for h in range(H):
            qt = q[t, h].double() / (q[t, h].double().norm() ** 2 + 1e-6) ** 0.5 / d ** 0.5
            kt = k[t, h].double() / (k[t, h].double().norm() ** 2 + 1e-6) ** 0.5
            S = torch.diag(g[t, h].double().exp()) @ s[h]
            S = S + torch.outer(kt, beta[t, h].double() * (v[t, h].double() - S.T @ kt))
            out[t, h] = S.T @ qt
            s[h] = S
    return out, s


def random_inputs(T, H=3, d=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = torch.randn(3, T, H, d, generator=gen).unbind(0)
    g = -5 * torch.sigmoid(torch.randn(T, H, d, generator=gen))
    beta = torch.sigmoid(torch.randn(T, H, generator=gen))
    s0 = 0.3 * torch.randn(H, d, d, generator=gen)
    return q, k, v, g, beta, s0


def test_chunked_equals_recurrent_equals_token_by_token():
    q, k, v, g, beta, s0 = random_inputs(37)
    ref_o, ref_s = naive(q, k, v, g, beta, s0)
    x = prepare_inputs(q, k, v, g, beta)
    o_r, s_r, states = kda_recurrent(x, s0, keep_states=True)
    torch.testing.assert_close(o_r.double(), ref_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s_r.double(), ref_s, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states[-1], s_r)
    for chunk in (64, 16, 5, 1):
        o_c, s_c = kda_chunked(x, s0, chunk)
        torch.testing.assert_close(o_c.double(), ref_o, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(s_c.double(), ref_s, atol=1e-5, rtol=1e-5)


def test_chunked_carries_state_across_calls():
    q, k, v, g, beta, s0 = random_inputs(50, seed=1)
    x = prepare_inputs(q, k, v, g, beta)
    o_all, s_all = kda_chunked(x, s0, 16)
    parts, s = [], s0
    for a, b in ((0, 7), (7, 8), (8, 40), (40, 50)):
        xi = KdaInputs(*(t[a:b] for t in (x.q, x.k, x.v, x.g, x.beta)))
        o, s = kda_chunked(xi, s, 16)
        parts.append(o)
    torch.testing.assert_close(torch.cat(parts), o_all, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, s_all, atol=1e-5, rtol=1e-5)


def test_conv_in_pieces_equals_whole():
    gen = torch.Generator().manual_seed(2)
    z = torch.randn(20, 6, generator=gen)
    w = torch.randn(6, 4, generator=gen)
    whole, _ = conv_apply(z, torch.zeros(3, 6), w)
    window, parts = torch.zeros(3, 6), []
    for a, b in ((0, 1), (1, 9), (9, 10), (10, 20)):
        out, ext = conv_apply(z[a:b], window, w)
        parts.append(out)
        window = ext[b - a:b - a + 3]
    torch.testing.assert_close(torch.cat(parts), whole)
    # the window is the last K-1 pre-conv rows
    torch.testing.assert_close(window, z[-3:])


def test_rollback_records_commit_the_same_state():
    q, k, v, g, beta, s0 = random_inputs(4, seed=3)
    x = prepare_inputs(q, k, v, g, beta)
    ext = torch.randn(3 + 4, 5)
    _, _, states = kda_recurrent(x, s0, keep_states=True)
    a = KdaPending(ext, states=states, start=s0)
    b = KdaPending(ext, inputs=x, start=s0)
    for keep in range(5):
        sa, wa = a.commit(keep, 4)
        sb, wb = b.commit(keep, 4)
        torch.testing.assert_close(sa, sb)
        torch.testing.assert_close(wa, ext[keep:keep + 3])
        ref = naive(q[:keep], k[:keep], v[:keep], g[:keep], beta[:keep], s0)[1]
        torch.testing.assert_close(sa.double(), ref, atol=1e-5, rtol=1e-5)
