"""Partitioners over label arrays, reproducible from a seed.

- iid: a random permutation cut into equal shares.
- dirichlet, convention "hsu" (FLGo's, Hsu et al. 2019; the default): every client gets
  the same number of samples and a label mix drawn from Dir(alpha * p), p the global label
  distribution; the draws are re-sampled client by client until their mean matches p
  (FLGo's procedure), then every class is split over the clients in those proportions.
- dirichlet, convention "per-class" (NIID-Bench / Flower Datasets): each class is split
  over the clients with Dir(alpha * 1_N); client sizes differ.
- pathological: every client holds exactly `classes_per_client` classes.
- quantity-dirichlet (HierFL's unbalanced IID split, MAFSA's Table 2): labels IID, client
  sizes a floor of min(100, n / 2N) plus a multinomial share of the rest with proportions
  from Dir(alpha * 1_N).

iid and quantity-dirichlet never read the labels, so they split float regression targets
too; dirichlet and pathological need integer class labels (`label_problem`).
"""

from __future__ import annotations

import numpy as np

from fedstale.common.config import ConfigError

MIN_PER_CLASS_CLIENT_SIZE = 10
# Per-class Dirichlet redraws until every client has MIN_PER_CLASS_CLIENT_SIZE samples. A
# seed whose first feasible draw comes earlier gets the same partition whatever the cap;
# 200 Fashion-MNIST clients at alpha 0.1 need 111-1,043 draws (seeds 0-2).
PER_CLASS_DRAWS = 5_000
QUANTITY_FLOOR = 100  # HierFL's minimum client size
BY_LABEL = ("dirichlet", "pathological")


def label_problem(scheme: str, labels: np.ndarray) -> str:
    """Why `scheme` cannot split `labels`, or "" when it can."""
    if scheme in BY_LABEL and not np.issubdtype(labels.dtype, np.integer):
        return (
            f"partition={scheme} splits by class label and these labels are "
            f"{labels.dtype} targets (regression); use partition=iid or quantity-dirichlet"
        )
    return ""


