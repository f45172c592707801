"""BatchNorm modules as other libraries write them, re-written here after their public definitions (timm,
torchvision, detectron2, mmcv are not installed: their wheels need their own torch), and small CNNs built from them.

  FrozenBatchNorm2d       torchvision.ops.misc.FrozenBatchNorm2d (= transformers' DetrFrozenBatchNorm2d, timm's)
  D2FrozenBatchNorm2d     detectron2.layers.FrozenBatchNorm2d: precomputed scale when x.requires_grad, else
                          F.batch_norm(training=False)
  BatchNormAct2d          timm.layers.norm_act.BatchNormAct2d: nn.BatchNorm2d whose forward adds drop + act
  SyncBatchNormAct        timm.layers.norm_act.SyncBatchNormAct: nn.SyncBatchNorm + drop + act
  FrozenBatchNormAct2d    timm.layers.norm_act.FrozenBatchNormAct2d: buffers only, + drop + act
  GroupNormAct            timm.layers.norm_act.GroupNormAct: nn.GroupNorm + drop + act
  BatchNormXd             mmcv.cnn.bricks.norm._BatchNormXd (revert_sync_batchnorm's target): torch's forward
  MMSyncBatchNorm         mmcv.ops.SyncBatchNorm in eval: its own forward calling F.batch_norm with its buffers
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.nn as nn
import torch.nn.functional as F


class FrozenBatchNorm2d(nn.Module):
    """torchvision's: BatchNorm2d where the batch statistics and the affine parameters are fixed (buffers)."""

    def __init__(self, num_features: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.register_buffer("weight", torch.ones(num_features))
        self.register_buffer("bias", torch.zeros(num_features))
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features))

    def forward(self, x):
        w = self.weight.reshape(1, -1, 1, 1)
        b = self.bias.reshape(1, -1, 1, 1)
        rv = self.running_var.reshape(1, -1, 1, 1)
        rm = self.running_mean.reshape(1, -1, 1, 1)
        scale = w * (rv + self.eps).rsqrt()
        bias = b - rm * scale
        return x * scale + bias


class D2FrozenBatchNorm2d(nn.Module):
    """detectron2's: the same buffers; a precomputed scale and bias when the input needs gradients."""

    def __init__(self, num_features: int, eps: float = 1e-5):
        super().__init__()
        self.num_features, self.eps = num_features, eps
        self.register_buffer("weight", torch.ones(num_features))
        self.register_buffer("bias", torch.zeros(num_features))
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features) - eps)

    def forward(self, x):
        if x.requires_grad:
            scale = self.weight * (self.running_var + self.eps).rsqrt()
            bias = self.bias - self.running_mean * scale
            scale = scale.reshape(1, -1, 1, 1)
            bias = bias.reshape(1, -1, 1, 1)
            out_dtype = x.dtype
            return x * scale.to(out_dtype) + bias.to(out_dtype)
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, training=False,
                            eps=self.eps)


def _act(act: bool, inplace: bool = False) -> nn.Module:
    return nn.ReLU(inplace=inplace) if act else nn.Identity()


class BatchNormAct2d(nn.BatchNorm2d):
    """timm's: BatchNorm2d, then drop, then act (its forward repeats torch's momentum bookkeeping)."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True, apply_act=True,
                 act_layer=nn.ReLU, drop_layer=None):
        super().__init__(num_features, eps=eps, momentum=momentum, affine=affine,
                         track_running_stats=track_running_stats)
        self.drop = drop_layer() if drop_layer is not None else nn.Identity()
        self.act = act_layer() if apply_act else nn.Identity()

    def forward(self, x):
        torch._assert(x.ndim == 4, f"expected 4D input (got {x.ndim}D input)")
        if self.momentum is None:
            exponential_average_factor = 0.0
        else:
            exponential_average_factor = self.momentum
        if self.training and self.track_running_stats:
            if self.num_batches_tracked is not None:
                self.num_batches_tracked.add_(1)
                if self.momentum is None:
                    exponential_average_factor = 1.0 / float(self.num_batches_tracked)
                else:
                    exponential_average_factor = self.momentum
        if self.training:
            bn_training = True
        else:
            bn_training = (self.running_mean is None) and (self.running_var is None)
        x = F.batch_norm(x, self.running_mean if not self.training or self.track_running_stats else None,
                         self.running_var if not self.training or self.track_running_stats else None,
                         self.weight, self.bias, bn_training, exponential_average_factor, self.eps)
        x = self.drop(x)
        x = self.act(x)
        return x


class SyncBatchNormAct(nn.SyncBatchNorm):
    """timm's: SyncBatchNorm, then drop, then act."""

    def __init__(self, num_features, eps=1e-5, act_layer=nn.ReLU):
        super().__init__(num_features, eps=eps)
        self.drop = nn.Identity()
        self.act = act_layer()

    def forward(self, x):
        x = super().forward(x)
        x = self.drop(x)
        x = self.act(x)
        return x


class FrozenBatchNormAct2d(nn.Module):
    """timm's: frozen statistics and affine (buffers), then drop, then act."""

    def __init__(self, num_features, eps=1e-5, act_layer=nn.ReLU):
        super().__init__()
        self.num_features, self.eps = num_features, eps
        self.register_buffer("weight", torch.ones(num_features))
        self.register_buffer("bias", torch.zeros(num_features))
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features))
        self.drop = nn.Identity()
        self.act = act_layer()

    def forward(self, x):
        scale = self.weight * (self.running_var + self.eps).rsqrt()
        bias = self.bias - self.running_mean * scale
        scale = scale.reshape(1, -1, 1, 1)
        bias = bias.reshape(1, -1, 1, 1)
        x = x * scale + bias
        x = self.act(self.drop(x))
        return x


