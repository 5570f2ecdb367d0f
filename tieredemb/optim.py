"""Fused optimizers and the row layout: a row is its weights ‖ the optimizer's float32 state.

Each optimizer is applied inside backward to the rows a batch touched, with the gradients of
duplicate ids summed first (exact). Its state lives in the same row, so it moves with the row
through every tier. `apply_torch` is the same arithmetic in torch ops, for devices the native
kernels do not run on (CUDA); the two are tested against each other on the CPU.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import numpy as np
import torch

from . import _C


def float32_number(value) -> bool:
    """Whether value is a real number (Python's or numpy's, not a bool) that float32 holds: finite,
    and neither past its range nor so small that it becomes 0 (the kernels take it as float32)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        return False
    with np.errstate(over="ignore", under="ignore"):
        f = np.float32(value)
    return bool(np.isfinite(f)) and (f != 0 or value == 0)


def _check(name: str, value, rule: str, ok) -> None:
    """ValueError naming the value and the rule unless float32_number(value) and ok(value)."""
    if not float32_number(value):
        raise ValueError(f"{name}={value!r}: must be a real number float32 holds (finite, not rounding to 0), "
                         f"{rule}")
    if not ok(value):
        raise ValueError(f"{name}={value!r}: must be {rule}")


WEIGHT_DECAY_MODES = ("l2", "decoupled")


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """A fused optimizer: applied inside backward to the rows a batch touched (one step per
    backward, the gradients of duplicate ids summed first); its state is stored in each row after
    the weights and travels with the row through every tier. lr: learning rate, >= 0.
    Subclasses: SGD, Adagrad, RowWiseAdagrad, MomentumScaledRowWiseAdagrad, Adam.

    weight_decay (keyword, >= 0; 0: none) decays the rows a step touches, and only them (as
    FBGEMM's TBE does; torch's dense optimizers decay every row each step, and its sparse ones
    take none). weight_decay_mode "l2" (torch's `weight_decay`, FBGEMM's L2): the summed gradient
    g becomes g + weight_decay * w before the optimizer sees it, its state included. "decoupled"
    (torch's AdamW, FBGEMM's DECOUPLE): w becomes w * (1 - lr * weight_decay), then the step
    with g as it is."""

    lr: float
    weight_decay: float = dataclasses.field(default=0.0, kw_only=True)
    weight_decay_mode: str = dataclasses.field(default="l2", kw_only=True)

    kind = -1
    name = ""

    def __post_init__(self):
        if self.kind < 0:  # (a table took it, and every backward failed: "optimizer kind must be in [0, 3]")
            raise TypeError("tieredemb.Optimizer is the base of the optimizers: give SGD, Adagrad, RowWiseAdagrad, "
                            "MomentumScaledRowWiseAdagrad or Adam")
        _check("lr", self.lr, ">= 0", lambda v: v >= 0)
        _check("weight_decay", self.weight_decay, ">= 0", lambda v: v >= 0)
        if self.weight_decay_mode not in WEIGHT_DECAY_MODES:
            raise ValueError(f"weight_decay_mode={self.weight_decay_mode!r}: must be one of {WEIGHT_DECAY_MODES}")
        def as_float(v):  # (numpy numbers as Python floats: a table's meta is JSON)
            return float(v) if isinstance(v, numbers.Real) and not isinstance(v, (bool, int)) else v

        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            object.__setattr__(self, field.name, tuple(map(as_float, value)) if isinstance(value, tuple)
                               else as_float(value))

    def state_width(self, dim: int) -> int:
        """Floats of state stored after the dim weights of each row."""
        return _C.state_width(self.kind, dim)

    def native_args(self, step: int) -> "_C.OptimizerArgs":
        a = _C.OptimizerArgs()
        a.kind = self.kind
        a.lr = self.lr
        for field in ("eps", "one_minus_beta1", "one_minus_beta2", "accumulator_divisor", "weight_decay"):
            if hasattr(self, field):
                setattr(a, field, getattr(self, field))
        a.decoupled_weight_decay = self.weight_decay_mode == "decoupled"
        return a

    def apply_torch(self, rows: torch.Tensor, grad: torch.Tensor, dim: int, step: int) -> None:
        """rows: float32 [U, W] (updated in place); grad: [U, D] summed gradients."""
        if self.weight_decay:
            w, decay = rows[:, :dim], torch.tensor(self.weight_decay, dtype=torch.float32)
            if self.weight_decay_mode == "decoupled":
                w.mul_(1 - torch.tensor(self.lr, dtype=torch.float32) * decay)
            else:
                grad = grad + decay * w
        self._step_torch(rows, grad, dim, step)

    def _step_torch(self, rows: torch.Tensor, grad: torch.Tensor, dim: int, step: int) -> None:
        raise NotImplementedError

    def to_meta(self) -> dict:
        """The optimizer as a table's stored meta records it (no weight decay fields without
        weight decay: tables stored before them keep their meta, and reopen)."""
        meta = {"name": self.name, **dataclasses.asdict(self)}
        if not self.weight_decay:
            del meta["weight_decay"], meta["weight_decay_mode"]
        return meta


