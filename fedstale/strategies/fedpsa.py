"""FedPSA (Lu et al., Algorithm 1, eq. 3-20; docs/algorithms.md): behavioural staleness.

Clients send their delta and a k-float sketch of their parameter sensitivity on a shared
calibration batch (eq. 8, 11). The server keeps a buffer of L_s updates and a thermometer
queue Q of the last L_q squared update norms m_i = ||delta_i||^2 (eq. 16).
M_0 = mean(Q) the first time Q is full, fixed afterwards; M_cur = mean(Q) (eq. 17);
Temp = gamma * M_cur / M_0 + delta (eq. 18). When the buffer holds L_s updates, the server
sketches the current global model on the same batch and projection, kappa_i =
cos(sketch_i, sketch_g) (eq. 12), weights are uniform while Q has never been full and
softmax(kappa / Temp) afterwards (eq. 19), and w <- w + sum_i weight_i delta_i (eq. 20).

Ablations (paper Table 6): no-thermometer (Temp fixed at gamma + delta), no-sensitivity
(sketches of the raw parameters), no-both. Calibration batch (Table 5): Gaussian from the
run seed, or a real held-out batch the server binds and sends once per client. The Gaussian
batch's labels (the paper does not say what they are): uniformly random, or with
`fedpsa-calib-labels=self` each sketched model's own argmax predictions.
Diagnostic (Sec. 6.6, eq. 21-22): with `fedpsa-diagnostic`, every update also records
align = cos(grad L(w_client; D_test), grad L(w_server; D_test)), w_client = w_base + delta.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from pydantic import Field

from fedstale.common.config import ConfigError, RuleSettings
from fedstale.common.schema import InvalidReply, SignalSpec, keys_of
from fedstale.strategies.base import (
    Assignment,
    ModelServices,
    Outcome,
    ServerModel,
    Strategy,
    TorchModel,
    Update,
    View,
    step_scale,
    update_record,
)
from fedstale.strategies.buffer import Buffer, BufferParams
from fedstale.strategies.client import ClientRule, LocalTask
from fedstale.strategies.privacy import CONVEX, Release
from fedstale.strategies.rule import Rule

# The torch side (calibration batches, sketches, gradients) is imported where it is used, so
# that the rule registry, and with it every `fedstale` command, loads without torch.
if TYPE_CHECKING:
    import torch
    from torch.nn import Module

    from fedstale.common.calibration import Batch

NORM_TOLERANCE = 1e-3  # relative: the client's ||delta||^2 against the server's
HISTORY = 256  # global versions kept for the diagnostic (an older base is not scored)
DIAGNOSTIC_BATCH = 512  # held-out samples behind each gradient of the Sec. 6.6 diagnostic

Sketcher = Callable[[np.ndarray], np.ndarray]  # flat global model -> its sketch
Aligner = Callable[[list[np.ndarray], np.ndarray], list[float]]  # clients, server -> cosines


class FedPSAKeys:
    """What FedPSA adds to the wire: the task-config entries that ask for its signal,
    then the reply metrics that carry it."""

    SKETCH_K = "sketch-k"
    SKETCH_SEED = "sketch-seed"
    SKETCH_OF = "sketch-of"  # "sensitivity" or "params"
    CALIB_SIZE = "calib-size"
    CALIB_SEED = "calib-seed"
    CALIB_SOURCE = "calib-source"  # "gaussian" (from CALIB_SEED) or "real"
    CALIB_LABELS = "calib-labels"  # "random" (drawn with the batch) or "self"
    CALIB_X = "calib-x"  # a real calibration batch, sent once (float32 bytes)
    CALIB_Y = "calib-y"  # its labels (int64 bytes)
    CALIB_DIGEST = "calib-digest"  # names the real batch in every task
    SKETCH = "sketch"
    UPDATE_NORM_SQ = "update-norm-sq"


class FedPSAParams(BufferParams):
    fedpsa_sketch_dim: int = Field(default=16, ge=1)
    fedpsa_queue: int = Field(default=50, ge=1)
    fedpsa_gamma: float = Field(default=5.0, ge=0)
    fedpsa_delta: float = Field(default=0.5, ge=0)
    fedpsa_calib_size: int = Field(default=32, ge=1)
    fedpsa_ablation: Literal["none", "no-thermometer", "no-sensitivity", "no-both"] = "none"
    fedpsa_calib_source: Literal["gaussian", "real"] = "gaussian"
    fedpsa_calib_labels: Literal["random", "self"] = "random"
    fedpsa_diagnostic: bool = False


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Eq. 12, both norms clamped at >= 1e-12 (docs/algorithms.md)."""
    norm = max(float(np.linalg.norm(a)), 1e-12) * max(float(np.linalg.norm(b)), 1e-12)
    return float(np.dot(a, b) / norm)


