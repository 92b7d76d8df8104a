"""Fit L(N, D) = E + A / N^alpha + B / D^beta to final losses (Chinchilla, approach 3).

Hoffmann et al. (2022), appendix D.2: with A = e^a, B = e^b, E = e^e, minimise over (a, b, e,
alpha, beta)

    sum_i Huber_delta( LSE(a - alpha log N_i, b - beta log D_i, e) - log L_i ),   delta = 1e-3

with L-BFGS started from a grid of initialisations (alpha, beta in {0, .5, .., 2}, e in {-1, -.5,
.., 1.5}, a, b in {0, 5, .., 25}) and keep the best. Huber on log-loss makes the fit robust to a
few outlier runs; log-sum-exp keeps every term positive. Here every grid point is scored at once
and L-BFGS runs from the best `starts` of them (all 5,400 cost minutes and, on ladders tried here,
found the same optimum).

The compute-optimal split of a budget C = 6 N D follows in closed form (their eq. 4):
N_opt = G (C/6)^(beta/(alpha+beta)), D_opt = (C/6)^(alpha/(alpha+beta)) / G,
G = (alpha A / (beta B))^(1/(alpha+beta)).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np

# L-BFGS-B bounds on (a, b, e, alpha, beta): wide around anything language models show, but
# finite, so a ladder that does not follow the law (too few sizes, undertrained rungs) ends at a
# bound the report flags instead of at exp(1000).
BOUNDS = ((-20.0, 80.0), (-20.0, 80.0), (-10.0, 5.0), (0.0, 3.0), (0.0, 3.0))

GRID = {
    "alpha": (0.0, 0.5, 1.0, 1.5, 2.0),
    "beta": (0.0, 0.5, 1.0, 1.5, 2.0),
    "e": (-1.0, -0.5, 0.0, 0.5, 1.0, 1.5),
    "a": (0.0, 5.0, 10.0, 15.0, 20.0, 25.0),
    "b": (0.0, 5.0, 10.0, 15.0, 20.0, 25.0),
}


@dataclass(frozen=True)
class Law:
    E: float
    A: float
    alpha: float
    B: float
    beta: float
    objective: float = math.nan   # the Huber sum at the optimum
    points: int = 0

    def loss(self, n: float | np.ndarray, d: float | np.ndarray) -> float | np.ndarray:
        return self.E + self.A / np.power(n, self.alpha) + self.B / np.power(d, self.beta)

    def compute_optimal(self, flops: float) -> tuple[float, float]:
        """(N, D) minimising the loss at C = 6 N D."""
        a, b = self.beta / (self.alpha + self.beta), self.alpha / (self.alpha + self.beta)
        g = (self.alpha * self.A / (self.beta * self.B)) ** (1 / (self.alpha + self.beta))
        return g * (flops / 6) ** a, (flops / 6) ** b / g

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def _objective(theta: np.ndarray, log_n: np.ndarray, log_d: np.ndarray, log_l: np.ndarray,
               delta: float) -> tuple[np.ndarray, np.ndarray]:
    """Huber sum and its gradient for a batch of parameter vectors theta (K, 5) =
    (a, b, e, alpha, beta); returns (K,) and (K, 5)."""
    a, b, e, alpha, beta = (theta[:, i:i + 1] for i in range(5))
    z = np.stack([a - alpha * log_n, b - beta * log_d, np.broadcast_to(e, (len(theta), len(log_n)))])
    top = z.max(axis=0)
    w = np.exp(z - top)
    total = w.sum(axis=0)
    r = top + np.log(total) - log_l                       # (K, n) residuals of log-loss
    soft = w / total                                      # d LSE / d z
    huber = np.where(np.abs(r) <= delta, 0.5 * r**2, delta * (np.abs(r) - 0.5 * delta))
    h = np.clip(r, -delta, delta)                         # Huber'(r)
    grad = np.stack([(h * soft[0]).sum(1), (h * soft[1]).sum(1), (h * soft[2]).sum(1),
                     -(h * soft[0] * log_n).sum(1), -(h * soft[1] * log_d).sum(1)], axis=1)
    return huber.sum(axis=1), grad


def _objective1(theta: np.ndarray, log_n: np.ndarray, log_d: np.ndarray, log_l: np.ndarray,
                delta: float) -> tuple[float, np.ndarray]:
    """`_objective` for one parameter vector, with fewer array operations (L-BFGS calls it
    a few hundred times per start)."""
    a, b, e, alpha, beta = theta
    z0, z1 = a - alpha * log_n, b - beta * log_d
    top = np.maximum(np.maximum(z0, z1), e)
    w0, w1, w2 = np.exp(z0 - top), np.exp(z1 - top), np.exp(e - top)
    total = w0 + w1 + w2
    r = top + np.log(total) - log_l
    absr = np.abs(r)
    value = np.where(absr <= delta, 0.5 * r * r, delta * (absr - 0.5 * delta)).sum()
    h = np.clip(r, -delta, delta) / total
    g0, g1 = h * w0, h * w1
    return float(value), np.array([g0.sum(), g1.sum(), (h * w2).sum(),
                                   -(g0 * log_n).sum(), -(g1 * log_d).sum()])


def _lbfgs(theta0: np.ndarray, args: tuple) -> tuple[np.ndarray, float]:
    try:
        from scipy.optimize import minimize
    except ImportError:  # the job image may lack scipy: torch's L-BFGS does the same
        return _lbfgs_torch(theta0, args)

    res = minimize(_objective1, theta0, args=args, jac=True, method="L-BFGS-B", bounds=BOUNDS,
                   options={"maxiter": 1000, "ftol": 1e-15, "gtol": 1e-12})
    return res.x, float(res.fun)


def _lbfgs_torch(theta0: np.ndarray, args: tuple) -> tuple[np.ndarray, float]:
    import torch

    theta = torch.tensor(theta0, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([theta], max_iter=1000, tolerance_grad=1e-12, tolerance_change=1e-15,
                            line_search_fn="strong_wolfe")

    def closure():
        value, grad = _objective(theta.detach().numpy()[None], *args)
        theta.grad = torch.from_numpy(grad[0].copy())
        return torch.tensor(float(value[0]), dtype=torch.float64)

    opt.step(closure)
    # torch's L-BFGS has no bounds: clip to them (an optimum inside them is unaffected)
    result = np.clip(theta.detach().numpy(), [lo for lo, _ in BOUNDS], [hi for _, hi in BOUNDS])
    value, _ = _objective(result[None], *args)
    return result, float(value[0])


def fit(n: Sequence[float], d: Sequence[float], loss: Sequence[float], *, delta: float = 1e-3,
        starts: int = 16, grid: dict[str, Sequence[float]] = GRID) -> Law:
    """The law through (N_i, D_i, L_i): Huber on log-loss, L-BFGS from the best grid starts."""
    log_n, log_d = np.log(np.asarray(n, float)), np.log(np.asarray(d, float))
    log_l = np.log(np.asarray(loss, float))
    if len(log_l) < 5:
        raise ValueError(f"fitting 5 constants needs at least 5 points, got {len(log_l)}")
    args = (log_n, log_d, log_l, delta)
    inits = np.array([(a, b, e, al, be) for al, be, e, a, b in itertools.product(
        grid["alpha"], grid["beta"], grid["e"], grid["a"], grid["b"])])
    scores, _ = _objective(inits, *args)
    best_theta, best_value = None, math.inf
    for i in np.argsort(scores)[:starts]:
        theta, value = _lbfgs(inits[i], args)
        if value < best_value and np.all(np.isfinite(theta)):
            best_theta, best_value = theta, value
    a, b, e, alpha, beta = (float(x) for x in best_theta)
    return Law(E=math.exp(e), A=math.exp(a), alpha=alpha, B=math.exp(b), beta=beta,
               objective=best_value, points=len(log_l))