class GroupNormAct(nn.GroupNorm):
    """timm's: GroupNorm, then drop, then act."""

    def __init__(self, num_channels, num_groups=32, eps=1e-5, affine=True, act_layer=nn.ReLU):
        super().__init__(num_groups, num_channels, eps=eps, affine=affine)
        self.drop = nn.Identity()
        self.act = act_layer()

    def forward(self, x):
        x = F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)
        x = self.drop(x)
        x = self.act(x)
        return x


class BatchNormXd(nn.modules.batchnorm._BatchNorm):
    """mmcv's _BatchNormXd: any rank, torch's own forward (what revert_sync_batchnorm builds)."""

    def _check_input_dim(self, input):
        return


class MMSyncBatchNorm(nn.Module):
    """mmcv.ops.SyncBatchNorm: its own module (not torch's) with BN parameters and buffers; in eval it calls
    F.batch_norm on its running statistics."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1):
        super().__init__()
        self.num_features, self.eps, self.momentum = num_features, eps, momentum
        self.weight = nn.Parameter(torch.ones(num_features))
        self.bias = nn.Parameter(torch.zeros(num_features))
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features))
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))

    def forward(self, input):
        return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias, False,
                            self.momentum, self.eps)


def randomize(model: nn.Module, seed: int = 0) -> nn.Module:
    """Every BatchNorm-like module's statistics and affine set to random values (gamma of both signs), so that no
    rewrite is exact by accident."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "running_var") and isinstance(getattr(m, "running_var"), torch.Tensor):
                c = m.running_var.numel()
                m.running_mean.copy_(torch.randn(c, generator=g) * 0.5)
                m.running_var.copy_(torch.rand(c, generator=g) * 2 + 0.2)
                if getattr(m, "weight", None) is not None:
                    m.weight.copy_(torch.randn(c, generator=g))
                if getattr(m, "bias", None) is not None:
                    m.bias.copy_(torch.randn(c, generator=g) * 0.3)
    return model


class Net(nn.Module):
    """conv -> norm -> conv -> norm -> pool -> linear, with the norm modules given by ``norm(channels)``."""

    def __init__(self, norm, channels=(8, 16)):
        super().__init__()
        self.conv1 = nn.Conv2d(3, channels[0], 3, padding=1)
        self.bn1 = norm(channels[0])
        self.conv2 = nn.Conv2d(channels[0], channels[1], 3, padding=1)
        self.bn2 = norm(channels[1])
        self.head = nn.Linear(channels[1], 5)

    def forward(self, x):
        x = self.bn1(self.conv1(x))
        x = self.bn2(self.conv2(F.relu(x)))
        return self.head(F.relu(x).mean((2, 3)))


def net(norm, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return randomize(Net(norm), seed).eval()


class Crepe(nn.Module):
    """torchcrepe's layout, small: each block is zero pad -> conv -> relu -> BatchNorm -> max pool (the BN after the
    activation, so ``fold`` alone folds nothing), then permute + reshape -> linear -> sigmoid. ``pad_mode`` reflect:
    the shift of each BN passes into the next conv too."""

    def __init__(self, channels=(1, 8, 16, 16), length: int = 64, bins: int = 12, pad_mode: str = "constant"):
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(channels[i], channels[i + 1], (8, 1), stride=(2 if i == 0 else 1, 1))
                                   for i in range(len(channels) - 1))
        self.bns = nn.ModuleList(nn.BatchNorm2d(c, eps=1e-3) for c in channels[1:])
        self.pad_mode = pad_mode
        size = length // 2
        for _ in channels[1:]:
            size //= 2
        self.classifier = nn.Linear(channels[-1] * size, bins)

    def forward(self, x):
        x = x[:, None, :, None]
        for i, (conv, bn) in enumerate(zip(self.convs, self.bns)):
            x = F.pad(x, (0, 0, 3, 4), mode=self.pad_mode)
            x = F.max_pool2d(bn(F.relu(conv(x))), (2, 1), (2, 1))
        x = x.permute(0, 2, 1, 3).reshape(-1, self.classifier.in_features)
        return torch.sigmoid(self.classifier(x))


def toy_pitch(n: int, length: int = 64, bins: int = 12, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Noisy sinusoids whose frequency is one of ``bins`` classes: (signals (n, length), labels (n,))."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, bins, (n,), generator=g)
    freq = 1.0 + labels.float() * 0.6 + torch.rand(n, generator=g) * 0.3
    phase = torch.rand(n, 1, generator=g) * 6.283
    t = torch.arange(length).float() / length * 6.283
    x = torch.sin(freq[:, None] * t + phase) * (0.5 + torch.rand(n, 1, generator=g)) + \
        0.1 * torch.randn(n, length, generator=g)
    return x, labels


@functools.lru_cache(maxsize=4)
def _trained(pad_mode: str, steps: int, seed: int) -> nn.Module:
    return _train(pad_mode, steps, seed)


def trained_crepe(pad_mode: str = "constant", steps: int = 60, seed: int = 0) -> nn.Module:
    """A Crepe trained for a few seconds on ``toy_pitch`` (real running statistics, learned gammas), in eval mode; one
    training per arguments and test session, a copy for each caller."""
    return copy.deepcopy(_trained(pad_mode, steps, seed))


def _train(pad_mode: str, steps: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = Crepe(pad_mode=pad_mode)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    x, y = toy_pitch(2048, seed=seed)
    model.train()
    for step in range(steps):
        i = torch.randint(0, len(x), (64,), generator=torch.Generator().manual_seed(step))
        loss = F.binary_cross_entropy(model(x[i]), F.one_hot(y[i], 12).float())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(-1) == y).float().mean())