def squared_norm(vector: np.ndarray) -> float:
    flat = vector.astype(np.float64)
    return float(np.dot(flat, flat))


def softmax(values: np.ndarray, temperature: float) -> np.ndarray:
    scaled = values / temperature
    exp = np.exp(scaled - scaled.max())
    return exp / exp.sum()


# ---------------------------------------------------------------- the client half


class SensitivitySketch(ClientRule):
    """FedPSA (eq. 8, 11): the k-float sketch of the trained model's parameter sensitivity
    on the shared calibration batch, and ||delta||^2 for the thermometer (eq. 16)."""

    name = "fedpsa-sketch"
    in_cohorts = True  # the sketch reads the trained model: training itself is plain
    mod = "fedstale.client_app.mods:fedpsa_mod(model_fn, input_shape)"

    def after(self, task: LocalTask, trained: np.ndarray, delta: np.ndarray) -> None:
        task.signals.update(
            sketch_signals(task.model, task.spec.extra, task.input_shape, task.num_classes, delta)
        )


def task_batch(
    settings: Mapping[str, Any], input_shape: tuple[int, ...], num_classes: int
) -> Batch:
    """The calibration batch a task's config names (Sec. 5.2; Table 5)."""
    from fedstale.common.calibration import SOURCES, gaussian_batch, real_for_task

    source = str(settings.get(FedPSAKeys.CALIB_SOURCE, "gaussian"))
    size = int(settings[FedPSAKeys.CALIB_SIZE])
    if source == "gaussian":
        return gaussian_batch(int(settings[FedPSAKeys.CALIB_SEED]), input_shape, num_classes, size)
    if source != "real":
        raise ValueError(f"calibration source '{source}' is not one of {SOURCES}")
    sent = None
    if FedPSAKeys.CALIB_X in settings:
        sent = (settings[FedPSAKeys.CALIB_X], settings[FedPSAKeys.CALIB_Y])
    return real_for_task(str(settings[FedPSAKeys.CALIB_DIGEST]), sent, size, input_shape)


def calibration_entries(batch: Batch) -> dict[str, Any]:
    """The task entries that carry a real batch (sent once per client)."""
    from fedstale.common.calibration import encode

    raw_x, raw_y, named = encode(batch)
    return {FedPSAKeys.CALIB_X: raw_x, FedPSAKeys.CALIB_Y: raw_y, FedPSAKeys.CALIB_DIGEST: named}


def calib_labels(settings: Mapping[str, Any]) -> str:
    """A task's label mode; a task that names none (an older server) means `random`."""
    from fedstale.common.sensitivity import LABELS

    labels = str(settings.get(FedPSAKeys.CALIB_LABELS, "random"))
    if labels not in LABELS:
        raise ValueError(f"calibration labels '{labels}' are not one of {LABELS}")
    return labels


def sketch_for_task(
    model: Module,
    settings: Mapping[str, Any],
    input_shape: tuple[int, ...],
    num_classes: int,
    batch: Batch | None = None,
) -> np.ndarray:
    """The sketch a task's config asks for (eq. 11); the server calls it with the same
    settings and its own copy of the calibration batch. With `self` labels, each model
    sketched (client or global) labels the batch itself."""
    from fedstale.common.sensitivity import model_sketch, self_labelled

    if batch is None:
        batch = task_batch(settings, input_shape, num_classes)
    if calib_labels(settings) == "self":
        batch = self_labelled(model, batch)
    return model_sketch(
        model,
        batch,
        int(settings[FedPSAKeys.SKETCH_K]),
        int(settings[FedPSAKeys.SKETCH_SEED]),
        str(settings[FedPSAKeys.SKETCH_OF]),
    )