@dataclasses.dataclass(frozen=True)
class SGD(Optimizer):
    """w -= lr * g. No state."""

    kind = 0
    name = "sgd"

    def _step_torch(self, rows, grad, dim, step):
        rows[:, :dim].add_(grad, alpha=-self.lr)


@dataclasses.dataclass(frozen=True)
class Adagrad(Optimizer):
    """torch.optim.Adagrad's update (lr_decay = initial accumulator = 0): a sum of
    squared gradients per element (D floats of state); eps > 0 is added to its square root."""

    eps: float = 1e-10
    kind = 1
    name = "adagrad"

    def __post_init__(self):
        super().__post_init__()
        _check("eps", self.eps, "> 0", lambda v: v > 0)

    def _step_torch(self, rows, grad, dim, step):
        w, s = rows[:, :dim], rows[:, dim:2 * dim]
        s.addcmul_(grad, grad)
        w.add_(-self.lr * (grad / (s.sqrt() + self.eps)))


@dataclasses.dataclass(frozen=True)
class RowWiseAdagrad(Optimizer):
    """One accumulator per row (1 float of state): the mean over the row of the squared gradient,
    summed over steps; w -= lr * g / (sqrt(acc) + eps). FBGEMM's EXACT_ROWWISE_ADAGRAD."""

    eps: float = 1e-8
    kind = 2
    name = "rowwise_adagrad"
    # What the accumulator is divided by before its square root (1: exact, so no change here;
    # MomentumScaledRowWiseAdagrad's c).
    accumulator_divisor = 1.0

    def __post_init__(self):
        super().__post_init__()
        _check("eps", self.eps, "> 0", lambda v: v > 0)

    def _step_torch(self, rows, grad, dim, step):
        m = rows[:, dim]
        m.add_(grad.square().sum(1) / dim)
        rows[:, :dim].sub_((self.lr / ((m / self.accumulator_divisor).sqrt() + self.eps)).unsqueeze(1) * grad)


@dataclasses.dataclass(frozen=True)
class MomentumScaledRowWiseAdagrad(RowWiseAdagrad):
    """Row-wise Adagrad whose accumulated second moment is scaled down by c before its square
    root: acc += mean over the row of g^2; w -= lr * g / (sqrt(acc / c) + eps). 1 float of state
    per row, as RowWiseAdagrad; scale c > 0 (c = 1 is RowWiseAdagrad, bit for bit), the second
    argument: MomentumScaledRowWiseAdagrad(lr, c); eps only by keyword.

    The rule is that of momentum-scaled row-wise AdaGrad in "Two-Dimensional Sparse Parallelism
    for Large Scale Deep Learning Recommendation Model Training" (Zhang et al., arXiv
    2508.03854): with M data-parallel groups each holding a replica of the table, a row's
    second moment ("momentum") accumulates about M times as fast as on one replica and its
    learning rate decays too early; dividing it by c = M before the square root restores the
    rate one replica would have. Give scale=M to train a replica as one of M groups does, or to
    reproduce a model trained that way.

    Source: the paper's method section could not be read where this was written (only its
    abstract and introduction were reachable); the formula is as a public review of the paper
    quotes it: step lr / sqrt(v / c + eps), c = M. eps is added outside the root here, as in
    RowWiseAdagrad (FBGEMM's EXACT_ROWWISE_ADAGRAD, the optimizer the paper scales), so that
    c = 1 is exactly RowWiseAdagrad. The two placements change the step by a relative
    max(eps / sqrt(acc / c), eps / (2 acc / c)) or less: under 1e-6 once acc / c > 0.005 with
    eps = 1e-8."""

    scale: float = 1.0
    # (keyword: MomentumScaledRowWiseAdagrad(0.01, 8) is lr and c, as the paper names them; eps
    # second, as RowWiseAdagrad takes it, gave eps = 8 and c = 1 without a word)
    eps: float = dataclasses.field(default=1e-8, kw_only=True)
    name = "momentum_scaled_rowwise_adagrad"

    def __post_init__(self):
        super().__post_init__()
        _check("scale", self.scale, "> 0 (c: the paper's M data-parallel groups)", lambda v: v > 0)

    @property
    def accumulator_divisor(self) -> float:
        return self.scale