def iid(labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    return [np.sort(part) for part in np.array_split(rng.permutation(len(labels)), num_clients)]


def _draw_mixes(alpha_p: np.ndarray, count: int, rng: np.random.Generator) -> np.ndarray:
    """Dirichlet draws; rows that underflow to NaN (tiny alpha) are drawn again."""
    mixes = rng.dirichlet(alpha_p, size=count)
    for _ in range(1000):
        bad = ~np.isfinite(mixes).all(axis=1)
        if not bad.any():
            return mixes
        mixes[bad] = rng.dirichlet(alpha_p, size=int(bad.sum()))
    raise ConfigError("Dirichlet draws stayed non-finite; raise dirichlet-alpha")


def _balance_mixes(
    mixes: np.ndarray, prior: np.ndarray, alpha_p: np.ndarray, rng: np.random.Generator
) -> np.ndarray:
    """Replace one client's mix at a time (round robin) by the best of N fresh draws while
    that brings the mean mix closer to the global label distribution (FLGo's loop)."""
    num_clients = len(mixes)
    max_error, loops, client = 1e-6, 0, 0
    for _ in range(20_000):
        error = float(((mixes.mean(axis=0) - prior) ** 2).sum())
        if error <= max_error:
            break
        loops += 1
        if loops % 500 == 0:
            max_error *= 10
        others = mixes.sum(axis=0) - mixes[client]
        candidates = _draw_mixes(alpha_p, num_clients, rng)
        errors = (((others + candidates) / num_clients - prior) ** 2).sum(axis=1)
        best = int(np.argmin(errors))
        if errors[best] < error:
            mixes[client] = candidates[best]
        client = (client + 1) % num_clients
    return mixes


def _split_by_mix(
    labels: np.ndarray, weights: np.ndarray, rng: np.random.Generator
) -> list[np.ndarray]:
    """Split each class over clients in proportion to `weights[:, class]`."""
    parts: list[list[np.ndarray]] = [[] for _ in range(weights.shape[0])]
    for cls in range(weights.shape[1]):
        members = rng.permutation(np.flatnonzero(labels == cls))
        column = weights[:, cls]
        if column.sum() <= 0:
            column = np.ones_like(column)
        cuts = (np.cumsum(column / column.sum()) * len(members)).astype(int)[:-1]
        for client, chunk in enumerate(np.split(members, cuts)):
            parts[client].append(chunk)
    return [np.sort(np.concatenate(chunks)) for chunks in parts]


def dirichlet_hsu(
    labels: np.ndarray, num_clients: int, alpha: float, rng: np.random.Generator
) -> list[np.ndarray]:
    num_classes = int(labels.max()) + 1
    prior = np.bincount(labels, minlength=num_classes) / len(labels)
    alpha_p = np.maximum(alpha * prior, 1e-12)
    mixes = _balance_mixes(_draw_mixes(alpha_p, num_clients, rng), prior, alpha_p, rng)
    return _split_by_mix(labels, mixes, rng)


def dirichlet_per_class(
    labels: np.ndarray, num_clients: int, alpha: float, rng: np.random.Generator
) -> list[np.ndarray]:
    num_classes = int(labels.max()) + 1
    minimum = min(MIN_PER_CLASS_CLIENT_SIZE, len(labels) // (2 * num_clients))
    for _ in range(PER_CLASS_DRAWS):
        shares = rng.dirichlet(np.full(num_clients, alpha), size=num_classes).T
        parts = _split_by_mix(labels, shares, rng)
        if min(len(p) for p in parts) >= max(minimum, 1):
            return parts
    raise ConfigError(
        f"per-class Dirichlet({alpha}) over {num_clients} clients left one with fewer than "
        f"{minimum} samples in {PER_CLASS_DRAWS:,} draws; raise dirichlet-alpha, lower "
        "num-clients or choose another seed"
    )


def quantity_dirichlet(
    labels: np.ndarray, num_clients: int, alpha: float, rng: np.random.Generator
) -> list[np.ndarray]:
    floor = min(QUANTITY_FLOOR, len(labels) // (2 * num_clients))
    shares = rng.dirichlet(np.full(num_clients, alpha))
    sizes = floor + rng.multinomial(len(labels) - floor * num_clients, shares)
    cuts = np.cumsum(sizes)[:-1]
    return [np.sort(part) for part in np.split(rng.permutation(len(labels)), cuts)]


def pathological(
    labels: np.ndarray, num_clients: int, classes_per_client: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """Client i holds classes order[(i * k + j) % C], j < k; each class is cut evenly
    among the clients that hold it."""
    num_classes = int(labels.max()) + 1
    order = rng.permutation(num_classes)
    holders: dict[int, list[int]] = {cls: [] for cls in range(num_classes)}
    for client in range(num_clients):
        for j in range(classes_per_client):
            holders[int(order[(client * classes_per_client + j) % num_classes])].append(client)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for cls, owners in holders.items():
        if not owners:
            continue
        members = rng.permutation(np.flatnonzero(labels == cls))
        for owner, chunk in zip(owners, np.array_split(members, len(owners)), strict=True):
            parts[owner].append(chunk)
    return [np.sort(np.concatenate(chunks)) for chunks in parts]


def partition(
    labels: np.ndarray,
    num_clients: int,
    scheme: str,
    seed: int,
    *,
    alpha: float = 1.0,
    convention: str = "hsu",
    classes_per_client: int = 2,
) -> list[np.ndarray]:
    """Indices of each client's samples; the same arguments always give the same result."""
    problem = label_problem(scheme, labels)
    if problem:
        raise ValueError(problem)
    rng = np.random.default_rng([seed, 0x5EED])
    if scheme == "iid":
        return iid(labels, num_clients, rng)
    if scheme == "dirichlet":
        split = dirichlet_hsu if convention == "hsu" else dirichlet_per_class
        return split(labels, num_clients, alpha, rng)
    if scheme == "quantity-dirichlet":
        return quantity_dirichlet(labels, num_clients, alpha, rng)
    if scheme == "pathological":
        return pathological(labels, num_clients, classes_per_client, rng)
    raise ValueError(f"unknown partition scheme '{scheme}'")


def split_validation(
    indices: np.ndarray, fraction: float, seed: int, client: int
) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) indices of one client; FLGo keeps `fraction` for validation."""
    if fraction <= 0 or len(indices) < 2:
        return indices, indices[:0]
    shuffled = np.random.default_rng([seed, client, 0x7A1]).permutation(indices)
    num_val = min(int(round(fraction * len(indices))), len(indices) - 1)
    return np.sort(shuffled[num_val:]), np.sort(shuffled[:num_val])
