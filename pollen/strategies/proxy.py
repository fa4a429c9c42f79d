"""GLFC's proxy server: gradient inversion of clients' LeNet gradients and best-old-model selection.

Clients that detect a new task send, for each new class, the gradient of ``CE(LeNet(x), c)`` w.r.t. the
parameters of a fixed, never-trained LeNet whose weights both sides draw from the run seed. The proxy

1. infers each gradient's label from the FC-weight gradient (iDLG: with non-negative features the true
   class's row is the only one with a negative sum),
2. reconstructs an image per gradient by DLG gradient matching — dummy ~ N(0, 1), L-BFGS (lr 0.1),
   loss ``sum_k ||grad_k CE(LeNet(dummy), label) - g_k||^2`` — keeping the last iterates as samples,
3. scores each new global model on the reconstructed set and keeps the best in two slots (the models
   clients distil from).

Step 2 is **batched**: the matching losses of a whole batch of dummies and their gradients w.r.t. the
dummies come from one closed-form per-sample backprop through the LeNet (:class:`MatchingObjective`;
``torch.func`` for other nets), and :class:`BatchedLBFGS` is ``torch.optim.LBFGS`` (no line search)
with every sample keeping its own history, step size and stopping tests — the two-loop recursion in
compact (Gram-matrix) form — so each image follows the same trajectory as the official one-by-one
loop (:func:`reconstruct_one_by_one`), up to float rounding.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap
from torch.nn.grad import conv2d_input

# ----------------------------------------------------------------------------------------------
# label inference


def infer_labels(fc_weight_grads: torch.Tensor | np.ndarray) -> torch.Tensor:
    """Label of each gradient: the row of the FC-weight gradient (C×d, or B×C×d) with the smallest sum."""
    g = torch.as_tensor(np.asarray(fc_weight_grads) if isinstance(fc_weight_grads, np.ndarray)
                        else fc_weight_grads)
    if g.dim() not in (2, 3):
        raise ValueError(f"fc_weight_grads must be C×d or B×C×d, got shape {tuple(g.shape)}")
    return torch.argmin(g.sum(-1), dim=-1)


# ----------------------------------------------------------------------------------------------
# gradients of the LeNet


def _sum_tensors(terms: Iterable[torch.Tensor]) -> torch.Tensor:
    """``sum(terms)`` of at least one tensor, typed as a tensor (the builtin's start 0 is absorbed)."""
    total = sum(terms)
    if not isinstance(total, torch.Tensor):
        raise ValueError("nothing to sum")
    return total


def _conv_sigmoid_stack(lenet: torch.nn.Module) -> list[torch.nn.Conv2d] | None:
    """The convs of a ``body`` made of (Conv2d, Sigmoid) pairs followed by a linear ``head``, else None."""
    body, head = getattr(lenet, "body", None), getattr(lenet, "head", None)
    if not isinstance(body, torch.nn.Sequential) or not isinstance(head, torch.nn.Linear):
        return None
    mods = list(body)
    convs = [m for m in mods[::2] if isinstance(m, torch.nn.Conv2d)]
    if len(mods) % 2 or len(convs) != len(mods) // 2 or not all(isinstance(b, torch.nn.Sigmoid) for b in mods[1::2]):
        return None
    if any(c.groups != 1 or c.dilation != (1, 1) or c.padding_mode != "zeros" or c.bias is None
           or isinstance(c.padding, str) for c in convs):
        return None
    return convs


def _head(lenet: torch.nn.Module) -> torch.nn.Linear:
    """The linear ``head`` of a LeNet that :func:`_conv_sigmoid_stack` accepted."""
    head = lenet.head
    assert isinstance(head, torch.nn.Linear)
    return head


def _numeric_padding(conv: torch.nn.Conv2d) -> tuple[int, ...]:
    """A conv's padding as numbers (:func:`_conv_sigmoid_stack` rejects ``"same"``/``"valid"``)."""
    assert not isinstance(conv.padding, str)
    return conv.padding


def _lenet_backprop(convs: list[torch.nn.Conv2d], head: torch.nn.Linear, x: torch.Tensor, labels: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Closed-form per-sample backprop through sigmoid convs + linear head (differentiable in ``x``).

    Returns ``(feat, delta, layers)``: the head's input (B×d), the error at the logits (B×C) — so the
    head's weight gradient is ``delta feat^T`` — and, for each conv in order, ``(d_z, cols)``: the error
    at its output (B×Cout×H×W) and its unfolded input (B×(Cin·k·k)×L), whose per-sample correlation
    ``d_z · cols^T`` is the conv's weight gradient. The error at a conv's input is the transposed
    convolution: the same quantities autograd computes one sample at a time, for all samples in a few
    batched kernels.
    """
    weights = [c.weight.detach() for c in convs]
    acts = [x]
    for conv, w in zip(convs, weights):
        assert conv.bias is not None  # _conv_sigmoid_stack admits only convs with a bias
        acts.append(torch.sigmoid(F.conv2d(acts[-1], w, conv.bias.detach(), conv.stride, conv.padding)))
    feat = acts[-1].flatten(1)
    head_w = head.weight.detach()
    logits = F.linear(feat, head_w, head.bias.detach())
    delta = torch.softmax(logits, dim=1) - F.one_hot(labels, logits.shape[1]).to(logits.dtype)
    layers: list[tuple[torch.Tensor, torch.Tensor]] = []
    d_act = (delta @ head_w).view_as(acts[-1])
    for i in range(len(convs) - 1, -1, -1):
        conv, inp, out = convs[i], acts[i], acts[i + 1]
        d_z = d_act * out * (1.0 - out)
        padding = _numeric_padding(conv)
        layers.insert(0, (d_z, F.unfold(inp, conv.kernel_size, padding=padding, stride=conv.stride)))
        if i:
            d_act = conv2d_input(inp.shape, weights[i], d_z, conv.stride, padding)
    return feat, delta, layers


def _lenet_per_sample_gradients(convs: list[torch.nn.Conv2d], head: torch.nn.Linear, x: torch.Tensor,
                                labels: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per-sample gradients of every LeNet parameter, in ``parameters()`` order, from :func:`_lenet_backprop`."""
    feat, delta, layers = _lenet_backprop(convs, head, x, labels)
    grads: list[torch.Tensor] = []
    for conv, (d_z, cols) in zip(convs, layers):
        grads += [torch.bmm(d_z.flatten(2), cols.transpose(1, 2)).view(-1, *conv.weight.shape), d_z.sum((2, 3))]
    return tuple(grads + [delta.unsqueeze(2) * feat.unsqueeze(1), delta])


def per_sample_gradients(lenet: torch.nn.Module, x: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per-sample ``grad_theta CE`` for a batch (each output B×param shape); differentiable in ``x``.

    The DLG LeNet (sigmoid convs + linear head) takes a closed-form batched path; any other network
    falls back to :func:`per_sample_gradients_vmap`.
    """
    convs = _conv_sigmoid_stack(lenet)
    if convs is not None:
        return _lenet_per_sample_gradients(convs, _head(lenet), x, labels)
    return per_sample_gradients_vmap(lenet, x, labels)


def per_sample_gradients_vmap(lenet: torch.nn.Module, x: torch.Tensor,
                              labels: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Generic per-sample gradients with ``torch.func`` (also the reference for the closed-form path)."""
    params = {k: v.detach() for k, v in lenet.named_parameters()}

    def loss_one(p, xi, yi):
        return F.cross_entropy(functional_call(lenet, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))

    grads = vmap(grad(loss_one), in_dims=(None, 0, 0))(params, x, labels)
    return tuple(grads[k] for k in params)


class MatchingObjective:
    """Per-sample DLG loss ``sum_k ||grad_k CE(LeNet(x_b), y_b) - target_k[b]||^2`` for a fixed batch of targets.

    For the DLG LeNet the loss is fused with the closed-form backprop of
    :func:`_lenet_per_sample_gradients`, without materialising what it need not:

    * head weight: ``||delta f^T - T||^2 = |delta|^2 |f|^2 - 2 delta·(T f) + |T|^2`` — no B×C×d outer product;
    * conv weights: compared transposed (``unfold(x) @ d_z^T``), so the backward pass hands ``col2im`` a
      contiguous gradient instead of copying a transposed one.

    Other networks use :func:`per_sample_gradients` (``torch.func``). Differentiable in ``x``.
    """

    def __init__(self, lenet: torch.nn.Module, labels: torch.Tensor, targets: Sequence[torch.Tensor]):
        n_params = len(list(lenet.parameters()))
        if len(targets) != n_params:
            raise ValueError(f"{len(targets)} target arrays for a LeNet with {n_params} parameters")
        self.lenet, self.labels, self.targets = lenet, labels, list(targets)
        self.convs = _conv_sigmoid_stack(lenet)
        if self.convs is not None:
            b = len(labels)
            self.conv_targets = [(targets[2 * i].reshape(b, conv.out_channels, -1).transpose(1, 2).contiguous(),
                                  targets[2 * i + 1]) for i, conv in enumerate(self.convs)]
            self.head_w, self.head_b = targets[-2], targets[-1]
            self.head_w_sq = (self.head_w ** 2).flatten(1).sum(1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.convs is None:
            grads = per_sample_gradients(self.lenet, x, self.labels)
            return _sum_tensors(((g - t) ** 2).flatten(1).sum(1) for g, t in zip(grads, self.targets))
        feat, delta, layers = _lenet_backprop(self.convs, _head(self.lenet), x, self.labels)
        t_f = torch.bmm(self.head_w, feat.unsqueeze(2)).squeeze(2)
        loss = ((delta * delta).sum(1) * (feat * feat).sum(1) - 2.0 * (delta * t_f).sum(1) + self.head_w_sq
                + ((delta - self.head_b) ** 2).sum(1))
        for (d_z, cols), (t_w, t_b) in zip(layers, self.conv_targets):
            g_w_t = torch.bmm(cols, d_z.flatten(2).transpose(1, 2))  # B×(Cin·k·k)×Cout
            loss = loss + ((g_w_t - t_w) ** 2).flatten(1).sum(1) + ((d_z.sum((2, 3)) - t_b) ** 2).sum(1)
        return loss


def matching_losses(lenet: torch.nn.Module, dummy: torch.Tensor, labels: torch.Tensor,
                    targets: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-sample DLG loss ``sum_k ||grad_k(dummy_b) - target_k[b]||^2`` (B)."""
    return MatchingObjective(lenet, labels, targets)(dummy)


def single_matching_loss(lenet: torch.nn.Module, dummy: torch.Tensor, label: torch.Tensor,
                         target: Sequence[torch.Tensor]) -> torch.Tensor:
    """The official loop's loss for one dummy (1×C×H×W): autograd with ``create_graph``."""
    params = list(lenet.parameters())
    loss = F.cross_entropy(lenet(dummy), label.view(1))
    dy_dx = torch.autograd.grad(loss, params, create_graph=True)
    return _sum_tensors(((gx - gy) ** 2).sum() for gx, gy in zip(dy_dx, target))


# ----------------------------------------------------------------------------------------------
# batched L-BFGS


@dataclass(frozen=True)
class LBFGSSettings:
    """``torch.optim.LBFGS`` arguments (its defaults, with DLG's lr); one ``step`` = up to max_iter updates."""

    lr: float = 0.1
    max_iter: int = 20
    max_eval: int | None = None  # None: max_iter * 5 // 4, as torch
    tolerance_grad: float = 1e-7
    tolerance_change: float = 1e-9
    history_size: int = 100

    @property
    def evals(self) -> int:
        return self.max_eval if self.max_eval is not None else self.max_iter * 5 // 4


class BatchedLBFGS:
    """``torch.optim.LBFGS`` (``line_search_fn=None``) run independently on every row of a B×D tensor.

    ``objective(x) -> (losses B, grads B×D)`` must be separable (row b's loss depends on row b only).
    Each row keeps its own curvature history, step size, iteration count and stopping tests, so row b
    ends exactly where ``torch.optim.LBFGS`` started from row b alone would (up to float rounding).
    """

    def __init__(self, x: torch.Tensor, settings: LBFGSSettings = LBFGSSettings()):
        if x.dim() != 2:
            raise ValueError(f"BatchedLBFGS works on B×D tensors, got shape {tuple(x.shape)}")
        self.x = x.detach().clone()
        self.s = settings
        b, d = self.x.shape
        h = settings.history_size
        self.Y = self.x.new_zeros((b, h, d))
        self.S = self.x.new_zeros((b, h, d))
        # 1/(y·s) and Gram matrices (rows scaled by ro where the triangular solves want them) in *age*
        # order (0 = oldest pair), zero beyond each row's history
        self.ro = self.x.new_zeros((b, h))
        self.RSY = self.x.new_zeros((b, h, h))  # RSY[i, k] = ro_i s_i · y_k
        self.RYS = self.x.new_zeros((b, h, h))  # RYS[i, k] = ro_i s_k · y_i
        self.YY = self.x.new_zeros((b, h, h))  # YY[i, k] = y_i · y_k
        self.used = 0  # slots 0..used-1 have ever been written; until the ring wraps every start is 0
        self.hist_len = torch.zeros(b, dtype=torch.long, device=self.x.device)
        self.start = torch.zeros(b, dtype=torch.long, device=self.x.device)
        self.H_diag = self.x.new_ones((b,))
        self.d = self.x.new_zeros((b, d))
        self.t = self.x.new_zeros((b,))
        self.prev_g = self.x.new_zeros((b, d))
        self.prev_loss = torch.zeros(b, dtype=torch.float64, device=self.x.device)
        self.n_iter = torch.zeros(b, dtype=torch.long, device=self.x.device)
        self.evaluations = 0

    def _reset(self, rows: torch.Tensor) -> None:
        """Empty the histories of ``rows`` (torch's first iteration)."""
        self.hist_len[rows] = 0
        self.start[rows] = 0
        self.H_diag[rows] = 1.0
        for m in (self.ro, self.RSY, self.RYS, self.YY):
            m[rows] = 0.0

    def _push(self, accept: torch.Tensor, y: torch.Tensor, s: torch.Tensor, ys: torch.Tensor):
        """Append (y, s, 1/ys) to the accepted rows' histories; a full history drops its oldest pair.

        S and Y are ring buffers (``start`` = slot of the oldest pair), so the big tensors are never
        shifted; the small age-ordered Gram matrices of a full row move up one age instead. Returns
        (rows, ages) of the new pairs, whose Gram entries :meth:`_direction` fills.
        """
        h = self.s.history_size
        idx = accept.nonzero().squeeze(1)
        full = self.hist_len[idx] == h
        slot = torch.where(full, self.start[idx], (self.start[idx] + self.hist_len[idx]) % h)
        self.Y[idx, slot] = y[idx]
        self.S[idx, slot] = s[idx]
        self.used = max(self.used, int(slot.max()) + 1)
        shift = idx[full]
        if len(shift):
            for m in (self.RSY, self.RYS, self.YY):
                m[shift, :-1, :-1] = m[shift, 1:, 1:].clone()
            self.ro[shift, :-1] = self.ro[shift, 1:].clone()
        self.start[idx] = torch.where(full, (self.start[idx] + 1) % h, self.start[idx])
        self.hist_len[idx] = torch.where(full, self.hist_len[idx], self.hist_len[idx] + 1)
        age = self.hist_len[idx] - 1
        self.ro[idx, age] = 1.0 / ys[idx]
        return idx, age

    def _direction(self, g: torch.Tensor, pushed=None) -> torch.Tensor:
        """L-BFGS two-loop recursion for every row (each over its own history), in compact form.

        The recursion ``al_i = ro_i s_i·q_i`` (newest to oldest, ``q`` losing ``al_k y_k`` on the way)
        and ``be_i = ro_i y_i·r_i`` (oldest to newest, ``r`` gaining ``(al_k − be_k) s_k``) is the same
        arithmetic as two unit-triangular systems in the Gram matrices ``s_i·y_k`` and ``y_i·y_k``.
        The history (the memory-bound part) is read twice per iteration: once for every dot product —
        those of ``q`` and those of the pair just pushed (``pushed`` = (rows, ages, y, s)), which extend
        the Gram matrices — and once to assemble the direction. No Python loop over the history.
        Rows without history get ``-H g``; callers keep the rows they need.
        """
        b = g.shape[0]
        q = -g
        a = int(self.hist_len.max()) if b else 0
        if a == 0:
            return q * self.H_diag[:, None]
        # Only slots 0..used-1 were ever written; before the ring wraps every start is 0.
        S, Y = self.S[:, :self.used], self.Y[:, :self.used]
        order = (self.start[:, None] + torch.arange(a, device=g.device)[None, :]) % self.s.history_size
        order = order.clamp_max(self.used - 1)  # ages beyond a row's history: any written slot (ro = 0 there)
        # (vectors × history^T): the layout in which batched GEMM streams the history fastest
        if pushed is None:
            s_dots, y_dots = (torch.bmm(q.unsqueeze(1), m.transpose(1, 2)).transpose(1, 2) for m in (S, Y))
        else:
            idx, age, y_new, s_new = pushed
            s_dots = torch.bmm(torch.stack([q, y_new], 1), S.transpose(1, 2)).transpose(1, 2)  # s_i·q, s_i·y_new
            y_dots = torch.bmm(torch.stack([q, s_new, y_new], 1), Y.transpose(1, 2)).transpose(1, 2)
        s_dots = s_dots.gather(1, order[:, :, None].expand(b, a, s_dots.shape[2]))
        y_dots = y_dots.gather(1, order[:, :, None].expand(b, a, y_dots.shape[2]))
        valid = torch.arange(a, device=g.device)[None, :] < self.hist_len[:, None]
        zero = torch.zeros((), dtype=g.dtype, device=g.device)
        ro = self.ro[:, :a]
        if pushed is not None:
            ok, ro_rows, ro_new = valid[idx], ro[idx], self.ro[idx, age][:, None]
            s_y_new = torch.where(ok, s_dots[idx, :, 1], zero)  # s_i · y_new
            y_s_new = torch.where(ok, y_dots[idx, :, 1], zero)  # y_i · s_new
            y_y_new = torch.where(ok, y_dots[idx, :, 2], zero)
            self.RSY[idx, :a, age] = ro_rows * s_y_new
            self.RSY[idx, age, :a] = ro_new * y_s_new
            self.RYS[idx, :a, age] = ro_rows * y_s_new
            self.RYS[idx, age, :a] = ro_new * s_y_new
            self.YY[idx, :a, age] = y_y_new
            self.YY[idx, age, :a] = y_y_new
        h_diag = self.H_diag[:, None]
        # al_i + ro_i sum_{k>i} (s_i·y_k) al_k = ro_i s_i·q   (only the strict upper triangle is read)
        al = torch.linalg.solve_triangular(self.RSY[:, :a, :a], (ro * s_dots[:, :, 0]).unsqueeze(2), upper=True,
                                           unitriangular=True).squeeze(2)
        # r = H (q − sum_k al_k y_k), so y_i·r = H (y_i·q − sum_k (y_i·y_k) al_k)
        y_dot_r = h_diag * (y_dots[:, :, 0] - torch.bmm(self.YY[:, :a, :a], al.unsqueeze(2)).squeeze(2))
        # c = al − be solves c_i + ro_i sum_{k<i} (s_k·y_i) c_k = al_i − ro_i y_i·r  (strict lower triangle)
        c = torch.linalg.solve_triangular(self.RYS[:, :a, :a], (al - ro * y_dot_r).unsqueeze(2),
                                          upper=False, unitriangular=True).squeeze(2)
        # d = H q − H sum_k al_k y_k + sum_k c_k s_k, scattered back from ages to ring slots
        slots = torch.where(valid, order, torch.full_like(order, self.used))  # invalid ages -> a dummy slot
        coef_y = torch.zeros(b, self.used + 1, dtype=g.dtype, device=g.device).scatter_(1, slots, -h_diag * al)
        coef_s = torch.zeros(b, self.used + 1, dtype=g.dtype, device=g.device).scatter_(1, slots, c)
        return (h_diag * q + torch.bmm(coef_y[:, None, :self.used], Y).squeeze(1)
                + torch.bmm(coef_s[:, None, :self.used], S).squeeze(1))

    def step(self, objective: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
             active: torch.Tensor | None = None) -> torch.Tensor:
        """One ``optimizer.step(closure)`` for every row; returns the losses at the start (B)."""
        s = self.s
        loss, g = objective(self.x)
        self.evaluations += 1
        orig_loss = loss.detach().clone()
        loss = loss.detach().double()
        running = g.abs().amax(1) > s.tolerance_grad
        if active is not None:
            running &= active
        current_evals = 1
        n_iter = 0
        while n_iter < s.max_iter and running.any():
            n_iter += 1
            self.n_iter[running] += 1
            first = running & (self.n_iter == 1)
            later = running & ~first
            if first.any():
                self.d[first] = -g[first]
                self._reset(first)
            if later.any():
                y = g - self.prev_g
                sv = self.d * self.t[:, None]
                ys = (y * sv).sum(1)
                accept = later & (ys > 1e-10)
                pushed = None
                if accept.any():
                    idx, age = self._push(accept, y, sv, ys)
                    pushed = (idx, age, y, sv)
                    self.H_diag[accept] = ys[accept] / (y[accept] * y[accept]).sum(1)
                direction = self._direction(g, pushed)
                self.d[later] = direction[later]
            self.prev_g[running] = g[running]
            self.prev_loss[running] = loss[running]
            first_t = torch.clamp(1.0 / g.abs().sum(1), max=1.0) * s.lr
            self.t[running] = torch.where(first, first_t, torch.full_like(first_t, s.lr))[running]
            gtd = (g * self.d).sum(1)
            running &= ~(gtd > -s.tolerance_change)
            self.x[running] += self.t[running, None] * self.d[running]
            opt_cond = torch.zeros_like(running)
            if n_iter != s.max_iter and running.any():
                new_loss, new_g = objective(self.x)
                self.evaluations += 1
                loss = torch.where(running, new_loss.detach().double(), loss)
                g = torch.where(running[:, None], new_g, g)
                opt_cond = g.abs().amax(1) <= s.tolerance_grad
                current_evals += 1
            if n_iter == s.max_iter or current_evals >= s.evals:
                break
            small_step = (self.d * self.t[:, None]).abs().amax(1) <= s.tolerance_change
            flat = (loss - self.prev_loss).abs() < s.tolerance_change
            running &= ~(opt_cond | small_step | flat)
        return orig_loss


# ----------------------------------------------------------------------------------------------
# reconstruction


@dataclass
class Reconstruction:
    """Images kept per gradient (B×K×C×H×W, the last K iterates), labels (B), final matching losses (B)."""

    images: torch.Tensor
    labels: torch.Tensor
    losses: torch.Tensor
    initial_losses: torch.Tensor
    seconds: float
    evaluations: int = 0

    def samples(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All kept iterates as one labelled set (B·K images)."""
        b, k = self.images.shape[:2]
        return self.images.reshape(b * k, *self.images.shape[2:]), self.labels.repeat_interleave(k)


def dummy_init(shape: Sequence[int], seed: int, dtype=torch.float32) -> torch.Tensor:
    """The dummy image of one gradient: N(0, 1) from a generator seeded with ``seed`` (CPU, reproducible)."""
    return torch.randn(tuple(shape), generator=torch.Generator().manual_seed(int(seed)), dtype=dtype)


def _stack_targets(grads: Sequence[Sequence[torch.Tensor | np.ndarray]], like: torch.Tensor) -> list[torch.Tensor]:
    return [torch.stack([torch.as_tensor(np.asarray(g[k]) if isinstance(g[k], np.ndarray) else g[k])
                         for g in grads]).to(like.device, like.dtype)
            for k in range(len(grads[0]))]


def _prepare_inversion(lenet: torch.nn.Module, grads, labels: torch.Tensor | None):
    """Shared set-up of both reconstruction modes: device reference, start time, stacked targets and
    labels (inferred from the FC-weight gradient sign when not given)."""
    ref = next(lenet.parameters())
    started = time.perf_counter()
    targets_all = _stack_targets(grads, ref)
    if labels is None:
        labels = infer_labels(targets_all[-2])
    return ref, started, targets_all, labels.to(ref.device)


def reconstruct_batched(lenet: torch.nn.Module, grads: Sequence[Sequence[torch.Tensor | np.ndarray]],
                        image_shape: Sequence[int], seeds: Sequence[int], *, iterations: int = 250,
                        keep_last: int = 20, settings: LBFGSSettings = LBFGSSettings(),
                        labels: torch.Tensor | None = None, chunk: int = 256) -> Reconstruction:
    """Invert many gradients together (``chunk`` at a time); same trajectory per image as one-by-one."""
    if len(grads) == 0:
        raise ValueError("reconstruct_batched needs at least one gradient")
    if len(seeds) != len(grads):
        raise ValueError(f"{len(seeds)} seeds for {len(grads)} gradients")
    if not 0 < keep_last <= iterations:
        raise ValueError(f"need 0 < keep_last <= iterations, got {keep_last} and {iterations}")
    ref, started, targets_all, labels = _prepare_inversion(lenet, grads, labels)
    images, losses, initial, evals = [], [], [], 0
    for lo in range(0, len(grads), chunk):
        hi = min(len(grads), lo + chunk)
        targets = [t[lo:hi] for t in targets_all]
        y = labels[lo:hi]
        x0 = torch.stack([dummy_init(image_shape, s, ref.dtype) for s in seeds[lo:hi]]).to(ref.device)

        matching = MatchingObjective(lenet, y, targets)

        def objective(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            with torch.enable_grad():
                xx = flat.detach().view(-1, *image_shape).requires_grad_(True)
                per = matching(xx)
                (gx,) = torch.autograd.grad(per.sum(), xx)
            return per.detach(), gx.flatten(1)

        opt = BatchedLBFGS(x0.flatten(1), settings)
        kept = []
        for it in range(iterations):
            start_loss = opt.step(objective)
            if it == 0:
                initial.append(start_loss)
            if it >= iterations - keep_last:
                kept.append(opt.x.view(-1, *image_shape).clone())
        final, _ = objective(opt.x)
        images.append(torch.stack(kept, 1))
        losses.append(final)
        evals += opt.evaluations + 1
    return Reconstruction(torch.cat(images).cpu(), labels.cpu(), torch.cat(losses).cpu(),
                          torch.cat(initial).cpu(), time.perf_counter() - started, evals)


def reconstruct_one_by_one(lenet: torch.nn.Module, grads: Sequence[Sequence[torch.Tensor | np.ndarray]],
                           image_shape: Sequence[int], seeds: Sequence[int], *, iterations: int = 250,
                           keep_last: int = 20, settings: LBFGSSettings = LBFGSSettings(),
                           labels: torch.Tensor | None = None) -> Reconstruction:
    """The official loop: one ``torch.optim.LBFGS`` per gradient, autograd with ``create_graph``."""
    if len(seeds) != len(grads):
        raise ValueError(f"{len(seeds)} seeds for {len(grads)} gradients")
    ref, started, targets_all, labels = _prepare_inversion(lenet, grads, labels)
    images, losses, initial = [], [], []
    evals = 0
    for b in range(len(grads)):
        target = [t[b] for t in targets_all]
        label = labels[b]
        dummy = dummy_init(image_shape, seeds[b], ref.dtype).to(ref.device).unsqueeze(0).requires_grad_(True)
        opt = torch.optim.LBFGS([dummy], lr=settings.lr, max_iter=settings.max_iter, max_eval=settings.max_eval,
                                tolerance_grad=settings.tolerance_grad, tolerance_change=settings.tolerance_change,
                                history_size=settings.history_size)

        def closure():
            nonlocal evals
            evals += 1
            opt.zero_grad()
            loss = single_matching_loss(lenet, dummy, label, target)
            loss.backward()
            return loss

        kept = []
        for it in range(iterations):
            start = opt.step(closure)
            if it == 0:
                initial.append(start.detach().reshape(()))
            if it >= iterations - keep_last:
                kept.append(dummy.detach().squeeze(0).clone())
        with torch.enable_grad():
            losses.append(single_matching_loss(lenet, dummy, label, target).detach())
        images.append(torch.stack(kept))
    return Reconstruction(torch.stack(images).cpu(), labels.cpu(), torch.stack(losses).cpu(),
                          torch.stack(initial).cpu(), time.perf_counter() - started, evals)


# ----------------------------------------------------------------------------------------------
# best-old-model selection


@dataclass
class ModelSlot:
    """A designated old model: its full state arrays, head size and version (0 = empty)."""

    arrays: list[np.ndarray] | None = None
    num_classes: int = 0
    version: int = 0


@dataclass
class ProxyState:
    """The proxy's memory: the monitor set, the best score, the two slots, the last task with gradients."""

    monitor_x: torch.Tensor | None = None
    monitor_y: torch.Tensor | None = None
    best_score: float = float("-inf")
    slot1: ModelSlot = field(default_factory=ModelSlot)
    slot2: ModelSlot = field(default_factory=ModelSlot)
    task: int = -1
    versions: int = 0

    def _next_version(self) -> int:
        self.versions += 1
        return self.versions

    def receive(self, task: int, images: torch.Tensor | None, labels: torch.Tensor | None,
                reset_per_task: bool = True) -> bool:
        """Add reconstructions of round gradients; the first gradients of a new task rotate the slots.

        Returns True when the slots rotated (``best_model_1 <- best_model_2``).
        """
        if images is None or len(images) == 0:
            return False
        rotated = False
        if task > self.task:
            self.task = task
            if self.slot2.arrays is not None:
                self.slot1 = ModelSlot(self.slot2.arrays, self.slot2.num_classes, self._next_version())
            self.monitor_x, self.monitor_y = images, labels
            if reset_per_task:
                self.best_score = float("-inf")
            rotated = True
        else:
            self.monitor_x = torch.cat([self.monitor_x, images]) if self.monitor_x is not None else images
            assert labels is not None  # labels come with their images
            self.monitor_y = torch.cat([self.monitor_y, labels]) if self.monitor_y is not None else labels
        return rotated

    def consider(self, score: float, arrays: list[np.ndarray], num_classes: int) -> bool:
        """Make the global model ``best_model_2`` when it scores at least the best so far."""
        if score >= self.best_score:
            self.best_score = score
            self.slot2 = ModelSlot([a.copy() for a in arrays], num_classes, self._next_version())
            return True
        return False


@torch.no_grad()
def monitor_accuracy(model: torch.nn.Module, x: torch.Tensor | None, y: torch.Tensor | None,
                     device: torch.device, batch_size: int = 512) -> float:
    """Top-1 accuracy of ``model`` on the reconstructed set (0 when empty)."""
    if x is None or len(x) == 0:
        return 0.0
    assert y is not None  # labels come with their images
    model.eval()
    correct = 0
    for i in range(0, len(x), batch_size):
        out = model(x[i:i + batch_size].to(device))
        correct += int((out.argmax(1).cpu() == y[i:i + batch_size]).sum())
    return correct / len(x)