@dataclasses.dataclass(frozen=True)
class Adam(Optimizer):
    """Lazy Adam: only the rows of a batch move; torch.optim.SparseAdam's arithmetic. State: the
    first and second moments (2 * D floats). betas: two numbers in [0, 1); eps > 0.

    The bias correction uses the table's step count (one step per backward), as SparseAdam does.
    eps is added to sqrt(v) before the correction (SparseAdam's), where FBGEMM's ADAM adds it to
    sqrt(v / (1 - beta2^t)): ours is larger by 1 / sqrt(1 - beta2^t) (31.6x at t = 1), which
    matters only for gradients near eps."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    kind = 3
    name = "adam"

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.betas, (str, bytes)) or not hasattr(self.betas, "__len__") or len(self.betas) != 2:
            raise ValueError(f"betas={self.betas!r}: must be two numbers in [0, 1)")
        for k, b in enumerate(self.betas):
            _check(f"betas[{k}]", b, "in [0, 1)", lambda v: 0 <= v < 1)
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))  # (a list or array: a tuple)
        _check("eps", self.eps, "> 0", lambda v: v > 0)

    @property
    def beta1(self) -> float:
        return self.betas[0]

    @property
    def beta2(self) -> float:
        return self.betas[1]

    # 1 - beta in double (as SparseAdam's), then float32 for the kernels: 1.f - float32(0.999)
    # is off by a relative 1.3e-5.
    one_minus_beta1 = property(lambda self: 1 - self.betas[0])
    one_minus_beta2 = property(lambda self: 1 - self.betas[1])

    def step_size(self, step: int) -> float:
        return self.lr * math.sqrt(1 - self.beta2**step) / (1 - self.beta1**step)

    def native_args(self, step):
        a = super().native_args(step)
        a.adam_step_size = self.step_size(step)
        return a

    def _step_torch(self, rows, grad, dim, step):
        w, m, v = rows[:, :dim], rows[:, dim:2 * dim], rows[:, 2 * dim:3 * dim]
        m_update = (grad - m) * self.one_minus_beta1
        v_update = (grad * grad - v) * self.one_minus_beta2
        numer = m_update + m
        vv = v_update + v
        m.copy_(numer)
        v.copy_(vv)
        w.add_(-self.step_size(step) * (numer / (vv.sqrt() + self.eps)))


OPTIMIZERS = {cls.name: cls for cls in (SGD, Adagrad, RowWiseAdagrad, MomentumScaledRowWiseAdagrad, Adam)}


def from_meta(meta: dict | None) -> Optimizer | None:
    if meta is None:
        return None
    fields = {k: (tuple(v) if isinstance(v, list) else v) for k, v in meta.items() if k != "name"}
    return OPTIMIZERS[meta["name"]](**fields)


# The weights' dtype in every tier: its code in the native and Triton kernels.
WEIGHT_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


@dataclasses.dataclass(frozen=True)
class RowLayout:
    """How a stored row holds its values: `width` 32-bit words, the first weight_words the dim
    weights (float32, or float16 / bfloat16 two to a word: weight d is the 16-bit value at byte
    2 d, an odd dim's last half-word zero), then the optimizer's float32 state (state_width
    words), then pad words, zero, that make the row a whole number of its alignment (TableConfig's
    row_alignment). Tier pools and stores move rows as float32 [n, width] blocks without looking
    inside; a mover may leave the pad words out (`words`: the words before them)."""

    dim: int
    dtype: torch.dtype
    state_width: int
    pad: int = 0

    @property
    def code(self) -> int:
        return WEIGHT_TYPES[self.dtype]

    @property
    def weight_words(self) -> int:
        return self.dim if self.dtype == torch.float32 else (self.dim + 1) // 2

    @property
    def words(self) -> int:
        """The words that hold values: the weights and the state."""
        return self.weight_words + self.state_width

    @property
    def width(self) -> int:
        return self.words + self.pad

    def weights(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [n, width] -> their weights as float32 [n, dim] (exact)."""
        w = rows[:, :self.weight_words]
        return w if self.dtype == torch.float32 else w.contiguous().view(self.dtype)[:, :self.dim].float()

    def state(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [n, width] -> their optimizer state, float32 [n, state_width]."""
        return rows[:, self.weight_words:self.words]

    def set_weights(self, rows: torch.Tensor, weights: torch.Tensor) -> None:
        """Writes weights (float [n, dim]) into rows [n, width], rounded to the nearest (even) value of dtype."""
        if self.dtype == torch.float32:
            rows[:, :self.dim] = weights.to(torch.float32)
            return
        half = torch.zeros(len(rows), 2 * self.weight_words, dtype=self.dtype)
        half[:, :self.dim] = weights.to(self.dtype)
        rows[:, :self.weight_words] = half.view(torch.float32)
