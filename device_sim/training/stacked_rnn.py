"""The stacked backend's recurrent layers (fedkey.device_sim.training.stacked): P phones' GRU or LSTM layer, each
phone its own weights, written out step by step with its backward pass by hand.

torch's fused nn.GRU/nn.LSTM have one set of weights, so the stacked model writes the gates out
(torch.nn.GRU's r, z, n and LSTM's i, f, g, o, in that order). Left to autograd, the recurrent
product's backward made the weights' gradient at every time step: T products and T sums of a
[P, 3H, H] tensor a layer (a tied 300-unit GRU: 1 MB a phone a step), which made the stacked
backend's CPU step many times the phones' own. Here backpropagation through time runs in one
loop that carries only the state's gradient [P, B, H]; the recurrent weights' gradient is one
batched product over all time steps afterwards (as cuDNN's and torch's CPU RNN backward do).
The arithmetic is the same; its float rounding differs from autograd's in the last bits.

The forward runs in the dtype of the inputs' share `gi` (bf16 under autocast, where the precision
says so; else fp32), the backward too, and the gradients come back in their inputs' dtypes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def recurrent(
    x: Tensor, w: dict[str, Tensor], layer: int, cell: str, rows: list[int] | None = None
) -> Tensor:
    """One stacked GRU/LSTM layer over x [P, B, T, in] from a zero state -> outputs [P, B, T, H].
    The inputs' share of every time step is one batched product up front. `rows`: at time step
    t only the first rows[t] rows of every phone (non-increasing: each phone's sentences longest
    first) are still words; the others' states stop there and their outputs are zero."""
    w_ih, w_hh = w[f"rnn.weight_ih_l{layer}"], w[f"rnn.weight_hh_l{layer}"]
    b_ih, b_hh = w[f"rnn.bias_ih_l{layer}"], w[f"rnn.bias_hh_l{layer}"]
    P, B, T, _ = x.shape
    gi = torch.baddbmm(b_ih.unsqueeze(1), x.reshape(P, B * T, -1), w_ih.transpose(1, 2))
    rnn = _GRU if cell == "gru" else _LSTM
    out: Tensor = rnn.apply(gi.view(P, B, T, -1), w_hh, b_hh, rows or [B] * T)
    return out


class _GRU(torch.autograd.Function):
    """h_t = n + z * (h_{t-1} - n), r, z = sigmoid, n = tanh(i_n + r * (W_hn h + b_hn))."""

    @staticmethod
    def forward(ctx: Any, gi: Tensor, w_hh: Tensor, b_hh: Tensor, rows: list[int]) -> Tensor:
        P, B, T, _ = gi.shape
        w_t, bias = w_hh.to(gi.dtype).transpose(1, 2), b_hh.to(gi.dtype).unsqueeze(1)
        h = gi.new_zeros(P, B, w_hh.shape[-1])
        hs, saved = [], []
        for t, step in enumerate(gi.unbind(2)):
            h = h[:, : rows[t]]
            i_r, i_z, i_n = step[:, : rows[t]].chunk(3, -1)
            h_r, h_z, h_n = torch.baddbmm(bias, h, w_t).chunk(3, -1)
            r, z = torch.sigmoid(i_r + h_r), torch.sigmoid(i_z + h_z)
            n = torch.tanh(i_n + r * h_n)
            saved.append((h, r, z, n, h_n))
            h = n + z * (h - n)
            hs.append(h)
        ctx.saved, ctx.shape = saved, gi.shape
        ctx.save_for_backward(w_hh, b_hh)
        return _outputs(hs, B)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, Tensor, None]:
        w_hh, b_hh = ctx.saved_tensors
        saved = ctx.saved
        w = w_hh.to(grad.dtype)
        d_gi, d_gh = [], []
        dh = grad.new_zeros(saved[-1][0].shape)
        for t in range(len(saved) - 1, -1, -1):
            h, r, z, n, h_n = saved[t]
            dh = _grow(dh, h.shape[1]) + grad[:, : h.shape[1], t]
            dn = dh * (1 - z) * (1 - n * n)
            dz = dh * (h - n) * z * (1 - z)
            dr = dn * h_n * r * (1 - r)
            d_gi.append(torch.cat([dr, dz, dn], -1))
            gh = torch.cat([dr, dz, dn * r], -1)
            d_gh.append(gh)
            dh = dh * z + torch.bmm(gh, w)
        return (*_weight_grads(d_gi, d_gh, saved, w_hh, b_hh, ctx.shape), None)