def sketch_signals(
    model: Module,
    settings: Mapping[str, Any],
    input_shape: tuple[int, ...],
    num_classes: int,
    delta: np.ndarray,
) -> dict[str, Any]:
    """The reply signals of a trained `model` (loaded) whose update is `delta`: its sketch
    as the task's `settings` ask (eq. 11) and ||delta||^2 (eq. 16)."""
    sketch = sketch_for_task(model, settings, input_shape, num_classes)
    return {
        FedPSAKeys.SKETCH: [float(v) for v in sketch],
        FedPSAKeys.UPDATE_NORM_SQ: float(np.dot(delta.astype(np.float64), delta)),
    }


# ---------------------------------------------------------------- the server half


def global_sketcher(
    model: TorchModel, settings: Mapping[str, Any], batch: Batch | None
) -> Sketcher:
    """The sketch of a flat global model, computed as a client computes its own from the
    task entries `settings` (and the real `batch`, or None)."""
    from fedstale.common.models import set_flat

    def sketch_of(flat: np.ndarray) -> np.ndarray:
        set_flat(model.module, flat)
        return sketch_for_task(model.module, settings, model.input_shape, model.num_classes, batch)

    return sketch_of


def gradient_aligner(model: Module, x: torch.Tensor, y: torch.Tensor) -> Aligner:
    """Eq. 21-22 on a held-out batch (x, y): cos(grad L(w_client), grad L(w_server))."""
    import torch

    from fedstale.common.models import set_flat
    from fedstale.common.sensitivity import loss_gradient

    device = next(model.parameters()).device
    x, y = x.to(device), y.to(device)

    def gradient(flat: np.ndarray) -> torch.Tensor:
        set_flat(model, flat)
        return loss_gradient(model, x, y)

    def align(clients: list[np.ndarray], server: np.ndarray) -> list[float]:
        g_server = gradient(server)
        return [
            float(torch.nn.functional.cosine_similarity(gradient(c), g_server, dim=0, eps=1e-12))
            for c in clients
        ]

    return align


def diagnostic_batch(x_pool: torch.Tensor, y_pool: torch.Tensor, seed: int) -> Batch:
    """The held-out batch behind the Sec. 6.6 gradients (eq. 21), drawn by the run seed."""
    from fedstale.common.calibration import real_batch

    return real_batch(x_pool, y_pool, seed=seed + 1, size=min(DIAGNOSTIC_BATCH, len(y_pool)))


