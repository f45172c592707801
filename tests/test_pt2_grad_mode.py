"""A .pt2 output of a model whose forward branches on torch.is_grad_enabled() (the d2l tutorial BatchNorm the seeds'
notes teach: running statistics under no_grad, batch statistics otherwise). Every check runs the model without
autograd; the program was traced with it on, so the written .pt2 took the batch-statistics branch: exit 0, the
report PASSED, the file 0.6 of the output's scale off. Now the program is traced under no_grad and checked at the
example inputs before it is written. Judged here on the loaded program at two shapes against the original."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def batch_norm(X, gamma, beta, running_mean, running_var, eps, momentum):  # d2l, as users write it
    if not torch.is_grad_enabled():
        X_hat = (X - running_mean) / torch.sqrt(running_var + eps)
    else:
        mean = X.mean(dim=(0, 2, 3), keepdim=True)
        var = ((X - mean) ** 2).mean(dim=(0, 2, 3), keepdim=True)
        X_hat = (X - mean) / torch.sqrt(var + eps)
        running_mean = (1.0 - momentum) * running_mean + momentum * mean
        running_var = (1.0 - momentum) * running_var + momentum * var
    return gamma * X_hat + beta, running_mean, running_var


class BatchNorm(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.gamma = nn.Parameter(torch.rand(1, c, 1, 1) + 0.5)
        self.beta = nn.Parameter(torch.randn(1, c, 1, 1))
        self.moving_mean = torch.randn(1, c, 1, 1)
        self.moving_var = torch.rand(1, c, 1, 1) + 0.5

    def forward(self, X):
        Y, self.moving_mean, self.moving_var = batch_norm(X, self.gamma, self.beta, self.moving_mean,
                                                          self.moving_var, 1e-5, 0.1)
        return Y


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = BatchNorm(8)

    def forward(self, x):
        return F.relu(self.bn(self.c(x)))


def make():
    torch.manual_seed(0)
    return Net().eval(), (torch.randn(2, 3, 16, 16),)


def test_a_pt2_of_a_model_branching_on_grad_mode_computes_what_was_checked(cli, tmp_path, monkeypatch):
    (tmp_path / "gradbn.py").write_text(open(__file__).read())
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    code, out, err = cli("canonicalize", "gradbn:make", "-o", tmp_path / "out.pt2")
    assert code == 0, err
    model, _ = make()
    program = torch.export.load(str(tmp_path / "out.pt2")).module()
    for shape in ((2, 3, 16, 16), (3, 3, 9, 12)):
        x = torch.randn(*shape)
        with torch.no_grad():
            want = model(x)
            got = program(x)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