class _LSTM(torch.autograd.Function):
    """c_t = f * c_{t-1} + i * g, h_t = o * tanh(c_t); i, f, o = sigmoid, g = tanh."""

    @staticmethod
    def forward(ctx: Any, gi: Tensor, w_hh: Tensor, b_hh: Tensor, rows: list[int]) -> Tensor:
        P, B, T, _ = gi.shape
        w_t, bias = w_hh.to(gi.dtype).transpose(1, 2), b_hh.to(gi.dtype).unsqueeze(1)
        h = gi.new_zeros(P, B, w_hh.shape[-1])
        c = torch.zeros_like(h)
        hs, saved = [], []
        for t, step in enumerate(gi.unbind(2)):
            h, c = h[:, : rows[t]], c[:, : rows[t]]
            i, f, g, o = (step[:, : rows[t]] + torch.baddbmm(bias, h, w_t)).chunk(4, -1)
            i, f, g, o = torch.sigmoid(i), torch.sigmoid(f), torch.tanh(g), torch.sigmoid(o)
            c_prev, c = c, f * c + i * g
            tc = torch.tanh(c)
            saved.append((h, c_prev, i, f, g, o, tc))
            h = o * tc
            hs.append(h)
        ctx.saved, ctx.shape = saved, gi.shape
        ctx.save_for_backward(w_hh, b_hh)
        return _outputs(hs, B)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, Tensor, None]:
        w_hh, b_hh = ctx.saved_tensors
        saved = ctx.saved
        w = w_hh.to(grad.dtype)
        d_gates = []
        dh = grad.new_zeros(saved[-1][0].shape)
        dc = torch.zeros_like(dh)
        for t in range(len(saved) - 1, -1, -1):
            h, c_prev, i, f, g, o, tc = saved[t]
            dh, dc = _grow(dh, h.shape[1]), _grow(dc, h.shape[1])
            dh = dh + grad[:, : h.shape[1], t]
            dc = dc + dh * o * (1 - tc * tc)
            gates = torch.cat(
                [dc * g * i * (1 - i), dc * c_prev * f * (1 - f), dc * i * (1 - g * g),
                 dh * tc * o * (1 - o)], -1)  # fmt: skip
            d_gates.append(gates)
            dc = dc * f
            dh = torch.bmm(gates, w)
        return (*_weight_grads(d_gates, d_gates, saved, w_hh, b_hh, ctx.shape), None)


def _outputs(hs: list[Tensor], rows: int) -> Tensor:
    """Each time step's states [P, rows_t, H] as one [P, rows, T, H], zero past each row's end."""
    if all(h.shape[1] == rows for h in hs):
        return torch.stack(hs, dim=2)
    P, H = hs[0].shape[0], hs[0].shape[2]
    out = hs[0].new_zeros(P, rows, len(hs), H)
    for t, h in enumerate(hs):
        out[:, : h.shape[1], t] = h
    return out


def _grow(d: Tensor, rows: int) -> Tensor:
    """A state's gradient [P, r, H] padded with zero rows to [P, rows, H] (rows >= r): going back
    in time, rows that had ended come back in."""
    if d.shape[1] == rows:
        return d
    return torch.cat([d, d.new_zeros(d.shape[0], rows - d.shape[1], d.shape[2])], 1)


def _weight_grads(
    d_gi: list[Tensor], d_gh: list[Tensor], saved: list[tuple[Tensor, ...]], w_hh: Tensor,
    b_hh: Tensor, shape: torch.Size,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """The gradients of gi [P, B, T, G], w_hh [P, G, H] and b_hh [P, G] from each time step's
    (collected last step first) gradient of the inputs' and the recurrent share [P, rows_t, G],
    and the states h_{t-1} [P, rows_t, H] the recurrent products saw: the weights' in one
    product over all steps."""
    d_gi, d_gh = d_gi[::-1], d_gh[::-1]
    gh = torch.cat(d_gh, dim=1)  # [P, sum of rows_t, G]
    prev = torch.cat([s[0] for s in saved], dim=1)  # [P, sum of rows_t, H]
    d_w = torch.bmm(gh.transpose(1, 2), prev).to(w_hh.dtype)
    gi = _outputs(d_gi, shape[1])
    return gi, d_w, gh.sum(1).to(b_hh.dtype)