class FedPSA(Strategy[FedPSAParams], ServerModel):
    name = "fedpsa"
    client_rules = (SensitivitySketch(),)
    kept = ("buffer", "queue", "m0", "calib_holders", "history")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.buffer: Buffer[Update] = Buffer(self.params.buffer_size)
        self.queue: deque[float] = deque(maxlen=self.params.fedpsa_queue)
        self.m0: float | None = None
        self.sketch_global: Sketcher | None = None
        self.align: Aligner | None = None
        self.calibration: dict[str, Any] = {}  # a real batch's task entries, bound by the server
        self.calib_holders: set[int] = set()  # clients sent the real batch
        self.history = {0: self.model.copy()} if self.params.fedpsa_diagnostic else {}

    @classmethod
    def check(cls, run: RuleSettings, params: FedPSAParams) -> None:
        if params.fedpsa_gamma == 0 and params.fedpsa_delta == 0:
            raise ValueError("fedpsa-gamma and fedpsa-delta are both 0: the temperature is 0")
        if params.fedpsa_calib_labels == "self":
            cls.check_self_labels(params)

    @staticmethod
    def check_self_labels(params: FedPSAParams) -> None:
        """`self` relabels the Gaussian batch of a sensitivity sketch, and nothing else."""
        if params.fedpsa_calib_source == "real":
            raise ValueError(
                "fedpsa-calib-labels=self labels the Gaussian batch; a real batch "
                "(fedpsa-calib-source=real) keeps its own labels"
            )
        if params.fedpsa_ablation in ("no-sensitivity", "no-both"):
            raise ValueError(
                f"fedpsa-calib-labels=self has no effect with fedpsa-ablation="
                f"{params.fedpsa_ablation}: its sketches are of the raw parameters, on no batch"
            )

    @property
    def uses_thermometer(self) -> bool:
        return self.params.fedpsa_ablation not in ("no-thermometer", "no-both")

    @property
    def sketch_of(self) -> str:
        uses_sensitivity = self.params.fedpsa_ablation not in ("no-sensitivity", "no-both")
        return "sensitivity" if uses_sensitivity else "params"

    @property
    def real_calibration(self) -> bool:
        return self.params.fedpsa_calib_source == "real"

    def bind_services(self, services: ModelServices) -> None:
        """The server's sketch of a global model on the clients' own batch and projection,
        the real calibration batch when the rule uses one, the Sec. 6.6 aligner if asked."""
        batch = None
        if self.real_calibration:
            from fedstale.common.calibration import real_batch

            pool = services.held_out("fedpsa-calib-source=real")
            size = self.params.fedpsa_calib_size
            try:
                batch = real_batch(*pool, seed=self.run.seed, size=size)
            except ValueError as err:
                raise ConfigError(f"fedpsa-calib-size: {err}; use a smaller batch") from None
            self.bind_calibration(calibration_entries(batch))
        model = services.model()
        settings = {k: v for k, v in self.task_extra(-1).items() if not isinstance(v, bytes)}
        self.bind_sketcher(global_sketcher(model, settings, batch))
        if self.params.fedpsa_diagnostic:
            x, y = diagnostic_batch(*services.held_out("fedpsa-diagnostic"), self.run.seed)
            self.bind_aligner(gradient_aligner(model.module, x, y))

    def bind_sketcher(self, sketcher: Sketcher) -> None:
        """The server's sketch of a global model, on the clients' batch and projection."""
        self.sketch_global = sketcher

    def bind_calibration(self, entries: dict[str, Any]) -> None:
        """The real batch's task entries (bytes and digest), sent once per client."""
        self.calibration = entries

    def bind_aligner(self, align: Aligner) -> None:
        self.align = align

    def assign(self, client: int, view: View) -> Assignment:
        assignment = super().assign(client, view)
        assignment.entries.update(self.task_extra(client))
        return assignment

    def task_extra(self, client: int) -> dict[str, Any]:
        """The task entries that ask the client for its sketch (the real calibration
        batch's bytes on a client's first task)."""
        extra: dict[str, Any] = {
            FedPSAKeys.SKETCH_K: self.params.fedpsa_sketch_dim,
            FedPSAKeys.SKETCH_SEED: self.run.seed,
            FedPSAKeys.SKETCH_OF: self.sketch_of,
            FedPSAKeys.CALIB_SIZE: self.params.fedpsa_calib_size,
            FedPSAKeys.CALIB_SEED: self.run.seed,
            FedPSAKeys.CALIB_SOURCE: self.params.fedpsa_calib_source,
            FedPSAKeys.CALIB_LABELS: self.params.fedpsa_calib_labels,
        }
        if self.real_calibration:
            if not self.calibration:
                raise RuntimeError("fedpsa-calib-source=real needs bind_calibration() first")
            extra[FedPSAKeys.CALIB_DIGEST] = self.calibration[FedPSAKeys.CALIB_DIGEST]
            if client not in self.calib_holders:
                extra.update(self.calibration)
        return extra

    def on_dispatch(self, client: int) -> None:
        if self.real_calibration:
            self.calib_holders.add(client)

    def on_task_lost(self, client: int) -> Outcome | None:
        """The client may not have kept the batch (it errs when it lacks it): send again."""
        self.calib_holders.discard(client)
        return None

    def signals(self) -> dict[str, SignalSpec]:
        return {
            FedPSAKeys.SKETCH: SignalSpec(self.params.fedpsa_sketch_dim),
            FedPSAKeys.UPDATE_NORM_SQ: SignalSpec(),
        }

    def temperature(self) -> float:
        gamma, delta = self.params.fedpsa_gamma, self.params.fedpsa_delta
        if not self.uses_thermometer or self.m0 is None:
            return gamma + delta
        return gamma * float(np.mean(self.queue)) / self.m0 + delta

    def validate(self, update: Update) -> None:
        """The reported ||delta||^2 must match the delta that arrived."""
        reported = float(update.signals[FedPSAKeys.UPDATE_NORM_SQ])
        actual = squared_norm(update.vector)
        if abs(reported - actual) > NORM_TOLERANCE * max(actual, 1e-12):
            raise InvalidReply(
                f"reported ||delta||^2 {reported:.6g} but the delta has {actual:.6g}"
            )

    def observe(self, update: Update) -> None:
        """Thermometer: push m_i; fix M_0 the first time the queue is full (eq. 16-17)."""
        self.queue.append(squared_norm(update.vector))
        if self.m0 is None and len(self.queue) == self.queue.maxlen:
            self.m0 = max(float(np.mean(self.queue)), 1e-12)

    def weights(self, kappas: np.ndarray) -> tuple[np.ndarray, float]:
        temp = self.temperature()
        if self.m0 is None:
            return np.full(len(kappas), 1.0 / len(kappas)), temp
        return softmax(kappas, temp), temp

    def on_update(self, update: Update, view: View) -> Outcome:
        if self.params.fedpsa_diagnostic:
            self.remember(view.version)
        self.observe(update)
        batch = self.buffer.add(update)
        if batch is None:
            return Outcome()
        if self.sketch_global is None:
            raise RuntimeError("FedPSA needs bind_sketcher() before it can aggregate")
        global_sketch = self.sketch_global(self.model)
        kappas = np.array([cosine(u.signals[FedPSAKeys.SKETCH], global_sketch) for u in batch])
        weights, temp = self.weights(kappas)
        weights = weights * step_scale(self.run, view.version)
        step = weights @ np.stack([u.vector for u in batch]).astype(np.float64)
        alignments = self.alignments(batch)
        self.model = (self.model + step).astype(np.float32)
        records = [
            update_record(u, w, kappa=float(k), temp=temp, **a)
            for u, w, k, a in zip(batch, weights, kappas, alignments, strict=True)
        ]
        return Outcome(changed=True, records=records)

    def remember(self, version: int) -> None:
        """Keep global model `version` as it was released: taken when the next update
        arrives, after the server's DP noise (if any) was added, never the rule's own
        un-noised result."""
        if version not in self.history:
            self.history[version] = self.model.copy()
            self.history.pop(version - HISTORY, None)

    def alignments(self, batch: list[Update]) -> list[dict[str, float]]:
        """Eq. 22 for each buffered update against the global model before this step."""
        if not self.params.fedpsa_diagnostic:
            return [{} for _ in batch]
        if self.align is None:
            raise RuntimeError("fedpsa-diagnostic needs bind_aligner() before it can aggregate")
        scored = [u for u in batch if u.base_version in self.history]
        clients = [self.history[u.base_version] + u.vector for u in scored]
        values = dict(
            zip((u.task_id for u in scored), self.align(clients, self.model), strict=True)
        )
        return [{"align": values[u.task_id]} if u.task_id in values else {} for u in batch]


RULES = (
    Rule(
        FedPSA,
        library="FedPSA",
        about="""FedPSA (Lu et al.): buffered updates weighted by how far each client's
    parameter sensitivity has drifted from the global model's, at a temperature that
    follows training. Needs `model_fn` and `input_shape` here, and fedstale.fedpsa_mod in
    the ClientApp.""",
        wire=keys_of(FedPSAKeys),
        labels="its sensitivity sketches are cross-entropy gradients",
        # softmax weights from the clients' sketches: S = 2 step C; kept under DP: which
        # clients were sent the batch, and the released models of the diagnostic
        dp=Release(CONVEX, public=("calib_holders", "history")),
    ),
)
